"""Triton kernels for block-scaled quantize/dequantize (NVFP4, MX, fp4_b32).

Every fp32 operation mirrors ``lowbit.formats.blockscaled`` in the same order; divisions that the
reference does in IEEE arithmetic use ``tl.div_rn`` (a plain ``/`` is approximate in Triton).
"""

import triton
import triton.language as tl

# SCALE_KIND
SCALE_E4M3 = 0
SCALE_E8M0_RCEIL = 1
SCALE_E8M0_FLOOR = 2
SCALE_FP32 = 3
# ELEM_KIND
ELEM_MINIFLOAT = 0
ELEM_E4M3 = 1
ELEM_E5M2 = 2


@triton.jit
def _encode_minifloat(x, EBITS: tl.constexpr, MBITS: tl.constexpr, BIAS: tl.constexpr, MAX: tl.constexpr):
    """fp32 -> sign-magnitude code, round-to-nearest-even, saturating; NaN -> +max code.

    With e = max(exponent(a), emin) and r = rint(a / 2^(e - MBITS)), the code is
    (e - emin) * 2^MBITS + r: a carry of r into the next binade lands on the right code by itself.
    """
    bits = x.to(tl.int32, bitcast=True)
    sign = (bits >> 31) & 1
    a = tl.minimum(tl.abs(x), MAX)
    emin: tl.constexpr = 1 - BIAS
    e = ((a.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
    e = tl.maximum(e, emin)
    # 2^-(e - MBITS), built from exponent bits so the scaling is exact
    inv_quantum = ((127 - (e - MBITS)) << 23).to(tl.float32, bitcast=True)
    # adding and removing 1.5*2^23 rounds to an integer, ties to even, for 0 <= y < 2^22
    y = a * inv_quantum
    r = ((y + 12582912.0) - 12582912.0).to(tl.int32)
    code = (e - emin) * (1 << MBITS) + r
    max_code: tl.constexpr = (1 << (EBITS + MBITS)) - 1
    code = tl.where(x != x, max_code, code | (sign << (EBITS + MBITS)))
    return code


@triton.jit
def _decode_minifloat(code, EBITS: tl.constexpr, MBITS: tl.constexpr, BIAS: tl.constexpr):
    mag = code & ((1 << (EBITS + MBITS)) - 1)
    exp_field = mag >> MBITS
    mant = mag & ((1 << MBITS) - 1)
    normal = (((exp_field - BIAS + 127) << 23) | (mant << (23 - MBITS))).to(tl.float32, bitcast=True)
    sub_unit: tl.constexpr = 2.0 ** (1 - BIAS - MBITS)
    value = tl.where(exp_field == 0, mant.to(tl.float32) * sub_unit, normal)
    # set the sign bit directly: `-value` compiles to 0 - value, which turns code -0 into +0
    sign = ((code >> (EBITS + MBITS)) & 1) << 31
    return (value.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)


@triton.jit
def _encode_fp8(x, ELEM_KIND: tl.constexpr, MAX: tl.constexpr):
    y = tl.minimum(tl.maximum(x, -MAX), MAX)
    if ELEM_KIND == 1:
        b = y.to(tl.float8e4nv).to(tl.uint8, bitcast=True).to(tl.int32)
    else:
        b = y.to(tl.float8e5).to(tl.uint8, bitcast=True).to(tl.int32)
    return tl.where(x != x, 0x7F, b)


@triton.jit
def _canonical_nan_bits(v, OUT_KIND: tl.constexpr):
    """Bits of v in the output dtype, NaN replaced by the quiet NaN torch produces on the CPU.

    GPU arithmetic returns NaN as 0x7FFFFFFF; the reference (and torch's casts) give 0x7FC00000,
    bf16 0x7FC0, fp16 0x7E00. OUT_KIND: 0 fp32, 1 bf16, 2 fp16.
    """
    if OUT_KIND == 0:
        return tl.where(v != v, 0x7FC00000, v.to(tl.int32, bitcast=True))
    elif OUT_KIND == 1:
        return tl.where(v != v, 0x7FC0, v.to(tl.bfloat16).to(tl.int16, bitcast=True).to(tl.int32)).to(tl.int16)
    else:
        return tl.where(v != v, 0x7E00, v.to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32)).to(tl.int16)


@triton.jit
def _e8m0_value(code):
    """fp32 2^(code-127) for code in [0, 254]; 0 -> 2^-127 (subnormal)."""
    return tl.where(code == 0, 0x00400000, code << 23).to(tl.float32, bitcast=True)


@triton.jit
def _quantize_blockscaled_kernel(
    x_ptr, data_ptr, scale_ptr, gscale_ptr,
    M, K, stride_xm,
    n_scale_cols_padded4,
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, GROUP: tl.constexpr,
    SCALE_KIND: tl.constexpr, ELEM_KIND: tl.constexpr,
    EBITS: tl.constexpr, MBITS: tl.constexpr, BIAS: tl.constexpr, MAX: tl.constexpr, RCP_MAX: tl.constexpr,
    EMAX: tl.constexpr, PACK_BITS: tl.constexpr, HAS_GSCALE: tl.constexpr, SWIZZLED: tl.constexpr,
):
    pid_m = tl.program_id(0).to(tl.int64)
    pid_k = tl.program_id(1).to(tl.int64)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M).to(tl.int64)
    cols = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    row_ok = rows < M
    mask = row_ok[:, None] & (cols < K)[None, :]
    x = tl.load(x_ptr + rows[:, None] * stride_xm + cols[None, :], mask=mask, other=0.0).to(tl.float32)

    NG: tl.constexpr = BLOCK_K // GROUP
    xg = tl.reshape(x, (BLOCK_M, NG, GROUP))
    amax = tl.max(tl.abs(xg), axis=2)
    # tl.max drops NaN; the reference's amax propagates it
    has_nan = tl.max((xg != xg).to(tl.int32), axis=2) > 0
    amax = tl.where(has_nan, float("nan"), amax)

    if SCALE_KIND == 0:
        if HAS_GSCALE:
            s = tl.load(gscale_ptr)
        else:
            s = 1.0
        sf_val = s * (amax * RCP_MAX)
        sf_bits = _encode_fp8(sf_val, 1, 448.0)
        sf32 = sf_bits.to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float32)
        mult = tl.where(sf32 == 0, 0.0, s * tl.div_rn(1.0, sf32))
        scaled = xg * mult[:, :, None]
        scale_out = sf_bits
    elif SCALE_KIND == 1 or SCALE_KIND == 2:
        if SCALE_KIND == 1:
            v = amax * RCP_MAX
            vb = v.to(tl.int32, bitcast=True)
            exp = (vb >> 23) & 0xFF
            mant = vb & 0x7FFFFF
            code = tl.where(exp == 0, (mant > 0x400000).to(tl.int32), exp + (mant != 0).to(tl.int32))
            code = tl.where(exp == 255, 255, tl.minimum(code, 254))
        else:
            exp = (amax.to(tl.int32, bitcast=True) >> 23) & 0xFF
            code = tl.where(exp == 255, 255, tl.maximum(exp - EMAX, 0))
        inv = tl.where(code == 255, float("nan"), _e8m0_value(tl.maximum(254 - code, 0)))
        scaled = xg * inv[:, :, None]
        scale_out = code
    else:
        sf = tl.div_rn(amax, MAX)
        safe = tl.where(sf == 0, 1.0, sf)
        scaled = tl.where(sf[:, :, None] == 0, xg * 0.0, tl.div_rn(xg, safe[:, :, None]))
        scale_out = sf

    if ELEM_KIND == 0:
        codes = _encode_minifloat(scaled, EBITS, MBITS, BIAS, MAX)
    else:
        codes = _encode_fp8(scaled, ELEM_KIND, MAX)
    codes = tl.reshape(codes, (BLOCK_M, BLOCK_K))

    if PACK_BITS == 4:
        pairs = tl.reshape(codes, (BLOCK_M, BLOCK_K // 2, 2))
        lo, hi = tl.split(pairs)
        byte = (lo | (hi << 4)).to(tl.uint8)
        bcols = pid_k * (BLOCK_K // 2) + tl.arange(0, BLOCK_K // 2)
        bmask = row_ok[:, None] & (bcols < K // 2)[None, :]
        tl.store(data_ptr + rows[:, None] * (K // 2) + bcols[None, :], byte, mask=bmask)
    elif PACK_BITS == 6:
        quads = tl.reshape(codes, (BLOCK_M, BLOCK_K // 4, 2, 2))
        even, odd = tl.split(quads)
        a, c = tl.split(even)
        b, d = tl.split(odd)
        word = a | (b << 6) | (c << 12) | (d << 18)
        qcols = pid_k * (BLOCK_K // 4) + tl.arange(0, BLOCK_K // 4)
        qmask = row_ok[:, None] & (qcols < K // 4)[None, :]
        base = data_ptr + rows[:, None] * (K // 4 * 3) + qcols[None, :] * 3
        tl.store(base, (word & 0xFF).to(tl.uint8), mask=qmask)
        tl.store(base + 1, ((word >> 8) & 0xFF).to(tl.uint8), mask=qmask)
        tl.store(base + 2, ((word >> 16) & 0xFF).to(tl.uint8), mask=qmask)
    else:
        tl.store(data_ptr + rows[:, None] * K + cols[None, :], codes.to(tl.uint8), mask=mask)

    scols = pid_k * NG + tl.arange(0, NG)
    smask = row_ok[:, None] & (scols < K // GROUP)[None, :]
    if SWIZZLED:
        r = rows[:, None]
        k = scols[None, :]
        soff = ((r // 128) * (n_scale_cols_padded4 // 4) + k // 4) * 512 + (r % 32) * 16 + ((r // 32) % 4) * 4 + k % 4
    else:
        soff = rows[:, None] * (K // GROUP) + scols[None, :]
    if SCALE_KIND == 3:
        tl.store(scale_ptr + soff, _canonical_nan_bits(scale_out, 0).to(tl.float32, bitcast=True), mask=smask)
    else:
        tl.store(scale_ptr + soff, scale_out.to(tl.uint8), mask=smask)


@triton.jit
def _dequantize_blockscaled_kernel(
    data_ptr, scale_ptr, gscale_ptr, out_ptr,
    M, K, n_scale_cols_padded4,
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, GROUP: tl.constexpr,
    SCALE_KIND: tl.constexpr, ELEM_KIND: tl.constexpr,
    EBITS: tl.constexpr, MBITS: tl.constexpr, BIAS: tl.constexpr,
    PACK_BITS: tl.constexpr, HAS_GSCALE: tl.constexpr, SWIZZLED: tl.constexpr, OUT_KIND: tl.constexpr,
):
    pid_m = tl.program_id(0).to(tl.int64)
    pid_k = tl.program_id(1).to(tl.int64)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M).to(tl.int64)
    row_ok = rows < M
    NG: tl.constexpr = BLOCK_K // GROUP

    if PACK_BITS == 4:
        bcols = pid_k * (BLOCK_K // 2) + tl.arange(0, BLOCK_K // 2)
        bmask = row_ok[:, None] & (bcols < K // 2)[None, :]
        byte = tl.load(data_ptr + rows[:, None] * (K // 2) + bcols[None, :], mask=bmask, other=0).to(tl.int32)
        codes = tl.reshape(tl.join(byte & 0xF, byte >> 4), (BLOCK_M, BLOCK_K))
    elif PACK_BITS == 6:
        qcols = pid_k * (BLOCK_K // 4) + tl.arange(0, BLOCK_K // 4)
        qmask = row_ok[:, None] & (qcols < K // 4)[None, :]
        base = data_ptr + rows[:, None] * (K // 4 * 3) + qcols[None, :] * 3
        b0 = tl.load(base, mask=qmask, other=0).to(tl.int32)
        b1 = tl.load(base + 1, mask=qmask, other=0).to(tl.int32)
        b2 = tl.load(base + 2, mask=qmask, other=0).to(tl.int32)
        word = b0 | (b1 << 8) | (b2 << 16)
        even = tl.join(word & 0x3F, (word >> 12) & 0x3F)
        odd = tl.join((word >> 6) & 0x3F, (word >> 18) & 0x3F)
        codes = tl.reshape(tl.join(even, odd), (BLOCK_M, BLOCK_K))
    else:
        cols0 = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
        m0 = row_ok[:, None] & (cols0 < K)[None, :]
        codes = tl.load(data_ptr + rows[:, None] * K + cols0[None, :], mask=m0, other=0).to(tl.int32)

    if ELEM_KIND == 0:
        v = _decode_minifloat(codes, EBITS, MBITS, BIAS)
    elif ELEM_KIND == 1:
        v = codes.to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float32)
    else:
        v = codes.to(tl.uint8).to(tl.float8e5, bitcast=True).to(tl.float32)

    scols = pid_k * NG + tl.arange(0, NG)
    smask = row_ok[:, None] & (scols < K // GROUP)[None, :]
    if SWIZZLED:
        r = rows[:, None]
        k = scols[None, :]
        soff = ((r // 128) * (n_scale_cols_padded4 // 4) + k // 4) * 512 + (r % 32) * 16 + ((r // 32) % 4) * 4 + k % 4
    else:
        soff = rows[:, None] * (K // GROUP) + scols[None, :]
    if SCALE_KIND == 0:
        sf = tl.load(scale_ptr + soff, mask=smask, other=0).to(tl.float8e4nv, bitcast=True).to(tl.float32)
        if HAS_GSCALE:
            sf = tl.div_rn(sf, tl.load(gscale_ptr))
    elif SCALE_KIND == 3:
        sf = tl.load(scale_ptr + soff, mask=smask, other=0.0)
    else:
        code = tl.load(scale_ptr + soff, mask=smask, other=0).to(tl.int32)
        sf = tl.where(code == 255, float("nan"), _e8m0_value(code))

    out = tl.reshape(v, (BLOCK_M, NG, GROUP)) * sf[:, :, None]
    out = tl.reshape(out, (BLOCK_M, BLOCK_K))
    cols = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    mask = row_ok[:, None] & (cols < K)[None, :]
    # out_ptr is an integer view of the output (int32 for fp32, int16 for bf16/fp16)
    tl.store(out_ptr + rows[:, None] * K + cols[None, :], _canonical_nan_bits(out, OUT_KIND), mask=mask)


@triton.jit
def _finite_absmax_kernel(x_ptr, out_ptr, N, BLOCK: tl.constexpr):
    """max |x| over finite elements into out_ptr[0] (int32 bits of a non-negative fp32, atomic max)."""
    pid = tl.program_id(0).to(tl.int64)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs, mask=offs < N, other=0.0).to(tl.float32)
    a = tl.abs(x)
    a = tl.where((a == a) & (a != float("inf")), a, 0.0)
    tl.atomic_max(out_ptr, tl.max(a, axis=0).to(tl.int32, bitcast=True))
