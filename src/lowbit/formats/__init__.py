"""Pure-PyTorch reference of every lowbit format. Never imports triton; runs on any device torch supports."""

from .codecs import (
    decode_codebook,
    decode_e8m0,
    decode_minifloat,
    encode_codebook,
    encode_e8m0,
    encode_int,
    encode_minifloat,
)
from .packing import (
    pack_fp4,
    pack_fp6,
    pack_nibbles_high_first,
    swizzle_scales,
    swizzled_scale_shape,
    unpack_fp4,
    unpack_fp6,
    unpack_nibbles_high_first,
    unswizzle_scales,
)
from .qtensor import QTensor
from .registry import REGISTRY, Format, Kernel, formats_with, register_format, unregister_format
from .spec import (
    BNB_FP4,
    E2M1,
    E2M3,
    E3M2,
    E4M3,
    E5M2,
    FORMATS,
    INT4,
    NF4,
    UINT4,
    CodebookSpec,
    FormatSpec,
    IntSpec,
    MinifloatSpec,
    NVFP4Convention,
    ScaleRounding,
)

__all__ = [
    "BNB_FP4", "E2M1", "E2M3", "E3M2", "E4M3", "E5M2", "FORMATS", "INT4", "NF4", "UINT4",
    "REGISTRY", "Format", "Kernel", "formats_with", "register_format", "unregister_format",
    "CodebookSpec", "FormatSpec", "IntSpec", "MinifloatSpec", "NVFP4Convention", "ScaleRounding", "QTensor",
    "decode_codebook", "decode_e8m0", "decode_minifloat", "encode_codebook", "encode_e8m0", "encode_int",
    "encode_minifloat", "pack_fp4", "pack_fp6", "pack_nibbles_high_first", "swizzle_scales",
    "swizzled_scale_shape", "unpack_fp4", "unpack_fp6", "unpack_nibbles_high_first", "unswizzle_scales",
]
