"""Quantization algorithms beyond round-to-nearest, on lowbit's format grids: GPTQ
(:mod:`lowbit.algorithms.gptq`), SmoothQuant-style smoothing (:mod:`lowbit.algorithms.smoothing`) and random
Hadamard rotations (:mod:`lowbit.algorithms.rotation`); :mod:`lowbit.algorithms.pipeline` combines them for
``quantize_model(algorithm=...)``."""

from .gptq import GPTQ, HessianAccumulator, apply_gptq, gptq_quantize
from .grids import GRID_FORMATS, grid_for
from .rotation import InputTransform, Rotate, apply_rotation, hadamard_transform
from .smoothing import SmoothQuant, apply_smoothing

__all__ = [
    "GPTQ",
    "GRID_FORMATS",
    "HessianAccumulator",
    "InputTransform",
    "Rotate",
    "SmoothQuant",
    "apply_gptq",
    "apply_rotation",
    "apply_smoothing",
    "gptq_quantize",
    "grid_for",
    "hadamard_transform",
]
