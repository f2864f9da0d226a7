"""The generic path of the block-scaled formats (pure PyTorch reference): element type x block size x scale
type x optional global scale.

:func:`quantize_blockscaled` splits the last dim into blocks, takes each block's absmax, turns it into a block
scale of the format's scale type (E4M3, E8M0 or fp32) and encodes ``x`` times the block's multiplier with the
element codec; the formats built on it (:mod:`lowbit.formats.nvfp4`, :mod:`lowbit.formats.mx`,
:mod:`lowbit.formats.fp4_b32`) share its input checks and scale layouts (linear or swizzled) from here. The
evaluation order of every fp32 operation is part of the format.
"""

from __future__ import annotations

import torch

from .codecs import canonical_nan, decode_e8m0, encode_e8m0, encode_minifloat, true_div
from .packing import swizzle_scales, unswizzle_scales
from .qtensor import QTensor
from .spec import E4M3, MinifloatSpec, NVFP4Convention, ScaleRounding

_SUPPORTED_INPUT = (torch.float32, torch.bfloat16, torch.float16)


def check_input(x: torch.Tensor, block: int, fmt: str) -> None:
    """Raise TypeError/ValueError unless ``x`` is float32/bf16/fp16 ``[..., K]`` with ``K % block == 0``.

    Args:
        x: the tensor to quantize.
        block: block size along the last dim.
        fmt: format name, used in the error messages.
    """
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in _SUPPORTED_INPUT:
        raise TypeError(f"{fmt}: x must be float32, bfloat16 or float16, got {x.dtype}")
    if x.dim() < 1:
        raise ValueError(f"{fmt}: x must have at least 1 dimension, got a scalar")
    if x.shape[-1] % block:
        raise ValueError(f"{fmt}: the last dim of x must be a multiple of {block}, got {x.shape[-1]}")


def as_blocks(x: torch.Tensor, block: int) -> torch.Tensor:
    """fp32 view ``[rows, K/block, block]`` of ``x`` (a copy: inputs are never modified)."""
    rows = x.shape[:-1].numel()
    # detached: the fp32 scales of fp4_b32 are computed from these values and must not carry x's graph
    return x.detach().float().reshape(rows, x.shape[-1] // block, block)


def layout_scales(scale_2d: torch.Tensor, lead: torch.Size, layout: str) -> torch.Tensor:
    if layout == "swizzled":
        return swizzle_scales(scale_2d)
    return scale_2d.reshape(*lead, scale_2d.shape[-1])


def linear_scales(q: QTensor, block: int) -> torch.Tensor:
    """Block scales of ``q`` as a ``[rows, K/block]`` tensor, whatever the stored layout."""
    cols = q.shape[-1] // block
    rows = q.shape[:-1].numel()
    if q.scale_layout == "swizzled":
        return unswizzle_scales(q.scale, rows, cols)
    return q.scale.reshape(rows, cols)


def check_layout(scale_layout: str) -> None:
    if scale_layout not in ("linear", "swizzled"):
        raise ValueError(f"scale_layout must be 'linear' or 'swizzled', got {scale_layout!r}")


def quantize_blockscaled(
    x: torch.Tensor,
    element: MinifloatSpec,
    block_size: int,
    scale_type: str,
    *,
    global_scale: torch.Tensor | None = None,
    scale_rounding: ScaleRounding | str = "rceil",
    convention: NVFP4Convention | str = "vllm",
) -> tuple[torch.Tensor, torch.Tensor]:
    """The generic block-scaled quantizer: element type x block size x scale type x optional global scale.

    Blocks of ``block_size`` run along the last dim of ``x`` (``K % block_size == 0``). With block absmax
    ``a`` (fp32), element max ``E`` and global multiplier ``S`` (1 if None):
      - ``"e4m3"``: ``sf = e4m3(S * (a * fp32(1/E)))``, multiplier ``m = 1/(fp32(sf) * (1/S))`` (``convention``
        ``"vllm"``) or ``m = S * (1/fp32(sf))`` (``"lightx2v"``), 0 if sf == 0.
      - ``"e8m0"``: ``sf = 2^e`` by ``scale_rounding`` (RCEIL of ``a * fp32(1/E)``, or FLOOR
        ``floor(log2 a) - emax``), ``m = 2^-e`` exactly; NaN/Inf blocks get 0xFF.
      - ``"fp32"``: ``sf = a / E``; elements are ``x / sf`` (IEEE division), 0 where sf == 0.
    Elements are encoded with round-to-nearest-even and saturation.

    Args:
        x: ``[..., K]`` float tensor.
        element: the element codec spec (E2M1, E2M3, E3M2, E4M3, E5M2).
        block_size: elements per block.
        scale_type: ``"e4m3"``, ``"e8m0"`` or ``"fp32"``.
        global_scale: e4m3 only: 0-dim fp32 multiplier ``S``.
        scale_rounding: e8m0 only: ``"rceil"`` or ``"floor"``.
        convention: e4m3 only: ``"vllm"`` or ``"lightx2v"``, the producer whose multiplier order to follow.

    Returns:
        (codes, scales): uint8 element codes shaped like x, and scales ``[rows, K/block_size]`` as
        float8_e4m3fn, float8_e8m0fnu or float32.
    """
    xb = as_blocks(x, block_size)
    amax_b = xb.abs().amax(dim=-1)
    # a fill, not a host-to-device copy (see true_div)
    rcp_max = torch.full((), 1.0 / element.max_normal, dtype=torch.float32, device=x.device)
    if scale_type == "e4m3":
        s = torch.ones((), dtype=torch.float32, device=x.device) if global_scale is None else global_scale
        # fp32(1/E) times amax: LightX2V's `vecMax * 0.16666666666666666f`, vLLM's `amax * (1/6)`
        sf = encode_minifloat(s * (amax_b * rcp_max), E4M3).view(torch.float8_e4m3fn)
        sf32 = sf.float()
        convention = NVFP4Convention(convention)
        if convention is NVFP4Convention.VLLM:
            # vLLM's `get_reciprocal(scale * get_reciprocal(global_scale))` (its CUDA kernel: the same with
            # rcp.approx); sf * (1/S) can underflow to 0 for a huge S, then m is Inf as in vLLM
            m = 1.0 / (sf32 * (1.0 / s))
        elif convention is NVFP4Convention.LIGHTX2V:
            # LightX2V's `SFScaleVal * reciprocal(SFValue)`
            m = s * (1.0 / sf32)
        else:
            raise ValueError(f"convention: the e4m3 scale follows 'vllm' or 'lightx2v', got {convention.value!r}")
        mult = torch.where(sf32 == 0, torch.zeros_like(sf32), m)
        scaled = xb * mult.unsqueeze(-1)
    elif scale_type == "e8m0":
        if global_scale is not None:
            raise ValueError("e8m0-scaled formats take no global_scale")
        rounding = ScaleRounding(scale_rounding)
        if rounding is ScaleRounding.RCEIL:
            code = encode_e8m0(amax_b * rcp_max, ScaleRounding.RCEIL)
        else:
            biased = encode_e8m0(amax_b, ScaleRounding.FLOOR).to(torch.int32)
            code = torch.where(biased == 255, biased, (biased - element.emax).clamp(min=0)).to(torch.uint8)
        # 2^-e, the exact reciprocal of the scale, is the E8M0 value of code 254 - c
        # (0x00 -> 2^127 ... 0xFE -> 2^-127)
        inv = decode_e8m0((254 - code.to(torch.int32)).clamp(min=0))
        inv = torch.where(code == 255, torch.full_like(inv, float("nan")), inv)
        sf = code.view(torch.float8_e8m0fnu)
        scaled = xb * inv.unsqueeze(-1)
    elif scale_type == "fp32":
        if global_scale is not None:
            raise ValueError("fp32-scaled formats take no global_scale")
        sf = canonical_nan(true_div(amax_b, element.max_normal))
        safe = torch.where(sf == 0, torch.ones_like(sf), sf)
        scaled = torch.where(sf.unsqueeze(-1) == 0, xb * 0.0, xb / safe.unsqueeze(-1))
    else:
        raise ValueError(f"scale_type must be 'e4m3', 'e8m0' or 'fp32', got {scale_type!r}")
    return encode_minifloat(scaled, element).reshape(x.shape), sf


__all__ = [
    "as_blocks", "check_input", "check_layout", "layout_scales", "linear_scales", "quantize_blockscaled",
]
