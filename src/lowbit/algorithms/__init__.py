"""Quantization algorithms beyond round-to-nearest, on lowbit's format grids
(:mod:`lowbit.algorithms.gptq`)."""

from .gptq import GPTQ, HessianAccumulator, apply_gptq, gptq_quantize
from .grids import GRID_FORMATS, grid_for

__all__ = ["GPTQ", "GRID_FORMATS", "HessianAccumulator", "apply_gptq", "gptq_quantize", "grid_for"]
