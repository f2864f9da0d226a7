"""lowbit: low-bit tensor formats with bit-exact references and Hopper kernels.

Importing lowbit does no device work and does not need triton.
"""

__version__ = "0.1.0"

from . import formats, io
from .api import dequantize, quantize
from .formats import FORMATS, QTensor, swizzle_scales, unswizzle_scales
from .ops import explain, linear

__all__ = [
    "FORMATS", "QTensor", "dequantize", "explain", "formats", "io", "linear", "quantize", "swizzle_scales",
    "unswizzle_scales",
]
