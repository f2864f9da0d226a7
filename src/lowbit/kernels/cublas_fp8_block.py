"""cuBLASLt's block-scaled FP8 GEMM on Hopper, reached through ``torch.nn.functional.scaled_mm``.

CUDA 12.9 put DeepSeek-V3's recipe into cuBLASLt for SM90: E4M3 operands, an fp32 scale per 1x128 block of the
activation and per 128x128 block of the weight, and the partial product of every 128-wide K block promoted to
fp32 with its two scales. PyTorch (2.9 on) exposes it as ``ScalingType.BlockWise1x128`` x ``BlockWise128x128``.
It is the kernel a user of torch would pick instead of ours, so :mod:`lowbit.kernels.scaled_mm` runs it where
it is faster. On an H100 it ran at
0.84-0.90x ``torch._scaled_mm`` per-tensor FP8 at M = 4096 on the DeepSeek-V3 shapes and 8192^3, where lowbit's
warp-specialized Gluon kernel ran at 0.71-0.75x, and it was faster than lowbit's kernels at every M >= 256 of the
probe. At M <= 64 lowbit's split-K kernel streams the weight faster, so decode stays there.

What cuBLAS takes (probed on an H100 case by case):

- M a multiple of 4 (M = 4095: ``CUBLAS_STATUS_NOT_SUPPORTED``): :func:`mm` pads other M with zero rows (a copy
  of the M x K FP8 activation) and returns the first M rows of the output; K and N multiples of 16;
- activation scales M-major: ``[M, K/128]`` with strides ``(1, M)``;
- weight scales ``[N/128, round_up(K/128, 4)]`` row-major, handed over transposed (``[round_up(K/128, 4), N/128]``);
- a bias only of the output's dtype and only with a bfloat16 or float16 output.

Results are the block-scaled product up to fp32 accumulation order: relative error 1.3e-4 with a float32 output
in the probe, the same as the Triton kernels (Hopper's FP8 MMA accumulates with fewer bits inside each K block).
There is no ``alpha`` argument, so ``alpha`` is folded into the activation scales (one fp32 rounding per scale).
"""

from __future__ import annotations

import functools
import os

import torch

ENV = "LOWBIT_CUBLAS_FP8_BLOCK"
"""Set to ``0`` to keep fp8_block GEMMs on lowbit's Triton kernels."""


@functools.cache
def _unavailable(device_index: int) -> str | None:
    import torch.nn.functional as F

    if not hasattr(F, "scaled_mm") or not hasattr(getattr(F, "ScalingType", None), "BlockWise128x128"):
        return f"torch {torch.__version__} has no torch.nn.functional.scaled_mm with BlockWise128x128 scales"
    cuda = torch.version.cuda
    if cuda is None or tuple(int(v) for v in cuda.split(".")[:2]) < (12, 9):
        return f"cuBLASLt block scaling needs CUDA >= 12.9, torch is built with {cuda}"
    cap = torch.cuda.get_device_capability(device_index)
    if cap != (9, 0):
        return f"cuBLASLt's 1x128 x 128x128 FP8 scaling runs on SM90 only, this GPU is sm_{cap[0]}{cap[1]}"
    return None


def aligned(t: torch.Tensor) -> bool:
    """cuBLAS reads an operand with a 16-byte aligned base and row stride, unit column stride."""
    return t.stride(-1) == 1 and t.data_ptr() % 16 == 0 and t.stride(0) % 16 == 0


def unsupported(m: int, n: int, k: int, device: torch.device, operands_aligned: bool, bias: torch.Tensor | None,
                out_dtype: torch.dtype) -> str | None:
    """None when :func:`mm` can run this GEMM, else why not (whether it should is ``lowbit.ops.policy``'s
    ``CUBLAS_FP8_BLOCK_MIN_M``)."""
    if os.environ.get(ENV, "1") == "0":
        return f"${ENV}=0"
    if n % 16 or k % 16:
        return f"N = {n} and K = {k} must be multiples of 16 (cuBLAS)"
    if not operands_aligned:
        return "an operand's base or row stride is not 16-byte aligned"
    if bias is not None and (bias.dtype != out_dtype or out_dtype == torch.float32):
        return (f"cuBLAS adds a bias only of the output's dtype to a bf16/fp16 output (bias {bias.dtype}, "
                f"output {out_dtype})")
    if device.type != "cuda":
        return "not on CUDA"
    return _unavailable(device.index if device.index is not None else torch.cuda.current_device())


def activation_scales(scale: torch.Tensor, m: int, k_blocks: int, alpha: torch.Tensor | None,
                      rows: int | None = None) -> torch.Tensor:
    """``scale`` ([M, K/128], or [M, 1] for one scale per row) times ``alpha``, M-major as cuBLAS reads it;
    ``rows`` > M: ``rows`` of them, the ones past M zero (the scales of zero padding rows)."""
    rows = m if rows is None else rows
    if alpha is None and rows == m and scale.shape == (m, k_blocks) and scale.stride() == (1, m):
        return scale
    full = torch.empty_strided((rows, k_blocks), (1, rows), dtype=torch.float32, device=scale.device)
    out = full[:m]
    src = scale.expand(m, k_blocks)
    if alpha is None:
        out.copy_(src)
    else:
        torch.mul(src, alpha, out=out)
    if rows > m:
        full[m:].zero_()
    return full


def weight_scales(scale: torch.Tensor, zero_padded: bool = False) -> torch.Tensor:
    """``[N/128, K/128]`` weight scales as ``[round_up(K/128, 4), N/128]`` with strides ``(1, round_up(K/128, 4))``.

    A view when the scales are contiguous and K/128 is a multiple of 4, or when ``zero_padded`` says that
    ``scale`` is the ``[:, :K/128]`` view of rows of ``round_up(K/128, 4)`` whose tail is zero; else a copy."""
    nb, kb = scale.shape
    k4 = -(-kb // 4) * 4
    if k4 == kb and scale.is_contiguous():
        return scale.t()
    if zero_padded and scale.stride() == (k4, 1):
        return scale.as_strided((k4, nb), (1, k4))  # the zero tail past the view, which cuBLAS wants
    padded = torch.zeros(nb, k4, dtype=torch.float32, device=scale.device)
    padded[:, :kb] = scale
    return padded.t()


def mm(a_data: torch.Tensor, a_scale: torch.Tensor, b_data: torch.Tensor, b_scale: torch.Tensor,
       alpha: torch.Tensor | None, bias: torch.Tensor | None, out_dtype: torch.dtype,
       b_scale_zero_padded: bool = False) -> torch.Tensor:
    """``alpha * (a_data * a_scale) @ (b_data * b_scale).T + bias`` for E4M3 ``a_data`` [M, K] with 1x128 scales
    ``a_scale`` ([M, K/128] in any layout, or [M, 1]) and ``b_data`` [N, K] with 128x128 scales ``b_scale``
    [N/128, K/128] (``b_scale_zero_padded``: see :func:`weight_scales`); :func:`route` must have said yes."""
    import torch.nn.functional as F

    m, k = a_data.shape
    pad = -m % 4
    if pad:  # cuBLAS takes M a multiple of 4: zero rows after the activation, the output's first M rows returned
        full = torch.empty((m + pad, k), dtype=a_data.dtype, device=a_data.device)
        full[:m].copy_(a_data)
        full[m:].view(torch.uint8).zero_()
        a_data = full
    sa = activation_scales(a_scale, m, -(-k // 128), alpha, m + pad)
    sb = weight_scales(b_scale, b_scale_zero_padded)
    out = F.scaled_mm(a_data, b_data.t(), sa, F.ScalingType.BlockWise1x128, sb, F.ScalingType.BlockWise128x128,
                      bias=bias, output_dtype=out_dtype)
    return out[:m] if pad else out


class PreparedMM:
    """:func:`mm` for one weight and output dtype with everything of the weight decided once (its data as cuBLAS
    reads it, its scales in cuBLAS's layout, the scaling recipes): ``call(a_data, a_scale, bias) -> out`` for
    E4M3 ``a_data`` [M, K] (M a multiple of 4, aligned) and M-major ``a_scale`` [M, K/128] with strides (1, M),
    ``bias`` as :func:`mm` takes it. The first call goes through ``torch.nn.functional.scaled_mm``; later calls
    go to the op under it (``torch._scaled_mm_v2``) when it gave the same bits on that first call."""

    __slots__ = ("b_t", "sb", "out_dtype", "_direct", "_recipes")

    def __init__(self, b_data: torch.Tensor, b_scale: torch.Tensor, out_dtype: torch.dtype) -> None:
        self.b_t = b_data.t()
        self.sb = weight_scales(b_scale)
        self.out_dtype = out_dtype
        self._direct = None
        self._recipes = None

    def __call__(self, a_data: torch.Tensor, a_scale: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        d = self._direct
        if d is not None:
            ra, rb = self._recipes
            return d(a_data, self.b_t, [a_scale], ra, [], [self.sb], rb, [], bias, self.out_dtype, [], False)
        import torch.nn.functional as F

        out = F.scaled_mm(a_data, self.b_t, a_scale, F.ScalingType.BlockWise1x128, self.sb,
                          F.ScalingType.BlockWise128x128, bias=bias, output_dtype=self.out_dtype)
        v2 = getattr(torch, "_scaled_mm_v2", None)
        if v2 is not None and self._recipes is None:
            recipes = ([int(F.ScalingType.BlockWise1x128.value)], [int(F.ScalingType.BlockWise128x128.value)])
            try:
                same = torch.equal(v2(a_data, self.b_t, [a_scale], recipes[0], [], [self.sb], recipes[1], [], bias,
                                      self.out_dtype, [], False), out)
            except (RuntimeError, TypeError):  # another signature in this torch: keep the public call
                same = False
            self._recipes = recipes
            if same:
                self._direct = v2
        return out

