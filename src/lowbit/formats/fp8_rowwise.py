"""Per-token (row-wise) FP8 (``fp8_rowwise``): E4M3 values, one fp32 scale per row of the last dim.

The dynamic per-token activation quantization of vLLM (``scaled_fp8_quant(x, use_per_token_if_dynamic=True)``,
CUDA ``dynamic_per_token_scaled_fp8_quant_kernel`` in ``csrc/quantization/fp8/common.cu``), whose scales are
what ``torch._scaled_mm`` takes as a rowwise ``scale_a`` (``[M, 1]`` fp32, dequant multiplier). Per row of
the last dim, in fp32:

- ``amax = max |x|`` over the row;
- ``s = max(amax / 448, MIN_SCALE)`` with ``MIN_SCALE = fp32(1) / fp32(448 * 512)`` (vLLM/FBGEMM's
  ``min_scaling_factor``: an all-zero row gets ``s = 2^-17.8...`` instead of 0, so nothing divides by zero);
- values ``e4m3(clamp(x / s, -448, 448))``: an IEEE fp32 division by ``s`` (vLLM: "we don't use inverted
  scales so we can match FBGemm"), round to nearest even, saturating.

Dequantization is ``fp32(data) * s``. Non-finite input follows lowbit's rule for every format (vLLM's
``fmaxf`` would drop a NaN amax): a NaN in a row makes its scale the canonical NaN and every code of the row
0x7F; an Inf amax gives scale +Inf, finite elements encode to +-0 and the Inf elements to 0x7F (``Inf/Inf``).
A row of length 0 has ``amax = 0``.
"""

from __future__ import annotations

import torch

from .codecs import canonical_nan, encode_minifloat, true_div
from .qtensor import QTensor
from .spec import E4M3

FP8_E4M3_MAX = 448.0
MIN_SCALE = (torch.tensor(1.0, dtype=torch.float32) / torch.tensor(448.0 * 512.0, dtype=torch.float32)).item()
"""``1.0f / (448.f * 512.f)`` in fp32 (vLLM / FBGEMM ``min_scaling_factor``), as a Python float (exact)."""
_SUPPORTED_INPUT = (torch.float32, torch.bfloat16, torch.float16)


def check_input(x: torch.Tensor) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"fp8_rowwise: x must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in _SUPPORTED_INPUT:
        raise TypeError(f"fp8_rowwise: x must be float32, bfloat16 or float16, got {x.dtype}")
    if x.dim() < 1:
        raise ValueError("fp8_rowwise: x must have at least 1 dimension, got a scalar")


def row_scale(x: torch.Tensor) -> torch.Tensor:
    """The fp32 per-row scale ``max(amax / 448, MIN_SCALE)`` of ``x`` ``[..., K]``, shaped ``[..., 1]``.

    NaN rows give the canonical NaN (fp32 0x7FC00000), rows with an infinite amax give +Inf.
    """
    xf = x.detach().float()
    if xf.shape[-1] == 0:
        amax = xf.new_zeros(*xf.shape[:-1], 1)
    else:
        amax = xf.abs().amax(dim=-1, keepdim=True)
    s = torch.maximum(
        true_div(amax, FP8_E4M3_MAX), torch.full((), MIN_SCALE, dtype=torch.float32, device=x.device)
    )
    return canonical_nan(s)


def quantize_fp8_rowwise(x: torch.Tensor) -> QTensor:
    """Per-token FP8: E4M3 values, one fp32 dequant scale per row (vLLM dynamic per-token quantization).

    Args:
        x: ``[..., K]`` float32/bfloat16/float16, any K and leading dims (non-contiguous is fine; x is not
            modified).

    Returns:
        QTensor with ``data`` float8_e4m3fn shaped like x and ``scale`` float32 ``[..., 1]`` (the
        ``torch._scaled_mm`` rowwise ``scale_a``): ``x ~= fp32(data) * scale`` per row.
    """
    check_input(x)
    s = row_scale(x)
    codes = encode_minifloat(x.detach().float() / s, E4M3)
    return QTensor(
        data=codes.view(torch.float8_e4m3fn),
        scale=s,
        fmt="fp8_rowwise",
        shape=x.shape,
        dtype=x.dtype,
        scale_layout="linear",
        params={},
    )


def check_qtensor(q: QTensor) -> None:
    if not isinstance(q, QTensor):
        raise TypeError(f"q must be a QTensor, got {type(q).__name__}")
    if q.fmt != "fp8_rowwise":
        raise ValueError(f"q must be an fp8_rowwise QTensor, got fmt {q.fmt!r}")
    if q.data.dtype != torch.float8_e4m3fn:
        raise TypeError(f"fp8_rowwise: q.data must be float8_e4m3fn, got {q.data.dtype}")
    if q.scale.dtype != torch.float32:
        raise TypeError(f"fp8_rowwise: q.scale must be float32, got {q.scale.dtype}")
    if tuple(q.data.shape) != tuple(q.shape):
        raise ValueError(
            f"fp8_rowwise: q.data shape {tuple(q.data.shape)} must equal q.shape {tuple(q.shape)}"
        )
    want = (*q.shape[:-1], 1)
    if tuple(q.scale.shape) != want:
        raise ValueError(
            f"fp8_rowwise: q.scale must have shape {want} (one scale per row), got {tuple(q.scale.shape)}"
        )


def dequantize_fp8_rowwise(q: QTensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``fp32(data) * scale`` per row, then cast to ``dtype``.

    Args:
        q: an ``fp8_rowwise`` QTensor.
        dtype: output dtype (float32, bfloat16 or float16).

    Returns:
        Tensor of shape ``q.shape``.
    """
    check_qtensor(q)
    return canonical_nan(q.data.float() * q.scale, dtype)


__all__ = ["FP8_E4M3_MAX", "MIN_SCALE", "dequantize_fp8_rowwise", "quantize_fp8_rowwise", "row_scale"]
