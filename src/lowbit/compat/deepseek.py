"""DeepSeek-V3 ``inference/kernel.py`` on lowbit: ``act_quant``, ``weight_dequant``, ``fp8_gemm``.

Same signatures, shapes, dtypes and meaning as DeepSeek's Triton functions (``deepseek-ai/DeepSeek-V3``,
``inference/kernel.py`` with the ``scale_fmt`` argument of Aug 2025), running lowbit's ``fp8_block`` reference
on CPU and lowbit's kernels on CUDA:

- ``act_quant(x, block_size=128, scale_fmt=None) -> (y, s)``: per ``block_size`` (default 128) contiguous
  elements of the last dim,
  ``s = max(amax, 1e-4) / 448`` (``scale_fmt="ue8m0"``: rounded up to a power of two), ``y = e4m3(x / s)``;
  ``y`` float8_e4m3fn shaped like ``x``, ``s`` float32 ``[..., K/block_size]``.
- ``weight_dequant(x, s, block_size=128) -> y``: ``x`` float8_e4m3fn ``[M, N]``, ``s`` float32
  ``[ceil(M/128), ceil(N/128)]`` (the checkpoint's ``weight_scale_inv``); ``y = fp32(x) * s`` per 128x128 block,
  in ``torch.get_default_dtype()`` (DeepSeek's ``model.py`` sets bfloat16).
- ``fp8_gemm(a, a_s, b, b_s) -> c``: ``a`` float8_e4m3fn ``[..., K]`` with ``a_s`` ``[..., ceil(K/128)]``
  (from ``act_quant``), ``b`` ``[N, K]`` with ``b_s`` ``[ceil(N/128), ceil(K/128)]``;
  ``c = (a * a_s) @ (b * b_s).T`` with fp32 accumulation, ``[..., N]`` in ``torch.get_default_dtype()``.

Bit-exactness: ``act_quant`` with ``scale_fmt=None`` is DeepSeek's bit for bit (same fp32 operations). With
``"ue8m0"`` lowbit rounds the scale up with the exponent bits (DeepGEMM ``ceil_to_ue8m0``) where DeepSeek
evaluates ``exp2(ceil(log2(s)))`` in floating point; the two differ only when ``s`` is a few ulps above a power
of two (docs/formats.md), where DeepSeek's scale is one step too small and the top elements saturate.
``weight_dequant`` is bit-exact. ``fp8_gemm`` equals DeepSeek's up to fp32 accumulation order (DeepSeek scales
each 128-wide partial product; lowbit's reference scales the operands first: both are exact products of
E4M3 values and scales, summed in fp32).

Differences in what is accepted: ``act_quant`` takes the block sizes DeepSeek's kernel compiles (powers of two
up to 2^20; 128 is lowbit's fp8_block and its kernel, the others run the torch reference);
``weight_dequant`` and ``fp8_gemm`` keep 128 (lowbit's fp8_block); inputs need not be
contiguous; DeepSeek's ``assert``\\ s become ValueError/TypeError naming the rule; ``scale_fmt`` other than None
or ``"ue8m0"`` is a ValueError (DeepSeek silently treats it as None). A default dtype other than float32,
bfloat16 or float16 gets the float32 result cast to it.
"""

from __future__ import annotations

import torch

from .. import api
from ..formats.fp8_block import BLOCK_SIZE, act_quant_groups, expected_scale_shape
from ..formats.qtensor import QTensor
from ..ops.scaled_mm import scaled_mm
from ..ops.scaled_mm_checks import OUT_DTYPES


_MAX_ACT_BLOCK = 1 << 20
"""DeepSeek's ``act_quant_kernel`` takes ``block_size`` as the extent of a ``tl.arange``: a power of two, at
most Triton's largest tensor (2^20 elements)."""


def _check_block_size(block_size: int, fn: str) -> None:
    if isinstance(block_size, bool) or not isinstance(block_size, int):
        raise TypeError(f"{fn}: block_size must be an int, got {type(block_size).__name__}")
    if block_size != BLOCK_SIZE:
        raise ValueError(f"{fn}: block_size must be {BLOCK_SIZE} (lowbit's fp8_block), got {block_size}")


def _check_act_block_size(block_size: int, fn: str) -> None:
    if isinstance(block_size, bool) or not isinstance(block_size, int):
        raise TypeError(f"{fn}: block_size must be an int, got {type(block_size).__name__}")
    if not 1 <= block_size <= _MAX_ACT_BLOCK or block_size & (block_size - 1):
        raise ValueError(
            f"{fn}: block_size must be a power of two from 1 to 2**20 (DeepSeek's kernel uses it as a "
            f"tl.arange extent), got {block_size}"
        )


def _check(t: torch.Tensor, name: str, dtype: torch.dtype, fn: str) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{fn}: {name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype != dtype:
        raise TypeError(f"{fn}: {name} must be {dtype}, got {t.dtype}")


def _out_dtype() -> tuple[torch.dtype, torch.dtype]:
    """(dtype lowbit computes in, dtype DeepSeek returns): ``torch.get_default_dtype()``."""
    want = torch.get_default_dtype()
    return (want if want in OUT_DTYPES else torch.float32), want


def act_quant(
    x: torch.Tensor, block_size: int = 128, scale_fmt: str | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek ``act_quant``: block-wise FP8 quantization of the last dim.

    Args:
        x: float32/bfloat16/float16 ``[..., K]``, ``K % block_size == 0``.
        block_size: elements per scale, a power of two (DeepSeek's kernel allows those); 128 (the
            ``fp8_block`` format) runs lowbit's kernel on CUDA, other sizes the torch reference on x's device.
        scale_fmt: None or ``"ue8m0"`` (power-of-two scales).

    Returns:
        ``(y, s)``: float8_e4m3fn shaped like ``x`` and float32 ``[..., K/block_size]`` (dequant multipliers).
    """
    fn = "act_quant"
    _check_act_block_size(block_size, fn)
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{fn}: x must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() < 1 or x.shape[-1] % block_size:
        raise ValueError(
            f"{fn}: Last dimension size must be divisible by block_size (block_size={block_size}), got shape "
            f"{tuple(x.shape)}"
        )
    if block_size != BLOCK_SIZE:
        return act_quant_groups(x, block_size, scale_fmt)
    q = api.quantize(x, "fp8_block", block=(1, BLOCK_SIZE), scale_fmt=scale_fmt)
    return q.data, q.scale


def weight_dequant(x: torch.Tensor, s: torch.Tensor, block_size: int = 128) -> torch.Tensor:
    """DeepSeek ``weight_dequant``: ``fp32(x) * s`` per 128x128 block, in ``torch.get_default_dtype()``.

    Args:
        x: float8_e4m3fn ``[M, N]``.
        s: float32 ``[ceil(M/128), ceil(N/128)]``.
        block_size: 128.

    Returns:
        ``[M, N]`` tensor in the default dtype.
    """
    fn = "weight_dequant"
    _check_block_size(block_size, fn)
    _check(x, "x", torch.float8_e4m3fn, fn)
    _check(s, "s", torch.float32, fn)
    if x.dim() != 2 or s.dim() != 2:
        raise ValueError(
            f"{fn}: Input tensors must have 2 dimensions, got x {tuple(x.shape)} and s {tuple(s.shape)}"
        )
    want = expected_scale_shape(x.shape, (BLOCK_SIZE, BLOCK_SIZE))
    if tuple(s.shape) != want:
        raise ValueError(
            f"{fn}: s must have shape {want} (one scale per 128x128 block of x {tuple(x.shape)}), "
            f"got {tuple(s.shape)}"
        )
    if s.device != x.device:
        raise ValueError(f"{fn}: x and s must be on one device, got {x.device} and {s.device}")
    q = QTensor(
        x,
        s,
        "fp8_block",
        x.shape,
        torch.bfloat16,
        params={"block": (BLOCK_SIZE, BLOCK_SIZE), "scale_fmt": None},
    )
    compute, want_dtype = _out_dtype()
    return api.dequantize(q, compute).to(want_dtype)


def fp8_gemm(a: torch.Tensor, a_s: torch.Tensor, b: torch.Tensor, b_s: torch.Tensor) -> torch.Tensor:
    """DeepSeek ``fp8_gemm``: ``(a * a_s) @ (b * b_s).T`` with fp32 accumulation, in the default dtype.

    Args:
        a: float8_e4m3fn ``[..., K]`` (activations from :func:`act_quant`).
        a_s: float32 ``[..., ceil(K/128)]``.
        b: float8_e4m3fn ``[N, K]`` (weight).
        b_s: float32 ``[ceil(N/128), ceil(K/128)]`` (``weight_scale_inv``).

    Returns:
        ``[..., N]`` in ``torch.get_default_dtype()``.
    """
    fn = "fp8_gemm"
    for name, t, dt in (
        ("a", a, torch.float8_e4m3fn),
        ("a_s", a_s, torch.float32),
        ("b", b, torch.float8_e4m3fn),
        ("b_s", b_s, torch.float32),
    ):
        _check(t, name, dt, fn)
    if a.dim() < 1:
        raise ValueError(f"{fn}: a must have at least 1 dimension, got a scalar")
    if b.dim() != 2:
        raise ValueError(f"{fn}: b must be a 2-D weight [N, K], got shape {tuple(b.shape)}")
    k = a.shape[-1]
    if b.shape[1] != k:
        raise ValueError(
            f"{fn}: K mismatch: a.shape[-1] = {k} must equal b.shape[1] (b is [N, K] = {tuple(b.shape)})"
        )
    lead = a.shape[:-1]
    a_want = (*lead, -(-k // BLOCK_SIZE))
    if tuple(a_s.shape) != a_want:
        raise ValueError(
            f"{fn}: a_s must have shape {a_want} (one scale per 128 elements of a's last dim), got "
            f"{tuple(a_s.shape)}"
        )
    b_want = expected_scale_shape(b.shape, (BLOCK_SIZE, BLOCK_SIZE))
    if tuple(b_s.shape) != b_want:
        raise ValueError(
            f"{fn}: b_s must have shape {b_want} (one scale per 128x128 block of b), got {tuple(b_s.shape)}"
        )
    m = lead.numel()
    qa = QTensor(
        a.reshape(m, k),
        a_s.reshape(m, a_want[-1]),
        "fp8_block",
        (m, k),
        torch.bfloat16,
        params={"block": (1, BLOCK_SIZE), "scale_fmt": None},
    )
    qb = QTensor(
        b,
        b_s,
        "fp8_block",
        b.shape,
        torch.bfloat16,
        params={"block": (BLOCK_SIZE, BLOCK_SIZE), "scale_fmt": None},
    )
    compute, want_dtype = _out_dtype()
    out = scaled_mm(qa, qb, None, None, compute)
    return out.reshape(*lead, b.shape[0]).to(want_dtype)


__all__ = ["act_quant", "fp8_gemm", "weight_dequant"]
