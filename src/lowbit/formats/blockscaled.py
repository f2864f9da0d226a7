"""Block-scaled floating-point formats: NVFP4, MXFP4/6/8 and fp4_b32 (pure PyTorch reference), in one import.

Each family lives in its own module; this one gathers their public names (``lowbit.kernels.blockscaled``
has the same signatures, on the GPU):

- :mod:`lowbit.formats.blockscaled_generic`: the generic path every format takes -- split the last dim
  into blocks, take each block's absmax, turn it into a block scale of the format's scale type (E4M3, E8M0 or
  fp32), encode ``x`` times the block's multiplier with the element codec (:func:`quantize_blockscaled`) --
  and the input checks and scale layouts they share;
- :mod:`lowbit.formats.nvfp4`: NVFP4 in each producer's convention, and its default global scale;
- :mod:`lowbit.formats.mx`: MXFP4, MXFP6 and MXFP8 (E8M0 scales);
- :mod:`lowbit.formats.fp4_b32`: the ``nvfp4_packed`` GEMV plugin's format (fp32 scales);
- :mod:`lowbit.formats.mx_fold`: MXFP4 re-encoded exactly as fp8_block, for the FP8 tensor cores.

The per-format arithmetic is pinned to the producers named in ``docs/formats.md``; the evaluation order of
every fp32 operation is part of the format.
"""

from __future__ import annotations

from .blockscaled_generic import check_input, check_layout, layout_scales, quantize_blockscaled
from .fp4_b32 import dequantize_fp4_b32, quantize_fp4_b32
from .mx import dequantize_mx, quantize_mx
from .mx_fold import FOLD_SHIFT, FOLD_WINDOW, check_fold_args, mxfp4_as_fp8_block
from .nvfp4 import (
    F4_MAX,
    F8E4M3_MAX,
    dequantize_nvfp4,
    finite_amax,
    nvfp4_default_global_scale,
    quantize_nvfp4,
    torchao_per_tensor_scale,
)

__all__ = [
    "F4_MAX", "F8E4M3_MAX", "FOLD_SHIFT", "FOLD_WINDOW", "check_fold_args", "check_input", "check_layout",
    "dequantize_fp4_b32", "dequantize_mx", "dequantize_nvfp4", "finite_amax", "layout_scales",
    "mxfp4_as_fp8_block", "nvfp4_default_global_scale", "quantize_blockscaled", "quantize_fp4_b32",
    "quantize_mx", "quantize_nvfp4", "torchao_per_tensor_scale",
]
