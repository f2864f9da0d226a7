"""``convert_checkpoint``: quantize a safetensors model directory tensor by tensor, never loading the whole model.

Sources: a transformers model directory (``config.json`` with ``model_type``: the config's model, built on the
meta device, says which tensors are Linear weights), or a diffusers model folder (``config.json`` with
``_class_name`` and no ``model_type``) or a bare folder of ``*.safetensors`` files (no config.json), where the
name and shape rules of :mod:`lowbit.io.rules` decide from the safetensors headers.

Memory bound: one source tensor at a time on ``device`` (the fused q/k/v or gate/up siblings are read one by
one for their shared NVFP4 global scale), its quantized output, plus the output tensors buffered for the file
being filled, which is handed to the writer before it exceeds ``max_shard_size`` (a single tensor larger than
that goes alone), plus at most one finished file the writer is still writing. So peak memory is about
2 x ``max_shard_size`` + twice the largest source tensor, whatever the size of the checkpoint or of its
shards, plus the quantizer's working memory for one tensor: on a GPU that is device memory; on the CPU the
reference quantizers hold up to three fp32 copies of the tensor (measured on a 25.3 GB machine converting a
29.1 GB checkpoint to w8a8-fp8-block with ``max_shard_size="1GB"``: 4.0 GB of anonymous memory at the peak,
``benchmarks/experiments/convert_larger_than_ram.py``; the safetensors files are memory-mapped, and the pages
read count as the process's file-backed resident memory, which the kernel reclaims like any page cache). Output files follow the source shards (one per shard, split into numbered parts where a shard's output
exceeds ``max_shard_size``).

Writing overlaps computing: a finished file (a shard's output, or one numbered part of it) is written and
fsynced by one background thread per process while the next is quantized, so a process takes about the
larger of its compute and its writes rather than their sum (ranks sharing one disk otherwise wait for each
other's writes with their devices idle). At most one write is pending: handing over the next file waits for
the previous one, and a write's error is raised in the converting thread there or at the end of its shards.

Resumable: work happens in ``.<out_name>.lowbit-convert.tmp`` next to ``out_dir``; each finished output shard
is recorded in ``progress.json`` there (``progress.rank<r>.json`` for rank ``r`` of several; by the writer,
after the shard's files are fsynced and renamed into place). A rerun with the same source, scheme and format,
on any number of processes, skips the shards finished by any of them. The last step renames the temp directory to ``out_dir`` in
one operation, so ``out_dir`` never holds a half checkpoint.

Several processes (``rank``/``world_size``, a ``torch.distributed`` process group or torchrun's environment):
each rank converts its share of the source shards (by bytes) into the shared temp directory; once all are done
rank 0 alone writes index and config from every rank's records, in source-shard order, and publishes, so the
result is the single-process one byte for byte (:mod:`lowbit.io.distributed` says how the ranks meet).
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import sys
import warnings
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as futures_wait
from pathlib import Path
from typing import Any

import torch

from ..api import quantize
from ..formats.blockscaled import finite_amax, nvfp4_default_global_scale
from ..nn.modules import QuantLinear
from ..nn.quantize import DEFAULT_SKIP, fused_groups, is_skipped, linear_layers, skip_patterns
from ..nn.schemes import Scheme, get_scheme
from . import lightx2v as _lx
from .files import (
    CONFIG_NAME,
    INDEX_FILE,
    SINGLE_FILE,
    TensorSource,
    check_out_dir,
    copy_extra_files,
    parse_size,
    publish,
    read_json,
    safetensors_keys,
    save_safetensors,
    temp_dir_for,
    tensor_nbytes,
    write_json,
)
from .layouts import DTYPE_NAMES, NAME_DTYPES, params_from_json, params_to_json
from .checkpoint import align_prefix, build_skeleton, check_skeleton_shapes, choose_layout
from .distributed import (
    DEFAULT_TIMEOUT,
    SYNC_TAG,
    DistributedConvertError,
    FileSync,
    GroupSync,
    World,
    assign_shards,
    check_statuses,
    check_timeout,
    on_device,
    rank_device,
    resolve_world,
)
from .rules import check_patterns, matches, select_linear_weights

MANIFEST = "progress.json"
RANK_MANIFEST = re.compile(r"progress\.rank\d+\.json")
_LINEAR_FALLBACK_SKIP = ("*embed*", "*norm*", "*wte*", "*wpe*", "*lm_head*", "*ln_*", "*layernorm*")
# False: every file is written in the converting thread before the next tensor is read (the sequential
# reference the tests compare the overlapped writer's bytes with); not a user option, the output is the same
_OVERLAP_WRITES = True


def _progress(total: int, enabled: bool, label: str = "lowbit convert"):
    if not enabled:
        return None
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return None
    return tqdm(total=total, desc=label, unit="tensor", file=sys.stderr)


def _fingerprint(source: TensorSource) -> dict[str, list[int]]:
    out = {}
    for f in sorted(set(source.files.values())):
        st = f.stat()
        out[f.name] = [st.st_size, int(st.st_mtime)]
    return out


def check_unquantized_config(cfg: dict, where: Path) -> None:
    """ValueError unless ``cfg`` (a parsed config.json) describes an unquantized model: a source that is
    already quantized cannot be quantized again, and a quantization_config of another type is not a config."""
    qc = cfg.get("quantization_config")
    if qc is None:
        return
    if not isinstance(qc, dict):
        raise ValueError(  # noqa: TRY004 (a malformed file, reported as bad input)
            f"{where}: quantization_config must be a JSON object, got {type(qc).__name__} {qc!r:.60}; "
            "a model with any quantization_config is already quantized: convert an unquantized model"
        )
    raise ValueError(
        f"{where}: the source is already quantized (quant_method {qc.get('quant_method')!r}); "
        "convert an unquantized model"
    )


def check_source(src_dir: str | Path, model_class: Any = None, trust_remote_code: bool = False) -> None:
    """Check an unquantized safetensors model directory: config.json against its safetensors headers.

    The config's model is built on the meta device (nothing allocated, whatever its dimensions) and every
    checkpoint tensor it has is compared by shape with the safetensors header; a mismatch, a quantized source
    or a malformed config is a ValueError naming the file. Without transformers only config.json is checked.
    """
    src_dir = Path(src_dir)
    check_unquantized_config(read_json(src_dir / CONFIG_NAME, "model config"), src_dir / CONFIG_NAME)
    try:
        skeleton = build_skeleton(src_dir, model_class, trust_remote_code, meta=True)
    except ImportError:
        return
    source = TensorSource(src_dir)
    try:
        check_skeleton_shapes(skeleton, source, align_prefix(source.keys(), skeleton))
    finally:
        source.close()


def _linear_weights(
    src_dir: Path, source: TensorSource, model_class, trust_remote_code
) -> dict[str, tuple[str, int, int]]:
    """``{module name: (checkpoint key of its weight, out_features, in_features)}`` for every nn.Linear."""
    try:
        # meta: only names and shapes are read, and a config with huge dimensions allocates nothing
        skeleton = build_skeleton(src_dir, model_class, trust_remote_code, meta=True)
    except ImportError:
        skeleton = None
    if skeleton is None:
        warnings.warn(
            "lowbit.convert_checkpoint: transformers is not installed; treating every 2-D '*.weight' tensor "
            f"outside {_LINEAR_FALLBACK_SKIP} as a Linear weight",
            stacklevel=3,
        )
        out = {}
        for key in list(source.files):
            shape = source.shape(key)
            if key.endswith(".weight") and len(shape) == 2 and not is_skipped(key, _LINEAR_FALLBACK_SKIP):
                out[key[: -len(".weight")]] = (key, shape[0], shape[1])
        return out
    keymap = align_prefix(source.keys(), skeleton)
    check_skeleton_shapes(skeleton, source, keymap)
    by_model = {v: k for k, v in keymap.items()}
    out = {}
    for name, lin in linear_layers(skeleton).items():
        key = by_model.get(f"{name}.weight")
        if key is None:
            continue  # tied or absent (e.g. lm_head tied to the embeddings)
        shape = source.shape(key)
        if shape != [lin.out_features, lin.in_features]:
            raise ValueError(
                f"{source.files[key]}: {key!r} has shape {shape} but config.json's model has Linear "
                f"[{lin.out_features}, {lin.in_features}] (checkpoint and config.json do not match)"
            )
        out[name] = (key, lin.out_features, lin.in_features)
    return out


def _stub(name: str, info: dict, scheme: Scheme) -> QuantLinear:
    """A QuantLinear without tensors carrying what ``layout.config`` reads (scheme, shape, format options)."""
    out_f, in_f = info["shape"]
    # the conversion's own scheme object: it may be one that is not registered by name (LightX2V's W6A8)
    m = QuantLinear(in_f, out_f, False, scheme=scheme if info["scheme"] == scheme.name else info["scheme"])
    m._meta = {
        "dtype": NAME_DTYPES.get(info["dtype"], torch.bfloat16),
        "scale_layout": info.get("scale_layout", "linear"),
        "params": params_from_json(info.get("params", {})),
    }
    return m


def _convert_shard(
    keys: list[str],
    source: TensorSource,
    targets: dict[str, tuple[str, str]],
    scheme: Scheme,
    layout,
    device: torch.device,
    global_scale,
    bar,
):
    """Per source key: ``(output tensors, (module name, info) or None)``; Linear weights among ``keys`` are
    quantized, the rest passed through. One source tensor is held at a time (a generator, so the caller
    decides when outputs are written and dropped)."""
    for key in keys:
        t = source.get(key)
        if key in targets:
            name, prefix = targets[key]
            w = t.to(device)
            if layout.name == "lightx2v":
                # LightX2V's own converter rule (bf16 cast, per-tensor 2688/amax in bf16), bit for bit
                q = _lx.quantize_weight(w, _lx.quant_scheme_of(scheme))
            else:
                opts = scheme.weight_quantize_options(w.shape[1])
                g = global_scale(name)
                if g is not None:
                    opts["global_scale"] = g.to(device)
                q = quantize(w, scheme.weight_format, **opts)
            m = QuantLinear(w.shape[1], w.shape[0], False, scheme=scheme, weight=q)
            out = {f"{prefix}{k}": v.detach().to("cpu") for k, v in layout.export(m).items()}
            info = {
                "scheme": scheme.name,
                "shape": [w.shape[0], w.shape[1]],
                "dtype": DTYPE_NAMES.get(t.dtype, "float32"),
                "scale_layout": q.scale_layout,
                "params": params_to_json(q.params),
            }
            del t, w, q, m
            yield out, (name, info)
        else:
            yield {key: t}, None
            del t
        if bar is not None:
            bar.update(1)


class _Writer:
    """Writes finished output files in one background thread while the converting thread computes the next.

    ``submit`` first waits for the write before it (raising that write's error, if any, in the caller), so at
    most one write is pending and at most one finished file is held in memory besides the one being filled.
    ``close`` waits for the last write and raises its error; ``abort`` (for the caller's own error, interrupts
    included) waits for the pending write too, so the writer thread never outlives the conversion call and a
    file that was computed is still written and recorded for a rerun. ``overlap=False`` runs every write in the
    calling thread, in the same order, with the same bytes.
    """

    def __init__(self, overlap: bool) -> None:
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="lowbit-convert-writer") if overlap else None
        self._pending: Future | None = None

    def submit(self, fn: Callable[..., None], /, *args: Any) -> None:
        self.wait()
        if self._pool is None:
            fn(*args)
        else:
            self._pending = self._pool.submit(fn, *args)

    def wait(self) -> None:
        """Block until the pending write is done; its error is raised here."""
        pending = self._pending
        if pending is None:
            return
        futures_wait([pending])  # an interrupt while waiting leaves the write pending, for abort to join
        self._pending = None
        pending.result()

    def close(self) -> None:
        try:
            self.wait()
        finally:
            self._shutdown()

    def abort(self, error: BaseException) -> None:
        """Join the writer after ``error`` stopped the caller; a failed pending write is added to ``error``'s
        notes (``error`` is what propagates: it is why the conversion stopped)."""
        pending, self._pending = self._pending, None
        try:
            # exception() waits without raising the write's error; an interrupt while waiting still propagates
            failed = pending.exception() if pending is not None else None
            if failed is not None and failed is not error:
                note = ("lowbit.convert_checkpoint: the pending background write failed too: "
                        f"{type(failed).__name__}: {failed}")
                if hasattr(error, "add_note"):
                    error.add_note(note)
                else:  # Python 3.10
                    warnings.warn(note, stacklevel=3)
        finally:
            self._shutdown()

    def _shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None


def _write_file(tensors: dict[str, torch.Tensor], path: Path, finish: Callable[[], None] | None) -> None:
    """One writer job: a part file (temp name, fsync, rename), then, for a shard's last part, ``finish``."""
    save_safetensors(tensors, path)  # looked up here, so tests can make it fail
    if finish is not None:
        finish()


def _write_shard(
    src_file: Path, out_name: str, outputs, tmp: Path, limit: int, writer: _Writer,
    record: Callable[[dict[str, dict]], None],
) -> None:
    """Write one source shard's outputs as ``out_name`` or, past ``limit`` bytes, as numbered parts; the buffer
    is handed to ``writer`` before a tensor would take it over ``limit``. Once the last part is on disk the
    writer renames the parts to their final names and calls ``record`` with their manifest entries."""
    stem = out_name.removesuffix(".safetensors")
    parts: list[tuple[Path, dict]] = []
    buf: dict[str, torch.Tensor] = {}
    infos: dict[str, dict] = {}
    size = 0

    def finish(parts: list[tuple[Path, dict]]) -> None:
        out: dict[str, dict] = {}
        for i, (path, entry) in enumerate(parts):
            name = out_name if len(parts) == 1 else f"{stem}-part{i + 1:05d}-of-{len(parts):05d}.safetensors"
            path.replace(tmp / name)
            out[name] = entry
        record(out)

    def flush(last: bool) -> None:
        nonlocal buf, infos, size
        path = tmp / f".{stem}.part{len(parts):05d}.safetensors"
        parts.append((path, {"source": src_file.name, "keys": list(buf), "bytes": size, "modules": infos}))
        tensors, buf, infos, size = buf, {}, {}, 0
        # the part count, hence the final names, is known only once the last part is handed over
        writer.submit(_write_file, tensors, path, (lambda p=list(parts): finish(p)) if last else None)

    for tensors, info in outputs:
        n = sum(tensor_nbytes(v) for v in tensors.values())
        if buf and size + n > limit:
            flush(last=False)
        buf.update(tensors)
        size += n
        if info is not None:
            infos[info[0]] = info[1]
        del tensors
    flush(last=True)


class _Plan:
    """What every rank of a conversion derives from its arguments and the source, before writing anything."""

    def __init__(self, **kw: Any) -> None:
        self.__dict__.update(kw)


def _plan(
    src_dir: Path,
    out_dir: Path,
    scheme: Scheme,
    dev: torch.device,
    *,
    skip,
    include_p,
    exclude_p,
    format: str,
    overwrite: bool,
    limit: int,
    model_class,
    trust_remote_code: bool,
) -> _Plan:
    """Check the source and the output path, select the Linear weights to quantize and the layout."""
    check_out_dir(out_dir, src_dir)
    if (out_dir.exists() or out_dir.is_symlink()) and not overwrite:
        raise FileExistsError(f"{out_dir}: already exists (pass overwrite=True to replace it)")
    if not src_dir.is_dir():
        raise FileNotFoundError(f"{src_dir}: source directory not found")
    cfg_path = src_dir / CONFIG_NAME
    cfg = read_json(cfg_path, "model config") if (cfg_path.exists() or cfg_path.is_symlink()) else None
    if cfg is not None:
        check_unquantized_config(cfg, cfg_path)
    # only a transformers config (model_type) can be built into a model; diffusers' (_class_name) and none
    # at all go by the tensor-name rules
    by_model = cfg is not None and ("model_type" in cfg or model_class is not None)
    source = TensorSource(src_dir)
    try:
        patterns = skip_patterns(skip)
        if by_model:
            linears = _linear_weights(src_dir, source, model_class, trust_remote_code)
        else:
            shapes = {k: (source.shape(k), source.dtype(k)) for k in source.keys()}
            linears, _ = select_linear_weights(shapes, lambda o, i: None, include_p, exclude_p)
        targets: dict[str, tuple[str, str]] = {}
        unsupported, ignore = [], []
        for name, (key, out_f, in_f) in linears.items():
            if is_skipped(name, patterns) or (include_p and not matches(name, include_p)) or matches(name, exclude_p):
                ignore.append(name)
                continue
            why = scheme.unsupported(out_f, in_f)
            if why is not None:
                unsupported.append(f"{name} [{out_f}, {in_f}]: {why}")
                ignore.append(name)
                continue
            targets[key] = (name, key[: -len("weight")])
        if not targets:
            detail = f"; unsupported shapes: {'; '.join(unsupported)}" if unsupported else ""
            what = "Linear layers" if by_model else "2-D '.weight' tensors passing the name rules of lowbit.io.rules"
            raise ValueError(
                f"convert_checkpoint: no Linear weight in {src_dir} can take scheme {scheme.name} "
                f"({len(linears)} {what}, skip={list(patterns)}, include={list(include_p)}, "
                f"exclude={list(exclude_p)}){detail}"
            )
        if unsupported:
            warnings.warn(
                f"lowbit.convert_checkpoint: {len(unsupported)} layer(s) left unquantized, their shapes do not "
                f"fit {scheme.name}: " + "; ".join(unsupported),
                stacklevel=3,
            )
        probe = QuantLinear(16, 16, False, scheme=scheme)
        layout = choose_layout({"probe": probe}, format)

        # fused siblings share one NVFP4 global scale: computed from each member's absmax, one tensor at a time
        name_to_key = {name: key for key, (name, _) in targets.items()}
        shared = scheme.shared_global_scale and layout.name != "lightx2v"  # LightX2V: one scale per weight
        group_of = {n: g for g in (fused_groups(name_to_key) if shared else []) for n in g}
        cache: dict[tuple[str, ...], torch.Tensor] = {}

        def global_scale(name: str) -> torch.Tensor | None:
            group = group_of.get(name)
            if group is None:
                return None
            if group not in cache:
                amax = torch.stack([finite_amax(source.get(name_to_key[n]).to(dev)).float().cpu() for n in group])
                cache[group] = nvfp4_default_global_scale(amax)
            return cache[group]

        ident = {
            "source": str(src_dir.resolve()),
            "fingerprint": _fingerprint(source),
            "scheme": scheme.name,
            "format": layout.name,
            "skip": list(patterns),
            "include": list(include_p),
            "exclude": list(exclude_p),
            "max_shard_size": limit,
        }
        shard_keys: dict[Path, list[str]] = {}
        for key, f in source.files.items():
            shard_keys.setdefault(f, []).append(key)
    except BaseException:
        source.close()
        raise
    return _Plan(
        src_dir=src_dir, out_dir=out_dir, scheme=scheme, cfg=cfg, source=source, linears=linears, targets=targets,
        ignore=ignore, layout=layout, global_scale=global_scale, ident=ident,
        ident_hash=hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest(),
        shard_keys=dict(sorted(shard_keys.items())),
        single=source.index is None and len(shard_keys) == 1, limit=limit,
    )


def _progress_files(tmp: Path) -> list[Path]:
    return sorted(p for p in tmp.glob("progress*.json") if p.name == MANIFEST or RANK_MANIFEST.fullmatch(p.name))


def _read_progress(tmp: Path, ident: dict) -> tuple[dict[Path, dict], bool]:
    """The progress files of ``tmp`` written for this conversion (``ident``), and whether others are there."""
    ours, stale = {}, False
    for p in _progress_files(tmp):
        try:
            m = read_json(p, "conversion manifest")
        except (FileNotFoundError, ValueError):
            stale = True
            continue
        if all(m.get(k) == v for k, v in ident.items()) and isinstance(m.get("shards"), dict):
            ours[p] = m
        else:
            stale = True
    return ours, stale


def _done(tmp: Path, manifests: Iterable[dict]) -> dict[str, dict]:
    """``{output file: manifest entry}`` of the source shards finished with every output part intact, in
    source-shard then file name order (so the result cannot depend on which rank wrote what, or when)."""
    by_source: dict[str, dict[str, dict]] = {}
    for m in manifests:
        for f, info in m["shards"].items():
            if isinstance(info, dict) and isinstance(info.get("source"), str):
                by_source.setdefault(info["source"], {})[f] = info
    out: dict[str, dict] = {}
    for src in sorted(by_source):
        files = by_source[src]
        if all(_shard_ok(tmp / f, info.get("keys", [])) for f, info in files.items()):
            out.update((f, files[f]) for f in sorted(files))
    return out


def _convert_shards(
    plan: _Plan, todo: list[Path], tmp: Path, manifest_path: Path, kept: dict[str, dict], dev: torch.device,
    progress: bool, done_count: int, total: int, label: str,
) -> None:
    """Convert the source shards ``todo`` into ``tmp``, recording each finished one in ``manifest_path`` (after
    ``kept``, the entries this file held that are still intact)."""
    manifest: dict[str, Any] = {**plan.ident, "shards": dict(kept)}
    bar = _progress(total, progress, label)
    if bar is not None:
        bar.update(done_count)

    def recorder(i: int, out_name: str) -> Callable[[dict[str, dict]], None]:
        # runs in the writer thread once the shard's files are on disk: the only place the manifest changes
        def record(entries: dict[str, dict]) -> None:
            manifest["shards"].update(entries)
            write_json(manifest_path, manifest)
            if bar is None and progress:
                print(f"{label}: shard {i + 1}/{len(todo)} {out_name} done", file=sys.stderr)

        return record

    writer = _Writer(_OVERLAP_WRITES)
    try:
        for i, src_file in enumerate(todo):
            out_name = SINGLE_FILE if plan.single else src_file.name
            outputs = _convert_shard(plan.shard_keys[src_file], plan.source, plan.targets, plan.scheme, plan.layout,
                                     dev, plan.global_scale, bar)
            _write_shard(src_file, out_name, outputs, tmp, plan.limit, writer, recorder(i, out_name))
        writer.close()
    except BaseException as e:
        writer.abort(e)
        raise
    finally:
        if bar is not None:
            bar.close()


def _finalize(plan: _Plan, tmp: Path, overwrite: bool) -> None:
    """Merge the progress files, write index, config and extra files into ``tmp`` and publish it."""
    manifests, _ = _read_progress(tmp, plan.ident)
    shards = _done(tmp, manifests.values())
    missing = sorted({f.name for f in plan.shard_keys} - {s["source"] for s in shards.values()})
    if missing:
        raise RuntimeError(
            f"convert_checkpoint: {tmp} lacks the output of source shard(s) {missing[:5]} that every rank reported "
            "done (was the temp directory changed meanwhile?); rerun to convert them"
        )
    # only the finished shards stay: parts of shards a killed run did not finish, files of another conversion
    # and progress files go, so the directory holds what a run that was never interrupted writes
    for p in tmp.iterdir():
        if p.name in shards and p.is_file() and not p.is_symlink():
            continue
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p)
        else:
            p.unlink()
    infos = {n: info for s in shards.values() for n, info in s["modules"].items()}
    stubs = {n: _stub(n, info, plan.scheme) for n, info in infos.items()}
    ignore = sorted(set(plan.ignore) | {n for n in plan.linears if n not in stubs})
    layout = choose_layout(stubs, plan.layout.name)
    if list(shards) != [SINGLE_FILE]:
        wmap = {k: f for f, s in shards.items() for k in s["keys"]}
        total_size = sum(s["bytes"] for s in shards.values())
        write_json(tmp / INDEX_FILE, {"metadata": {"total_size": total_size}, "weight_map": wmap})
    cfg = plan.cfg
    if cfg is not None:
        src_dtype = NAME_DTYPES.get(str(cfg.get("dtype", cfg.get("torch_dtype"))).removeprefix("torch."))
    else:
        src_dtype = NAME_DTYPES.get(next(iter(infos.values()))["dtype"]) if infos else None
    config = dict(cfg) if cfg is not None else {}
    if cfg is None and src_dtype is not None:
        # a bare folder has no config to say the weights' dtype; load_quantized reads it from here
        config["dtype"] = DTYPE_NAMES[src_dtype]
    config["quantization_config"] = layout.config(stubs, ignore, src_dtype)
    write_json(tmp / CONFIG_NAME, config)
    for name, data in layout.extra_files(stubs, ignore).items():
        write_json(tmp / name, data)
    copy_extra_files(plan.src_dir, tmp)
    try:
        publish(tmp, plan.out_dir, overwrite)
    except BaseException:
        write_json(tmp / MANIFEST, {**plan.ident, "shards": shards})  # keep the finished shards for a rerun
        raise


def convert_checkpoint(
    src_dir: str | Path,
    out_dir: str | Path,
    scheme: str | Scheme,
    *,
    device: str | torch.device | Sequence[str | torch.device] | None = None,
    skip: str | Iterable[str] | None = DEFAULT_SKIP,
    include: str | Iterable[str] | None = None,
    exclude: str | Iterable[str] | None = None,
    progress: bool = True,
    format: str = "auto",
    overwrite: bool = False,
    max_shard_size: int | str = "5GB",
    model_class: Any = None,
    trust_remote_code: bool = False,
    rank: int | None = None,
    world_size: int | None = None,
    timeout: float = DEFAULT_TIMEOUT,
) -> Path:
    """Quantize the Linear weights of a safetensors model directory into a new checkpoint directory.

    Args:
        src_dir: a transformers model directory (``config.json`` with ``model_type`` and ``model.safetensors``
            or ``model.safetensors.index.json`` + shards), a diffusers model folder (``config.json`` with
            ``_class_name``) or a folder of ``*.safetensors`` files without config.json. It is only read.
        out_dir: the checkpoint to create (same layout rules as :func:`lowbit.save_quantized`); it must lie
            outside ``src_dir`` and must not contain it.
        scheme: a name from ``lowbit.SCHEMES`` (or a :class:`Scheme`, e.g. one of
            ``lowbit.io.lightx2v.LIGHTX2V_SCHEMES``).
        device: where each tensor is quantized (None: CUDA if available, else CPU; with several ranks
            ``cuda:<LOCAL_RANK>``); a list or tuple gives one device per rank. ValueError if torch does not
            know it.
        skip: fnmatch patterns of module names kept in full precision (default ``lm_head``).
        include: module-name patterns (globs, or regular expressions after ``re:``; :mod:`lowbit.io.rules`):
            only matching Linear weights are quantized. Without a transformers model it also replaces the
            default name rules (embeddings, norms, modulation, final projection).
        exclude: module-name patterns never quantized (in addition to ``skip``).
        progress: show a tqdm bar (or a line per shard on stderr without tqdm).
        format: checkpoint layout, as ``save_quantized(format=...)``; ``"lightx2v"`` writes LightX2V's keys
            and quantizes the weights exactly as LightX2V's converter does.
        overwrite: replace an existing ``out_dir``.
        max_shard_size: bound on the output buffered in memory per file (``"5GB"``, ``"500MB"`` or bytes): a
            source shard whose output is larger is written in numbered parts. A finished file is written in the
            background while the next is filled, so peak memory is about twice this plus twice the largest
            source tensor.
        model_class, trust_remote_code: for building the model skeleton (meta device) that says which tensors
            are Linear weights; without transformers, or for diffusers/bare folders, the rules of
            :mod:`lowbit.io.rules` decide.
        rank, world_size: this process's rank among ``world_size`` processes converting together (both or
            neither). None: the initialized ``torch.distributed`` process group's, else torchrun's ``RANK`` and
            ``WORLD_SIZE`` environment variables, else a single process.
        timeout: without a process group, the seconds a rank may stay silent before the others give up on
            it (a killed rank, or one never started); a process group's own timeout applies otherwise.

    Returns:
        ``Path(out_dir)`` (on every rank, once rank 0 has published it).

    Activation scales are dynamic (no calibration data here); fused q/k/v and gate/up NVFP4 weights share one
    global scale as in :func:`lowbit.quantize_model`, so a checkpoint converted here and a model quantized in
    memory and saved hold the same bytes. The output of a diffusers or bare folder has a config.json holding
    the source's config (if any) and the ``quantization_config``; load it with
    ``lowbit.load_quantized(out_dir, model=<the module>)``.

    Several processes: every rank is called with the same arguments. The source shards are split by bytes
    (:func:`lowbit.io.distributed.assign_shards`), each rank converts its own on its own device into the
    shared temp directory (its progress in ``progress.rank<r>.json``), and once all ranks are done (a barrier:
    the process group's, else files, see :mod:`lowbit.io.distributed`) rank 0 alone writes the index and
    config and publishes; the result is byte for byte the single-process one, whatever the number of ranks. A
    failed rank fails every rank (:class:`lowbit.io.distributed.DistributedConvertError` on the others) and
    nothing is published; a rerun, with any number of ranks, resumes from the finished shards.
    """
    scheme = get_scheme(scheme)
    world = resolve_world(rank, world_size)
    dev = rank_device(device, world)
    include_p = check_patterns(include, "include")
    exclude_p = check_patterns(exclude, "exclude")
    limit = parse_size(max_shard_size)
    timeout = check_timeout(timeout)
    src_dir, out_dir = Path(src_dir), Path(out_dir)
    opts = dict(skip=skip, include_p=include_p, exclude_p=exclude_p, format=format, overwrite=overwrite, limit=limit,
                model_class=model_class, trust_remote_code=trust_remote_code)
    if world.size == 1:
        with on_device(dev):
            plan = _plan(src_dir, out_dir, scheme, dev, **opts)
            tmp = temp_dir_for(out_dir, "convert")
            try:
                manifests, stale = _read_progress(tmp, plan.ident) if tmp.is_dir() else ({}, False)
                if stale and not manifests:
                    warnings.warn(
                        f"lowbit.convert_checkpoint: {tmp} is from another conversion; starting over", stacklevel=2
                    )
                    shutil.rmtree(tmp)
                tmp.mkdir(parents=True, exist_ok=True)
                done = _done(tmp, manifests.values())
                own = _done(tmp, [manifests[tmp / MANIFEST]]) if tmp / MANIFEST in manifests else {}
                _run_shards(plan, list(plan.shard_keys), tmp, tmp / MANIFEST, own, done, dev, progress,
                            "lowbit convert")
            finally:
                plan.source.close()
            _finalize(plan, tmp, overwrite)
        return out_dir
    return _convert_ranks(src_dir, out_dir, scheme, world, dev, progress, timeout, opts)


def _run_shards(
    plan: _Plan, mine: list[Path], tmp: Path, manifest_path: Path, own: dict[str, dict], done: dict[str, dict],
    dev: torch.device, progress: bool, label: str,
) -> None:
    """Convert the source shards ``mine`` that ``done`` does not hold yet."""
    done_sources = {info["source"] for info in done.values()}
    todo = [f for f in mine if f.name not in done_sources]
    total = sum(len(plan.shard_keys[f]) for f in mine)
    done_count = total - sum(len(plan.shard_keys[f]) for f in todo)
    _convert_shards(plan, todo, tmp, manifest_path, own, dev, progress, done_count, total, label)


def _convert_ranks(
    src_dir: Path, out_dir: Path, scheme: Scheme, world: World, dev: torch.device, progress: bool, timeout: float,
    opts: dict,
) -> Path:
    """One rank of a multi-process conversion (see :func:`convert_checkpoint`)."""
    sync = GroupSync(world, dev) if world.group else FileSync(temp_dir_for(out_dir, SYNC_TAG), world, timeout)
    sync.start()
    status: dict[str, Any] = {"ok": True, "error": None, "ident": None, "world_size": world.size}
    err: BaseException | None = None
    plan = tmp = None
    try:
        try:
            with on_device(dev):
                plan = _plan(src_dir, out_dir, scheme, dev, **opts)
                status["ident"] = plan.ident_hash
                tmp = temp_dir_for(out_dir, "convert")
                try:
                    # no rank deletes anything here: files of another conversion are replaced or, at the end,
                    # removed by rank 0 once no rank writes any more
                    tmp.mkdir(parents=True, exist_ok=True)
                    manifests, stale = _read_progress(tmp, plan.ident)
                    if stale and world.rank == 0:
                        warnings.warn(
                            f"lowbit.convert_checkpoint: {tmp} holds files of another conversion; they are replaced",
                            stacklevel=3,
                        )
                    done = _done(tmp, manifests.values())
                    path = tmp / f"progress.rank{world.rank}.json"
                    own = _done(tmp, [manifests[path]]) if path in manifests else {}
                    owner = assign_shards({f.name: f.stat().st_size for f in plan.shard_keys}, world.size)
                    mine = [f for f in plan.shard_keys if owner[f.name] == world.rank]
                    _run_shards(plan, mine, tmp, path, own, done, dev, progress,
                                f"lowbit convert rank {world.rank}/{world.size}")
                finally:
                    plan.source.close()
        except Exception as e:  # noqa: BLE001 - reported to every rank, then raised here
            err = e
            status.update(ok=False, error=f"{type(e).__name__}: {e}")
        statuses = sync.exchange(status)
        if world.rank == 0:
            problem = check_statuses(statuses, world)
            if problem is None:
                try:
                    with on_device(dev):
                        _finalize(plan, tmp, opts["overwrite"])
                    outcome = {"ok": True}
                except Exception as e:  # noqa: BLE001 - reported to every rank, then raised here
                    err = e
                    outcome = {"ok": False, "error": f"rank 0 could not publish: {type(e).__name__}: {e}"}
            else:
                outcome = {"ok": False, "error": problem}
        else:
            outcome = None
        outcome = sync.outcome(outcome)
    finally:
        sync.close()
    if err is not None:
        raise err
    if not outcome.get("ok"):
        where = f"; the finished shards stay in {tmp} for a rerun" if tmp is not None else ""
        raise DistributedConvertError(
            f"convert_checkpoint rank {world.rank} of {world.size}: {outcome.get('error')}; nothing was published"
            f" at {out_dir}{where}"
        )
    return out_dir


def _shard_ok(path: Path, keys: list[str]) -> bool:
    try:
        return path.is_file() and set(safetensors_keys(path)) == set(keys)
    except (ValueError, OSError):
        return False


__all__ = ["check_source", "check_unquantized_config", "convert_checkpoint"]
