"""compressed-tensors ``pack-quantized`` 4-bit (llm-compressor W4A16 asymmetric, group strategy) <-> int4_awq.

Per module (``compressors/pack_quantized``, formats.md section 5):

- ``weight_packed`` int32 ``[out, ceil(in/8)]``: signed values ``-8..7`` stored ``+8`` and packed LSB-first
  (``pack_to_int32``): ``[-8, -7, 0, 1, 2, 3, 4, 7]`` -> ``0xfcba9810``. The signed value of an AWQ code ``q``
  is ``q - 8``, so the stored nibble is ``q`` itself.
- ``weight_scale`` ``[out, n_groups]``: CT keeps the weight's dtype (float16, bfloat16 or float32); read
  as it is, into an int4_awq QTensor with ``params["convention"] = "compressed-tensors"``.
- ``weight_zero_point`` int32 ``[out/8, n_groups]``: signed zero ``z - 8`` stored ``+8`` (again the raw
  ``z``), packed along dim 0 (``pack_to_int32(..., packed_dim=0)``). Absent for symmetric schemes
  (signed zero 0 = raw 8).
- ``weight_shape`` int64 ``[2]`` = ``(out, in)``; optional ``weight_g_idx``.

Dequantization ``(q_signed - zp_signed) * scale`` equals AWQ's ``(q - z) * s`` as integers; compressed-tensors
multiplies in the scale's dtype (``_dequantize``: ``x_q.to(scale.dtype)``), so a bfloat16 or float32 scale is
kept (converting it to float16 would change the decode: a bf16 product rounded once, against an fp16 product
cast to bf16). With fp16 scales the decode is AutoAWQ's fp16 multiply, which also matches CT's
``AutoAWQConverter`` (``entrypoints/convert``).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from ..formats.int4_awq import (
    FMT,
    check_int4_awq,
    int4_awq_codes,
    pack_awq,
    pack_int4_sequential,
    unpack_int4_sequential,
)
from ..formats.qtensor import QTensor
from .awq import infer_group_size

_SIGNED_ZERO = 8


def to_ct_pack_quantized(q: QTensor) -> dict[str, torch.Tensor]:
    """compressed-tensors ``pack-quantized`` tensors (asymmetric int4, group strategy) for ``q``.

    Args:
        q: int4_awq QTensor of logical shape ``[out, in]``, group size ``g``.

    Returns:
        ``{"weight_packed": int32 [out, ceil(in/8)], "weight_scale": [out, in/g] in q.scale's dtype (float16
        for AutoAWQ-convention tensors),
        "weight_zero_point": int32 [out/8, in/g], "weight_shape": int64 [2]}``.
    """
    out_features, in_features, _ = check_int4_awq(q)
    intweight, zeros = int4_awq_codes(q)
    return {
        "weight_packed": pack_int4_sequential(intweight.t(), dim=1),
        "weight_scale": q.scale.t().contiguous(),
        "weight_zero_point": pack_int4_sequential(zeros.t(), dim=0),
        "weight_shape": torch.tensor([out_features, in_features], dtype=torch.int64),
    }


def _get(tensors: Mapping[str, torch.Tensor], key: str) -> torch.Tensor:
    if key not in tensors:
        raise ValueError(f"tensors is missing {key!r} (needs weight_packed, weight_scale, weight_shape)")
    t = tensors[key]
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"tensors[{key!r}] must be a torch.Tensor, got {type(t).__name__}")
    return t


def from_ct_pack_quantized(tensors: Mapping[str, torch.Tensor]) -> QTensor:
    """Convert one module's compressed-tensors ``pack-quantized`` 4-bit tensors to an int4_awq QTensor.

    Args:
        tensors: the module's tensors without the module prefix: ``weight_packed`` int32
            ``[out, ceil(in/8)]``, ``weight_scale`` ``[out, n_groups]``, ``weight_shape`` ``[2]``, and
            ``weight_zero_point`` int32 ``[out/8, n_groups]`` (absent for symmetric schemes: zero 0). An
            optional ``weight_g_idx`` must be the trivial ``i // g``. ``weight_scale`` may be float16,
            bfloat16 or float32 (the model's dtype, as llm-compressor writes it).

    Returns:
        int4_awq QTensor of logical shape ``weight_shape``: ``scale`` keeps ``weight_scale``'s dtype
        (transposed to ``[n_groups, out]``) and ``dtype`` is that dtype, so it decodes as compressed-tensors
        does; bfloat16/float32 scales carry ``params["convention"] = "compressed-tensors"``.
    """
    if not isinstance(tensors, Mapping):
        raise TypeError(f"tensors must be a mapping of name -> tensor, got {type(tensors).__name__}")
    packed = _get(tensors, "weight_packed")
    scale = _get(tensors, "weight_scale")
    shape = _get(tensors, "weight_shape")
    if packed.dtype != torch.int32 or packed.dim() != 2:
        raise TypeError(f"weight_packed must be a 2-D int32 tensor, got {packed.dtype} {tuple(packed.shape)}")
    if shape.dtype.is_floating_point or shape.numel() != 2:
        raise ValueError(
            f"weight_shape must hold the two ints (out, in), got {shape.dtype} {tuple(shape.shape)}"
        )
    out_features, in_features = (int(v) for v in shape.reshape(2).tolist())
    if scale.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise TypeError(f"weight_scale must be float16, bfloat16 or float32, got {scale.dtype}")
    if scale.dim() != 2 or scale.shape[0] != out_features:
        raise ValueError(
            f"weight_scale must be [out, n_groups] with out={out_features}, got {tuple(scale.shape)}"
        )
    n_groups = scale.shape[1]
    if tuple(packed.shape) != (out_features, -(-in_features // 8)):
        raise ValueError(
            f"weight_packed must be [out, ceil(in/8)] = {(out_features, -(-in_features // 8))} for "
            f"weight_shape {(out_features, in_features)}, got {tuple(packed.shape)}"
        )
    if out_features % 8:
        raise ValueError(f"out_features={out_features} must be a multiple of 8 for the AWQ layout")
    group_size = infer_group_size(in_features, n_groups, None, "weight_scale")
    g_idx = tensors.get("weight_g_idx")
    if g_idx is not None:
        if not isinstance(g_idx, torch.Tensor):
            raise TypeError(f"weight_g_idx must be a torch.Tensor, got {type(g_idx).__name__}")
        trivial = torch.arange(in_features, device=g_idx.device) // group_size
        if g_idx.dtype.is_floating_point or not torch.equal(g_idx.reshape(-1).to(torch.int64), trivial):
            raise ValueError(
                "weight_g_idx is not the trivial i // group_size (activation ordering): the AWQ layout "
                "cannot express permuted groups"
            )

    intweight = unpack_int4_sequential(packed, in_features, dim=1)
    zp = tensors.get("weight_zero_point")
    if zp is None:
        zeros = torch.full((out_features, n_groups), _SIGNED_ZERO, dtype=torch.int32, device=packed.device)
    else:
        if not isinstance(zp, torch.Tensor) or zp.dtype != torch.int32:
            raise TypeError("weight_zero_point must be an int32 tensor packed along dim 0")
        if tuple(zp.shape) != (out_features // 8, n_groups):
            raise ValueError(
                f"weight_zero_point must be [out/8, n_groups] = {(out_features // 8, n_groups)}, "
                f"got {tuple(zp.shape)}"
            )
        zeros = unpack_int4_sequential(zp, out_features, dim=0)
    return QTensor(
        data=pack_awq(intweight.t()),
        scale=scale.t().contiguous(),
        fmt=FMT,
        shape=torch.Size((out_features, in_features)),
        dtype=scale.dtype,
        zeros=pack_awq(zeros.t()),
        # float16 scales decode the same under both conventions: those stay plain AutoAWQ tensors (writable
        # as AutoAWQ/GPTQ, run by the fp16 kernels)
        params={"group_size": group_size,
                **({} if scale.dtype == torch.float16 else {"convention": "compressed-tensors"})},
    )
