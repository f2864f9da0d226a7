"""Triton kernel for AutoAWQ INT4 (GEMM layout) dequantization, bit-identical to ``lowbit.formats.int4_awq``.

out[o, i] = fp16((q[i, o] - z[i // g, o]) * s[i // g, o]), then converted to the output dtype. ``q - z`` is a
small integer and ``s`` an fp16, so the fp32 product is exact and one round-to-nearest to fp16 gives the
reference's fp16 multiply. NaN follows the reference on x86: a NaN scale comes out quieted
(``s | 0x200``), ``0 * inf`` is the default NaN 0xFE00 (fp16); widening to fp32 keeps sign and payload
(F16C) and every NaN becomes 0x7FC0 in bfloat16 (c10's conversion).
"""

import triton
import triton.language as tl

from .device import nan_mask


@triton.jit
def dequantize_int4_awq_kernel(
    qweight_ptr, qzeros_ptr, scales_ptr, out_ptr,
    IN, OUT, OUTW, NC, QW_STRIDE, QZ_STRIDE, S_STRIDE,
    GROUP: tl.constexpr, TI: tl.constexpr, TC: tl.constexpr, OUT_KIND: tl.constexpr, ON_GPU: tl.constexpr,
):
    """One program writes out[8*c0 : 8*(c0+TC), i0 : i0+TI] (a column tile inside one group: TI divides GROUP).

    qweight int32 [IN, OUTW], qzeros int32 [IN/GROUP, OUTW], scales fp16 [IN/GROUP, OUT], OUTW = OUT/8,
    with row strides QW_STRIDE, QZ_STRIDE, S_STRIDE (column slices of a wider weight are views), NC = cdiv(OUTW, TC);
    nibble j of a word holds column 8c + [0, 2, 4, 6, 1, 3, 5, 7][j]. ``out_ptr`` is an integer view of the
    [OUT, IN] output (int32 for fp32, int16 for bf16/fp16; OUT_KIND 0, 1, 2).
    """
    # a 1-D grid of NC column tiles per row tile: consecutive programs read adjacent words of the same rows
    pid = tl.program_id(0)
    pid_c = pid % NC
    pid_i = pid // NC
    i0 = pid_i.to(tl.int64) * TI
    c0 = pid_c * TC
    g = i0 // GROUP
    c = tl.arange(0, TC)
    k = tl.arange(0, 8)
    i = tl.arange(0, TI)
    c_ok = c0 + c < OUTW

    # column 8c + k sits in nibble AWQ_REVERSE_ORDER[k] = [0, 4, 1, 5, 2, 6, 3, 7][k]
    shift = 16 * (k % 2) + 4 * (k // 2)
    words = tl.load(qweight_ptr + i0 * QW_STRIDE + c0 + (i[None, :] * QW_STRIDE + c[:, None]), mask=c_ok[:, None], other=0)
    zw = tl.load(qzeros_ptr + g * QZ_STRIDE + c0 + c, mask=c_ok, other=0)
    z = (zw[:, None] >> shift[None, :]) & 0xF                                  # [TC, 8]
    o = c0 * 8 + c[:, None] * 8 + k[None, :]                                   # [TC, 8]
    s = tl.load(scales_ptr + g * S_STRIDE + o, mask=c_ok[:, None], other=0.0)       # fp16 [TC, 8]
    s_bits = s.to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
    # the fp16 NaN of a product that is NaN: the scale quieted, or the default NaN for 0 * inf
    nan_h = tl.where(nan_mask(s), s_bits | 0x200, 0xFE00)

    q = (words[:, None, :] >> shift[None, :, None]) & 0xF                      # [TC, 8, TI]
    p = (q - z[:, :, None]).to(tl.float32) * s.to(tl.float32)[:, :, None]
    is_nan = nan_mask(p)
    h = p.to(tl.float16)
    nan_h = nan_h[:, :, None]
    if OUT_KIND == 0:
        bits = tl.where(is_nan, ((nan_h & 0x8000) << 16) | 0x7F800000 | ((nan_h & 0x3FF) << 13),
                        h.to(tl.float32).to(tl.int32, bitcast=True))
    elif OUT_KIND == 1:
        if ON_GPU:
            b = h.to(tl.float32).to(tl.bfloat16).to(tl.int16, bitcast=True).to(tl.int32)
        else:
            # the interpreter's fp32 -> bf16 cast truncates: round to nearest even on the bits
            f = h.to(tl.float32).to(tl.int32, bitcast=True)
            b = (f + 0x7FFF + ((f >> 16) & 1)) >> 16
        bits = tl.where(is_nan, 0x7FC0, b).to(tl.int16)
    else:
        bits = tl.where(is_nan, nan_h, h.to(tl.int16, bitcast=True).to(tl.int32)).to(tl.int16)

    rows = (o.to(tl.int64) * IN + i0)[:, :, None]
    tl.store(out_ptr + rows + i[None, None, :], bits, mask=c_ok[:, None, None])
