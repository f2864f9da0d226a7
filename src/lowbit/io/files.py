"""Checkpoint files: safetensors sources with clear errors, sharded writing, atomic directories.

Only safetensors is ever read (never pickle). Every error names the file and the rule it broke.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import shutil
import threading
import uuid
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

CONFIG_NAME = "config.json"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
PICKLE_WEIGHTS = ("pytorch_model.bin", "pytorch_model.bin.index.json", "model.pt", "model.pth")
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".gguf")
WEIGHT_NAMES = (INDEX_FILE, "pytorch_model.bin.index.json", CONFIG_NAME)
SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "I64": torch.int64,
    "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "F8_E8M0": torch.float8_e8m0fnu,
    "U16": torch.uint16, "U32": torch.uint32, "U64": torch.uint64, "C64": torch.complex64,
}  # fmt: skip
"""torch dtypes of the safetensors header's dtype names (all that torch and safetensors share but F4: the
ones lowbit's formats store, and those a conversion passes through)."""


def file_sha256(path: Path | str) -> str:
    """The sha256 hex digest of the file at ``path``, read in 16 MB pieces (hashlib releases the GIL on large
    buffers, so threads can hash several files at once)."""
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for piece in iter(lambda: fh.read(1 << 24), b""):
            h.update(piece)
    return h.hexdigest()

def read_json(path: Path, what: str = "JSON file") -> dict:
    """Parse a JSON object; FileNotFoundError / ValueError naming the file."""
    if not path.is_file():
        raise FileNotFoundError(f"{path}: {what} not found")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: {what} is not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: {what} must hold a JSON object, got {type(data).__name__}")  # noqa: TRY004
    return data


def weight_files(model_dir: Path) -> tuple[dict[str, Path], dict | None]:
    """``{tensor name: shard path}`` of a safetensors model directory, and the parsed index (None if single file).

    Raises:
        FileNotFoundError: the directory, the index's shards, or any safetensors weights are missing.
        ValueError: only pickle weights are present (never unpickled), or the index is malformed.
    """
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise FileNotFoundError(f"{model_dir}: checkpoint directory not found")
    index_path = model_dir / INDEX_FILE
    if index_path.is_file():
        index = read_json(index_path, "safetensors index")
        wmap = index.get("weight_map")
        if not isinstance(wmap, dict) or not wmap:
            raise ValueError(
                f"{index_path}: 'weight_map' must be a non-empty object of tensor name -> shard file"
            )
        out = {}
        for name, shard in wmap.items():
            if not isinstance(shard, str) or "/" in shard or "\\" in shard or shard.startswith("."):
                raise ValueError(f"{index_path}: shard of {name!r} must be a plain file name, got {shard!r}")
            out[name] = model_dir / shard
        for shard in sorted(set(out.values())):
            if not shard.is_file():
                raise FileNotFoundError(f"{shard}: shard listed in {index_path} is missing")
        return out, index
    single = model_dir / SINGLE_FILE
    files = [single] if single.is_file() else sorted(model_dir.glob("*.safetensors"))
    if not files:
        pickles = [p for p in PICKLE_WEIGHTS if (model_dir / p).exists()]
        if pickles:
            raise ValueError(
                f"{model_dir}: only pickle weights ({', '.join(pickles)}); lowbit reads safetensors only and never "
                "unpickles (convert them with transformers' save_pretrained(safe_serialization=True) first)"
            )
        raise FileNotFoundError(f"{model_dir}: no {SINGLE_FILE}, {INDEX_FILE} or *.safetensors file")
    out = {}
    for f in files:
        for name in safetensors_keys(f):
            if name in out:
                raise ValueError(
                    f"{f}: tensor {name!r} is also in {out[name]} (no index to say which one counts)"
                )
            out[name] = f
    return out, None


def _open(path: Path, device: str = "cpu"):
    from safetensors import SafetensorError, safe_open

    if not path.is_file():
        raise FileNotFoundError(f"{path}: safetensors file not found")
    try:
        return safe_open(str(path), framework="pt", device=device)
    except (SafetensorError, OSError, ValueError, RuntimeError) as e:
        raise ValueError(f"{path}: not a valid safetensors file (corrupt or truncated?): {e}") from None


def safetensors_keys(path: Path) -> list[str]:
    """Tensor names of one safetensors file (header only); ValueError for a corrupt or truncated file."""
    size = path.stat().st_size
    with _open(path) as f:
        keys = list(f.keys())
        # safetensors checks that the header's byte ranges fit the file; keep our own check for clarity
        end = _data_end(path)
        if end is not None and end > size:
            raise ValueError(f"{path}: truncated: the header describes {end} bytes, the file has {size}")
    return keys


MAX_HEADER_BYTES = 100_000_000
"""The largest safetensors header read (safetensors' own limit)."""


def _header(path: Path) -> tuple[int, dict, int] | None:
    """(header length, the parsed header, file size) of a safetensors file; None if it is not readable as one."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as fh:
            n = int.from_bytes(fh.read(8), "little")
            if not 0 < n <= min(MAX_HEADER_BYTES, size - 8):
                return None
            header = json.loads(fh.read(n))
    except (OSError, ValueError):
        return None
    return (n, header, size) if isinstance(header, dict) else None


def _data_end(path: Path) -> int | None:
    parsed = _header(path)
    if parsed is None:
        return None
    n, header, _ = parsed
    ends = [v["data_offsets"][1] for k, v in header.items() if k != "__metadata__" and isinstance(v, dict)]
    return 8 + n + (max(ends) if ends else 0)


READ_CHUNK_BYTES = 32 << 20
"""Bytes of one positional read of :meth:`TensorSource.read_into`; a tensor's chunks go to the pool's threads."""


@dataclass(frozen=True)
class Span:
    """Where a tensor's bytes lie in its safetensors file: ``nbytes`` bytes from ``offset``."""

    offset: int
    nbytes: int
    dtype: torch.dtype
    shape: tuple[int, ...]


def _non_negative_ints(v: Any, lengths) -> bool:
    return isinstance(v, list) and len(v) in lengths and all(
        isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in v)


def tensor_spans(path: Path) -> dict[str, Span] | None:
    """Each tensor's :class:`Span`, from the header of ``path``; None where the header is not one this reader
    takes as it is (a dtype torch lacks, byte ranges that do not match the shapes or the file, malformed JSON):
    safetensors then reads those tensors and reports what is wrong."""
    parsed = _header(path)
    if parsed is None:
        return None
    n, header, size = parsed
    out = {}
    for key, entry in header.items():
        if key == "__metadata__":
            continue
        if not isinstance(entry, dict):
            return None
        dtype, shape, offsets = SAFETENSORS_DTYPES.get(entry.get("dtype")), entry.get("shape"), entry.get(
            "data_offsets")
        if dtype is None or not _non_negative_ints(shape, range(64)) or not _non_negative_ints(offsets, (2,)):
            return None
        begin, end = offsets
        nbytes = math.prod(shape) * dtype.itemsize
        if end - begin != nbytes or 8 + n + end > size:
            return None
        out[key] = Span(8 + n + begin, nbytes, dtype, tuple(shape))
    return out


def settle(futures) -> None:
    """Wait for every future, then raise the first error: no chunk of a read or copy is still running when an
    error propagates (its buffer may be freed then)."""
    errors = [f.exception() for f in futures]
    first = next((e for e in errors if e is not None), None)
    if first is not None:
        raise first


def read_span(fd: int, offset: int, out: memoryview, path: Path) -> None:
    """Fill ``out`` with the bytes of file descriptor ``fd`` from ``offset`` (positional reads, no seek: threads
    share the descriptor); ValueError naming ``path`` if the file ends first."""
    done = 0
    while done < len(out):
        got = os.preadv(fd, [out[done:]], offset + done)
        if got <= 0:
            raise ValueError(f"{path}: truncated: {len(out) - done} byte(s) missing at offset {offset + done}")
        done += got


class TensorSource:
    """Lazy access to the tensors of a safetensors model directory (one open handle per shard)."""

    def __init__(self, model_dir: Path | str, device: str = "cpu") -> None:
        self.dir = Path(model_dir)
        self.device = device
        self.files, self.index = weight_files(self.dir)
        self._handles: dict[Path, Any] = {}
        self._checked: set[Path] = set()
        self._spans: dict[Path, dict[str, Span] | None] = {}
        self._fds: dict[Path, int] = {}
        self._lock = threading.Lock()
        self._span_lock = threading.Lock()

    def keys(self) -> list[str]:
        return list(self.files)

    def __contains__(self, key: str) -> bool:
        return key in self.files

    def _handle(self, path: Path):
        h = self._handles.get(path)
        if h is None:
            if path not in self._checked:
                names = set(safetensors_keys(path))
                listed = {k for k, p in self.files.items() if p == path}
                missing = sorted(listed - names)
                if missing:
                    raise ValueError(
                        f"{path}: tensors listed in the index are missing from the file: {missing[:5]}"
                    )
                self._checked.add(path)
            h = _open(path, self.device)
            self._handles[path] = h
        return h

    def get(self, key: str) -> torch.Tensor:
        return self._read(key, lambda h: h.get_tensor(key), "tensor")

    def read_slice(self, key: str, index: tuple[slice, ...]) -> torch.Tensor:
        """The part ``index`` (one slice per dim, ``slice(None)`` for whole dims) of tensor ``key``, read with
        safetensors' slice reads: only those bytes of the file are touched, never the whole tensor (how a
        tensor-parallel rank reads its shard)."""
        return self._read(key, lambda h: h.get_slice(key)[index], f"{index} of tensor")

    def _read(self, key: str, read, what: str) -> torch.Tensor:
        if key not in self.files:
            raise KeyError(key)
        path = self.files[key]
        try:
            return read(self._handle(path))
        except (ValueError, FileNotFoundError):
            raise
        except Exception as e:  # noqa: BLE001 (safetensors raises its own error types for bad data)
            raise ValueError(
                f"{path}: cannot read {what} {key!r} (corrupt or truncated file?): {e}"
            ) from None

    def shape(self, key: str) -> list[int]:
        return list(self._handle(self.files[key]).get_slice(key).get_shape())

    def meta(self, key: str) -> torch.Tensor:
        """A meta-device tensor with the dtype and shape of ``key``, from the header (no data is read)."""
        name = self.dtype(key)
        if name not in SAFETENSORS_DTYPES:
            raise ValueError(
                f"{self.files[key]}: tensor {key!r} has safetensors dtype {name}, which lowbit does not read"
            )
        return torch.empty(self.shape(key), dtype=SAFETENSORS_DTYPES[name], device="meta")

    def dtype(self, key: str) -> str:
        """The safetensors dtype name of ``key`` (``"BF16"``, ``"F32"``, ...), from the header."""
        return str(self._handle(self.files[key]).get_slice(key).get_dtype())

    def span(self, key: str) -> Span | None:
        """Where the bytes of ``key`` lie in its file (:func:`tensor_spans`); None if only safetensors reads it
        (also where the platform has no ``os.preadv``)."""
        if key not in self.files:
            raise KeyError(key)
        if not hasattr(os, "preadv"):
            return None
        path = self.files[key]
        if path not in self._spans:
            with self._span_lock:  # reader threads ask at once: one parse of the header per file
                if path not in self._spans:
                    self._handle(path)  # the checks of every read (index against file, a valid file)
                    self._spans[path] = tensor_spans(path)
        spans = self._spans[path]
        return spans.get(key) if spans is not None else None

    def _fd(self, path: Path) -> int:
        with self._lock:  # readers of one file share its descriptor; positional reads need no seek
            fd = self._fds.get(path)
            if fd is None:
                fd = self._fds[path] = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
            return fd

    def _span_or_raise(self, key: str) -> Span:
        span = self.span(key)
        if span is None:
            raise ValueError(f"{self.files[key]}: tensor {key!r} has no byte span this reader takes; use get()")
        return span

    def read_bytes(self, key: str, start: int, out: memoryview) -> None:
        """Read bytes ``start`` to ``start + len(out)`` of tensor ``key``'s data into ``out`` (positional reads;
        any thread). Call only for keys with a :meth:`span`."""
        span = self._span_or_raise(key)
        if start < 0 or start + len(out) > span.nbytes:
            raise ValueError(f"read_bytes: bytes {start}..{start + len(out)} lie outside tensor {key!r}'s "
                             f"{span.nbytes} bytes")
        path = self.files[key]
        read_span(self._fd(path), span.offset + start, out, path)

    def read_into(self, key: str, out: torch.Tensor, pool=None) -> torch.Tensor:
        """Read ``key`` into ``out`` (a contiguous uint8 CPU tensor of exactly the tensor's byte count) and return
        it viewed as the tensor: the bytes ``get`` returns, read with positional reads straight into ``out``, in
        chunks over ``pool``'s threads if given. Call only for keys with a :meth:`span`."""
        span = self._span_or_raise(key)
        if (out.dtype != torch.uint8 or out.device.type != "cpu" or not out.is_contiguous()
                or out.numel() != span.nbytes):
            raise ValueError(f"read_into: out must be a contiguous uint8 CPU tensor of {span.nbytes} bytes")
        if span.nbytes:
            mv = memoryview(out.numpy()).cast("B")
            starts = range(0, span.nbytes, READ_CHUNK_BYTES)
            chunk = lambda a: self.read_bytes(key, a, mv[a:a + READ_CHUNK_BYTES])
            if pool is None or len(starts) == 1:
                for a in starts:
                    chunk(a)
            else:
                settle([pool.submit(chunk, a) for a in starts])
        return out.view(span.dtype).view(span.shape)

    def close(self) -> None:
        self._handles.clear()
        for fd in self._fds.values():
            with contextlib.suppress(OSError):
                os.close(fd)
        self._fds.clear()


# ---------------------------------------------------------------------------------------------- writing


def _fsync_dir(path: Path) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def fsync_file(path: Path) -> None:
    with open(path, "rb+") as fh:
        os.fsync(fh.fileno())


def write_json(path: Path, data: Any) -> None:
    """Write JSON via a temp file + fsync + rename (atomic on POSIX)."""
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.tmp")
    with open(tmp, "w", encoding="utf-8") as fh:
        json.dump(data, fh, indent=2, sort_keys=True)
        fh.write("\n")
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def save_safetensors(
    tensors: Mapping[str, torch.Tensor], path: Path, metadata: dict[str, str] | None = None
) -> None:
    """Write a safetensors file via a temp name + fsync + rename; tensors are made contiguous CPU copies."""
    from safetensors.torch import save_file

    clean = {k: t.detach().to("cpu").contiguous() for k, t in tensors.items()}
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.tmp")
    save_file(clean, str(tmp), metadata={"format": "pt", **(metadata or {})})
    fsync_file(tmp)
    os.replace(tmp, path)


def tensor_nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def dedupe_shared(tensors: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], list[str]]:
    """Drop tensors that alias an earlier one (tied weights); returns (kept, dropped names)."""
    seen: dict[tuple, str] = {}
    kept, dropped = {}, []
    for k, t in tensors.items():
        key = (
            t.device,
            t.untyped_storage().data_ptr(),
            t.storage_offset(),
            tuple(t.shape),
            tuple(t.stride()),
            t.dtype,
        )
        if t.numel() and key in seen:
            dropped.append(k)
            continue
        seen[key] = k
        kept[k] = t
    return kept, dropped


def parse_size(size: int | str, name: str = "max_shard_size") -> int:
    """``5GB`` / ``500MB`` / ``1.5GiB`` / an int of bytes -> a positive number of bytes.

    ValueError / TypeError naming ``name`` for anything else: a shard limit of zero or less would put every
    tensor in a shard of its own (or loop), so it is refused rather than silently accepted.
    """
    if isinstance(size, bool) or not isinstance(size, (int, str)):
        raise TypeError(f"{name} must be an int of bytes or a string like '5GB', got {type(size).__name__}")
    if isinstance(size, int):
        n = size
    else:
        s = size.strip().upper()
        mult = 1
        for unit, m in (
            ("GIB", 2**30),
            ("MIB", 2**20),
            ("KIB", 2**10),
            ("GB", 10**9),
            ("MB", 10**6),
            ("KB", 10**3),
            ("B", 1),
        ):
            if s.endswith(unit):
                s, mult = s[: -len(unit)].strip(), m
                break
        try:
            value = float(s)
        except ValueError:
            raise ValueError(
                f"{name} must be a number of bytes or a size like '5GB', '500MB', '2GiB', got {size!r}"
            ) from None
        if not math.isfinite(value):
            raise ValueError(f"{name} must be a finite size, got {size!r}")
        n = int(value * mult)
    if n <= 0:
        raise ValueError(f"{name} must be a positive size, got {size!r}")
    return n


def write_sharded(
    tensors: Mapping[str, torch.Tensor], out_dir: Path, max_shard_size: int | str = "5GB"
) -> dict:
    """Write ``tensors`` as ``model.safetensors`` or as shards ``model-0000i-of-0000n.safetensors`` + index.

    Returns the weight map ``{name: file}``.
    """
    limit = parse_size(max_shard_size)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for k, t in tensors.items():
        n = tensor_nbytes(t)
        if shards[-1] and size + n > limit:
            shards.append({})
            size = 0
        shards[-1][k] = t
        size += n
    if len(shards) == 1:
        save_safetensors(shards[0], out_dir / SINGLE_FILE)
        return dict.fromkeys(shards[0], SINGLE_FILE)
    wmap = {}
    total = 0
    for i, shard in enumerate(shards):
        name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_safetensors(shard, out_dir / name)
        wmap.update(dict.fromkeys(shard, name))
        total += sum(tensor_nbytes(t) for t in shard.values())
    write_json(out_dir / INDEX_FILE, {"metadata": {"total_size": total}, "weight_map": wmap})
    return wmap


def copy_extra_files(src_dir: Path, out_dir: Path) -> list[str]:
    """Copy everything but weights and config.json (tokenizer, generation config, sentence-transformers
    modules, README, ...) from ``src_dir`` into ``out_dir``; files already in ``out_dir`` are kept."""
    src_dir = Path(src_dir)
    if not src_dir.is_dir():
        raise FileNotFoundError(f"{src_dir}: source directory not found")
    copied = []
    for p in sorted(src_dir.rglob("*")):
        rel = p.relative_to(src_dir)
        if any(part.startswith(".") for part in rel.parts):
            continue
        if p.is_dir():
            continue
        if rel.parts[0] in ("onnx", "openvino") or str(rel) in WEIGHT_NAMES or p.suffix in WEIGHT_SUFFIXES:
            continue
        if p.name.endswith((".safetensors.index.json", ".bin.index.json")):
            continue  # another producer's index (diffusers') names the source shards, not the output's
        dest = out_dir / rel
        if dest.exists():
            continue
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(p, dest)
        copied.append(str(rel))
    return copied


def overlaps(a: Path, b: Path) -> bool:
    """True if ``a`` and ``b`` are the same directory or one lies inside the other (symlinks resolved)."""
    ra, rb = Path(a).resolve(), Path(b).resolve()
    return ra == rb or ra.is_relative_to(rb) or rb.is_relative_to(ra)


def check_out_dir(out_dir: Path, src_dir: Path) -> None:
    """ValueError unless ``out_dir`` and the source directory are disjoint: an output inside the source writes
    into it (and later outputs would copy earlier ones along), and replacing an output that contains the
    source would delete it."""
    if overlaps(out_dir, src_dir):
        raise ValueError(
            f"{out_dir}: the output must lie outside the source directory {src_dir} and must not contain it "
            "(sources are never modified)"
        )


def temp_dir_for(out_dir: Path, tag: str | None = None) -> Path:
    """A sibling temp directory of ``out_dir`` (same filesystem, so the final rename is atomic)."""
    out_dir = Path(out_dir)
    name = f".{out_dir.name}.lowbit-{tag or uuid.uuid4().hex[:12]}.tmp"
    return out_dir.parent / name


def fsync_tree(root: Path) -> None:
    for p in sorted(root.rglob("*")):
        if p.is_file():
            fsync_file(p)
    for p in sorted({q.parent for q in root.rglob("*")} | {root}):
        _fsync_dir(p)


def publish(tmp: Path, out_dir: Path, overwrite: bool) -> None:
    """fsync ``tmp`` and rename it to ``out_dir``. An existing ``out_dir`` is an error unless ``overwrite``
    (then it is moved aside and removed only after the new directory is in place)."""
    fsync_tree(tmp)
    old = None
    if out_dir.exists() or out_dir.is_symlink():
        if not overwrite:
            raise FileExistsError(f"{out_dir}: already exists (pass overwrite=True to replace it)")
        old = out_dir.parent / f".{out_dir.name}.lowbit-old-{uuid.uuid4().hex[:8]}"
        os.replace(out_dir, old)
    os.replace(tmp, out_dir)
    _fsync_dir(out_dir.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


@contextlib.contextmanager
def atomic_dir(out_dir: Path | str, *, overwrite: bool = False) -> Iterator[Path]:
    """Yield a temp directory next to ``out_dir``; on success it replaces ``out_dir`` in one rename, on any
    error it is removed (a crash leaves at most a hidden ``.<name>.lowbit-*.tmp`` sibling, never ``out_dir``)."""
    out_dir = Path(out_dir)
    if (out_dir.exists() or out_dir.is_symlink()) and not overwrite:
        raise FileExistsError(f"{out_dir}: already exists (pass overwrite=True to replace it)")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_dir_for(out_dir)
    tmp.mkdir()
    try:
        yield tmp
        publish(tmp, out_dir, overwrite)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
