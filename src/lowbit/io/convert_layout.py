"""The output files of a conversion, laid out before anything is quantized, and the pieces ranks convert.

Every output file's bytes are known in advance but for the tensor data: the names, dtypes and shapes of a
quantized weight's tensors follow from the weight's shape alone (:func:`output_specs` runs the quantizer and the
layout's export once per distinct shape on the meta device), and a safetensors file is its header followed by
its tensors at offsets the header fixes. So :func:`plan_outputs` lays out every file up front, exactly as
``safetensors.torch.save_file`` would write it (tensors ordered by dtype, largest first, then by name; the
header padded with spaces to 8 bytes; ``{"format": "pt"}`` metadata), and the source shards are cut into
**pieces** of about :data:`PIECE_BYTES` of source each, at module boundaries. A piece is the unit of work:
any rank converts any piece and writes its tensors' bytes straight into the files at their offsets, so the
ranks share the work by tensors rather than by whole shards (a 20 GB checkpoint in six 3.5 GB shards split
55/45 over two ranks by shards, evenly by pieces), and the files are the same bytes whichever rank wrote what.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..api import quantize
from ..nn.modules import QuantLinear
from ..nn.schemes import Scheme
from . import lightx2v as _lx
from .files import SAFETENSORS_DTYPES, SINGLE_FILE

PIECE_BYTES = 256 << 20
"""Source bytes a piece grows to before it is cut (at the next module boundary): small enough that two to eight
ranks get even shares of a checkpoint of a few shards, large enough that a piece's fsync is amortized."""

DTYPE_ORDER = ("BOOL", "F4", "U8", "I8", "F8_E5M2", "F8_E4M3", "F8_E8M0", "I16", "U16", "F16", "BF16", "I32", "U32",
               "F32", "C64", "F64", "I64", "U64")
"""safetensors' dtype order, lowest first: its writer puts the tensors of the largest dtype first, then by
name (measured on safetensors 0.8's ``save_file``; the tests compare bytes with it)."""

_RANK = {name: i for i, name in enumerate(DTYPE_ORDER)}
_NAMES = {dtype: name for name, dtype in SAFETENSORS_DTYPES.items()}
_ITEM_BYTES = {name: dtype.itemsize for name, dtype in SAFETENSORS_DTYPES.items()}
METADATA = {"format": "pt"}


def dtype_name(dtype: torch.dtype) -> str:
    name = _NAMES.get(dtype)
    if name is None:
        raise ValueError(f"safetensors has no dtype for {dtype}")
    return name


@dataclass(frozen=True)
class Spec:
    """One output tensor: its name, safetensors dtype name, shape and byte count."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int


@dataclass
class OutputFile:
    """One output file: written at ``tmp_name`` in the temp directory, renamed to ``name`` when published."""

    name: str
    tmp_name: str
    source: str
    keys: list[str]
    header: bytes
    size: int
    tensor_bytes: int
    offsets: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class Piece:
    """Consecutive source keys of one shard; ``files`` are the temp names of the files its outputs go to."""

    id: str
    source: str
    keys: tuple[str, ...]
    nbytes: int
    files: tuple[str, ...]


@dataclass
class OutputPlan:
    files: dict[str, OutputFile]  # by temp name, in source-shard then part order
    pieces: list[Piece]
    specs: dict[str, list[Spec]]  # source key -> its output tensors, in export order
    where: dict[str, tuple[str, int]]  # output tensor name -> (temp name of its file, data offset in the file)


def safetensors_layout(specs: list[Spec], metadata: dict[str, str] = METADATA) -> tuple[bytes, dict[str, int]]:
    """(the 8-byte length + header bytes, ``{name: offset of its data from the start of the file}``), as
    ``safetensors.torch.save_file(tensors, path, metadata)`` writes them."""
    order = sorted(specs, key=lambda s: (-_RANK[s.dtype], s.name))
    header: dict[str, object] = {"__metadata__": dict(sorted(metadata.items()))} if metadata else {}
    begin = 0
    begins = {}
    for s in order:
        header[s.name] = {"dtype": s.dtype, "shape": list(s.shape), "data_offsets": [begin, begin + s.nbytes]}
        begins[s.name] = begin
        begin += s.nbytes
    text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    text += b" " * (-len(text) % 8)
    head = len(text).to_bytes(8, "little") + text
    return head, {n: len(head) + b for n, b in begins.items()}


def quantize_target(w: torch.Tensor, scheme: Scheme, layout, global_scale: torch.Tensor | None):
    """(the QuantLinear a conversion exports for weight ``w``, its quantized weight); also run on the meta device
    to plan the files."""
    if layout.name == "lightx2v":
        # LightX2V's own converter rule (bf16 cast, per-tensor 2688/amax in bf16), bit for bit
        q = _lx.quantize_weight(w, _lx.quant_scheme_of(scheme))
    else:
        opts = scheme.weight_quantize_options(w.shape[1])
        if global_scale is not None:
            opts["global_scale"] = global_scale.to(w.device)
        q = quantize(w, scheme.weight_format, **opts)
    return QuantLinear(w.shape[1], w.shape[0], False, scheme=scheme, weight=q), q


def _export_specs(shape: list[int], dtype: torch.dtype, scheme: Scheme, layout, shared: bool) -> list[tuple]:
    """``[(local name, dtype name, shape)]`` of the tensors exported for a weight of ``shape``: the quantizer on
    the meta device, or, where it reads a value (LightX2V's per-tensor scale), on a CPU tensor of ones."""
    g = torch.ones((), dtype=torch.float32) if shared else None
    try:
        m, _ = quantize_target(torch.empty(shape, dtype=dtype, device="meta"), scheme, layout,
                               None if g is None else g.to("meta"))
    except (RuntimeError, NotImplementedError):
        m, _ = quantize_target(torch.ones(shape, dtype=dtype), scheme, layout, g)
    return [(k, dtype_name(v.dtype), tuple(v.shape)) for k, v in layout.export(m).items()]


def _module_of(key: str) -> str:
    """The module a key belongs to, above its Linear: ``a.layers.3.self_attn`` for ``...self_attn.q_proj.weight``
    (fused siblings share it, so a piece holds a whole fused group and one rank reads it for its global scale)."""
    return key.rsplit(".", 2)[0] if key.count(".") >= 2 else key


def plan_outputs(
    shard_keys: dict[Path, list[str]],
    shape_of: Callable[[str], list[int]],
    dtype_of: Callable[[str], str],
    targets: dict[str, tuple[str, str]],
    shared: Callable[[str], bool],
    scheme: Scheme,
    layout,
    limit: int,
    single: bool,
    piece_bytes: int = PIECE_BYTES,
) -> OutputPlan:
    """Lay out every output file and cut the shards into pieces (see the module docstring).

    A shard's outputs go to one file named after it (``model.safetensors`` for a single unindexed source) or,
    when they exceed ``limit`` bytes, to numbered parts cut in key order before a source tensor's outputs would
    take a part over ``limit`` (a single larger one goes alone)."""
    cache: dict[tuple, list[tuple]] = {}
    specs: dict[str, list[Spec]] = {}
    files: dict[str, OutputFile] = {}
    pieces: list[Piece] = []
    where: dict[str, tuple[str, int]] = {}
    for src_file, keys in shard_keys.items():
        source_bytes = {}
        for key in keys:
            shape, dname = shape_of(key), dtype_of(key)
            source_bytes[key] = _nbytes(dname, shape)
            if key in targets:
                name, prefix = targets[key]
                ck = (tuple(shape), dname, shared(name))
                if ck not in cache:
                    cache[ck] = _export_specs(shape, SAFETENSORS_DTYPES[dname], scheme, layout, ck[2])
                out = [Spec(f"{prefix}{k}", d, s, _nbytes(d, s)) for k, d, s in cache[ck]]
            else:
                out = [Spec(key, dname, tuple(shape), source_bytes[key])]
            specs[key] = out
        # parts: cut before a key's outputs would take the part over the limit
        parts: list[list[str]] = [[]]
        size = 0
        for key in keys:
            n = sum(s.nbytes for s in specs[key])
            if parts[-1] and size + n > limit:
                parts.append([])
                size = 0
            parts[-1].append(key)
            size += n
        out_name = SINGLE_FILE if single else src_file.name
        stem = out_name.removesuffix(".safetensors")
        file_of: dict[str, str] = {}
        for i, part in enumerate(parts):
            name = out_name if len(parts) == 1 else f"{stem}-part{i + 1:05d}-of-{len(parts):05d}.safetensors"
            tmp_name = f".{stem}.part{i:05d}.safetensors"
            part_specs = [s for key in part for s in specs[key]]
            header, offsets = safetensors_layout(part_specs)
            tensor_bytes = sum(s.nbytes for s in part_specs)
            files[tmp_name] = OutputFile(name, tmp_name, src_file.name, [s.name for s in part_specs], header,
                                         len(header) + tensor_bytes, tensor_bytes, offsets)
            for s in part_specs:
                where[s.name] = (tmp_name, offsets[s.name])
            for key in part:
                file_of[key] = tmp_name
        # pieces: consecutive keys up to about piece_bytes of source, cut between modules only
        run: list[str] = []
        run_bytes = count = 0
        for i, key in enumerate(keys):
            run.append(key)
            run_bytes += source_bytes[key]
            last = i == len(keys) - 1
            if last or (run_bytes >= piece_bytes and _module_of(keys[i + 1]) != _module_of(key)):
                touched = tuple(dict.fromkeys(file_of[k] for k in run))
                pieces.append(Piece(f"{src_file.name}#{count}", src_file.name, tuple(run), run_bytes, touched))
                run, run_bytes, count = [], 0, count + 1
    return OutputPlan(files, pieces, specs, where)


def _nbytes(dtype: str, shape) -> int:
    size = _ITEM_BYTES.get(dtype)
    if size is None:
        raise ValueError(f"convert_checkpoint: cannot lay out a tensor of safetensors dtype {dtype!r} "
                         f"(supported: {sorted(_ITEM_BYTES)})")
    n = 1
    for d in shape:
        n *= int(d)
    return n * size


__all__ = ["PIECE_BYTES", "OutputFile", "OutputPlan", "Piece", "Spec", "plan_outputs", "quantize_target",
           "safetensors_layout"]
