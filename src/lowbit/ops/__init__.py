"""Operators on quantized tensors.

``linear``: weight-only 4-bit linear (W4A16), see :mod:`lowbit.ops.linear`. ``scaled_mm`` /
``scaled_linear``: block-scaled GEMMs on two quantized operands (W4A4, W8A8, W4A8), see
:mod:`lowbit.ops.scaled_mm`.
"""

from .linear import (
    ACTIVATIONS,
    GEMV_MAX_M,
    SUPPORTED_FORMATS,
    LinearPlan,
    explain,
    linear,
    linear_dequant_gemm,
    linear_reference,
    plan_linear,
)
from .scaled_mm import scaled_linear, scaled_mm
from .scaled_mm_checks import PAIRS
from .scaled_mm_dispatch import ScaledMMPlan, explain_scaled_mm, plan_scaled_mm, scaled_mm_reference

__all__ = [
    "ACTIVATIONS", "GEMV_MAX_M", "PAIRS", "SUPPORTED_FORMATS", "LinearPlan", "ScaledMMPlan", "explain",
    "explain_scaled_mm", "linear", "linear_dequant_gemm", "linear_reference", "plan_linear", "plan_scaled_mm", "scaled_linear",
    "scaled_mm", "scaled_mm_reference",
]
