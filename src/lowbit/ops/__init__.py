"""Operators on quantized tensors. ``linear``: weight-only 4-bit linear (W4A16), see :mod:`lowbit.ops.linear`."""

from .linear import (
    ACTIVATIONS,
    GEMV_MAX_M,
    SUPPORTED_FORMATS,
    LinearPlan,
    explain,
    linear,
    linear_reference,
    plan_linear,
)

__all__ = [
    "ACTIVATIONS", "GEMV_MAX_M", "SUPPORTED_FORMATS", "LinearPlan", "explain", "linear", "linear_reference",
    "plan_linear",
]
