"""safetensors headers, read and validated without loading a tensor (``lowbit inspect``).

A ``*.safetensors`` file is an 8-byte little-endian header length, a JSON header giving every tensor's dtype,
shape and byte range, then the data. :func:`read_header` checks the header as the safetensors library does
when ``load_quantized`` opens the file; :func:`read_small` reads one tiny tensor by offset. Truncated or
corrupt files raise :class:`CheckpointError`.
"""

from __future__ import annotations

import json
import math
import os
import stat
import struct
from dataclasses import dataclass
from pathlib import Path

DTYPE_BYTES = {
    "F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "U16": 2,
    "U32": 4, "U64": 8, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1, "F8_E4M3FNUZ": 1,
    "F8_E5M2FNUZ": 1, "F4": 0.5, "F6_E2M3": 0.75, "F6_E3M2": 0.75,
}  # fmt: skip
_MAX_HEADER = 100 * 1024 * 1024


class CheckpointError(ValueError):
    """A path that is not a readable safetensors checkpoint (missing, truncated, corrupt header)."""


@dataclass
class TensorInfo:
    file: Path
    dtype: str
    shape: tuple[int, ...]
    start: int
    end: int
    data_start: int

    @property
    def nbytes(self) -> int:
        return self.end - self.start

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def regular_file_size(path: Path, what: str = "file") -> int:
    """The size of ``path``; CheckpointError unless it is a regular file. Checked with ``os.stat`` before any
    ``open``: opening a FIFO for reading blocks until a writer comes, and devices never end."""
    try:
        st = os.stat(path)
    except OSError as e:
        raise CheckpointError(f"{path}: {e.strerror or e}") from None
    if not stat.S_ISREG(st.st_mode):
        kind = "a directory" if stat.S_ISDIR(st.st_mode) else "not a regular file (FIFO, socket or device?)"
        raise CheckpointError(f"{path}: {what} is {kind}")
    return st.st_size


def _bits(dtype: str) -> int:
    return round(DTYPE_BYTES[dtype] * 8)


def read_header(path: str | os.PathLike) -> dict[str, TensorInfo]:
    """Tensor infos of one safetensors file, validated as the safetensors library validates them when
    ``load_quantized`` opens the file: a JSON object header of at most 100 MB, known dtypes, non-negative
    integer shapes, byte ranges that tile the data buffer exactly (no overlap, no gap, nothing after the last
    tensor) and hold ``numel * dtype size`` bytes each. Anything else raises :class:`CheckpointError`."""
    path = Path(path)
    size = regular_file_size(path, "safetensors file")
    try:
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise CheckpointError(f"{path}: {size} bytes, too short for a safetensors header")
            (n,) = struct.unpack("<Q", head)
            if n > min(size - 8, _MAX_HEADER):
                raise CheckpointError(
                    f"{path}: header length {n} exceeds the file ({size} bytes): not safetensors"
                )
            raw = f.read(n)
    except OSError as e:
        raise CheckpointError(f"{path}: {e.strerror or e}") from None
    try:
        header = json.loads(raw.decode("utf-8"))
        assert isinstance(header, dict)
    except (UnicodeDecodeError, ValueError, AssertionError):
        raise CheckpointError(f"{path}: the safetensors header is not valid JSON (corrupt file?)") from None
    meta = header.get("__metadata__")
    if meta is not None and not (
        isinstance(meta, dict) and all(isinstance(v, str) for v in meta.values())
    ):
        raise CheckpointError(f"{path}: __metadata__ must be an object of strings")
    data_start = 8 + n
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
        except (KeyError, TypeError):
            raise CheckpointError(f"{path}: malformed header entry for {name!r}") from None
        if not isinstance(dtype, str) or dtype not in DTYPE_BYTES:
            raise CheckpointError(
                f"{path}: tensor {name!r} has unknown dtype {dtype!r} (safetensors dtypes: "
                f"{', '.join(DTYPE_BYTES)})"
            )
        if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
            raise CheckpointError(f"{path}: tensor {name!r} has shape {shape!r}: not a list of integers >= 0")
        if not (
            isinstance(offsets, list) and len(offsets) == 2 and all(type(o) is int and o >= 0 for o in offsets)
        ) or offsets[0] > offsets[1]:
            raise CheckpointError(
                f"{path}: tensor {name!r} has data_offsets {offsets!r}: not [begin, end] with 0 <= begin <= end"
            )
        start, end = offsets
        if data_start + end > size:
            raise CheckpointError(
                f"{path}: truncated: tensor {name!r} ends at byte {data_start + end}, the file has {size}"
            )
        bits = math.prod(shape) * _bits(dtype)
        if bits % 8 or bits // 8 != end - start:
            raise CheckpointError(
                f"{path}: tensor {name!r} of shape {shape} and dtype {dtype} needs {bits / 8:g} bytes but its "
                f"data_offsets give {end - start}"
            )
        out[name] = TensorInfo(path, dtype, tuple(shape), start, end, data_start)
    pos = 0
    for name, t in sorted(out.items(), key=lambda kv: (kv[1].start, kv[1].end)):
        if t.start != pos:
            what = "overlaps the previous tensor" if t.start < pos else f"leaves a gap at byte {pos}"
            raise CheckpointError(f"{path}: tensor {name!r} (bytes {t.start}-{t.end} of the data) {what}")
        pos = t.end
    if data_start + pos != size:
        raise CheckpointError(
            f"{path}: the tensors end at byte {data_start + pos} but the file has {size} bytes (corrupt file?)"
        )
    return out


def read_small(t: TensorInfo, limit: int = 4096) -> bytes:
    """The raw bytes of a tensor of at most ``limit`` bytes."""
    if t.nbytes > limit:
        raise CheckpointError(f"{t.file}: refusing to read a {t.nbytes}-byte tensor for metadata")
    with open(t.file, "rb") as f:
        f.seek(t.data_start + t.start)
        return f.read(t.nbytes)


__all__ = ["DTYPE_BYTES", "CheckpointError", "TensorInfo", "read_header", "read_small", "regular_file_size"]
