"""MX, OCP Microscaling (pure PyTorch reference): MXFP4, MXFP6 (E2M3, E3M2) and MXFP8 (E4M3, E5M2); 32-element
blocks along the last dim with E8M0 power-of-two scales, RCEIL or FLOOR scale rounding."""

from __future__ import annotations

import torch

from .blockscaled_generic import check_input, check_layout, layout_scales, linear_scales, quantize_blockscaled
from .codecs import canonical_nan, decode_e8m0, decode_minifloat
from .packing import pack_fp4, pack_fp6, unpack_fp4, unpack_fp6
from .qtensor import QTensor
from .spec import FORMATS, MinifloatSpec, ScaleRounding


def _pack(codes: torch.Tensor, elem: MinifloatSpec) -> torch.Tensor:
    if elem.torch_dtype is not None:
        return codes.view(elem.torch_dtype)
    if elem.bits == 4:
        return pack_fp4(codes)
    return pack_fp6(codes)


def _unpack(data: torch.Tensor, elem: MinifloatSpec) -> torch.Tensor:
    if elem.torch_dtype is not None:
        return data.view(torch.uint8)
    if elem.bits == 4:
        return unpack_fp4(data)
    return unpack_fp6(data)


def quantize_mx(
    x: torch.Tensor,
    fmt: str,
    scale_rounding: ScaleRounding | str = "rceil",
    scale_layout: str = "linear",
) -> QTensor:
    """MX (OCP Microscaling): 32-element blocks along the last dim, E8M0 power-of-two scales.

    Args:
        x: ``[..., K]`` float32/bfloat16/float16, ``K % 32 == 0``.
        fmt: ``"mxfp4"``, ``"mxfp6_e2m3"``, ``"mxfp6_e3m2"``, ``"mxfp8_e4m3"`` or ``"mxfp8_e5m2"``.
        scale_rounding: ``"rceil"`` (default): the smallest power of two >= ``amax * fp32(1/max_elem)``
            (LightX2V/TransformerEngine/FlashInfer); ``"floor"``: ``2^(floor(log2(amax)) - emax_elem)``
            (OCP spec, torchao FLOOR), values above the element max then saturate.
        scale_layout: ``"linear"`` (``[..., K/32]`` float8_e8m0fnu) or ``"swizzled"``.

    Elements are ``x / 2^e`` (exact: a power of two) rounded to nearest even with saturation. A block
    whose absmax is NaN or Inf gets scale 0xFF (NaN); a zero block gets 0x00 and zero codes.

    Returns:
        QTensor: ``data`` uint8 (FP4 ``[..., K/2]``, FP6 ``[..., 3K/4]``) or float8 ``[..., K]``,
        ``scale`` float8_e8m0fnu ``[..., K/32]`` (or swizzled 2-D).

    Equal to torchao 0.18.0 ``to_mx`` (FLOOR / RCEIL, every element type) except, by design
    (tests/interop/test_torchao.py pins each case):
      - RCEIL: torchao's eager path computes ``ceil(log2(amax/E))`` in floating point; when
        ``amax/E`` is a few ulps above ``2^k`` with ``|k|`` large, log2 rounds to ``k`` and torchao picks
        the scale one step smaller (the top elements then saturate). lowbit uses the exact exponent bits
        (TransformerEngine, torchao HEAD, PTX ``cvt.rp.satfinite.ue8m0x2``). ``amax * fp32(1/E)`` and
        torchao's ``amax / E`` give the same scale for every fp32 amax (checked near every power of two).
      - Scale code 0x00 (2^-127) with nonzero elements: lowbit multiplies by 2^127 (OCP, TE, torchao
        HEAD); torchao 0.18.0 FLOOR divides by 2^-126 and RCEIL multiplies by 1.0.
      - Inf absmax: lowbit 0xFF (NaN block, torchao HEAD); torchao 0.18.0 FLOOR gives ``255 - emax``
        (e.g. 247 for E4M3), RCEIL 0xFE, with the Inf element saturated.
      - Element codes inside a NaN block (scale 0xFF) are unspecified; the block decodes to NaN.
    """
    spec = FORMATS[fmt]
    check_input(x, 32, fmt)
    check_layout(scale_layout)
    rounding = ScaleRounding(scale_rounding)
    codes, scale = quantize_blockscaled(x, spec.element, 32, "e8m0", scale_rounding=rounding)
    return QTensor(
        data=_pack(codes, spec.element),
        scale=layout_scales(scale, x.shape[:-1], scale_layout),
        fmt=fmt,
        shape=x.shape,
        dtype=x.dtype,
        scale_layout=scale_layout,
        params={"scale_rounding": rounding.value},
    )


def dequantize_mx(q: QTensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Decode an MX QTensor: ``element * 2^(s-127)`` in fp32 (scale 0xFF gives NaN), cast to ``dtype``.

    Args:
        q: MX QTensor (linear or swizzled scales).
        dtype: output dtype.

    Returns:
        Tensor of shape ``q.shape``.
    """
    elem = q.spec.element
    rows = q.shape[:-1].numel()
    values = decode_minifloat(_unpack(q.data, elem), elem).reshape(rows, q.shape[-1] // 32, 32)
    scale = decode_e8m0(linear_scales(q, 32).view(torch.uint8))
    return canonical_nan((values * scale.unsqueeze(-1)).reshape(q.shape), dtype)


__all__ = ["dequantize_mx", "quantize_mx"]
