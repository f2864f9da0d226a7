"""Triton kernel: MXFP4 re-encoded exactly as fp8_block for the FP8 tensor cores.

Mirrors ``lowbit.formats.blockscaled.mxfp4_as_fp8_block`` bit for bit. One program reads BLOCK_R rows of one
128-column tile as 32-bit words (16 per row, 8 E2M1 codes each; a word never straddles an MX block) and writes
32 words of E4M3 bytes per row plus the tile's fp32 scale(s).

Inside the window (FOLD_SHIFT + d >= -5) every folded value is a normal E4M3 number, so an MX block's eight
magnitudes are a byte table: 0, 0x30, 0x38, 0x3C (0.5, 1, 1.5 at shift 0), 0x40 .. 0x4C (2, 3, 4, 6), each
nonzero entry plus ``shift << 3`` (the exponent field moves, the mantissa stays). The table fits two 32-bit
registers, and on the GPU one ``prmt`` turns four codes' magnitudes into four E4M3 bytes (their order is
already the element order: element 2i is the low nibble); a second ``prmt`` places the sign bits. The
interpreter builds the same bytes with integer arithmetic.
"""

import triton
import triton.language as tl

from .device import swizzled_offsets

FOLD_SHIFT = tl.constexpr(6)
FOLD_WINDOW = tl.constexpr(11)

# $0, $1: E4M3 bytes of codes 0-3 and 4-7 of word $2; $3, $4: the block's table (magnitudes 0-3, 4-7)
_PRMT_ASM = tl.constexpr("""
{
.reg .b32 sel, mag, sgn, hi, signs;
mov.b32 signs, 0x80808080;
and.b32 sel, $2, 0x7777;
prmt.b32 mag, $3, $4, sel;
shr.b32 sel, $2, 1;
and.b32 sel, sel, 0x4444;
prmt.b32 sgn, 0, signs, sel;
or.b32 $0, mag, sgn;
shr.b32 hi, $2, 16;
and.b32 sel, hi, 0x7777;
prmt.b32 mag, $3, $4, sel;
shr.b32 sel, hi, 1;
and.b32 sel, sel, 0x4444;
prmt.b32 sgn, 0, signs, sel;
or.b32 $1, mag, sgn;
}
""")


@triton.jit
def _folded_byte(code, shift):
    """E4M3 byte (int32) of E2M1 ``code`` times 2^shift, -5 <= shift <= 6 (the table of the module doc)."""
    mag = code & 7
    byte = tl.where(mag == 0, 0, tl.where(mag == 1, 0x30, 0x30 + (mag << 2)) + (shift << 3))
    return byte | ((code & 8) << 4)


@triton.jit
def _folded_words(w, shift, ON_GPU: tl.constexpr):
    """int32 words of 8 E2M1 codes -> (E4M3 bytes of codes 0-3, of codes 4-7) as int32 words."""
    if ON_GPU:
        lut_lo = 0x3C383000 + (shift << 3) * 0x01010100
        lut_hi = 0x4C484440 + (shift << 3) * 0x01010101
        lo, hi = tl.inline_asm_elementwise(_PRMT_ASM, "=r,=r,r,r,r", [w, lut_lo, lut_hi],
                                           dtype=(tl.int32, tl.int32), is_pure=True, pack=1)
    else:
        lo = (_folded_byte(w & 15, shift) | (_folded_byte((w >> 4) & 15, shift) << 8)
              | (_folded_byte((w >> 8) & 15, shift) << 16) | (_folded_byte((w >> 12) & 15, shift) << 24))
        hi = (_folded_byte((w >> 16) & 15, shift) | (_folded_byte((w >> 20) & 15, shift) << 8)
              | (_folded_byte((w >> 24) & 15, shift) << 16) | (_folded_byte((w >> 28) & 15, shift) << 24))
    return lo, hi


@triton.jit
def mxfp4_as_fp8_block_kernel(
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
    stride_os_k,
    SWIZZLED: tl.constexpr,
    BLOCK_R: tl.constexpr,
    ROWS_PER_SCALE: tl.constexpr,
    ON_GPU: tl.constexpr,
):
    """Rows pid * BLOCK_R .. of 128-column tile ``program_id(1)``. ``data_ptr``/``out_ptr`` are int32 views
    (row strides ``stride_d``/``stride_o`` in words). ROWS_PER_SCALE 1: one scale per row (block (1, 128));
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
        soff = swizzled_offsets(rows[:, None], blk[None, :], s_cols4).to(tl.int64)
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

    wc = kt * 16 + tl.arange(0, 16)
    w = tl.load(data_ptr + rows64[:, None] * stride_d + wc[None, :], mask=row_ok[:, None] & (wc < K // 8)[None, :],
                other=0)
    w3 = tl.reshape(w, (BLOCK_R, 4, 4))
    nonzero = tl.max(w3 & 0x77777777, axis=2) != 0
    dropped = nan_block | (nonzero & (d < -FOLD_WINDOW))
    shift = tl.maximum(d, -FOLD_WINDOW) + FOLD_SHIFT
    # a dropped block becomes +0: its codes are cleared
    w = tl.reshape(tl.where(dropped[:, :, None], 0, w3), (BLOCK_R, 16))
    shift = tl.reshape(tl.broadcast_to(shift[:, :, None], (BLOCK_R, 4, 4)), (BLOCK_R, 16))
    lo, hi = _folded_words(w, shift, ON_GPU)
    out = tl.reshape(tl.join(lo, hi), (BLOCK_R, 32))

    oc = kt * 32 + tl.arange(0, 32)
    tl.store(out_ptr + rows64[:, None] * stride_o + oc[None, :], out, mask=row_ok[:, None] & (oc < K // 4)[None, :])
    scale_bits = tl.where(emax > FOLD_SHIFT, (emax - FOLD_SHIFT) << 23, 1 << (emax + 22 - FOLD_SHIFT))
    if ROWS_PER_SCALE == 1:
        tl.store(out_scale_ptr + rows64 * stride_os + kt * stride_os_k, scale_bits.to(tl.float32, bitcast=True),
                 mask=row_ok)
    else:
        tl.store(out_scale_ptr + pid_r * stride_os + kt * stride_os_k, scale_bits.to(tl.float32, bitcast=True))
    if tl.max(tl.max(dropped.to(tl.int32), axis=1), axis=0) > 0:
        tl.store(flag_ptr, 1)
