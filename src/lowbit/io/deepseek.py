"""DeepSeek-V3 FP8 checkpoint tensors: ``<mod>.weight`` (float8_e4m3fn) and ``<mod>.weight_scale_inv`` (fp32).

In the DeepSeek-V3/R1 safetensors (``README_WEIGHTS.md``, ``inference/kernel.py::weight_dequant``), a linear
weight ``[N, K]`` is stored as E4M3 values plus one fp32 per 128x128 block, ``weight_scale_inv``
``[ceil(N/128), ceil(K/128)]`` row-major. Despite its name, ``weight_scale_inv`` is the dequant multiplier:
``W = fp32(weight) * weight_scale_inv`` per block, the same meaning as an ``fp8_block`` QTensor's scale,
so conversion is a relabelling with no arithmetic.
"""

from __future__ import annotations

import torch

from ..formats.fp8_block import check_pow2_scales, check_qtensor, check_scale_fmt, expected_scale_shape
from ..formats.qtensor import QTensor

_WEIGHT_BLOCK = (128, 128)


def deepseek_quantization_config() -> dict:
    """The ``quantization_config`` of DeepSeek-V3's HF ``config.json`` (a fresh dict on every call).

    Returns:
        ``{"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
        "weight_block_size": [128, 128]}``
    """
    return {
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "quant_method": "fp8",
        "weight_block_size": list(_WEIGHT_BLOCK),
    }


def to_deepseek_fp8(q: QTensor) -> dict[str, torch.Tensor]:
    """The DeepSeek checkpoint tensors of a 128x128-block ``fp8_block`` weight.

    Args:
        q: QTensor from ``quantize_fp8_block(w, block=(128, 128))`` for a weight ``w`` of shape ``[N, K]``.

    Returns:
        ``{"weight": float8_e4m3fn [N, K], "weight_scale_inv": float32 [ceil(N/128), ceil(K/128)]}``,
        contiguous (ready for safetensors); they may share storage with ``q``. Prefix the keys with the
        module name (``"model.layers.0.mlp.down_proj."``) to place them in a state dict.
    """
    block = check_qtensor(q)
    if block != _WEIGHT_BLOCK:
        raise ValueError(f"to_deepseek_fp8: q must use block (128, 128) (DeepSeek weights), got {block}")
    return {"weight": q.data.contiguous(), "weight_scale_inv": q.scale.contiguous()}


def from_deepseek_fp8(
    weight: torch.Tensor,
    weight_scale_inv: torch.Tensor,
    dtype: torch.dtype = torch.bfloat16,
    scale_fmt: str | None = None,
) -> QTensor:
    """An ``fp8_block`` QTensor (block ``(128, 128)``) from DeepSeek checkpoint tensors.

    Args:
        weight: float8_e4m3fn ``[N, K]``.
        weight_scale_inv: float32 ``[ceil(N/128), ceil(K/128)]``, the per-block dequant multiplier.
        dtype: the dtype recorded as the unquantized dtype (DeepSeek models run in bfloat16).
        scale_fmt: None, or ``"ue8m0"`` to record (and check) that every scale is a power of two.

    Returns:
        QTensor with ``data = weight`` and ``scale = weight_scale_inv`` (no copy, no arithmetic).
    """
    if not isinstance(weight, torch.Tensor):
        raise TypeError(f"weight must be a torch.Tensor, got {type(weight).__name__}")
    if not isinstance(weight_scale_inv, torch.Tensor):
        raise TypeError(f"weight_scale_inv must be a torch.Tensor, got {type(weight_scale_inv).__name__}")
    if weight.dtype != torch.float8_e4m3fn:
        raise TypeError(f"weight must be float8_e4m3fn, got {weight.dtype}")
    if weight_scale_inv.dtype != torch.float32:
        raise TypeError(f"weight_scale_inv must be float32, got {weight_scale_inv.dtype}")
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"dtype must be a floating-point torch.dtype, got {dtype!r}")
    scale_fmt = check_scale_fmt(scale_fmt)
    if weight.dim() != 2:
        raise ValueError(f"weight must be 2-D [N, K], got shape {tuple(weight.shape)}")
    want = expected_scale_shape(weight.shape, _WEIGHT_BLOCK)
    if tuple(weight_scale_inv.shape) != want:
        raise ValueError(f"weight_scale_inv must have shape [ceil(N/128), ceil(K/128)] = {list(want)} for "
                         f"weight {list(weight.shape)}, got {list(weight_scale_inv.shape)}")
    if weight_scale_inv.device != weight.device:
        raise ValueError(f"weight and weight_scale_inv must be on one device, got {weight.device} and "
                         f"{weight_scale_inv.device}")
    if scale_fmt == "ue8m0" and weight_scale_inv.numel() and not weight_scale_inv.is_meta:
        # a meta tensor (the shape-only read that plans a sharded load) has no values: checked when read
        check_pow2_scales(weight_scale_inv, "weight_scale_inv")
    return QTensor(
        data=weight,
        scale=weight_scale_inv,
        fmt="fp8_block",
        shape=weight.shape,
        dtype=dtype,
        params={"block": _WEIGHT_BLOCK, "scale_fmt": scale_fmt},
    )


__all__ = ["deepseek_quantization_config", "from_deepseek_fp8", "to_deepseek_fp8"]
