"""Triton kernels for block-scaled quantize/dequantize (NVFP4, MX, fp4_b32).

Every fp32 operation mirrors ``lowbit.formats.blockscaled`` in the same order; divisions that the
reference does in IEEE arithmetic use ``tl.div_rn`` (a plain ``/`` is approximate in Triton).
"""

import triton
import triton.language as tl

from .device import decode_minifloat, fp6_codes

# SCALE_KIND
SCALE_E4M3 = 0
SCALE_E8M0_RCEIL = 1
SCALE_E8M0_FLOOR = 2
SCALE_FP32 = 3
# E4M3_ORDER: how the E4M3 (nvfp4) element multiplier is evaluated from the block scale sf and global scale S
ORDER_VLLM = 0  # 1 / (sf * (1/S))
ORDER_LIGHTX2V = 1  # S * (1/sf)
# ELEM_KIND
ELEM_MINIFLOAT = 0
ELEM_E4M3 = 1
ELEM_E5M2 = 2


@triton.jit
def _encode_minifloat(x, EBITS: tl.constexpr, MBITS: tl.constexpr, BIAS: tl.constexpr, MAX: tl.constexpr,
                      NAN_FIXUP: tl.constexpr):
    """fp32 -> sign-magnitude E{EBITS}M{MBITS} code, round-to-nearest-even, saturating; NaN -> +max code.

    Normal range: the fp32 significand is rounded to MBITS bits on the bit pattern (add half an ulp minus
    one plus the kept LSB, then shift), which also carries into the exponent; rebasing the exponent by
    (127 - BIAS) makes the shifted value the code. Subnormal range: one uniform step, rounded with the
    1.5*2^23 magic number. On the GPU a NaN reaches min(|x|, MAX) as MAX (min returns the number) with a
    clear sign bit (GPU arithmetic makes the positive canonical NaN), so it already encodes as the max
    code; NAN_FIXUP adds the explicit test where that does not hold (the interpreter).
    """
    bits = x.to(tl.int32, bitcast=True)
    a = tl.minimum(tl.abs(x), MAX)
    ab = a.to(tl.int32, bitcast=True)
    SHIFT: tl.constexpr = 23 - MBITS
    normal = (ab + ((1 << (SHIFT - 1)) - 1) + ((ab >> SHIFT) & 1) - ((127 - BIAS) << 23)) >> SHIFT
    SUB_SCALE: tl.constexpr = 2.0 ** (MBITS - 1 + BIAS)
    sub = (a * SUB_SCALE + 12582912.0).to(tl.int32, bitcast=True) - 0x4B400000
    MIN_NORMAL: tl.constexpr = 2.0 ** (1 - BIAS)
    SIGN: tl.constexpr = 1 << (EBITS + MBITS)
    code = tl.where(a < MIN_NORMAL, sub, normal) | ((bits >> (31 - EBITS - MBITS)) & SIGN)
    if NAN_FIXUP:
        code = tl.where(x != x, SIGN - 1, code)
    return code


@triton.jit
def _e2m1_rounded(x, NAN_FIXUP: tl.constexpr):
    """fp32 x -> the fp32 value of its E2M1 code as ``_encode_minifloat`` then ``decode_minifloat`` give it
    (round-to-nearest-even, saturating at 6, x's sign; NaN -> +6 as there), without the code in between.

    Adding c = 1.5 * 2^(e + 22), e the binade of |x| (at least 0), rounds |x| to a multiple of 2^(e - 1) (the
    sum's ulp), which is one significand bit in [1, 6] (the carry reaches the next binade as the code's
    does; 6 is a code, so nothing at or below it rounds above it) and steps of 0.5 below 1; subtracting c is
    exact. Ties go to even: the sum's last kept bit is x's own bit of that weight."""
    a = tl.minimum(tl.abs(x), 6.0)
    if NAN_FIXUP:
        a = tl.where(x != x, 6.0, a)
    binade = tl.maximum(a.to(tl.int32, bitcast=True) & 0x7F800000, 127 << 23)
    c = (binade + ((22 << 23) | 0x400000)).to(tl.float32, bitcast=True)
    v = (a + c) - c
    sign = x.to(tl.int32, bitcast=True) & -0x80000000
    if NAN_FIXUP:
        sign = tl.where(x != x, 0, sign)
    return (v.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)


@triton.jit
def _e2m1_decoded(code):
    """E2M1 code -> fp32 value, as ``decode_minifloat(code, 2, 1, 1)`` gives it, in fewer instructions: the three
    magnitude bits at the bottom of the fp32 exponent field (code 1 lands on the subnormal 2^-127) times 2^126,
    which is exact (0.5 ... 6, signed zeros kept)."""
    bits = ((code & 7) << 22) | ((code & 8) << 28)
    return bits.to(tl.float32, bitcast=True) * 8.507059173023462e37


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
def _group_scales(x, SCALE_KIND: tl.constexpr, MAX: tl.constexpr, RCP_MAX: tl.constexpr, EMAX: tl.constexpr,
                  s, E4M3_ORDER: tl.constexpr):
    """Per-group (row of x) scale bits to store and the scaled values to encode, as in the reference."""
    # max of |x| as integer bits: orders like the floats, and any NaN (bits above Inf) wins, as the
    # reference's amax propagates NaN where tl.max on floats would drop it
    amax = tl.max(x.to(tl.int32, bitcast=True) & 0x7FFFFFFF, axis=1).to(tl.float32, bitcast=True)
    if SCALE_KIND == 0:
        sf_val = s * (amax * RCP_MAX)
        sf_bits = _encode_fp8(sf_val, 1, 448.0)
        sf32 = sf_bits.to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float32)
        # both orders in IEEE arithmetic, as the reference: they differ in the last bit for some (sf, S), which
        # moves elements that sit on an E2M1 tie to another code
        if E4M3_ORDER == 0:
            m = tl.div_rn(1.0, sf32 * tl.div_rn(1.0, s))
        else:
            m = s * tl.div_rn(1.0, sf32)
        mult = tl.where(sf32 == 0, 0.0, m)
        scaled = x * mult[:, None]
        scale_out = sf_bits
    elif SCALE_KIND == 1 or SCALE_KIND == 2:
        if SCALE_KIND == 1:
            vb = (amax * RCP_MAX).to(tl.int32, bitcast=True)
            exp = (vb >> 23) & 0xFF
            mant = vb & 0x7FFFFF
            code = tl.where(exp == 0, (mant > 0x400000).to(tl.int32), exp + (mant != 0).to(tl.int32))
            code = tl.where(exp == 255, 255, tl.minimum(code, 254))
        else:
            exp = (amax.to(tl.int32, bitcast=True) >> 23) & 0xFF
            code = tl.where(exp == 255, 255, tl.maximum(exp - EMAX, 0))
        inv = tl.where(code == 255, float("nan"), _e8m0_value(tl.maximum(254 - code, 0)))
        scaled = x * inv[:, None]
        scale_out = code
    else:
        sf = tl.div_rn(amax, MAX)
        safe = tl.where(sf == 0, 1.0, sf)
        scaled = tl.where(sf[:, None] == 0, x * 0.0, tl.div_rn(x, safe[:, None]))
        scale_out = _canonical_nan_bits(sf, 0)
    return scaled, scale_out


@triton.jit
def _scale_offsets(g, groups_per_row, n_scale_cols_padded4, SWIZZLED: tl.constexpr):
    """Linear scale index of group g is g itself; the 128x4 swizzle needs its (row, column)."""
    if SWIZZLED:
        r = g // groups_per_row
        k = g % groups_per_row
        return ((r // 128) * (n_scale_cols_padded4 // 4) + k // 4) * 512 + (r % 32) * 16 + ((r // 32) % 4) * 4 + k % 4
    return g


@triton.jit
def quantize_blockscaled_kernel(
    x_ptr, data_ptr, scale_ptr, gscale_ptr, amax_ptr,
    n_groups, groups_per_row, n_scale_cols_padded4,
    BLOCK_G: tl.constexpr, GROUP: tl.constexpr,
    SCALE_KIND: tl.constexpr, ELEM_KIND: tl.constexpr,
    EBITS: tl.constexpr, MBITS: tl.constexpr, BIAS: tl.constexpr, MAX: tl.constexpr, RCP_MAX: tl.constexpr,
    EMAX: tl.constexpr, PACK_BITS: tl.constexpr, HAS_GSCALE: tl.constexpr, SWIZZLED: tl.constexpr,
    NAN_FIXUP: tl.constexpr, E4M3_ORDER: tl.constexpr, GSCALE_FROM_AMAX: tl.constexpr = False,
    DECODED: tl.constexpr = False,
):
    """x is contiguous, so it is a flat sequence of groups: each program quantizes BLOCK_G of them.

    GSCALE_FROM_AMAX: the global scale is the default ``2688 * (1/amax)`` (1 for amax 0, capped at FLT_MAX) of
    the finite absmax in ``amax_ptr`` (fp32 bits), computed here as the reference does; program 0 writes it
    to ``gscale_ptr``. E4M3_ORDER (SCALE_E4M3 only): ORDER_VLLM or ORDER_LIGHTX2V, the producer whose
    multiplier order the element codes follow.

    DECODED (E2M1 elements with E4M3 scales, nvfp4): instead of the codes and scales, the values they decode
    to without the global scale, as ``dequantize_blockscaled_kernel`` decodes them (bf16 bits into the int16
    view ``data_ptr``, x's layout; nothing written to ``scale_ptr``): the activation operand of the
    ``"dequant"`` route in one pass.
    """
    pid = tl.program_id(0).to(tl.int64)
    g = pid * BLOCK_G + tl.arange(0, BLOCK_G).to(tl.int64)
    g_ok = g < n_groups
    e = tl.arange(0, GROUP)
    x = tl.load(x_ptr + g[:, None] * GROUP + e[None, :], mask=g_ok[:, None], other=0.0).to(tl.float32)
    if GSCALE_FROM_AMAX:
        amax_t = tl.load(amax_ptr).to(tl.float32, bitcast=True)
        # 2688 * (1/amax): what torch computes for `2688.0 / amax` (Tensor.__rtruediv__ is reciprocal-then-multiply)
        s = tl.where(amax_t == 0, 1.0, tl.minimum(2688.0 * tl.div_rn(1.0, amax_t), 3.4028234663852886e38))
        if pid == 0:
            tl.store(gscale_ptr, s)
    elif HAS_GSCALE:
        s = tl.load(gscale_ptr)
    else:
        s = 1.0
    scaled, scale_out = _group_scales(x, SCALE_KIND, MAX, RCP_MAX, EMAX, s, E4M3_ORDER)

    if DECODED:
        # the E2M1 rounding as a value, without the code in between (encode-then-decode's value in fewer
        # instructions: this pass is bound by them). |v| <= 6, so a product is NaN exactly where its block
        # scale is, and the canonical NaN is chosen per block; v * sf is exact in bf16 (2 + 4 significant bits).
        v = _e2m1_rounded(scaled, NAN_FIXUP)
        sf = scale_out.to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float32)
        bits = (v * sf[:, None]).to(tl.bfloat16).to(tl.int16, bitcast=True)
        bits = tl.where((sf != sf)[:, None], tl.full(bits.shape, 0x7FC0, tl.int16), bits)
        tl.store(data_ptr + g[:, None] * GROUP + e[None, :], bits, mask=g_ok[:, None])
    else:
        if ELEM_KIND == 0:
            codes = _encode_minifloat(scaled, EBITS, MBITS, BIAS, MAX, NAN_FIXUP)
        else:
            codes = _encode_fp8(scaled, ELEM_KIND, MAX)
        _store_codes(codes, data_ptr, g, g_ok, BLOCK_G, GROUP, PACK_BITS)
        soff = _scale_offsets(g, groups_per_row, n_scale_cols_padded4, SWIZZLED)
        if SCALE_KIND == 3:
            tl.store(scale_ptr + soff, scale_out.to(tl.float32, bitcast=True), mask=g_ok)
        else:
            tl.store(scale_ptr + soff, scale_out.to(tl.uint8), mask=g_ok)


@triton.jit
def _store_codes(codes, data_ptr, g, g_ok, BLOCK_G: tl.constexpr, GROUP: tl.constexpr, PACK_BITS: tl.constexpr):
    """Element codes [BLOCK_G, GROUP] of groups g, packed at PACK_BITS per element into the bytes of data_ptr."""
    if PACK_BITS == 4:
        lo, hi = tl.split(tl.reshape(codes, (BLOCK_G, GROUP // 2, 2)))
        b = tl.arange(0, GROUP // 2)
        tl.store(data_ptr + g[:, None] * (GROUP // 2) + b[None, :], (lo | (hi << 4)).to(tl.uint8),
                 mask=g_ok[:, None])
    elif PACK_BITS == 6:
        # codes a b c d -> 24-bit word -> bytes b0 b1 b2, written as 4-byte slots with the 4th masked off
        even, odd = tl.split(tl.reshape(codes, (BLOCK_G, GROUP // 4, 2, 2)))
        a, c = tl.split(even)
        b, d = tl.split(odd)
        word = a | (b << 6) | (c << 12) | (d << 18)
        b0 = word & 0xFF
        b1 = (word >> 8) & 0xFF
        b2 = (word >> 16) & 0xFF
        slots = tl.reshape(tl.join(tl.join(b0, b2), tl.join(b1, b2)), (BLOCK_G, GROUP))
        col = tl.arange(0, GROUP)
        off = (col // 4) * 3 + col % 4
        tl.store(data_ptr + g[:, None] * (GROUP // 4 * 3) + off[None, :], slots.to(tl.uint8),
                 mask=g_ok[:, None] & (col % 4 < 3)[None, :])
    else:
        e = tl.arange(0, GROUP)
        tl.store(data_ptr + g[:, None] * GROUP + e[None, :], codes.to(tl.uint8), mask=g_ok[:, None])


@triton.jit
def dequantize_blockscaled_kernel(
    data_ptr, scale_ptr, gscale_ptr, out_ptr,
    n_groups, groups_per_row, n_scale_cols_padded4,
    BLOCK_G: tl.constexpr, GROUP: tl.constexpr,
    SCALE_KIND: tl.constexpr, ELEM_KIND: tl.constexpr,
    EBITS: tl.constexpr, MBITS: tl.constexpr, BIAS: tl.constexpr,
    PACK_BITS: tl.constexpr, HAS_GSCALE: tl.constexpr, SWIZZLED: tl.constexpr, OUT_KIND: tl.constexpr,
):
    _dequantize_program(tl.program_id(0).to(tl.int64), data_ptr, scale_ptr, gscale_ptr, out_ptr, n_groups,
                        groups_per_row, n_scale_cols_padded4, BLOCK_G, GROUP, SCALE_KIND, ELEM_KIND, EBITS, MBITS,
                        BIAS, PACK_BITS, HAS_GSCALE, SWIZZLED, OUT_KIND)


@triton.jit
def _dequantize_program(
    pid, data_ptr, scale_ptr, gscale_ptr, out_ptr, n_groups, groups_per_row, n_scale_cols_padded4,
    BLOCK_G: tl.constexpr, GROUP: tl.constexpr, SCALE_KIND: tl.constexpr, ELEM_KIND: tl.constexpr,
    EBITS: tl.constexpr, MBITS: tl.constexpr, BIAS: tl.constexpr, PACK_BITS: tl.constexpr,
    HAS_GSCALE: tl.constexpr, SWIZZLED: tl.constexpr, OUT_KIND: tl.constexpr,
):
    """Groups [pid * BLOCK_G, (pid + 1) * BLOCK_G) of the dequantize kernel."""
    g = pid * BLOCK_G + tl.arange(0, BLOCK_G).to(tl.int64)
    g_ok = g < n_groups
    e = tl.arange(0, GROUP)

    if PACK_BITS == 4:
        b = tl.arange(0, GROUP // 2)
        byte = tl.load(data_ptr + g[:, None] * (GROUP // 2) + b[None, :], mask=g_ok[:, None], other=0).to(tl.int32)
        codes = tl.reshape(tl.join(byte & 0xF, byte >> 4), (BLOCK_G, GROUP))
    elif PACK_BITS == 6:
        off = (e // 4) * 3 + e % 4
        slots = tl.load(data_ptr + g[:, None] * (GROUP // 4 * 3) + off[None, :],
                        mask=g_ok[:, None] & (e % 4 < 3)[None, :], other=0).to(tl.int32)
        codes = fp6_codes(slots)
    else:
        codes = tl.load(data_ptr + g[:, None] * GROUP + e[None, :], mask=g_ok[:, None], other=0).to(tl.int32)

    if ELEM_KIND == 0 and EBITS == 2 and MBITS == 1:
        v = _e2m1_decoded(codes)
    elif ELEM_KIND == 0:
        v = decode_minifloat(codes, EBITS, MBITS, BIAS)
    elif ELEM_KIND == 1:
        v = codes.to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float32)
    else:
        v = codes.to(tl.uint8).to(tl.float8e5, bitcast=True).to(tl.float32)

    soff = _scale_offsets(g, groups_per_row, n_scale_cols_padded4, SWIZZLED)
    if SCALE_KIND == 0:
        sf = tl.load(scale_ptr + soff, mask=g_ok, other=0).to(tl.float8e4nv, bitcast=True).to(tl.float32)
        if HAS_GSCALE:
            sf = tl.div_rn(sf, tl.load(gscale_ptr))
    elif SCALE_KIND == 3:
        sf = tl.load(scale_ptr + soff, mask=g_ok, other=0.0)
    else:
        code = tl.load(scale_ptr + soff, mask=g_ok, other=0).to(tl.int32)
        sf = tl.where(code == 255, float("nan"), _e8m0_value(code))

    out = v * sf[:, None]
    # out_ptr is an integer view of the output (int32 for fp32, int16 for bf16/fp16)
    optr = out_ptr + g[:, None] * GROUP + e[None, :]
    # per element: an Inf scale times a zero element is NaN too, not only a NaN scale
    tl.store(optr, _canonical_nan_bits(out, OUT_KIND), mask=g_ok[:, None])


@triton.jit
def finite_absmax_kernel(x_ptr, out_ptr, N, CHUNK: tl.constexpr, CHUNKS: tl.constexpr):
    """max |x| over finite elements into out_ptr[0] (int32 bits of a non-negative fp32, atomic max).

    Each program reduces CHUNKS chunks before its one atomic, so a large tensor costs few atomics.
    """
    _finite_absmax_program(tl.program_id(0).to(tl.int64), x_ptr, out_ptr, N, CHUNK, CHUNKS)


@triton.jit
def absmax_and_dequantize_kernel(
    x_ptr, amax_ptr, N, absmax_programs,
    data_ptr, scale_ptr, gscale_ptr, out_ptr, n_groups, groups_per_row, n_scale_cols_padded4,
    CHUNK: tl.constexpr, CHUNKS: tl.constexpr,
    BLOCK_G: tl.constexpr, GROUP: tl.constexpr, SCALE_KIND: tl.constexpr, ELEM_KIND: tl.constexpr,
    EBITS: tl.constexpr, MBITS: tl.constexpr, BIAS: tl.constexpr, PACK_BITS: tl.constexpr,
    HAS_GSCALE: tl.constexpr, SWIZZLED: tl.constexpr, OUT_KIND: tl.constexpr,
):
    """``finite_absmax_kernel`` on x (programs below ``absmax_programs``) and ``dequantize_blockscaled_kernel``
    on a weight (the rest) in one launch: two independent memory-bound passes, each too short at DiT sizes to
    reach the copy bandwidth by itself (the absmax of an 8190 x 5120 activation ran at about 60 % of it)."""
    pid = tl.program_id(0).to(tl.int64)
    if pid < absmax_programs:
        _finite_absmax_program(pid, x_ptr, amax_ptr, N, CHUNK, CHUNKS)
    else:
        _dequantize_program(pid - absmax_programs, data_ptr, scale_ptr, gscale_ptr, out_ptr, n_groups,
                            groups_per_row, n_scale_cols_padded4, BLOCK_G, GROUP, SCALE_KIND, ELEM_KIND, EBITS,
                            MBITS, BIAS, PACK_BITS, HAS_GSCALE, SWIZZLED, OUT_KIND)


@triton.jit
def _finite_absmax_program(pid, x_ptr, out_ptr, N, CHUNK: tl.constexpr, CHUNKS: tl.constexpr):
    """Chunks [pid * CHUNKS, (pid + 1) * CHUNKS) of the absmax kernel, and its atomic."""
    best = tl.zeros((CHUNK,), dtype=tl.float32)
    # unrolled, so the chunk loads are all in flight before the first max
    for c in tl.static_range(CHUNKS):
        offs = (pid * CHUNKS + c) * CHUNK + tl.arange(0, CHUNK)
        a = tl.abs(tl.load(x_ptr + offs, mask=offs < N, other=0.0).to(tl.float32))
        best = tl.maximum(best, tl.where((a == a) & (a != float("inf")), a, 0.0))
    tl.atomic_max(out_ptr, tl.max(best, axis=0).to(tl.int32, bitcast=True))


@triton.jit
def nvfp4_roundtrip_small_kernel(
    x_ptr, gscale_ptr, out_ptr, N,
    BLOCK_N: tl.constexpr, E4M3_ORDER: tl.constexpr, NAN_FIXUP: tl.constexpr,
    MAX: tl.constexpr, RCP_MAX: tl.constexpr, EMAX: tl.constexpr,
    EBITS: tl.constexpr, MBITS: tl.constexpr, BIAS: tl.constexpr,
):
    """One program: ``x`` (N contiguous elements, N <= BLOCK_N, N % 16 == 0) quantized to NVFP4 with the
    default global scale, exactly as ``finite_absmax_kernel`` then ``quantize_blockscaled_kernel``
    (GSCALE_FROM_AMAX) quantize it, and decoded without the global scale as ``dequantize_blockscaled_kernel``
    decodes the codes (bf16 out, bits into the int16 view ``out_ptr``); the global scale goes to
    ``gscale_ptr``. The same device functions in the same order, so the same bits, in one launch instead of
    three (what a decode step's activation costs on the host)."""
    offs = tl.arange(0, BLOCK_N)
    x = tl.load(x_ptr + offs, mask=offs < N, other=0.0).to(tl.float32)
    a = tl.abs(x)
    amax_t = tl.max(tl.where((a == a) & (a != float("inf")), a, 0.0), axis=0)
    s = tl.where(amax_t == 0, 1.0, tl.minimum(2688.0 * tl.div_rn(1.0, amax_t), 3.4028234663852886e38))
    tl.store(gscale_ptr, s)
    xg = tl.reshape(x, (BLOCK_N // 16, 16))
    scaled, sf_bits = _group_scales(xg, 0, MAX, RCP_MAX, EMAX, s, E4M3_ORDER)  # SCALE_E4M3
    codes = _encode_minifloat(scaled, EBITS, MBITS, BIAS, MAX, NAN_FIXUP)
    v = decode_minifloat(codes, EBITS, MBITS, BIAS)
    sf = sf_bits.to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float32)
    out = tl.reshape(v * sf[:, None], (BLOCK_N,))
    tl.store(out_ptr + offs, _canonical_nan_bits(out, 1), mask=offs < N)
