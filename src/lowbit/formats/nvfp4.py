"""NVFP4 (pure PyTorch reference): E2M1 values, 16-element blocks, E4M3 block scales and an fp32 per-tensor
global scale, in the arithmetic of each producer convention (vLLM, LightX2V, torchao, compressed-tensors).

The per-convention arithmetic is pinned to the producers named in ``docs/formats.md``; the evaluation order of
every fp32 operation is part of the format. :func:`nvfp4_default_global_scale` (and :func:`finite_amax`) is
what a caller that shares one global scale between tensors (fused q/k/v, tensor-parallel shards) computes.
"""

from __future__ import annotations

import torch

from .blockscaled_generic import (
    as_blocks,
    check_input,
    check_layout,
    layout_scales,
    linear_scales,
    quantize_blockscaled,
)
from .checks import positive_fp32_scalar
from .codecs import canonical_nan, decode_minifloat, encode_minifloat, true_div
from .packing import pack_fp4, unpack_fp4
from .qtensor import QTensor
from .spec import E2M1, NVFP4Convention

F4_MAX = 6.0
F8E4M3_MAX = 448.0
_FLT_MAX = torch.finfo(torch.float32).max


def finite_amax(x: torch.Tensor) -> torch.Tensor:
    """max |x| over the finite elements, in x's dtype (0 for an empty or all-non-finite tensor).

    Args:
        x: any float tensor.

    Returns:
        0-dim tensor of ``x.dtype``.
    """
    a = x.detach().abs()
    a = torch.where(torch.isfinite(a), a, torch.zeros_like(a))
    return a.amax() if a.numel() else torch.zeros((), dtype=x.dtype, device=x.device)


def nvfp4_default_global_scale(x: torch.Tensor, convention: NVFP4Convention | str = "vllm") -> torch.Tensor:
    """The per-tensor multiplier ``448*6/amax(x)`` each convention computes when none is given.

    vllm and lightx2v: fp32 ``2688 / amax``; amax == 0 gives 1.0 (as TransformerEngine) and the result is capped at
    FLT_MAX. compressed-tensors: ``2688 / amax`` evaluated in x's dtype (bf16 gives 13120 where fp32 gives
    13107.2), amax clamped to the dtype's tiny, non-finite results replaced by 1.0 (``generate_gparam``).
    torchao: ``1 / (amax/2688)`` of its divisor ``per_tensor_amax_to_scale`` (amax == 0 gives 1.0, where
    torchao itself divides by zero). Non-finite elements of x are ignored when taking amax.

    Args:
        x: the tensor to be quantized (float32/bfloat16/float16).
        convention: ``"vllm"``, ``"lightx2v"``, ``"torchao"`` or ``"compressed-tensors"``.

    Returns:
        0-dim fp32 multiplier.
    """
    convention = NVFP4Convention(convention)
    amax = finite_amax(x)
    if convention is NVFP4Convention.COMPRESSED_TENSORS:
        a = amax.clamp(min=torch.finfo(x.dtype).tiny)
        g = torch.nan_to_num(F8E4M3_MAX * F4_MAX / a, nan=1.0, posinf=1.0, neginf=1.0)
        return g.to(torch.float32).reshape(())
    amax = amax.float()
    if convention is NVFP4Convention.TORCHAO:
        return 1.0 / _torchao_default_pts(amax)
    # `2688 / amax` on a tensor is torch's __rtruediv__, i.e. 2688 * reciprocal(amax): two roundings, as in
    # every torch-side producer that writes this expression (vLLM's tests, LightX2V); kernels copy the order.
    # amax == 0 is selected on the device, not branched on: no host read (a GPU sync; a meta x has no value)
    g = (F8E4M3_MAX * F4_MAX / amax).clamp(max=_FLT_MAX)
    return torch.where(amax == 0, torch.ones_like(g), g)


def torchao_per_tensor_scale(amax: torch.Tensor) -> torch.Tensor:
    """torchao's divisor ``amax / (448*6)`` in fp32 (``per_tensor_amax_to_scale``).

    Args:
        amax: tensor absmax, any float dtype and shape.

    Returns:
        fp32 tensor of ``amax``'s shape.
    """
    return true_div(amax.to(torch.float32), F8E4M3_MAX * F4_MAX)


def _torchao_default_pts(amax: torch.Tensor) -> torch.Tensor:
    # torchao divides by a zero pts for an all-zero tensor and returns NaN scales; 1.0 keeps the
    # tensor decodable (zero blocks then get the clamped minimum scale 0x08, as any zero block does)
    pts = torchao_per_tensor_scale(amax)
    return torch.where(pts == 0, torch.ones_like(pts), pts)


def quantize_nvfp4(
    x: torch.Tensor,
    global_scale: torch.Tensor | float | str | None = None,
    convention: NVFP4Convention | str = "vllm",
    scale_layout: str = "linear",
) -> QTensor:
    """NVFP4: E2M1 values, 16-element blocks along the last dim, E4M3 block scales, fp32 global scale.

    Args:
        x: ``[..., K]`` float32/bfloat16/float16, ``K % 16 == 0``.
        global_scale: the per-tensor multiplier ``S`` (dequant = value * block_scale / S). None computes
            the convention's default from ``amax(x)`` (see :func:`nvfp4_default_global_scale`); ``"none"``
            quantizes single-level (no global scale, ``S = 1``).
        convention: ``"vllm"`` (default; vLLM, FlashInfer), ``"lightx2v"``, ``"torchao"`` or
            ``"compressed-tensors"``.
        scale_layout: ``"linear"`` (``[..., K/16]``) or ``"swizzled"`` (128x4 tiles, 2-D).

    Per block with absmax ``a`` (fp32 unless said otherwise), block scale ``sf`` and value multiplier ``m``:
      - vllm: ``sf = e4m3(S * (a * fp32(1/6)))``; ``m = 1/(fp32(sf) * (1/S))``, or 0 when ``sf == 0``
        (so a zero block gets scale byte 0x00 and codes 0); codes ``e2m1(x * m)``.
      - lightx2v: as vllm but ``m = S * (1/fp32(sf))``. The two multipliers can differ in the last bit, and
        an element that lands on an E2M1 tie with one of them gets another code with the other.
      - torchao (divisor ``p = 1/S``, or its own ``amax/2688`` by default): ``sf = e4m3(clamp((a/6)/p,
        2^-6, 448))``; ``m = (1/p)/fp32(sf)``; single-level: ``sf = e4m3(clamp(a/6, 2^-6, 448))``,
        ``m = 1/fp32(sf)``.
      - compressed-tensors: ``sf = e4m3(clamp(S * fp32(a/6 in x.dtype), +-448))``, 0 replaced by 0.125;
        codes ``e2m1(clamp(x / (fp32(sf)/S), +-6))``; an exactly -0.0 scaled value gets code 0x0.

    Returns:
        QTensor: ``data`` uint8 ``[..., K/2]``, ``scale`` float8_e4m3fn, ``global_scale`` fp32 ``[1]``
        (None when single-level); torchao convention also keeps its exact divisor in
        ``params["per_tensor_scale"]`` so that dequantization is torchao's ``p * sf``.

    Where lowbit deliberately differs from the producer (tests/interop pin each case):
      - The default global scale ignores NaN/Inf elements. torchao's ``amax`` then is NaN/Inf (every
        scale NaN); compressed-tensors gives ``S = 1`` for NaN and ``S = 0`` for Inf.
      - torchao with an all-zero tensor divides by ``p = 0`` (NaN scales); lowbit uses ``p = 1``.
      - Elements that are NaN after scaling (NaN inputs, or torchao's ``0 * inf`` when ``1/p``
        overflows for ``amax < ~2^-117``) get the codec's canonical code 0x7, where torchao's bit
        trick gives 0x3/0xB and compressed-tensors' int8 cast gives 0x0; their block scale is NaN.
    """
    check_input(x, 16, "nvfp4")
    convention = NVFP4Convention(convention)
    check_layout(scale_layout)
    lead = x.shape[:-1]
    xb = as_blocks(x, 16)
    single_level = isinstance(global_scale, str)
    if single_level and global_scale != "none":
        raise ValueError(f"global_scale must be a tensor, a float, 'none' or None, got {global_scale!r}")
    params: dict = {"convention": convention.value}

    if single_level:
        s = None
    elif global_scale is None:
        s = nvfp4_default_global_scale(x, convention)
    else:
        s = positive_fp32_scalar(global_scale, "global_scale").to(x.device)

    if convention is NVFP4Convention.TORCHAO:
        amax_b = xb.abs().amax(dim=-1)
        block_scale = true_div(amax_b, F4_MAX)
        tiny = torch.finfo(torch.float8_e4m3fn).tiny
        if s is None:
            sf = block_scale.clamp(min=tiny, max=F8E4M3_MAX).to(torch.float8_e4m3fn)
            mult = 1.0 / sf.float()
        else:
            pts = _torchao_default_pts(finite_amax(x)) if global_scale is None else 1.0 / s
            params["per_tensor_scale"] = pts
            sf = (block_scale / pts).clamp(min=tiny, max=F8E4M3_MAX).to(torch.float8_e4m3fn)
            mult = (1.0 / pts) / sf.float()
        scaled = (xb * mult.unsqueeze(-1)).clamp(-F4_MAX, F4_MAX)
    elif convention is NVFP4Convention.COMPRESSED_TENSORS:
        # llm-compressor computes amax/6 in the weight's dtype, then promotes to fp32 for the global scale
        amax_b = x.detach().reshape(xb.shape).abs().amax(dim=-1)
        local = true_div(amax_b, F4_MAX).float()
        s_eff = torch.ones((), dtype=torch.float32, device=x.device) if s is None else s
        sf = (s_eff * local).clamp(-F8E4M3_MAX, F8E4M3_MAX).to(torch.float8_e4m3fn)
        sf = torch.where(sf.float() == 0, torch.full_like(sf, 0.125), sf)
        scaled = (xb / (sf.float() / s_eff).unsqueeze(-1)).clamp(-F4_MAX, F4_MAX)
        # CT's cast_to_fp4 takes the sign from torch.sign, which is 0 for -0.0: a scaled value that is
        # exactly -0.0 gets code 0x0, while a negative value that rounds to zero gets 0x8
        scaled = torch.where(scaled == 0, torch.zeros_like(scaled), scaled)
    else:
        codes, sf = quantize_blockscaled(x, E2M1, 16, "e4m3", global_scale=s, convention=convention)
        scaled = None

    if scaled is not None:
        codes = encode_minifloat(scaled, E2M1).reshape(x.shape)
    return QTensor(
        data=pack_fp4(codes),
        scale=layout_scales(sf.reshape(x.shape[:-1].numel(), x.shape[-1] // 16), lead, scale_layout),
        fmt="nvfp4",
        shape=x.shape,
        dtype=x.dtype,
        global_scale=None if s is None else s.reshape(1),
        scale_layout=scale_layout,
        params=params,
    )


def dequantize_nvfp4(q: QTensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Decode an nvfp4 QTensor: ``e2m1 * (fp32(sf) / S)`` per block, computed in fp32, cast to ``dtype``.

    A QTensor carrying an exact divisor ``params["per_tensor_scale"] = p`` (torchao convention, ModelOpt)
    decodes ``e2m1 * (p * fp32(sf))`` instead, as those producers do; single-level decodes ``e2m1 * sf``.

    Args:
        q: nvfp4 QTensor (linear or swizzled scales).
        dtype: output dtype.

    Returns:
        Tensor of shape ``q.shape``.
    """
    values = decode_minifloat(unpack_fp4(q.data), E2M1).reshape(q.shape[:-1].numel(), q.shape[-1] // 16, 16)
    sf = linear_scales(q, 16).float()
    pts = q.params.get("per_tensor_scale")
    if pts is not None:
        block = pts * sf
    elif q.global_scale is not None:
        block = sf / q.global_scale.reshape(())
    else:
        block = sf
    return canonical_nan((values * block.unsqueeze(-1)).reshape(q.shape), dtype)


__all__ = [
    "F4_MAX", "F8E4M3_MAX", "dequantize_nvfp4", "finite_amax", "nvfp4_default_global_scale",
    "quantize_nvfp4", "torchao_per_tensor_scale",
]
