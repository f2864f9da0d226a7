"""Triton kernel: MXFP4 re-encoded exactly as fp8_block (1x128) for the FP8 tensor cores.

Mirrors ``lowbit.formats.blockscaled.mxfp4_as_fp8_block`` bit for bit. One program reads BLOCK_R rows of one
128-column tile (64 packed bytes and 4 E8M0 codes per row) and writes 128 E4M3 bytes and one fp32 scale per
row. Each E2M1 value times 2^(FOLD_SHIFT + d) is built directly as its fp32 bit pattern (exponent field
plus the block's shift) and cast to E4M3, which is exact for every value of the window.
"""

import triton
import triton.language as tl

from ._gemm_w4 import _swizzled_offsets

FOLD_SHIFT = tl.constexpr(6)
FOLD_WINDOW = tl.constexpr(14)


@triton.jit
def _folded_e4m3(code, shift):
    """E2M1 codes (int32, low 4 bits) times 2^shift (int32, same shape) -> float8e4nv, exact in the window."""
    mag = code & 7
    ex = mag >> 1
    # 0.5 (code 1) is 2^-1 like a normal value with exponent field 0; codes 2..7 are (1 + m/2) * 2^(ex - 1)
    exp_field = tl.where(ex == 0, 126, ex + 126) + shift
    mant = tl.where(ex == 0, 0, (mag & 1) << 22)
    bits = tl.where(mag == 0, 0, (exp_field << 23) | mant) | ((code & 8) << 28)
    return bits.to(tl.float32, bitcast=True).to(tl.float8e4nv)


@triton.jit
def _mxfp4_as_fp8_block_kernel(
    data_ptr,
    scale_ptr,
    out_ptr,
    out_scale_ptr,
    flag_ptr,
    R,
    K,
    stride_d,
    stride_s0,
    s_cols4,
    stride_o,
    stride_os,
    SWIZZLED: tl.constexpr,
    BLOCK_R: tl.constexpr,
    ROWS_PER_SCALE: tl.constexpr,
):
    """Rows pid * BLOCK_R .. of one 128-column tile. ROWS_PER_SCALE 1: one scale per row (block (1, 128));
    equal to BLOCK_R: one for all of them (block (BLOCK_R, 128)). flag_ptr (int32) is set to 1 when a block
    cannot be folded (the reference's ``exact`` is False); it is never cleared here."""
    pid_r = tl.program_id(0)
    kt = tl.program_id(1)
    rows = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = rows < R
    rows64 = rows.to(tl.int64)

    blk = kt * 4 + tl.arange(0, 4)
    blk_ok = row_ok[:, None] & (blk < K // 32)[None, :]
    if SWIZZLED:
        soff = _swizzled_offsets(rows[:, None], blk[None, :], s_cols4).to(tl.int64)
    else:
        soff = rows64[:, None] * stride_s0 + blk[None, :]
    e = tl.load(scale_ptr + soff, mask=blk_ok, other=0).to(tl.int32)
    nan_block = e == 255
    e = tl.where(nan_block, 0, e)
    emax = tl.max(e, axis=1)
    if ROWS_PER_SCALE == 1:
        d = e - emax[:, None]
    else:
        emax = tl.max(emax, axis=0)
        d = e - emax

    kb = kt * 64 + tl.arange(0, 64)
    byte_ok = row_ok[:, None] & (kb < K // 2)[None, :]
    byte = tl.load(data_ptr + rows64[:, None] * stride_d + kb[None, :], mask=byte_ok, other=0).to(tl.int32)
    nonzero = tl.max(tl.reshape(byte & 0x77, (BLOCK_R, 4, 16)), axis=2) > 0
    dropped = nan_block | (nonzero & (d < -FOLD_WINDOW))
    shift = tl.maximum(d, -FOLD_WINDOW) + FOLD_SHIFT
    # a dropped block becomes +0: its codes are cleared before the shift is applied
    byte = tl.reshape(tl.where(dropped[:, :, None], 0, tl.reshape(byte, (BLOCK_R, 4, 16))), (BLOCK_R, 64))
    shift = tl.reshape(tl.broadcast_to(shift[:, :, None], (BLOCK_R, 4, 16)), (BLOCK_R, 64))
    lo = _folded_e4m3(byte & 15, shift)
    hi = _folded_e4m3(byte >> 4, shift)
    vals = tl.reshape(tl.join(lo, hi), (BLOCK_R, 128))

    cols = kt * 128 + tl.arange(0, 128)
    tl.store(out_ptr + rows64[:, None] * stride_o + cols[None, :], vals,
             mask=row_ok[:, None] & (cols < K)[None, :])
    scale_bits = tl.where(emax > FOLD_SHIFT, (emax - FOLD_SHIFT) << 23, 1 << (emax + 22 - FOLD_SHIFT))
    if ROWS_PER_SCALE == 1:
        tl.store(out_scale_ptr + rows64 * stride_os + kt, scale_bits.to(tl.float32, bitcast=True), mask=row_ok)
    else:
        tl.store(out_scale_ptr + pid_r * stride_os + kt, scale_bits.to(tl.float32, bitcast=True))
    if tl.max(tl.max(dropped.to(tl.int32), axis=1), axis=0) > 0:
        tl.store(flag_ptr, 1)
