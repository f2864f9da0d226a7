"""MXFP4 folded into fp8_block (pure PyTorch reference): a 2-D MXFP4 tensor re-encoded exactly as E4M3 values
with one fp32 scale per 1x128 or 128x128 block, so the FP8 tensor cores can take it
(:func:`mxfp4_as_fp8_block`; the Triton kernel mirrors it bit for bit)."""

from __future__ import annotations

import torch

from .blockscaled_generic import linear_scales
from .codecs import decode_minifloat
from .packing import unpack_fp4
from .qtensor import QTensor
from .spec import E2M1

FOLD_SHIFT = 6
"""An MXFP4 block re-encoded in E4M3 (:func:`mxfp4_as_fp8_block`) is its E2M1 codes times 2^(FOLD_SHIFT + d),
d <= 0 its exponent below the largest of its 128-column tile: 6 * 2^6 = 384 <= 448."""
FOLD_WINDOW = 11
"""Folded blocks stay within FOLD_WINDOW binades of their block's largest (shift FOLD_SHIFT + d >= -5): there
every E2M1 value times 2^(FOLD_SHIFT + d) is a normal E4M3 number (0.5 * 2^-5 = 2^-6 is E4M3's smallest
normal), exact, and the E4M3 code is the shift-0 code plus ``shift << 3`` (the kernel's byte table)."""


def check_fold_args(q: QTensor, block: tuple[int, int]) -> tuple[int, int]:
    """Raise ValueError unless ``q`` is a 2-D mxfp4 QTensor and ``block`` is (1, 128) or (128, 128); returns
    ``block`` as a tuple."""
    if not isinstance(q, QTensor) or q.fmt != "mxfp4" or len(q.shape) != 2:
        raise ValueError("q must be a 2-D mxfp4 QTensor")
    block = tuple(block)
    if block not in ((1, 128), (128, 128)):
        raise ValueError(f"block must be (1, 128) or (128, 128), got {block}")
    return block


def mxfp4_as_fp8_block(q: QTensor, block: tuple[int, int] = (1, 128)) -> tuple[QTensor, torch.Tensor]:
    """Re-encode a 2-D MXFP4 tensor exactly as ``fp8_block``, for the FP8 tensor cores.

    In each ``block`` (1x128: a row's 128-column tile, 4 MX blocks; 128x128: 128 rows of it) let ``emax`` be
    the largest scale code. The block's fp32 scale is ``2^(emax - 127 - FOLD_SHIFT)`` and each element becomes
    the E4M3 value ``e2m1 * 2^(e - emax + FOLD_SHIFT)`` (``e`` its MX block's code), so ``dequantize_fp8_block``
    of the result equals :func:`dequantize_mx` of ``q`` bit for bit. An MX block that cannot be folded exactly
    -- a NaN scale (0xFF), or a nonzero block more than ``FOLD_WINDOW`` binades below its ``emax`` -- is
    written as +0 and left out of ``emax``; the second result (a bool scalar tensor) is False when any was.

    Args:
        q: ``mxfp4`` QTensor of shape ``[R, K]`` (linear or swizzled scales).
        block: ``(1, 128)`` (activations: one scale per row and 128 columns) or ``(128, 128)`` (weights: one
            scale per 128x128 block, so a GEMM tile of up to 128 weight rows has a single scale).

    Returns:
        (QTensor ``fp8_block`` with ``params={"block": block}``: data float8_e4m3fn ``[R, K]``, scale fp32
        ``[R, ceil(K/128)]`` or ``[ceil(R/128), ceil(K/128)]``; ``exact`` bool tensor).
    """
    block = check_fold_args(q, block)
    rows, k = q.shape
    blocks = k // 32
    tiles = -(-k // 128)
    row_blocks = -(-rows // block[0])
    codes = unpack_fp4(q.data.reshape(rows, k // 2)).reshape(rows, blocks, 32)
    e = linear_scales(q, 32).view(torch.uint8).to(torch.int32)
    nan_block = e == 255
    e_padded = torch.zeros(row_blocks * block[0], tiles * 4, dtype=torch.int32, device=e.device)
    e_padded[:rows, :blocks] = torch.where(nan_block, 0, e)
    emax = e_padded.reshape(row_blocks, block[0], tiles, 4).amax((1, 3))
    d = e_padded - emax.repeat_interleave(block[0], dim=0).repeat_interleave(4, dim=1)
    d = d[:rows, :blocks]
    nonzero = (codes & 7).amax(-1) > 0
    dropped = nan_block | (nonzero & (d < -FOLD_WINDOW))
    mult = ((d.clamp(min=-FOLD_WINDOW) + FOLD_SHIFT + 127) << 23).view(torch.float32)
    values = decode_minifloat(codes, E2M1) * mult.unsqueeze(-1)
    values = torch.where(dropped.unsqueeze(-1), torch.zeros_like(values), values)
    scale_bits = torch.where(emax > FOLD_SHIFT, (emax - FOLD_SHIFT) << 23, 1 << (emax + 22 - FOLD_SHIFT))
    folded = QTensor(
        data=values.reshape(rows, k).to(torch.float8_e4m3fn),
        scale=scale_bits.view(torch.float32),
        fmt="fp8_block",
        shape=q.shape,
        dtype=q.dtype,
        params={"block": block},
    )
    return folded, ~dropped.any()


__all__ = ["FOLD_SHIFT", "FOLD_WINDOW", "check_fold_args", "mxfp4_as_fp8_block"]
