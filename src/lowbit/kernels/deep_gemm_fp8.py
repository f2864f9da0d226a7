"""DeepGEMM's FP8 GEMM (``deep_gemm.fp8_gemm_nt``) for fp8_block pairs, where it is installed.

DeepGEMM is the GEMM library DeepSeek wrote for its own FP8 recipe: E4M3 operands, an fp32 scale per 1x128
block of the activation and per 128x128 block of the weight, each 128-wide K block's partial product promoted
to fp32 with its two scales. That is lowbit's fp8_block pair bit for bit as input, so the product is the
block-scaled product up to fp32 accumulation order, as with cuBLASLt's block-scaled GEMM
(:mod:`lowbit.kernels.cublas_fp8_block`) and lowbit's own kernels. Serving stacks that run DeepSeek-V3 install
it (vLLM, SGLang; on pip as ``tokenspeed-deepgemm`` or built from source), and where it is present
``lowbit.ops.policy`` routes the prefill sizes it runs faster than cuBLASLt to it.

What this route takes (DeepGEMM's SM90 FP8 kernels; checked by :func:`unsupported`, cheaply, on the host):

- an SM90 GPU, and a ``deep_gemm`` that imports and has ``fp8_gemm_nt``;
- E4M3 data, K-major and contiguous; K a multiple of 128 and N a multiple of 64;
- fp32 scales (DeepGEMM lays out the activation's itself: M-major, M padded to 4, as lowbit's quantize kernel
  writes them for this route, so no copy);
- a bfloat16 output, and a bias (if any) in bfloat16: DeepGEMM's SM90 FP8 GEMM has no bias epilogue, so the
  route adds it to the bfloat16 product in one more pass (:func:`add_bias_`: the fp32 sum of the two bfloat16
  values, rounded once; cuBLASLt adds it to the fp32 product before its one rounding, so the two routes may
  differ by one bfloat16 ulp there); an ``alpha`` is folded into the activation scales, as on cuBLASLt's
  route.

DeepGEMM compiles its kernels at run time for each (N, K) (``compiled_dims="nk"``: M stays a runtime value), so
the first call of a layer shape takes seconds, and it needs ``nvcc`` (``CUDA_HOME``). If that first call fails,
the route is switched off for the process with a warning and the call runs on cuBLASLt's route instead.
"""

from __future__ import annotations

import functools
import os
import warnings

import torch

ENV = "LOWBIT_DEEP_GEMM"
"""Set to ``0`` to keep fp8_block GEMMs off DeepGEMM even where it is installed."""

_FAILED: list[str] = []
"""Why DeepGEMM's first call failed in this process (its JIT needs nvcc), once it has."""


@functools.cache
def _unavailable(device_index: int) -> str | None:
    try:
        import deep_gemm
    except Exception as e:  # not installed, or built for another torch / CUDA
        return f"deep_gemm does not import ({type(e).__name__}: {e})"
    if not hasattr(deep_gemm, "fp8_gemm_nt"):
        return "this deep_gemm has no fp8_gemm_nt"
    cap = torch.cuda.get_device_capability(device_index)
    if cap != (9, 0):
        return f"lowbit routes to DeepGEMM's SM90 FP8 kernels only, this GPU is sm_{cap[0]}{cap[1]}"
    return None


def unsupported(m: int, n: int, k: int, device: torch.device, operands_contiguous: bool,
                scales_fp32: bool, bias: torch.Tensor | None, out_dtype: torch.dtype) -> str | None:
    """None when :func:`mm` can run this GEMM, else why not (whether it should is ``lowbit.ops.policy``'s)."""
    if os.environ.get(ENV, "1") == "0":
        return f"${ENV}=0"
    if _FAILED:
        return f"DeepGEMM's first call failed in this process: {_FAILED[0]}"
    if k % 128 or n % 64:
        return f"DeepGEMM's FP8 GEMM takes K a multiple of 128 and N of 64 (N = {n}, K = {k})"
    if not operands_contiguous:
        return "DeepGEMM reads contiguous K-major operands"
    if not scales_fp32:
        return "DeepGEMM's SM90 recipe takes fp32 scales"
    if out_dtype != torch.bfloat16:
        return f"DeepGEMM writes a bfloat16 output (asked for {out_dtype})"
    if bias is not None and (bias.dtype != torch.bfloat16 or bias.shape != (n,)):
        return f"the route adds a bfloat16 bias of N = {n} values (bias {bias.dtype}, shape {tuple(bias.shape)})"
    if m < 1:
        return "M must be at least 1"
    if device.type != "cuda":
        return "not on CUDA"
    return _unavailable(device.index if device.index is not None else torch.cuda.current_device())


def mm(a_data: torch.Tensor, a_scale: torch.Tensor, b_data: torch.Tensor, b_scale: torch.Tensor,
       fallback=None, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``(a_data * a_scale) @ (b_data * b_scale).T (+ bias)`` in bfloat16 for E4M3 ``a_data`` [M, K] with 1x128
    scales ``a_scale`` [M, K/128] (any layout) and ``b_data`` [N, K] with 128x128 scales ``b_scale``
    [ceil(N/128), K/128]; :func:`unsupported` must have said yes. ``fallback()`` runs instead if DeepGEMM's
    first call fails (it adds the bias itself)."""
    if _FAILED and fallback is not None:  # a layer prepared before the failure
        return fallback()
    import deep_gemm

    out = torch.empty((a_data.shape[0], b_data.shape[0]), dtype=torch.bfloat16, device=a_data.device)
    try:
        deep_gemm.fp8_gemm_nt((a_data, a_scale), (b_data, b_scale), out)
    except Exception as e:  # the JIT (nvcc missing, a compile error): this process stops asking DeepGEMM
        if fallback is None:
            raise
        if not _FAILED:
            _FAILED.append(f"{type(e).__name__}: {str(e)[:300]}")
            warnings.warn(f"lowbit: DeepGEMM's fp8_gemm_nt failed ({_FAILED[0]}); fp8_block GEMMs run on "
                          f"cuBLASLt's route from now on (set {ENV}=0 to skip DeepGEMM)", RuntimeWarning,
                          stacklevel=2)
        return fallback()
    if bias is not None:
        add_bias_(out, bias)
    return out


def add_bias_(out: torch.Tensor, bias: torch.Tensor) -> None:
    """``out += bias`` in place for a contiguous bfloat16 ``out`` [M, N] and ``bias`` [N]: the fp32 sum of the
    two bfloat16 values rounded once, torch's ``add_`` bit for bit. On CUDA one pass of the ``"dequant"``
    route's epilogue kernel, 16-byte loads and stores (torch's broadcasting add runs its non-vectorized
    kernel there: 118 us at 8190 x 5120 on an H200, 0.7 TB/s)."""
    if not out.is_cuda:
        out.add_(bias)
        return
    from .scaled_mm_routes import dequant_epilogue

    dequant_epilogue(out, out, None, None, None, bias)


class PreparedMM:
    """:func:`mm` for one weight: ``call(a_data, a_scale, bias) -> out`` as
    ``lowbit.kernels.cublas_fp8_block.PreparedMM`` takes it, with that cuBLASLt call (``fallback``, the same
    operands) run instead should DeepGEMM's first call fail."""

    __slots__ = ("b", "fallback")

    def __init__(self, b_data: torch.Tensor, b_scale: torch.Tensor, fallback) -> None:
        self.b = (b_data, b_scale)
        self.fallback = fallback

    def __call__(self, a_data: torch.Tensor, a_scale: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        b_data, b_scale = self.b
        return mm(a_data, a_scale, b_data, b_scale, lambda: self.fallback(a_data, a_scale, bias), bias)


__all__ = ["ENV", "PreparedMM", "add_bias_", "mm", "unsupported"]
