"""Row ranges of a 2-D quantized weight ``[N, K]`` as QTensors of their own (views where the layout allows),
and the reverse: weights stacked along their rows.

``slice_rows(q, n0, n1)`` decodes to exactly ``dequantize(q)[n0:n1]``. Used to dequantize a weight a bounded
chunk of rows at a time (``lowbit.ops.linear``'s dequantize + GEMM path), never the whole matrix at once.
``cat_rows(qs)`` decodes to exactly ``torch.cat([dequantize(q) for q in qs])``: the weight of sibling
projections that read one input (q/k/v, gate/up) as one GEMM, as serving engines fuse them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import torch

from .nf4 import BNB_4BIT_FORMATS, NESTED_BLOCKSIZE, check_bnb4_qtensor, nf4_absmax
from .qtensor import QTensor

ROW_ALIGN = {"nvfp4": 128, "mxfp4": 128, "fp4_b32": 1, "nf4": 1, "bnb_fp4": 1, "int4_awq": 8}
"""Row starts :func:`slice_rows` accepts per format must be multiples of this (128: the swizzled scale tile,
which it also requires for linear scales so that chunking does not depend on the layout; 8: the AutoAWQ
column packing)."""


def slice_rows_reason(q: QTensor) -> str | None:
    """None if :func:`slice_rows` takes ``q``, else why not."""
    if q.fmt not in ROW_ALIGN:
        return f"no row slicing for format {q.fmt!r}"
    if len(q.shape) != 2:
        return f"row slicing needs a 2-D weight, got shape {tuple(q.shape)}"
    if q.fmt in BNB_4BIT_FORMATS:
        blocksize = q.params.get("blocksize")
        if not blocksize or q.shape[1] % blocksize:
            return f"{q.fmt}: K = {q.shape[1]} is not a multiple of the blocksize {blocksize}"
    return None


def nf4_without_double_quant(q: QTensor) -> QTensor:
    """The same nf4 (or bnb_fp4) weight with its absmax decoded to fp32 (dequantizes identically)."""
    check_bnb4_qtensor(q)
    if q.nested_scale is None:
        return q
    params = dict(q.params, double_quant=False)
    return replace(q, scale=nf4_absmax(q).reshape(-1), nested_scale=None, nested_offset=None, params=params)


def nf4_slices_keep_double_quant(q: QTensor, n0: int) -> bool:
    """Whether :func:`slice_rows` keeps an nf4 weight's absmax double-quantized for row starts that are
    multiples of ``n0``: they must start a nested block (256 absmax blocks)."""
    return q.nested_scale is not None and (n0 * q.shape[1] // q.params["blocksize"]) % NESTED_BLOCKSIZE == 0


def slice_rows(q: QTensor, n0: int, n1: int) -> QTensor:
    """Rows ``n0:n1`` of the weight ``q`` ``[N, K]``; ``n0`` a multiple of ``ROW_ALIGN[q.fmt]``.

    nf4 with double quantization stays double-quantized when ``n0`` starts a nested block (256 absmax
    blocks); otherwise it is sliced from its fp32 absmax (decoded here on every call: call
    :func:`nf4_without_double_quant` once and slice that instead)."""
    why = slice_rows_reason(q)
    if why:
        raise ValueError(f"slice_rows: {why}")
    n, k = q.shape
    align = ROW_ALIGN[q.fmt]
    if not (0 <= n0 < n1 <= n) or n0 % align:
        raise ValueError(f"slice_rows: need 0 <= n0 < n1 <= {n} and n0 % {align} == 0, got n0={n0}, n1={n1}")
    rows = n1 - n0
    shape = (rows, k)
    if q.fmt in ("nvfp4", "mxfp4", "fp4_b32"):
        data = q.data[n0:n1]
        if q.scale_layout == "swizzled":
            # every 128-row tile is one contiguous run of the swizzled scales, so a range of whole tiles is a
            # row range of the padded [round_up(N, 128), round_up(K / block, 4)] tensor
            padded = -(-rows // 128) * 128
            scale = q.scale.reshape(-1, q.scale.shape[-1])[n0 : n0 + padded]
        else:
            scale = q.scale[n0:n1]
        return replace(q, data=data, scale=scale, shape=shape)
    if q.fmt in BNB_4BIT_FORMATS:
        blocksize = q.params["blocksize"]
        b0, b1 = n0 * k // blocksize, n1 * k // blocksize
        data = q.data.reshape(-1)[n0 * k // 2 : n1 * k // 2]
        if nf4_slices_keep_double_quant(q, n0):
            # whole nested blocks: the absmax codes stay double-quantized (decoded by the kernel)
            nested = q.nested_scale.reshape(-1)[b0 // NESTED_BLOCKSIZE : -(-b1 // NESTED_BLOCKSIZE)]
            return replace(q, data=data, scale=q.scale.reshape(-1)[b0:b1], nested_scale=nested, shape=shape)
        q = nf4_without_double_quant(q)
        return replace(q, data=data, scale=q.scale.reshape(-1)[b0:b1], shape=shape)
    # int4_awq: qweight [K, N/8], qzeros [K/g, N/8] pack 8 output columns per int32; scales [K/g, N]
    if n1 % 8:
        raise ValueError(f"slice_rows: int4_awq row ranges must end on a multiple of 8, got n1={n1}")
    # column views (row strides of the whole weight): the dequantize kernel takes the strides
    data = q.data[:, n0 // 8 : n1 // 8]
    zeros = q.zeros[:, n0 // 8 : n1 // 8]
    scale = q.scale[:, n0:n1]
    return replace(q, data=data, scale=scale, zeros=zeros, shape=shape)


def cat_rows(qs: Sequence[QTensor]) -> QTensor:
    """The weights ``qs`` (each ``[N_i, K]``, one format) stacked along their rows as one ``[sum N_i, K]``
    QTensor that decodes to exactly the members' rows, bit for bit. Codes and scales are copied, never
    requantized, so the members must agree on everything but their rows: format, params, K, layouts, dtypes,
    device and (nvfp4) the global scale itself; a swizzled-scale member other than the last must have a
    multiple of 128 rows (its scale tiles are not padded), an int4_awq member a multiple of 8. nf4 and
    bnb_fp4 weights with double quantization are stacked from their fp32 absmax (the nested blocks of two
    weights do not line up).

    Raises:
        ValueError: an empty sequence, or members that differ in any of the above (naming it).
        TypeError: a member that is not a QTensor.
    """
    qs = list(qs)
    if not qs:
        raise ValueError("cat_rows: needs at least one weight")
    for i, q in enumerate(qs):
        if not isinstance(q, QTensor):
            raise TypeError(f"cat_rows: qs[{i}] must be a QTensor, got {type(q).__name__}")
        why = slice_rows_reason(q)
        if why:
            raise ValueError(f"cat_rows: qs[{i}]: {why}")
    qs = [nf4_without_double_quant(q) if q.fmt in BNB_4BIT_FORMATS else q for q in qs]
    first = qs[0]
    k = first.shape[1]
    for i, q in enumerate(qs[1:], 1):
        for what, a, b in (("format", q.fmt, first.fmt), ("in_features (K)", q.shape[1], k),
                           ("params", q.params, first.params), ("scale layout", q.scale_layout, first.scale_layout),
                           ("data dtype", q.data.dtype, first.data.dtype),
                           ("scale dtype", q.scale.dtype, first.scale.dtype), ("device", q.data.device, first.data.device)):
            if a != b:
                raise ValueError(f"cat_rows: qs[{i}] has {what} {a!r}, qs[0] has {b!r}; stacked weights must agree")
        if (q.global_scale is None) != (first.global_scale is None) or (
                q.global_scale is not None and not torch.equal(q.global_scale, first.global_scale)):
            raise ValueError(f"cat_rows: qs[{i}] has another global scale than qs[0]; quantize the siblings with "
                             "one shared global scale (quantize_model does for q/k/v and gate/up)")
    n = sum(q.shape[0] for q in qs)
    shape = (n, k)
    if len(qs) == 1:
        return first
    if first.fmt in ("nvfp4", "mxfp4", "fp4_b32"):
        data = torch.cat([q.data for q in qs])
        if first.scale_layout == "swizzled":
            for i, q in enumerate(qs[:-1]):
                if q.shape[0] % 128:
                    raise ValueError(f"cat_rows: qs[{i}] has {q.shape[0]} rows; with swizzled scales every weight "
                                     "but the last needs a multiple of 128 (its scale tiles would be padded)")
            cols = first.scale.shape[-1]
            scale = torch.cat([q.scale.reshape(-1, cols) for q in qs])
            if first.scale.dim() != 2:
                scale = scale.reshape(-1)
        else:
            scale = torch.cat([q.scale for q in qs])
        return replace(first, data=data, scale=scale, shape=shape)
    if first.fmt in BNB_4BIT_FORMATS:
        data = torch.cat([q.data.reshape(-1) for q in qs]).reshape(-1, *first.data.shape[1:])
        scale = torch.cat([q.scale.reshape(-1) for q in qs])
        return replace(first, data=data, scale=scale, shape=shape)
    # int4_awq: qweight [K, N/8], qzeros [K/g, N/8] pack 8 output columns per int32; scales [K/g, N]
    for i, q in enumerate(qs):
        if q.shape[0] % 8:
            raise ValueError(f"cat_rows: int4_awq qs[{i}] has {q.shape[0]} rows, not a multiple of 8 (the packing "
                             "holds 8 output columns per int32)")
    return replace(first, data=torch.cat([q.data for q in qs], dim=1), zeros=torch.cat([q.zeros for q in qs], dim=1),
                   scale=torch.cat([q.scale for q in qs], dim=1), shape=shape)
