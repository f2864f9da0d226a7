"""Shards of a 2-D quantized weight ``[N, K]``: equal ranges of rows (output features) or of columns (input
features), each a QTensor of its own that decodes to exactly the same slice of the whole weight.

``shard(q, dim, index, count)`` is what tensor parallelism needs: a column-parallel layer holds rows
``index * N/count`` onwards, a row-parallel layer columns ``index * K/count`` onwards. Every tensor of the
shard is a new contiguous tensor (the whole weight can be freed), and

    dequantize(shard(q, 0, i, c)) == dequantize(q)[i*N/c : (i+1)*N/c]      (bit for bit, NaN included)
    dequantize(shard(q, 1, i, c)) == dequantize(q)[:, i*K/c : (i+1)*K/c]

Boundaries must fall on the format's blocks (:func:`shard_align`): a range never splits a block that shares
one scale, a byte that packs two codes, or an int32 word that packs eight AutoAWQ columns. Swizzled
(128x4-tiled) scales are rebuilt for the shard's own shape; nf4 double quantization stays when the range
keeps whole nested blocks and is decoded to its exact fp32 absmax otherwise (both decode identically).
"""

from __future__ import annotations

from dataclasses import replace

import torch

from .nf4 import BNB_4BIT_FORMATS, check_bnb4_qtensor
from .packing import swizzle_scales, unswizzle_scales
from .qtensor import QTensor
from .rows import nf4_without_double_quant, slice_rows
from .spec import FORMATS

PLAN_ROWS = "plan_rows"
"""``QTensor.params`` key of a column shard that plans its kernel launches as the whole weight does: the kernels
choose their variant and split K from this many rows instead of the shard's own, so every output element is
computed in the same order as on one GPU (bit for bit). Set by ``lowbit.parallel`` (``exact=True``); never
written to checkpoints."""

SHARDABLE = ("nvfp4", "mxfp4", "mxfp6_e2m3", "mxfp6_e3m2", "mxfp8_e4m3", "mxfp8_e5m2", "fp4_b32", "nf4",
             "bnb_fp4", "int4_awq", "fp8_block")
"""Formats :func:`shard` takes (2-D weights)."""


def plan_rows(q) -> int:
    """The rows the kernels plan a weight's launches for: ``q.params[PLAN_ROWS]`` where a column shard set it,
    else its own ``N`` (``q`` a QTensor, or anything with ``shape`` and ``params``)."""
    params = getattr(q, "params", None) or {}
    return int(params.get(PLAN_ROWS, q.shape[-2] if len(q.shape) >= 2 else q.shape[0]))


def shard_align(q: QTensor, dim: int) -> int:
    """Rows (``dim`` 0) or columns (``dim`` 1) a shard boundary of ``q`` must be a multiple of.

    - rows: 8 for int4_awq (eight output columns per packed int32), the block's rows for 128x128 fp8_block,
      1 otherwise (nf4's 64-blocks run along rows when K is a multiple of the blocksize, which is required);
    - columns: the scale block (16 nvfp4, 32 MX and fp4_b32, the blocksize of nf4, the group of int4_awq, 128
      for fp8_block).
    """
    _check(q, dim)
    return _align(q, dim)


def _align(q: QTensor, dim: int) -> int:
    fmt = q.fmt
    if fmt == "int4_awq":
        return 8 if dim == 0 else int(q.params["group_size"])
    if fmt == "fp8_block":
        return int(tuple(q.params["block"])[dim])
    if fmt in BNB_4BIT_FORMATS:
        return 1 if dim == 0 else int(q.params["blocksize"])
    return 1 if dim == 0 else int(FORMATS[fmt].block)


def shard_reason(q: QTensor, dim: int, count: int) -> str | None:
    """None if ``q`` splits into ``count`` equal shards along ``dim``, else the rule it breaks."""
    if not isinstance(q, QTensor):
        return f"the weight must be a QTensor, got {type(q).__name__}"
    if q.fmt not in SHARDABLE:
        return f"no sharding for format {q.fmt!r} (shardable: {', '.join(SHARDABLE)})"
    if len(q.shape) != 2:
        return f"sharding needs a 2-D weight [N, K], got shape {tuple(q.shape)}"
    if dim not in (0, 1):
        return f"dim must be 0 (rows, N) or 1 (columns, K), got {dim!r}"
    if isinstance(count, bool) or not isinstance(count, int) or count < 1:
        return f"count must be a positive int, got {count!r}"
    size = q.shape[dim]
    what = "N (rows)" if dim == 0 else "K (columns)"
    if size % count:
        return f"{what} = {size} is not divisible into {count} equal shards"
    align = _align(q, dim)
    if (size // count) % align:
        return (f"{what} / {count} = {size // count} is not a multiple of {align}: {q.fmt} shards must hold whole "
                f"{'packed words' if q.fmt == 'int4_awq' and dim == 0 else 'scale blocks'} of {align}")
    if q.fmt in BNB_4BIT_FORMATS and q.shape[1] % int(q.params["blocksize"]):
        return (f"{q.fmt}: K = {q.shape[1]} is not a multiple of the blocksize {q.params['blocksize']}, so its "
                "blocks (over the flattened weight) do not follow rows")
    if q.fmt == "fp8_block" and any(s % b for s, b in zip(q.shape, tuple(q.params["block"]))):
        return f"fp8_block: shape {tuple(q.shape)} must be a multiple of the block {tuple(q.params['block'])}"
    return None


def _check(q: QTensor, dim: int) -> None:
    why = shard_reason(q, dim, 1)
    if why is not None:
        raise ValueError(f"shard: {why}")


def shard_range(size: int, index: int, count: int) -> tuple[int, int]:
    """``(start, stop)`` of shard ``index`` of ``count`` equal shards of ``size`` elements."""
    if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < count:
        raise ValueError(f"index must be an int in [0, {count}), got {index!r}")
    step = size // count
    return index * step, (index + 1) * step


def shard(q: QTensor, dim: int, index: int, count: int) -> QTensor:
    """Shard ``index`` of ``count`` equal shards of the weight ``q`` ``[N, K]`` along ``dim`` (module docstring).

    Raises:
        ValueError: the format cannot be sharded, or the shard boundaries break its blocks (the message says
            which rule), or ``index`` is not in ``[0, count)``.
    """
    why = shard_reason(q, dim, count)
    if why is not None:
        raise ValueError(f"shard: {why}")
    start, stop = shard_range(q.shape[dim], index, count)
    if (start, stop) == (0, q.shape[dim]):
        return _owned(q)
    out = _rows(q, start, stop) if dim == 0 else _cols(q, start, stop)
    return _owned(out)


def _owned(q: QTensor) -> QTensor:
    """The same QTensor with every tensor a new contiguous one (a shard must not keep the whole weight alive)."""
    return replace(q, **{name: t.contiguous().clone() for name, t in q.tensors().items()})


def _linear_scales(q: QTensor) -> torch.Tensor:
    """Block scales ``[N, K/block]`` of a block-scaled weight, unswizzled if needed."""
    cols = q.shape[1] // FORMATS[q.fmt].block
    if q.scale_layout == "swizzled":
        return unswizzle_scales(q.scale, q.shape[0], cols)
    return q.scale


def _with_scales(q: QTensor, scale: torch.Tensor) -> torch.Tensor:
    """Scales in ``q``'s layout for a shard whose linear scales are ``scale``."""
    return swizzle_scales(scale) if q.scale_layout == "swizzled" else scale


def _rows(q: QTensor, n0: int, n1: int) -> QTensor:
    shape = (n1 - n0, q.shape[1])
    if FORMATS[q.fmt].kind == "blockscaled":
        return replace(q, data=q.data[n0:n1], scale=_with_scales(q, _linear_scales(q)[n0:n1]), shape=shape)
    if q.fmt == "fp8_block":
        br = tuple(q.params["block"])[0]
        return replace(q, data=q.data[n0:n1], scale=q.scale[n0 // br : n1 // br], shape=shape)
    # nf4 / bnb_fp4 (blocks over the flattened rows) and int4_awq (packed columns): the chunking reference
    return slice_rows(q, n0, n1)


def _cols(q: QTensor, k0: int, k1: int) -> QTensor:
    n = q.shape[0]
    shape = (n, k1 - k0)
    spec = FORMATS[q.fmt]
    if spec.kind == "blockscaled":
        bits = spec.element.bits
        block = spec.block
        # whole blocks hold whole bytes: 16 or 32 codes of 4, 6 or 8 bits
        data = q.data[:, k0 * bits // 8 : k1 * bits // 8]
        scale = _linear_scales(q)[:, k0 // block : k1 // block]
        return replace(q, data=data, scale=_with_scales(q, scale), shape=shape)
    if q.fmt == "fp8_block":
        bc = tuple(q.params["block"])[1]
        return replace(q, data=q.data[:, k0:k1], scale=q.scale[:, k0 // bc : k1 // bc], shape=shape)
    if q.fmt == "int4_awq":
        g = int(q.params["group_size"])
        # qweight [K, N/8]; qzeros [K/g, N/8] and scales [K/g, N] per group of input columns
        return replace(q, data=q.data[k0:k1], zeros=q.zeros[k0 // g : k1 // g], scale=q.scale[k0 // g : k1 // g],
                       shape=shape)
    # nf4 / bnb_fp4: 64-blocks over the flattened weight follow rows (K a multiple of the blocksize); a column
    # range cuts every nested block of 256 absmax values, so the absmax is decoded to its exact fp32 values
    check_bnb4_qtensor(q)
    bs = int(q.params["blocksize"])
    k = q.shape[1]
    plain = nf4_without_double_quant(q)
    data = plain.data.reshape(n, k // 2)[:, k0 // 2 : k1 // 2].reshape(-1)
    absmax = plain.scale.reshape(n, k // bs)[:, k0 // bs : k1 // bs].reshape(-1)
    return replace(plain, data=data, scale=absmax, shape=shape)


__all__ = ["PLAN_ROWS", "SHARDABLE", "plan_rows", "shard", "shard_align", "shard_range", "shard_reason"]
