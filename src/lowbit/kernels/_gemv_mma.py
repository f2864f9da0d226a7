"""Triton kernel of the tensor-core 4-bit GEMV (``mma.sync`` m16n8k16 in inline PTX), M <= 32 per block of
programs (up to 4 n-tiles of 8 x rows share each decoded weight register).

Why: the CUDA-core FMA kernel spends about 4.5 instructions per weight at M = 1 and one more FMA per weight
per extra row of x, so it is issue-bound from M = 2 on. Here one ``mma.sync`` multiplies 256 weights by up to
8 rows of x; the decode is about 2 instructions per weight whatever M is.

Layout (made once by ``gemv_mma_layout.mma_layout``): W ``[N, K]`` is cut into 16-row groups and 64-column chunks.
Lane ``(g, t) = (lane // 4, lane % 4)`` of a warp owns, in a chunk at column ``c0``, the 16 weights of rows
``g`` and ``g + 8`` at columns ``c0 + 16 t .. c0 + 16 t + 15`` (one NVFP4 scale block per row), as four int32
words ``i = 0..3`` (columns ``c0 + 16 t + 4 i + 0..3`` of both rows), stored ``[N/16, K/64, 32 lanes, 4]`` so a
warp reads 512 contiguous bytes with 16-byte loads. The mma's reduction index is permuted against K (the
same permutation for W and x, so the product is unchanged): word ``i`` is the A fragment of the i-th mma of
the chunk and the lane's x values for it are columns ``c0 + 16 t + 4 i + 0..3`` of x, i.e. the lane loads 32
contiguous bytes of each x row once per chunk and they are already the B fragments.

Decode of a word to the four bf16x2 A registers (bit positions chosen by the pre-layout): an E2M1 nibble
``s e1 e0 m`` placed at bf16 bits 15 and 8..6 is exactly ``e2m1 * 2^-126`` (``0.5`` lands on the bf16
subnormal 2^-127), so three registers are one shift and one AND, the fourth six instructions. Each
register is multiplied (``mul.rn.bf16x2``, exact: at most 6 significant bits, within range) by the lane's
block scale times 2^63, so the A operand is ``W * 2^-63``; the epilogue multiplies by 2^63. A product
``W * x`` below 2^-126 (|x| < ~1e-16) is flushed by the tensor core; its absolute error is below 1e-19.

Streaming (what the H200 sweeps chose): the
warps split the chunks of an iteration, so each warp loads x once for its row groups; the words, scale pairs
and x fragments of the next iteration are plain loads into registers issued while the current one is
multiplied (no shared memory, no barrier in the loop). A cp.async pipeline of the words through shared
memory, a two-iteration register prefetch and warps split over the row groups were each slower (28672x8192
NVFP4 at M = 1: 44-53 us against 42 us; at M = 16: 58-92 us against 52 us).

int4 and NF4 (bitsandbytes) put whole nibbles in the words (``gemv_mma_layout._MMA_INT4_BITS`` / ``_MMA_NF4_BITS``):
int4 decodes to ``(MAGIC + q) - (MAGIC + z)``, NF4 to its table level (prmt lookups, see ``_nf4_word``); both
multiply each chunk's mma result by the row's scale (int4 group scale, NF4 fp32 absmax) into the accumulators,
so a chunk must lie in one group / block.

Epilogue as in ``_gemv_w4`` (split-K partials reduced by the last-arriving program, global scale, bias,
activation); the C fragment of lane ``(g, t)`` register ``r`` is output row ``g + 8 (r // 2)`` of the group,
x row ``2 t + r % 2`` (+ 8 for the second n-tile).
"""

import struct

import triton
import triton.language as tl

from ..formats.spec import NF4
from .device import ACT_GATED, gemv_epilogue, one_line

FMT_NVFP4 = tl.constexpr(0)
FMT_MXFP4 = tl.constexpr(1)
FMT_INT4 = tl.constexpr(2)
FMT_NF4 = tl.constexpr(3)

# x: 32 bytes at $8 (16 bf16 of one x row) -> the B fragments of the chunk's 4 mmas: lo = columns 4i, 4i+1,
# hi = columns 4i+2, 4i+3
_X_ASM = tl.constexpr(one_line("""{
ld.global.nc.v4.b32 {$0, $4, $1, $5}, [$8];
ld.global.nc.v4.b32 {$2, $6, $3, $7}, [$8+16];
}"""))

# the 4 words of a chunk ($16..$19), the scale pair, x fragments -> 4 chained mmas into the accumulators
_DECODE_WORD = """
and.b32 r0, {w}, 0x81C081C0;
shl.b32 t, {w}, 3;
and.b32 r1, t, 0x81C081C0;
shl.b32 t, {w}, 6;
and.b32 r2, t, 0x81C081C0;
shr.u32 t, {w}, 4;
and.b32 r3, t, 0x00C000C0;
shr.u32 t, {w}, 5;
and.b32 t, t, 0x01000100;
or.b32 r3, r3, t;
shl.b32 t, {w}, 1;
and.b32 t, t, 0x80008000;
or.b32 r3, r3, t;
mul.rn.bf16x2 r0, r0, sg;
mul.rn.bf16x2 r1, r1, sg8;
mul.rn.bf16x2 r2, r2, sg;
mul.rn.bf16x2 r3, r3, sg8;
"""
_MMA = ("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {{{d0}, {d1}, {d2}, {d3}}}, {{r0, r1, r2, r3}}, "
        "{{{b0}, {b1}}}, {{{d0}, {d1}, {d2}, {d3}}};\n")


def _chunk_operands(nt: int) -> tuple[list[str], list[tuple[list[str], list[str]]]]:
    """Operand names shared by the chunk asm of every format: after the 4 nt outputs, the lane's 4 words, then
    x-lo / x-hi (4 + 4) of each n-tile."""
    base = 4 * nt
    words = [f"${base + i}" for i in range(4)]
    xs = [([f"${base + 4 + 8 * n + i}" for i in range(4)], [f"${base + 8 + 8 * n + i}" for i in range(4)])
          for n in range(nt)]
    return words, xs


def _mma_asm(nt: int) -> str:
    """Operands: outputs $0..$3 (n-tile 0), $4..$7 (n-tile 1 if nt == 2); inputs, after the outputs: 4 words,
    4 x-lo, 4 x-hi (n-tile 0), [4 x-lo, 4 x-hi (n-tile 1)], 4 scale-pair copies (bf16x2 sg | sg8 packed as
    two int32 operands: sg, sg8), 4 (or 8) accumulators."""
    n_out = 4 * nt
    words, xs = _chunk_operands(nt)
    s_base = n_out + 4 + 8 * nt
    sg, sg8 = f"${s_base}", f"${s_base + 4}"
    acc_in = [f"${s_base + 8 + j}" for j in range(n_out)]
    lines = ["{", ".reg .b32 r0, r1, r2, r3, t, sg, sg8;", f"mov.b32 sg, {sg};", f"mov.b32 sg8, {sg8};"]
    lines += [f"mov.b32 ${j}, {acc_in[j]};" for j in range(n_out)]
    for i in range(4):
        lines.append(_DECODE_WORD.format(w=words[i]))
        for n in range(nt):
            d = [f"${4 * n + j}" for j in range(4)]
            lines.append(_MMA.format(d0=d[0], d1=d[1], d2=d[2], d3=d[3], b0=xs[n][0][i], b1=xs[n][1][i]))
    lines.append("}")
    return "\n".join(lines)


# int4 (AWQ/GPTQ): nibble q of element (row g + 8 h, column 4 i + c) sits at bit 4 (h + 2 (c // 2)) + 16 (c % 2)
# of the lane's word, so A register j is ((w >> 4 j) & 0x000F000F) | MAGIC = (MAGIC + q) in both halves, exact
# (bf16 0x4300 = 128, fp16 0x6400 = 1024, one unit per integer step there); minus (MAGIC + z) it is q - z
_INT4_WORD = """
and.b32 r0, {w}, 0x000F000F;
or.b32 r0, r0, {magic};
sub.{ty}x2 r0, r0, zg;
shr.u32 t, {w}, 4;
and.b32 r1, t, 0x000F000F;
or.b32 r1, r1, {magic};
sub.{ty}x2 r1, r1, zg8;
shr.u32 t, {w}, 8;
and.b32 r2, t, 0x000F000F;
or.b32 r2, r2, {magic};
sub.{ty}x2 r2, r2, zg;
shr.u32 t, {w}, 12;
and.b32 r3, t, 0x000F000F;
or.b32 r3, r3, {magic};
sub.{ty}x2 r3, r3, zg8;
"""


def _post_scaled_asm(nt: int, fp16: bool, regs: str, prologue, decode_word, extra_inputs: int = 0) -> str:
    """The chunk asm of the formats whose scale goes after the mmas (int4, NF4). Operands: outputs
    $0..$(4 nt - 1) (accumulators of n-tile 0, then 1); inputs: 4 words, x-lo / x-hi of each n-tile (4 + 4
    each), 4 copies of each of the two per-lane pairs, the 4 nt accumulators, then ``extra_inputs`` more.
    ``prologue(pair_a, pair_b, extra)`` sets the f32 registers sg / sg8 (the scales of rows g and g + 8) from
    the pairs; ``decode_word(word, extra)`` writes the A registers r0..r3. The chunk's 4 mmas go into fresh
    registers, which are then scaled per row (rows g and g + 8 of the lane's C fragment: registers 0, 1 and
    2, 3) into the accumulators: ``acc += s * sum_k a x`` with the a x products exact."""
    ty = "f16" if fp16 else "bf16"
    n_out = 4 * nt
    base = n_out
    words, xs = _chunk_operands(nt)
    pair_a = f"${base + 4 + 8 * nt}"
    pair_b = f"${base + 8 + 8 * nt}"
    acc_in = [f"${base + 12 + 8 * nt + j}" for j in range(n_out)]
    extra = [f"${base + 12 + 8 * nt + n_out + 4 * j}" for j in range(extra_inputs)]  # first of each 4 copies
    tmp = [f"c{j}" for j in range(n_out)]
    mma = f"mma.sync.aligned.m16n8k16.row.col.f32.{ty}.{ty}.f32 "
    lines = ["{", regs, ".reg .f32 sg, sg8, " + ", ".join(tmp) + ";"] + prologue(pair_a, pair_b, extra)
    lines += [f"mov.f32 {c}, 0f00000000;" for c in tmp]
    for i in range(4):
        lines.append(decode_word(words[i], extra))
        for n in range(nt):
            d = tmp[4 * n:4 * n + 4]
            lines.append(mma + f"{{{d[0]}, {d[1]}, {d[2]}, {d[3]}}}, {{r0, r1, r2, r3}}, "
                         f"{{{xs[n][0][i]}, {xs[n][1][i]}}}, {{{d[0]}, {d[1]}, {d[2]}, {d[3]}}};")
    for j in range(n_out):
        lines.append(f"fma.rn.f32 ${j}, {tmp[j]}, {'sg' if j % 4 < 2 else 'sg8'}, {acc_in[j]};")
    lines.append("}")
    return "\n".join(lines)


def _mma_int4_asm(nt: int, fp16: bool) -> str:
    """int4: the pairs are the fp16 scale pair (s_g | s_g8 << 16) and the zero pair (z_g | z_g8 << 16);
    ``acc += s * sum_k (q - z) x``."""
    ty = "f16" if fp16 else "bf16"
    magic = "0x64006400" if fp16 else "0x43004300"

    def prologue(s_op, z_op, _):
        return [f"mov.b32 {{h0, h1}}, {s_op};", "cvt.f32.f16 sg, h0;", "cvt.f32.f16 sg8, h1;",
                f"prmt.b32 zg, {z_op}, 0, 0x1010;", f"prmt.b32 zg8, {z_op}, 0, 0x3232;",
                f"or.b32 zg, zg, {magic};", f"or.b32 zg8, zg8, {magic};"]

    return _post_scaled_asm(nt, fp16, ".reg .b32 r0, r1, r2, r3, t, zg, zg8;\n.reg .b16 h0, h1;", prologue,
                            lambda w, _: _INT4_WORD.format(w=w, magic=magic, ty=ty))


# NF4 (bitsandbytes): a 16-entry table lookup per nibble with prmt. The table of the 16 levels (rounded to the
# mma operand type: bf16 for bf16 x, fp16 for fp16 x) is split into its low bytes and its high bytes, 4
# registers each; a prmt indexes 8 bytes with the 3 low bits of a nibble, so each byte comes from two prmts
# (levels 0-7, levels 8-15) and a select on the nibble's bit 3 (a byte mask made by prmt's sign-replicate
# mode). Nibble placement (see gemv_mma_layout._MMA_NF4_BITS): the low half-word holds the nibbles of A registers 0
# and 1 (row g, then row g + 8, columns c = 0, 1), the high half-word those of registers 2 and 3 (c = 2, 3).
def _level_bits(fp16: bool) -> list:
    out = []
    for v in NF4.levels:
        if fp16:
            out.append(struct.unpack("<H", struct.pack("<e", v))[0])
        else:
            b = struct.unpack("<I", struct.pack("<f", v))[0]
            out.append(((b + 0x7FFF + ((b >> 16) & 1)) >> 16) & 0xFFFF)   # round to nearest even
    return out


def nf4_table_words(fp16: bool) -> tuple:
    """(low-byte words, high-byte words): 4 int32 each, byte j of word i = byte of level 4 i + j."""
    bits = _level_bits(fp16)
    lo = tuple(sum((bits[4 * i + j] & 0xFF) << (8 * j) for j in range(4)) for i in range(4))
    hi = tuple(sum((bits[4 * i + j] >> 8) << (8 * j) for j in range(4)) for i in range(4))
    return lo, hi


# selectors (see the asm): the bit-3 byte masks of nibbles 0-3 and 4-7 (sign-replicate of bytes of w << 4 and
# w), and the two byte interleaves of (low bytes, high bytes) into two 16-bit pairs
NF4_MASK_LO, NF4_MASK_HI, NF4_PAIR_01, NF4_PAIR_23 = 0xD9C8, 0xFBEA, 0x5140, 0x7362


def _nf4_word(w: str, lo: list, hi: list) -> str:
    """The 4 A registers r0..r3 of word ``w`` (21 instructions); lo / hi: the operands holding the table words
    (kernel arguments, see ``gemv_mma_kernel``: as immediates, ptxas re-materializes them at every prmt)."""
    lines = [f"and.b32 s, {w}, 0x77777777;", f"shl.b32 u, {w}, 4;",
             f"prmt.b32 m0, u, {w}, {NF4_MASK_LO:#x};", f"prmt.b32 m1, u, {w}, {NF4_MASK_HI:#x};"]
    for half, (ra, rb, m) in enumerate((("r0", "r1", "m0"), ("r2", "r3", "m1"))):
        if half:
            lines.append("shr.u32 s, s, 16;")
        lines += [f"prmt.b32 a, {lo[0]}, {lo[1]}, s;", f"prmt.b32 b, {lo[2]}, {lo[3]}, s;",
                  f"lop3.b32 xl, a, b, {m}, 0xD8;",
                  f"prmt.b32 a, {hi[0]}, {hi[1]}, s;", f"prmt.b32 b, {hi[2]}, {hi[3]}, s;",
                  f"lop3.b32 xh, a, b, {m}, 0xD8;",
                  f"prmt.b32 {ra}, xl, xh, {NF4_PAIR_01:#x};", f"prmt.b32 {rb}, xl, xh, {NF4_PAIR_23:#x};"]
    return "\n".join(lines)


def _mma_nf4_asm(nt: int, fp16: bool) -> str:
    """NF4: the pairs are the fp32 absmax of rows g and g + 8 in the chunk's block (as int32 bits), then come
    the 8 table words (:func:`nf4_table_words`: low bytes, high bytes; 4 copies each, pack = 4);
    ``acc += absmax * sum_k level(q) x``."""
    return _post_scaled_asm(
        nt, fp16, ".reg .b32 r0, r1, r2, r3, s, u, m0, m1, a, b, xl, xh;",
        lambda sg, sg8, _: [f"mov.b32 sg, {sg};", f"mov.b32 sg8, {sg8};"],
        lambda w, tab: _nf4_word(w, tab[:4], tab[4:]), extra_inputs=8)


def _chunk_constraints(nt: int, nf4: bool) -> str:
    """The chunk asm's constraints (pack = 4): 4 nt outputs; 4 words, 8 x registers per n-tile, 4 copies of each
    of the two pairs, 4 nt accumulators; NF4: 4 copies of each of the 8 table words."""
    return ",".join(["=f"] * (4 * nt) + ["r"] * (4 + 8 * nt + 8) + ["f"] * (4 * nt) + ["r"] * (32 if nf4 else 0))


_PAIR_ASM = tl.constexpr("ld.global.nc.v2.b32 {$0, $1}, [$2];")

# NVFP4 scale pair (u16: row g E4M3 in the low byte, row g + 8 in the high byte) -> bf16x2 (s, s) * 2^63 each
_SCALE_E4M3_ASM = tl.constexpr(one_line("""{
.reg .b16 h0, h1;
.reg .b32 t;
.reg .f32 f0, f1;
cvt.u16.u32 h0, $2;
cvt.rn.f16x2.e4m3x2 t, h0;
mov.b32 {h0, h1}, t;
cvt.f32.f16 f0, h0;
cvt.f32.f16 f1, h1;
mul.f32 f0, f0, 0f5F000000;
mul.f32 f1, f1, 0f5F000000;
cvt.rn.bf16x2.f32 $0, f0, f0;
cvt.rn.bf16x2.f32 $1, f1, f1;
}"""))
_U16_ASM = tl.constexpr("ld.global.nc.u16 $0, [$1];")


@triton.jit
def _scale_pair(raw, FMT: tl.constexpr):
    """(sg, sg8): bf16x2 (s * 2^63, s * 2^63) of the lane's two rows."""
    if FMT == FMT_NVFP4:
        sg, sg8 = tl.inline_asm_elementwise(_SCALE_E4M3_ASM, "=r,=r,r", [raw], dtype=(tl.int32, tl.int32),
                                            is_pure=True, pack=1)
    else:
        # E8M0 code e: 2^(e - 127) * 2^63 as bf16 = exponent field e + 63 (the launcher checks 1 <= e + 63 <= 254)
        lo = ((raw & 0xFF) + 63) << 7
        hi = (((raw >> 8) & 0xFF) + 63) << 7
        sg = lo | (lo << 16)
        sg8 = hi | (hi << 16)
    return sg, sg8


@triton.jit
def _load_x_frags(ptrs):
    """(lo, hi) B fragments of 32 bytes of one x row at each pointer (see _X_ASM)."""
    return tl.inline_asm_elementwise(_X_ASM, "=r,=r,=r,=r,=r,=r,=r,=r,l,l,l,l", [ptrs], dtype=(tl.int32, tl.int32),
                                     is_pure=True, pack=4)


@triton.jit
def _load_scale_raw(ptrs):
    return tl.inline_asm_elementwise(_U16_ASM, "=r,l", [ptrs], dtype=tl.int32, is_pure=True, pack=1)


@triton.jit
def _load_pair(ptrs):
    """(scale pair, zero pair) int32 of an int4 lane's rows in one group."""
    return tl.inline_asm_elementwise(_PAIR_ASM, "=r,=r,l", [ptrs], dtype=(tl.int32, tl.int32), is_pure=True,
                                     pack=1)


# the chunk asm of every (format, x dtype, n-tile count) and its constraints, indexed by _mma_chunk (compile-time
# tuples: Triton picks the entry when a kernel variant compiles)
_CHUNK_ASM = tl.constexpr(tuple(
    one_line(_mma_int4_asm(nt, xf16) if fmt == FMT_INT4.value else _mma_nf4_asm(nt, xf16) if fmt == FMT_NF4.value
             else _mma_asm(nt))
    for fmt in range(4) for xf16 in (False, True) for nt in range(1, 5)))
_CHUNK_CONSTRAINTS = tl.constexpr(tuple(_chunk_constraints(nt, nf4) for nf4 in (False, True) for nt in range(1, 5)))


@triton.jit
def _mma_chunk(words, xf, raw, zraw, acc, tab, FMT: tl.constexpr, NT: tl.constexpr, XF16: tl.constexpr):
    """The chunk's 4 mmas per n-tile into the accumulators (a tuple of 4, the first NT used). ``xf``: the
    (x-lo, x-hi) fragments of the 4 n-tiles, flat. The FP4, int4 and NF4 asm take the same operand list: after
    the words and x fragments, two per-lane int32 pairs (FP4: the bf16x2 scales of rows g and g + 8; int4: the
    fp16 scale pair and the zero pair; NF4: the fp32 absmax of rows g and g + 8), then (NF4) the table words."""
    if FMT == FMT_INT4 or FMT == FMT_NF4:
        a, b = raw, zraw
    else:
        a, b = _scale_pair(raw, FMT)
    ASM: tl.constexpr = _CHUNK_ASM[(FMT * 2 + XF16) * 4 + NT - 1]
    CONS: tl.constexpr = _CHUNK_CONSTRAINTS[(FMT == FMT_NF4) * 4 + NT - 1]
    if FMT == FMT_NF4:
        t0, t1, t2, t3, t4, t5, t6, t7 = tab
        if NT == 1:
            acc0 = tl.inline_asm_elementwise(
                ASM, CONS, [words, xf[0], xf[1], a, b, acc[0], t0, t1, t2, t3, t4, t5, t6, t7],
                dtype=tl.float32, is_pure=True, pack=4)
            out = (acc0, acc[1], acc[2], acc[3])
        elif NT == 2:
            o0, o1 = tl.inline_asm_elementwise(
                ASM, CONS, [words, xf[0], xf[1], xf[2], xf[3], a, b, acc[0], acc[1], t0, t1, t2, t3, t4, t5, t6, t7],
                dtype=(tl.float32, tl.float32), is_pure=True, pack=4)
            out = (o0, o1, acc[2], acc[3])
        elif NT == 3:
            o0, o1, o2 = tl.inline_asm_elementwise(
                ASM, CONS, [words, xf[0], xf[1], xf[2], xf[3], xf[4], xf[5], a, b, acc[0], acc[1], acc[2],
                            t0, t1, t2, t3, t4, t5, t6, t7],
                dtype=(tl.float32, tl.float32, tl.float32), is_pure=True, pack=4)
            out = (o0, o1, o2, acc[3])
        else:
            o0, o1, o2, o3 = tl.inline_asm_elementwise(
                ASM, CONS, [words, xf[0], xf[1], xf[2], xf[3], xf[4], xf[5], xf[6], xf[7], a, b,
                            acc[0], acc[1], acc[2], acc[3], t0, t1, t2, t3, t4, t5, t6, t7],
                dtype=(tl.float32, tl.float32, tl.float32, tl.float32), is_pure=True, pack=4)
            out = (o0, o1, o2, o3)
    else:
        if NT == 1:
            acc0 = tl.inline_asm_elementwise(ASM, CONS, [words, xf[0], xf[1], a, b, acc[0]],
                                             dtype=tl.float32, is_pure=True, pack=4)
            out = (acc0, acc[1], acc[2], acc[3])
        elif NT == 2:
            o0, o1 = tl.inline_asm_elementwise(
                ASM, CONS, [words, xf[0], xf[1], xf[2], xf[3], a, b, acc[0], acc[1]],
                dtype=(tl.float32, tl.float32), is_pure=True, pack=4)
            out = (o0, o1, acc[2], acc[3])
        elif NT == 3:
            o0, o1, o2 = tl.inline_asm_elementwise(
                ASM, CONS, [words, xf[0], xf[1], xf[2], xf[3], xf[4], xf[5], a, b, acc[0], acc[1], acc[2]],
                dtype=(tl.float32, tl.float32, tl.float32), is_pure=True, pack=4)
            out = (o0, o1, o2, acc[3])
        else:
            o0, o1, o2, o3 = tl.inline_asm_elementwise(
                ASM, CONS, [words, xf[0], xf[1], xf[2], xf[3], xf[4], xf[5], xf[6], xf[7], a, b,
                            acc[0], acc[1], acc[2], acc[3]],
                dtype=(tl.float32, tl.float32, tl.float32, tl.float32), is_pure=True, pack=4)
            out = (o0, o1, o2, o3)
    return out


@triton.jit
def _fetch(w_tile, s_tile, xr, kq, jj, FMT: tl.constexpr, SPC: tl.constexpr, CPG: tl.constexpr,
           NT: tl.constexpr):
    """Everything one iteration at chunk kq consumes: words, scale pairs (int4: and zero pairs; NF4: the absmax
    of the lane's two rows; else the second is a copy), the x fragments of the 4 n-tiles (x-lo, x-hi each; 0
    for an absent n-tile). ``xr``: the x row pointers of the 4 n-tiles."""
    words = tl.load(w_tile + kq * 128)
    if FMT == FMT_INT4 or FMT == FMT_NF4:
        raw, zraw = _load_pair(s_tile + ((kq + jj) // CPG) * 16)
    else:
        raw = _load_scale_raw(s_tile + kq * SPC * 8)
        zraw = raw
    xlo0, xhi0 = _load_x_frags(xr[0] + kq * 64)
    xlo1 = 0
    xhi1 = 0
    xlo2 = 0
    xhi2 = 0
    xlo3 = 0
    xhi3 = 0
    if NT >= 2:
        xlo1, xhi1 = _load_x_frags(xr[1] + kq * 64)
    if NT >= 3:
        xlo2, xhi2 = _load_x_frags(xr[2] + kq * 64)
    if NT >= 4:
        xlo3, xhi3 = _load_x_frags(xr[3] + kq * 64)
    return words, raw, zraw, (xlo0, xhi0, xlo1, xhi1, xlo2, xhi2, xlo3, xhi3)


@triton.jit
def gemv_mma_kernel(
    x_ptr, w_ptr, s_ptr, gs_ptr, rs_ptr, bias_ptr, out_ptr, ws_ptr, cnt_ptr,
    M, N, K, KQ, T0, T1, T2, T3, T4, T5, T6, T7,
    FMT: tl.constexpr, RG: tl.constexpr, J: tl.constexpr, IPS: tl.constexpr, NT: tl.constexpr,
    SPLIT: tl.constexpr, HAS_BIAS: tl.constexpr, ACT: tl.constexpr,
    GS_KIND: tl.constexpr, ROW_SCALE: tl.constexpr, POST: tl.constexpr,
    CPG: tl.constexpr = 1, XF16: tl.constexpr = False, MB: tl.constexpr = 1,
):
    """out[m, n] = act(POST * sum_k x[m, k] W'[n, k] (/ or *) gs + bias[n]) for m < M <= 8 NT MB (NT <= 4).

    w_ptr: int32 [N16, KQ, 128] (= [N16, KQ, 32 lanes, 4]) (N16 = ceil(N / 16) row groups, KQ = K / 64
    chunks); s_ptr: uint16 [N16, K / SB, 8] scale pairs (SB = 16 for NVFP4: one per lane t; 32 for MXFP4:
    lanes t, t + 1 share); int4: int32 [N16, K / G, 8, 2] (fp16 scale pair, zero pair) per group of
    G = 64 CPG columns; NF4: the same shape, (fp32 absmax of row g, of row g + 8) per block of G columns;
    x bf16 or (XF16, int4 and NF4) fp16; T0..T7: NF4's table words (``nf4_table_words``), unused otherwise.
    A program owns RG row groups and IPS iterations of J chunks starting at chunk
    pid_k * IPS * J; the tile is ``[J, RG, 128]`` and the warps split its J chunks, so a warp loads the x
    fragments of its chunk once and uses them for its RG row groups.
    NT n-tiles of 8 x rows share each decoded weight register (one decode, NT mmas). MB > 1: blocks of 8 NT
    x rows, each in programs of its own; the MB programs of one weight tile are consecutive in dim 0, so they
    run together and all but the first read the tile from L2 (and decode it again).
    """
    if MB == 1:
        pid_n = tl.program_id(0)
    else:
        pid_n = tl.program_id(0) // MB
        pid_m = tl.program_id(0) % MB
        m_base = pid_m * (8 * NT)
        x_ptr += m_base.to(tl.int64) * K
        if ACT >= ACT_GATED:
            out_ptr += m_base.to(tl.int64) * (N // 2)
        else:
            out_ptr += m_base.to(tl.int64) * N
        if ROW_SCALE == 2:
            rs_ptr += m_base
        # this block's split-K partials and arrival counters follow the other blocks'
        ws_ptr += pid_m.to(tl.int64) * (SPLIT * 8 * NT) * N
        cnt_ptr += pid_m * tl.cdiv(tl.cdiv(N, 16), RG) * NT
        M = M - m_base
    pid_k = tl.program_id(1)
    rg = pid_n * RG + tl.arange(0, RG)
    n16 = tl.cdiv(N, 16)
    rg_c = tl.minimum(rg, n16 - 1)
    jj = tl.arange(0, J)[:, None, None]
    rr = rg_c.to(tl.int64)[None, :, None]
    # dim 2 is (lane, word) = 4 lane + i, contiguous in memory, so the load's layout gives each lane its own
    # 4 words (16 bytes) in registers: the mma asm (pack=4) relies on it
    d = tl.arange(0, 128)[None, None, :]
    lane = d // 4
    g = lane // 4
    t = lane % 4
    w_tile = w_ptr + (rr * KQ + jj) * 128 + d                                          # [J, RG, 128]
    if FMT == FMT_NVFP4:
        SPC: tl.constexpr = 4          # scale blocks per chunk
        s_tile = s_ptr + (rr * (KQ * SPC) + jj * 4 + t) * 8 + g
    elif FMT == FMT_MXFP4:
        SPC: tl.constexpr = 2
        s_tile = s_ptr + (rr * (KQ * SPC) + jj * 2 + t // 2) * 8 + g
    else:
        # int4 / NF4: the group (NF4 block) of chunk kq + jj is (kq + jj) // CPG
        SPC: tl.constexpr = 0
        s_tile = s_ptr + rr * ((KQ // CPG) * 16) + g * 2
    # x rows of the two n-tiles (a row past M - 1 re-reads the last row; its output is masked); the 4
    # pointers of a lane's pack are equal (the asm reads 32 bytes from the first)
    x_col = jj * 64 + t * 16                                                          # [J, 1, 128]
    xr = (x_ptr + (tl.minimum(g, M - 1).to(tl.int64) * K + x_col),
          x_ptr + (tl.minimum(g + 8, M - 1).to(tl.int64) * K + x_col),
          x_ptr + (tl.minimum(g + 16, M - 1).to(tl.int64) * K + x_col),
          x_ptr + (tl.minimum(g + 24, M - 1).to(tl.int64) * K + x_col))

    # the accumulators of the 4 n-tiles; an absent n-tile's stays a scalar, never touched
    acc0 = tl.zeros((J, RG, 128), dtype=tl.float32)
    acc1 = 0.0
    acc2 = 0.0
    acc3 = 0.0
    if NT >= 2:
        acc1 = tl.zeros((J, RG, 128), dtype=tl.float32)
    if NT >= 3:
        acc2 = tl.zeros((J, RG, 128), dtype=tl.float32)
    if NT >= 4:
        acc3 = tl.zeros((J, RG, 128), dtype=tl.float32)
    acc = (acc0, acc1, acc2, acc3)
    kq_start = pid_k * (IPS * J)
    # software pipeline in registers: what iteration i + 1 consumes is loaded during iteration i (the
    # prefetch after the last iteration re-reads the row's last chunks)
    # NF4: the table words are kernel arguments; ptxas keeps them in registers across the loop (loaded from
    # memory as warp-uniform values they went to uniform registers, which prmt cannot read, and were copied back
    # at every use: 34 against 28 instructions per word at M <= 8)
    tab = (T0, T1, T2, T3, T4, T5, T6, T7)
    w_a, r_a, z_a, xf_a = _fetch(w_tile, s_tile, xr, kq_start, jj, FMT, SPC, CPG, NT)
    for it in tl.range(0, IPS, num_stages=1):
        kq_n = tl.minimum(kq_start + (it + 1) * J, KQ - J)
        w_n, r_n, z_n, xf_n = _fetch(w_tile, s_tile, xr, kq_n, jj, FMT, SPC, CPG, NT)
        acc = _mma_chunk(w_a, xf_a, r_a, z_a, acc, tab, FMT, NT, XF16)
        w_a, r_a, z_a, xf_a = w_n, r_n, z_n, xf_n

    # C fragment register i of lane (g, t): row g + 8 (i // 2) of the group, x row 2 t + i % 2
    d2 = tl.arange(0, 128)[None, :]
    lane2 = d2 // 4
    rows = rg[:, None] * 16 + lane2 // 4 + 8 * ((d2 % 4) // 2)                        # [RG, 128]
    m0 = 2 * (lane2 % 4) + (d2 % 2)
    # split-K: workspace [SPLIT, 8 NT, N], one counter per (N tile, n-tile)
    gemv_epilogue(tl.sum(acc[0], axis=0), cnt_ptr + pid_n * NT, pid_k, m0, rows, M, N, gs_ptr, rs_ptr, bias_ptr,
                  out_ptr, ws_ptr, 8 * NT, SPLIT, POST, GS_KIND, ROW_SCALE, HAS_BIAS, ACT, 2)
    if NT >= 2:
        gemv_epilogue(tl.sum(acc[1], axis=0), cnt_ptr + pid_n * NT + 1, pid_k, m0 + 8, rows, M, N, gs_ptr, rs_ptr,
                      bias_ptr, out_ptr, ws_ptr, 8 * NT, SPLIT, POST, GS_KIND, ROW_SCALE, HAS_BIAS, ACT, 2)
    if NT >= 3:
        gemv_epilogue(tl.sum(acc[2], axis=0), cnt_ptr + pid_n * NT + 2, pid_k, m0 + 16, rows, M, N, gs_ptr,
                      rs_ptr, bias_ptr, out_ptr, ws_ptr, 8 * NT, SPLIT, POST, GS_KIND, ROW_SCALE, HAS_BIAS, ACT, 2)
    if NT >= 4:
        gemv_epilogue(tl.sum(acc[3], axis=0), cnt_ptr + pid_n * NT + 3, pid_k, m0 + 24, rows, M, N, gs_ptr,
                      rs_ptr, bias_ptr, out_ptr, ws_ptr, 8 * NT, SPLIT, POST, GS_KIND, ROW_SCALE, HAS_BIAS, ACT, 2)
