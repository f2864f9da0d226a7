"""Drop-in replacements for other projects' low-bit APIs, built on lowbit's formats and ``lowbit.scaled_mm``.

- :mod:`lowbit.compat.lightx2v`: LightX2V ``lightx2v_kernel.gemm`` (NVFP4 / MXFP4 / MXFP6 / MXFP8 quantize and
  CUTLASS GEMMs, which upstream only run on Blackwell SM120).
- :mod:`lowbit.compat.deepseek`: DeepSeek-V3 ``inference/kernel.py`` (``act_quant``, ``weight_dequant``,
  ``fp8_gemm``).
- :mod:`lowbit.compat.nvfp4_packed`: the ``nvfp4_packed`` GEMV plugin's ``NVFP4PackedLinear`` (import it by
  name; not loaded here).

Importing this package needs no GPU and no triton; kernels load on first CUDA use, as everywhere in lowbit.
"""

from . import deepseek, lightx2v

__all__ = ["deepseek", "lightx2v"]
