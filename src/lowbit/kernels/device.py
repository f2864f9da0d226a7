"""Triton device functions shared by the kernel modules: decode of packed codes and scales, packing, scale
math and the GEMV epilogue. A helper that more than one kernel module calls lives here under a public name, so
no kernel module reaches into another's private helpers; a helper of one kernel module stays in that module.

The kernels that call these are bit-exact against the references in ``lowbit.formats``: a change to an
operation here, or to the order of operations, changes every caller.
"""

import triton
import triton.language as tl


def one_line(asm: str) -> str:
    """Inline asm on one line (statements end with ';'): torch.compile pastes a kernel's global constants into
    generated source inside a triple-quoted string, where the ``\\n`` of a multi-line repr would become a line
    break inside a string literal."""
    return " ".join(part.strip() for part in asm.splitlines() if part.strip())


# ACT: the activation of the GEMV epilogue (the 4-bit GEMVs of ``_gemv_w4`` and ``_gemv_mma``)
ACT_NONE = tl.constexpr(0)
ACT_GELU = tl.constexpr(1)
ACT_GELU_TANH = tl.constexpr(2)
ACT_SILU = tl.constexpr(3)
ACT_GATED = tl.constexpr(4)
"""Added to an activation code: the gated form ``act(gate) * up`` (``silu_and_mul`` ...): the weight's rows
hold gate and up interleaved in blocks of 8 (fused rows 16j..16j+7 are gate rows 8j..8j+7, 16j+8..16j+15 the
up rows 8j..8j+7; ``lowbit.kernels.gemv_prepack.gated_layout``), and output row 8j + i is
``act(gate[8j+i]) * up[8j+i]``, written to an output of N / 2 columns."""
# GS_KIND: what the epilogue does with gs_ptr[0]
GS_NONE = tl.constexpr(0)
GS_DIVIDE = tl.constexpr(1)  # nvfp4 global scale S (dequant = value * sf / S)
GS_MULTIPLY = tl.constexpr(2)  # nvfp4 per_tensor_scale p (dequant = value * p * sf)


@triton.jit
def decode_minifloat(code, EBITS: tl.constexpr, MBITS: tl.constexpr, BIAS: tl.constexpr):
    """Code -> fp32 by building the fp32 bit pattern; subnormal codes are integer multiples of one step."""
    SIGN: tl.constexpr = 1 << (EBITS + MBITS)
    mag = code & (SIGN - 1)
    normal = (mag + ((127 - BIAS) << MBITS)) << (23 - MBITS)
    STEP: tl.constexpr = 2.0 ** (1 - BIAS - MBITS)
    sub = (mag.to(tl.float32) * STEP).to(tl.int32, bitcast=True)
    vbits = tl.where(mag < (1 << MBITS), sub, normal) | ((code & SIGN) << (31 - EBITS - MBITS))
    return vbits.to(tl.float32, bitcast=True)


@triton.jit
def fp6_codes(slots):
    """FP6 codes [R, C] from ``slots`` [R, C] (int32): for each group of 4 elements, slots 0..2 hold its 3
    packed bytes (little-endian 24-bit stream, element 0 in the low 6 bits) and slot 3 is ignored."""
    R: tl.constexpr = slots.shape[0]
    C: tl.constexpr = slots.shape[1]
    s02, s13 = tl.split(tl.reshape(slots, (R, C // 4, 2, 2)))
    b0, b2 = tl.split(s02)
    b1, _ = tl.split(s13)
    word = b0 | (b1 << 8) | (b2 << 16)
    even = tl.join(word & 0x3F, (word >> 12) & 0x3F)
    odd = tl.join((word >> 6) & 0x3F, (word >> 18) & 0x3F)
    return tl.reshape(tl.join(even, odd), (R, C))


@triton.jit
def split_pairs(pair, DT: tl.constexpr):
    """int32 [R, P] words, each holding two 16-bit patterns (low half first) -> ``DT`` [R, 2P]."""
    lo = pair.to(tl.int16)
    hi = (pair >> 16).to(tl.int16)
    v = tl.reshape(tl.join(lo, hi), (pair.shape[0], 2 * pair.shape[1]))
    return v.to(DT, bitcast=True)


@triton.jit
def e2m1_bits(b, DT: tl.constexpr):
    """Packed bytes ``b`` (int32 [R, P], element 2i in the low nibble) -> int32 words holding the two 16-bit
    patterns (element 2i in the low half) whose ``DT`` values are the E2M1 values times 2^-126 (bf16) or
    2^-14 (fp16): the magnitude bits go to the bottom of the exponent field (bits 6-8 or 9-11; code 1 becomes
    a subnormal), the sign to bit 15. Two multiplies spread the byte (the shifted copies do not overlap, so
    there are no carries) and masks keep the wanted bits."""
    if DT == tl.float16:
        mag = (b * 0x200200) & 0x0E000E00             # b<<9 | b<<21: bits 0-2 -> 9-11, bits 4-6 -> 25-27
        sign = ((b & 0x88) * 0x1001000) & -0x7FFF8000  # mask 0x80008000: bit 3 -> 15, bit 7 -> 31
        bits = mag | sign
    else:
        # b<<6 | b<<18 and (b & 0x88)<<12 | (b & 0x88)<<24 share no wanted bit: one and-or
        bits = ((b * 0x40040) | ((b & 0x88) * 0x1001000)) & -0x7E3F7E40   # mask 0x81C081C0
    return bits


@triton.jit
def e2m1_pairs(b, DT: tl.constexpr, ON_GPU: tl.constexpr):
    """Packed bytes -> exact E2M1 values [R, 2P] in ``DT`` (one power-of-two multiply of ``e2m1_bits``)."""
    v = split_pairs(e2m1_bits(b, DT), DT)
    if DT == tl.float16:
        out = v * 16384.0                           # 2^14
    elif ON_GPU:
        out = v * 8.507059173023462e37              # 2^126
    else:
        # the interpreter cannot make bf16 constants (nor multiply bf16 correctly; see the interpreter test)
        out = v * tl.full((1, 1), 0x7E80, tl.int16).to(tl.bfloat16, bitcast=True)
    return out


@triton.jit
def e8m0_to(code, DT: tl.constexpr):
    """E8M0 code (int32) -> 2^(code-127) in ``DT`` (255 -> NaN). bf16 holds every value exactly; in fp16 the
    value rounds as a cast would (2^-25 and below flush to zero, 2^16 and above overflow)."""
    if DT == tl.bfloat16:
        # 2^-127 is the bf16 subnormal 0x0040
        bits = tl.where(code == 0, 0x0040, tl.where(code == 255, 0x7FC0, code << 7))
        return bits.to(tl.int16).to(tl.bfloat16, bitcast=True)
    else:
        f = tl.where(code == 0, 0x00400000, tl.where(code == 255, 0x7FC00000, code << 23))
        return f.to(tl.float32, bitcast=True).to(DT)


@triton.jit
def _per_group(v, s, SUBTRACT: tl.constexpr):
    """v [R, C] times (SUBTRACT: minus) s [R, G]: G == 1 broadcasts, else each entry of s covers C / G
    consecutive columns."""
    R: tl.constexpr = v.shape[0]
    C: tl.constexpr = v.shape[1]
    G: tl.constexpr = s.shape[1]
    if G == 1:
        if SUBTRACT:
            out = v - s
        else:
            out = v * s
    else:
        if SUBTRACT:
            out = tl.reshape(tl.reshape(v, (R, G, C // G)) - s[:, :, None], (R, C))
        else:
            out = tl.reshape(tl.reshape(v, (R, G, C // G)) * s[:, :, None], (R, C))
    return out


@triton.jit
def mul_groups(v, s):
    """v [R, C] times s [R, G]: G == 1 broadcasts, else each scale covers C / G consecutive columns."""
    return _per_group(v, s, False)


@triton.jit
def sub_groups(v, z):
    """v [R, C] minus z [R, G], grouped as in :func:`mul_groups`."""
    return _per_group(v, z, True)


@triton.jit
def load_nc(ptrs, ASM: tl.constexpr, CONSTRAINTS: tl.constexpr, DT: tl.constexpr, ON_GPU: tl.constexpr):
    """One element per pointer through the read-only path. On the GPU the elementwise inline-asm load ``ASM``
    (an ``ld.global.nc`` of ``$1`` into ``$0``; ``CONSTRAINTS`` ``"=<reg>,l"``, result dtype ``DT``): inline asm
    takes the register layout of its consumers, where a ``tl.load`` gather would impose its own and cost a layout
    conversion. The interpreter cannot run inline asm: ``tl.load(ptrs)`` (the pointer's dtype)."""
    if ON_GPU:
        # inline_asm_elementwise takes a dtype, not a constexpr: DT.value
        return tl.inline_asm_elementwise(ASM, CONSTRAINTS, [ptrs], dtype=DT.value, is_pure=True, pack=1)
    else:
        return tl.load(ptrs)


@triton.jit
def swizzled_offsets(r, c, n_cols_padded4):
    """Byte offset of scale (r, c) in the 128x4-swizzled layout (torchao ``to_blocked``)."""
    # r, c >= 0: shifts and masks instead of signed division
    return ((r >> 7) * (n_cols_padded4 >> 2) + (c >> 2)) * 512 + (r & 31) * 16 + ((r >> 5) & 3) * 4 + (c & 3)


@triton.jit
def scale_from_amax_bits(abits, POW2_SCALE: tl.constexpr):
    """fp32 scale from the int32 bits of |amax| (NaN bits allowed), as formats.fp8_block._block_scale."""
    abits = tl.maximum(abits, 0x38D1B717)  # amax.clamp(min=fp32(1e-4)); NaN bits are larger and stay
    s = tl.div_rn(abits.to(tl.float32, bitcast=True), 448.0)
    if POW2_SCALE:
        sb = s.to(tl.int32, bitcast=True) & 0x7FFFFFFF
        biased = sb >> 23
        e = biased + ((sb & 0x7FFFFF) != 0).to(tl.int32)
        e = tl.minimum(tl.maximum(e, 1), 254)
        s = tl.where(biased == 255, s, (e << 23).to(tl.float32, bitcast=True))
    return s


@triton.jit
def e4m3_codes(q):
    """uint8 E4M3 codes of fp32 q (|q| <= 448 (1 + 2^-23), or NaN).

    ``cvt.rn.satfinite.e4m3x2.f32`` writes NaN as 0x7F (the only positive E4M3 NaN; every NaN reaching
    here comes out of a GPU fmul/fma, which returns the positive canonical NaN 0x7FFFFFFF). An explicit
    ``where(q != q, 0x7F, ...)`` on the bytes costs ~5 instructions per element (unpack/repack), a third
    of the kernel's ALU work, so it is left out; the GPU tests check NaN of both signs and payloads.
    """
    return q.to(tl.float8e4nv).to(tl.uint8, bitcast=True)


@triton.jit
def rn_quotient(x, xbits, s, r):
    """RN(x / s) for fp32 x (int32 bits ``xbits``), scale s > 0 (or +Inf) and r = RN(1 / s), broadcast to x's
    shape, by correction steps on x * r (``_fp8_block``'s module docstring). Negations are sign-bit flips,
    since Triton's unary minus is 0 - v, which turns -0 into +0."""
    q0 = x * r
    s_fin = tl.where(s == float("inf"), 0.0, s)
    neg_x = (xbits ^ -2147483648).to(tl.float32, bitcast=True)
    neg_r = (r.to(tl.int32, bitcast=True) ^ -2147483648).to(tl.float32, bitcast=True)  # -r, -0 for r = 0
    q1 = tl.fma(tl.fma(q0, s_fin, neg_x), neg_r, q0)  # within 0.5 + 2^-23 ulp: faithful
    return tl.fma(tl.fma(q1, s_fin, neg_x), neg_r, q1)   # Markstein: correctly rounded


@triton.jit
def nan_mask(x):
    """True where x is NaN: the one comparison that tells a NaN, named so that callers read as intended."""
    return x != x  # noqa: PLR0124 - the NaN test


@triton.jit
def settled(acc, ON_GPU: tl.constexpr):
    """``acc``, once every wgmma that produced it has completed.

    Triton 3.6 pipelines a wgmma whose A operand is in registers so that the next tile's decode may overwrite
    the A registers of the previous tile's wgmmas before they have all run (its ``wgmma.wait_group`` only
    covers the first of them; triton-lang/triton#9433, fixed after 3.6 by #9514). On the H100 that gave wrong
    results in some tile shapes (rel. error up to 0.2, varying with num_stages and the epilogue). Reading the
    accumulator here makes Triton wait for all of this tile's wgmmas before the next decode starts; the
    decode no longer overlaps the tensor cores of its own warpgroup (other programs on the SM still do)."""
    if ON_GPU:
        return tl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r", [acc], dtype=tl.float32, is_pure=False,
                                         pack=1)
    return acc


@triton.jit
def gemv_activation(y, ACT: tl.constexpr):
    """The GEMV epilogue's activation (ACT_*) of fp32 ``y``: erf GELU, tanh GELU or SiLU (IEEE divisions)."""
    if ACT == ACT_GELU:
        y = 0.5 * y * (1.0 + tl.math.erf(y * 0.7071067811865476))
    elif ACT == ACT_GELU_TANH:
        u = 0.7978845608028654 * (y + 0.044715 * y * y * y)
        # tanh(u) = 1 - 2 / (exp(2u) + 1): exact limits +-1 for large |u|
        t = 1.0 - tl.div_rn(2.0, tl.exp(2.0 * u) + 1.0)
        y = 0.5 * y * (1.0 + t)
    elif ACT == ACT_SILU:
        y = tl.div_rn(y, 1.0 + tl.exp(-y))
    return y


@triton.jit
def _gate_pairs(t, PAIR: tl.constexpr):
    """(gate, up) halves of ``t`` [A, B] whose dim 1 runs over groups of 2 PAIR elements, the first PAIR of a
    group from gate rows and the next PAIR from the matching up rows: each [A, B / 2], in group order."""
    A: tl.constexpr = t.shape[0]
    B: tl.constexpr = t.shape[1]
    t = tl.reshape(t, (A, B // (2 * PAIR), 2, PAIR))
    t = tl.permute(t, (0, 1, 3, 2))
    return tl.split(tl.reshape(t, (A, B // 2, 2)))


@triton.jit
def gemv_finish(acc, m, rows, M, N, gs_ptr, rs_ptr, bias_ptr, out_ptr, POST: tl.constexpr,
                GS_KIND: tl.constexpr, ROW_SCALE: tl.constexpr, HAS_BIAS: tl.constexpr, ACT: tl.constexpr,
                PAIR: tl.constexpr):
    """acc: fp32 partial sums for x rows ``m`` and output rows ``rows`` (index tensors broadcastable to acc's
    shape); writes out[m, rows]. ROW_SCALE 1 multiplies by rs_ptr[0], 2 by rs_ptr[m], 3 divides by rs_ptr[0]
    (what x's own scales leave over: an FP8 activation's per-token scale, an nvfp4 activation's global scale;
    applied before the bias). With ACT >= ACT_GATED the gated form (see ACT_GATED): ``PAIR`` is the distance
    along acc's dim 1 between a gate row and its up row (8 in a row-per-column tile, 2 in the mma C fragment
    layout), and out has N / 2 columns."""
    y = acc * POST
    if GS_KIND == GS_DIVIDE:
        y = tl.div_rn(y, tl.load(gs_ptr))
    elif GS_KIND == GS_MULTIPLY:
        y = y * tl.load(gs_ptr)
    if ROW_SCALE == 1:
        y = y * tl.load(rs_ptr)
    elif ROW_SCALE == 2:
        y = y * tl.load(rs_ptr + m, mask=m < M, other=0.0)
    elif ROW_SCALE == 3:
        y = tl.div_rn(y, tl.load(rs_ptr))
    if HAS_BIAS:
        y = y + tl.load(bias_ptr + rows, mask=rows < N, other=0.0).to(tl.float32)
    if ACT >= ACT_GATED:
        gate, up = _gate_pairs(y, PAIR)
        r, _ = _gate_pairs(rows + m * 0, PAIR)       # fused row of each gate value
        mm, _ = _gate_pairs(m + rows * 0, PAIR)
        orow = (r // 16) * 8 + r % 16
        y = gemv_activation(gate, ACT - ACT_GATED) * up
        tl.store(out_ptr + mm * (N // 2) + orow, y.to(out_ptr.dtype.element_ty), mask=(mm < M) & (r < N))
    else:
        y = gemv_activation(y, ACT)
        tl.store(out_ptr + m * N + rows, y.to(out_ptr.dtype.element_ty), mask=(m < M) & (rows < N))


@triton.jit
def gemv_epilogue(acc, cnt, pid_k, m, rows, M, N, gs_ptr, rs_ptr, bias_ptr, out_ptr, ws_ptr,
                  MP: tl.constexpr, SPLIT: tl.constexpr, POST: tl.constexpr, GS_KIND: tl.constexpr,
                  ROW_SCALE: tl.constexpr, HAS_BIAS: tl.constexpr, ACT: tl.constexpr, PAIR: tl.constexpr):
    """:func:`gemv_finish`, after the split-K reduction when SPLIT > 1: ``cnt`` is this output tile's counter,
    the workspace is [SPLIT, MP, N] fp32 (rows past N are never read back, x rows m >= M are ignored)."""
    if SPLIT == 1:
        gemv_finish(acc, m, rows, M, N, gs_ptr, rs_ptr, bias_ptr, out_ptr, POST, GS_KIND, ROW_SCALE, HAS_BIAS, ACT,
                    PAIR)
    else:
        wmask = rows < N
        tl.store(ws_ptr + (pid_k * MP + m) * N + rows, acc, mask=wmask)
        tl.debug_barrier()
        prev = tl.atomic_add(cnt, 1, sem="acq_rel", scope="gpu")
        if prev == SPLIT - 1:
            tot = tl.zeros_like(acc)
            for s in range(SPLIT):
                tot += tl.load(ws_ptr + (s * MP + m) * N + rows, mask=wmask, other=0.0, cache_modifier=".cg")
            # every program of this tile has arrived: reset the counter for the next launch
            tl.atomic_xchg(cnt, 0, sem="relaxed", scope="gpu")
            gemv_finish(tot, m, rows, M, N, gs_ptr, rs_ptr, bias_ptr, out_ptr, POST, GS_KIND, ROW_SCALE, HAS_BIAS,
                        ACT, PAIR)
