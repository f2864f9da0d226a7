"""lowbit: low-bit tensor formats with bit-exact references and Hopper kernels.

Importing lowbit does no device work and does not need triton.
"""

__version__ = "0.1.0"

from . import formats, io, nn
from .api import dequantize, quantize
from .formats import FORMATS, QTensor, swizzle_scales, unswizzle_scales
from .nn import SCHEMES, quantize_model
from .ops import explain, linear, scaled_mm

__all__ = [
    "FORMATS",
    "SCHEMES",
    "QTensor",
    "dequantize",
    "explain",
    "formats",
    "io",
    "linear",
    "nn",
    "quantize",
    "quantize_model",
    "scaled_mm",
    "swizzle_scales",
    "unswizzle_scales",
]
