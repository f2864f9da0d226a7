"""lowbit: low-bit tensor formats with bit-exact references and Hopper kernels.

Importing lowbit does no device work and does not need triton.
"""

__version__ = "0.1.0"

from . import formats, io, nn
from .api import dequantize, quantize
from .formats import FORMATS, QTensor, swizzle_scales, unswizzle_scales
from .io.load import load_quantized
from .io.convert import convert_checkpoint
from .io.save import save_quantized
from .nn import SCHEMES, quantize_model
from .ops import explain, linear, scaled_mm

__all__ = [
    "FORMATS",
    "SCHEMES",
    "QTensor",
    "convert_checkpoint",
    "dequantize",
    "explain",
    "formats",
    "io",
    "linear",
    "load_quantized",
    "nn",
    "quantize",
    "quantize_model",
    "save_quantized",
    "scaled_mm",
    "swizzle_scales",
    "unswizzle_scales",
]
