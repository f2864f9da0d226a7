"""Triton kernels of the weight-only 4-bit GEMV (decode regime, M <= 16): ``out = act(x @ W.T + bias)``.

The weight arrives as int32 words ``[N, K/8]`` (8 consecutive K elements per word, see
``gemv_prepack.prepare_w4``) plus per-block scales. A program owns ``BN`` output rows and a range of K
iterations (split-K). ``tl.range(num_stages=STAGES)`` pipelines the word tile through shared memory with
cp.async, so ``STAGES - 1`` tiles are in flight while one is decoded. A chunk (16 bytes, 32 elements) never
straddles two scale blocks; the scales are loaded one iteration ahead of their use (raw bytes into
registers, decoded at use), so their HBM latency is not exposed.

Layouts are steered, not declared: every load that must not impose its own register layout (x, scales,
tables) is an inline-asm ``ld.global.nc``, which takes the layout of its consumers; only the word tile is a
``tl.load`` (so that the pipeliner turns it into 16-byte cp.async). The sm_90 SASS of the FMA loop at M=1
is about 4.5 instructions per weight (FP4 formats, int4; nf4 more: one table load per weight); the tl.dot
loop about 6.5, whatever M.

Two kernels share the decode and the epilogue (the tensor-core GEMV in ``_gemv_mma`` shares the epilogue):

- ``gemv_w4_fma_kernel`` (small M): CUDA-core FMAs in fp32, ``MP`` (= M, 1..4) rows of x per program, on a
  row-major ``[BN, 4 C]`` word tile (lanes along the chunks of a row; each thread reuses its x values for
  all its rows). The 8 elements of a word are decoded by one inline-asm block to 8 fp32 values,
  multiplied by the 8 x values of the matching 16-byte x load and scaled once per word.
- ``gemv_w4_dot_kernel`` (larger M): a ``[C, BN, 4]`` tile decoded and scaled, cast to x's dtype and fed
  to ``tl.dot`` (wgmma on Hopper) against a ``[32C, 16]`` x tile; accumulation in fp32.

Decode (``ON_GPU``; the interpreter runs the plain-Triton equivalents, same values):

- FP4 (E2M1): a nibble ``s e1 e0 m`` becomes the E4M3 byte ``s 000 e1e0 m00``, whose value is exactly
  ``e2m1 * 2^-6`` (E2M1's subnormal 0.5 lands on E4M3's subnormal range), then ``cvt.rn.f16x2.e4m3x2``
  converts two at a time; the 2^6 is applied once in the epilogue.
- NF4: 16-entry fp32 table (64 bytes, 64-byte aligned) gathered with ``ld.global.nc``.
- INT4 (AWQ): ``lop3(w >> s, 0x000F000F, 0x64006400)`` gives the fp16 pair ``1024 + q``; subtracting the
  fp16 pair ``1024 + z`` gives ``q - z`` exactly.

Split-K (``SPLIT > 1``): every program writes its fp32 partial ``[MP, BN]`` to a workspace, then bumps a
per-N-tile counter (acq_rel, gpu scope); the program that arrives last sums the partials (L1-bypassing
loads), resets the counter to 0 for the next launch and runs the epilogue. One launch, no memset.

Epilogue: ``y = acc * POST [/ S or * p]``, ``+ bias``, activation (erf GELU, tanh GELU, SiLU; no
approximate division), cast to the output dtype.
"""

import triton
import triton.language as tl

from .device import decode_minifloat, gemv_epilogue, one_line


# FMT
FMT_NVFP4 = tl.constexpr(0)
FMT_MXFP4 = tl.constexpr(1)
FMT_FP4_B32 = tl.constexpr(2)
FMT_NF4 = tl.constexpr(3)
FMT_NF4_DQ = tl.constexpr(4)
FMT_AWQ = tl.constexpr(5)

# table layout in tab_ptr (fp32): NF4 levels at 0..15, bitsandbytes dynamic map at 16..271, nested offset at 272
TAB_DMAP = tl.constexpr(16)
TAB_OFFSET = tl.constexpr(272)

_FP4_ASM = tl.constexpr(one_line("""{
.reg .b32 e, o, t;
.reg .b16 h0, h1, h2, h3, q0, q1, q2, q3, q4, q5, q6, q7;
.reg .b32 p0, p1, p2, p3;
shl.b32 t, $8, 4;
and.b32 t, t, 0x80808080;
shl.b32 e, $8, 2;
and.b32 e, e, 0x1C1C1C1C;
or.b32 e, e, t;
shr.u32 o, $8, 2;
and.b32 o, o, 0x1C1C1C1C;
and.b32 t, $8, 0x80808080;
or.b32 o, o, t;
mov.b32 {h0, h1}, e;
mov.b32 {h2, h3}, o;
cvt.rn.f16x2.e4m3x2 p0, h0;
cvt.rn.f16x2.e4m3x2 p1, h1;
cvt.rn.f16x2.e4m3x2 p2, h2;
cvt.rn.f16x2.e4m3x2 p3, h3;
mov.b32 {q0, q1}, p0;
mov.b32 {q2, q3}, p1;
mov.b32 {q4, q5}, p2;
mov.b32 {q6, q7}, p3;
cvt.f32.f16 $0, q0;
cvt.f32.f16 $2, q1;
cvt.f32.f16 $4, q2;
cvt.f32.f16 $6, q3;
cvt.f32.f16 $1, q4;
cvt.f32.f16 $3, q5;
cvt.f32.f16 $5, q6;
cvt.f32.f16 $7, q7;
}"""))

# element j of the word is nibble j ^ 1 (bitsandbytes: element 2i in the high nibble); the table pointer's
# low 32 bits are ORed with 4 * code (the table is 64-byte aligned, so OR is addition)
_NF4_ASM = tl.constexpr(one_line("""{
.reg .b32 lo, hi, a;
.reg .b64 p;
mov.b64 {lo, hi}, $9;
shr.u32 a, $8, 2;
lop3.b32 a, a, 0x3C, lo, 0xEA;
mov.b64 p, {a, hi};
ld.global.nc.f32 $0, [p];
shl.b32 a, $8, 2;
lop3.b32 a, a, 0x3C, lo, 0xEA;
mov.b64 p, {a, hi};
ld.global.nc.f32 $1, [p];
shr.u32 a, $8, 10;
lop3.b32 a, a, 0x3C, lo, 0xEA;
mov.b64 p, {a, hi};
ld.global.nc.f32 $2, [p];
shr.u32 a, $8, 6;
lop3.b32 a, a, 0x3C, lo, 0xEA;
mov.b64 p, {a, hi};
ld.global.nc.f32 $3, [p];
shr.u32 a, $8, 18;
lop3.b32 a, a, 0x3C, lo, 0xEA;
mov.b64 p, {a, hi};
ld.global.nc.f32 $4, [p];
shr.u32 a, $8, 14;
lop3.b32 a, a, 0x3C, lo, 0xEA;
mov.b64 p, {a, hi};
ld.global.nc.f32 $5, [p];
shr.u32 a, $8, 26;
lop3.b32 a, a, 0x3C, lo, 0xEA;
mov.b64 p, {a, hi};
ld.global.nc.f32 $6, [p];
shr.u32 a, $8, 22;
lop3.b32 a, a, 0x3C, lo, 0xEA;
mov.b64 p, {a, hi};
ld.global.nc.f32 $7, [p];
}"""))

# $8: word (nibble j = element j), $9: fp16 pair (1024 + z, 1024 + z); outputs q_j - z as fp32
_AWQ_ASM = tl.constexpr(one_line("""{
.reg .b32 t0, t1, t2, t3, u;
.reg .b16 a, b;
lop3.b32 t0, $8, 0x000F000F, 0x64006400, 0xEA;
shr.u32 u, $8, 4;
lop3.b32 t1, u, 0x000F000F, 0x64006400, 0xEA;
shr.u32 u, $8, 8;
lop3.b32 t2, u, 0x000F000F, 0x64006400, 0xEA;
shr.u32 u, $8, 12;
lop3.b32 t3, u, 0x000F000F, 0x64006400, 0xEA;
sub.f16x2 t0, t0, $9;
sub.f16x2 t1, t1, $9;
sub.f16x2 t2, t2, $9;
sub.f16x2 t3, t3, $9;
mov.b32 {a, b}, t0;
cvt.f32.f16 $0, a;
cvt.f32.f16 $4, b;
mov.b32 {a, b}, t1;
cvt.f32.f16 $1, a;
cvt.f32.f16 $5, b;
mov.b32 {a, b}, t2;
cvt.f32.f16 $2, a;
cvt.f32.f16 $6, b;
mov.b32 {a, b}, t3;
cvt.f32.f16 $3, a;
cvt.f32.f16 $7, b;
}"""))

# 16 bytes of x (8 bf16 or 8 fp16) -> 8 fp32
_X_BF16_ASM = tl.constexpr(one_line("""{
.reg .b32 a, b, c, d;
ld.global.nc.v4.b32 {a, b, c, d}, [$8];
shl.b32 $0, a, 16;
and.b32 $1, a, 0xFFFF0000;
shl.b32 $2, b, 16;
and.b32 $3, b, 0xFFFF0000;
shl.b32 $4, c, 16;
and.b32 $5, c, 0xFFFF0000;
shl.b32 $6, d, 16;
and.b32 $7, d, 0xFFFF0000;
}"""))
_X_FP16_ASM = tl.constexpr(one_line("""{
.reg .b32 a, b, c, d;
.reg .b16 l, h;
ld.global.nc.v4.b32 {a, b, c, d}, [$8];
mov.b32 {l, h}, a;
cvt.f32.f16 $0, l;
cvt.f32.f16 $1, h;
mov.b32 {l, h}, b;
cvt.f32.f16 $2, l;
cvt.f32.f16 $3, h;
mov.b32 {l, h}, c;
cvt.f32.f16 $4, l;
cvt.f32.f16 $5, h;
mov.b32 {l, h}, d;
cvt.f32.f16 $6, l;
cvt.f32.f16 $7, h;
}"""))

# raw scale loads (read-only path) and the E4M3 byte -> fp32 decode
_U8_ASM = tl.constexpr("ld.global.nc.u8 $0, [$1];")
_B32_ASM = tl.constexpr("ld.global.nc.b32 $0, [$1];")
_F32_ASM = tl.constexpr("ld.global.nc.f32 $0, [$1];")
_E4M3_ASM = tl.constexpr(one_line("""{
.reg .b16 s, lo, hi;
.reg .b32 h;
cvt.u16.u32 s, $1;
cvt.rn.f16x2.e4m3x2 h, s;
mov.b32 {lo, hi}, h;
cvt.f32.f16 $0, lo;
}"""))


@triton.jit
def _decode8(words, zz, tab_ptr, FMT: tl.constexpr, ON_GPU: tl.constexpr):
    """The 8 elements of each int32 word as fp32 (element j of the word is ``8 * word + j`` along K).

    FP4 formats return ``e2m1 * 2^-6``, NF4 the table level, AWQ ``q - z`` (``zz``: per-word fp16 pair
    ``1024 + z`` as int32)."""
    if FMT == FMT_NF4 or FMT == FMT_NF4_DQ:
        if ON_GPU:
            return tl.inline_asm_elementwise(_NF4_ASM, "=f,=f,=f,=f,=f,=f,=f,=f,r,l",
                                             [words, tl.broadcast_to(tab_ptr, words.shape)],
                                             dtype=(tl.float32,) * 8, is_pure=True, pack=1)
        else:
            return (tl.load(tab_ptr + ((words >> 4) & 0xF)), tl.load(tab_ptr + (words & 0xF)),
                    tl.load(tab_ptr + ((words >> 12) & 0xF)), tl.load(tab_ptr + ((words >> 8) & 0xF)),
                    tl.load(tab_ptr + ((words >> 20) & 0xF)), tl.load(tab_ptr + ((words >> 16) & 0xF)),
                    tl.load(tab_ptr + ((words >> 28) & 0xF)), tl.load(tab_ptr + ((words >> 24) & 0xF)))
    elif FMT == FMT_AWQ:
        if ON_GPU:
            return tl.inline_asm_elementwise(_AWQ_ASM, "=f,=f,=f,=f,=f,=f,=f,=f,r,r",
                                             [words, tl.broadcast_to(zz, words.shape)],
                                             dtype=(tl.float32,) * 8, is_pure=True, pack=1)
        else:
            z = ((zz >> 16) & 0x3FF).to(tl.float32)
            return (((words >> 0) & 0xF).to(tl.float32) - z, ((words >> 4) & 0xF).to(tl.float32) - z,
                    ((words >> 8) & 0xF).to(tl.float32) - z, ((words >> 12) & 0xF).to(tl.float32) - z,
                    ((words >> 16) & 0xF).to(tl.float32) - z, ((words >> 20) & 0xF).to(tl.float32) - z,
                    ((words >> 24) & 0xF).to(tl.float32) - z, ((words >> 28) & 0xF).to(tl.float32) - z)
    else:
        if ON_GPU:
            return tl.inline_asm_elementwise(_FP4_ASM, "=f,=f,=f,=f,=f,=f,=f,=f,r", [words],
                                             dtype=(tl.float32,) * 8, is_pure=True, pack=1)
        else:
            S: tl.constexpr = 0.015625
            return (decode_minifloat((words >> 0) & 0xF, 2, 1, 1) * S,
                    decode_minifloat((words >> 4) & 0xF, 2, 1, 1) * S,
                    decode_minifloat((words >> 8) & 0xF, 2, 1, 1) * S,
                    decode_minifloat((words >> 12) & 0xF, 2, 1, 1) * S,
                    decode_minifloat((words >> 16) & 0xF, 2, 1, 1) * S,
                    decode_minifloat((words >> 20) & 0xF, 2, 1, 1) * S,
                    decode_minifloat((words >> 24) & 0xF, 2, 1, 1) * S,
                    decode_minifloat((words >> 28) & 0xF, 2, 1, 1) * S)


@triton.jit
def _load_x8(ptrs, X_FP16: tl.constexpr, ON_GPU: tl.constexpr):
    """8 consecutive x elements starting at each pointer (16-byte aligned) as fp32."""
    if ON_GPU:
        if X_FP16:
            return tl.inline_asm_elementwise(_X_FP16_ASM, "=f,=f,=f,=f,=f,=f,=f,=f,l", [ptrs],
                                             dtype=(tl.float32,) * 8, is_pure=True, pack=1)
        else:
            return tl.inline_asm_elementwise(_X_BF16_ASM, "=f,=f,=f,=f,=f,=f,=f,=f,l", [ptrs],
                                             dtype=(tl.float32,) * 8, is_pure=True, pack=1)
    else:
        if X_FP16:
            return (tl.load(ptrs + 0).to(tl.float32), tl.load(ptrs + 1).to(tl.float32),
                    tl.load(ptrs + 2).to(tl.float32), tl.load(ptrs + 3).to(tl.float32),
                    tl.load(ptrs + 4).to(tl.float32), tl.load(ptrs + 5).to(tl.float32),
                    tl.load(ptrs + 6).to(tl.float32), tl.load(ptrs + 7).to(tl.float32))
        else:
            # bf16 bits -> fp32 (the interpreter has no bf16 arithmetic)
            p = ptrs.to(tl.pointer_type(tl.int16), bitcast=True)
            return ((tl.load(p + 0).to(tl.int32) << 16).to(tl.float32, bitcast=True),
                    (tl.load(p + 1).to(tl.int32) << 16).to(tl.float32, bitcast=True),
                    (tl.load(p + 2).to(tl.int32) << 16).to(tl.float32, bitcast=True),
                    (tl.load(p + 3).to(tl.int32) << 16).to(tl.float32, bitcast=True),
                    (tl.load(p + 4).to(tl.int32) << 16).to(tl.float32, bitcast=True),
                    (tl.load(p + 5).to(tl.int32) << 16).to(tl.float32, bitcast=True),
                    (tl.load(p + 6).to(tl.int32) << 16).to(tl.float32, bitcast=True),
                    (tl.load(p + 7).to(tl.int32) << 16).to(tl.float32, bitcast=True))


@triton.jit
def _load_scales(s_ptr, blk, row_blk, nested_ptr, FMT: tl.constexpr, ON_GPU: tl.constexpr):
    """Raw scale data for scale pointers ``s_ptr + row_blk + blk`` (decoded by :func:`_decode_scales` one
    iteration later, so the load latency is hidden). ``row_blk + blk`` is the flat block index (row *
    blocks_per_row + block); NF4 double quantization needs it for the nested absmax (one per 256 blocks).

    Returns (raw, nested): raw is the int32 code (E4M3 / E8M0 / nf4 dq byte, AWQ scale|zero word) or the
    fp32 scale; nested is the fp32 nested absmax (nf4 dq) or 0.
    """
    ptrs = s_ptr + (row_blk + blk)
    nested = 0.0
    if FMT == FMT_FP4_B32 or FMT == FMT_NF4:
        if ON_GPU:
            raw = tl.inline_asm_elementwise(_F32_ASM, "=f,l", [ptrs], dtype=tl.float32, is_pure=True, pack=1)
        else:
            raw = tl.load(ptrs)
    elif FMT == FMT_AWQ:
        if ON_GPU:
            raw = tl.inline_asm_elementwise(_B32_ASM, "=r,l", [ptrs], dtype=tl.int32, is_pure=True, pack=1)
        else:
            raw = tl.load(ptrs)
    else:
        if ON_GPU:
            raw = tl.inline_asm_elementwise(_U8_ASM, "=r,l", [ptrs], dtype=tl.int32, is_pure=True, pack=1)
        else:
            raw = tl.load(ptrs).to(tl.int32)
        if FMT == FMT_NF4_DQ:
            nptrs = nested_ptr + (row_blk + blk) // 256
            if ON_GPU:
                nested = tl.inline_asm_elementwise(_F32_ASM, "=f,l", [nptrs], dtype=tl.float32, is_pure=True,
                                                   pack=1)
            else:
                nested = tl.load(nptrs)
    return raw, nested


@triton.jit
def _decode_scales(raw, nested, tab_ptr, FMT: tl.constexpr, ON_GPU: tl.constexpr):
    """(fp32 block scale, AWQ zero pair) from :func:`_load_scales`' raw data."""
    zz = 0
    if FMT == FMT_NVFP4:
        if ON_GPU:
            sf = tl.inline_asm_elementwise(_E4M3_ASM, "=f,r", [raw], dtype=tl.float32, is_pure=True, pack=1)
        else:
            sf = decode_minifloat(raw, 4, 3, 7)
    elif FMT == FMT_MXFP4:
        # 2^(c - 127); code 0 is 2^-127 (subnormal), 255 is NaN
        v = (tl.maximum(raw << 23, 0x00400000) | (((raw + 1) & 0x100) << 14)).to(tl.float32, bitcast=True)
        sf = v
    elif FMT == FMT_AWQ:
        # raw = fp16 scale bits | (0x6400 + z) << 16; zz = the fp16 pair (1024 + z, 1024 + z)
        sf = (raw & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
        hi = (raw >> 16) & 0xFFFF
        zz = hi | (hi << 16)
    elif FMT == FMT_NF4_DQ:
        # dmap[code] * nested + offset (bitsandbytes: dequantize_blockwise, then + offset)
        if ON_GPU:
            d = tl.inline_asm_elementwise(_F32_ASM, "=f,l", [tab_ptr + TAB_DMAP + raw], dtype=tl.float32,
                                          is_pure=True, pack=1)
        else:
            d = tl.load(tab_ptr + TAB_DMAP + raw)
        sf = d * nested + tl.load(tab_ptr + TAB_OFFSET)
    else:
        sf = raw
    return sf, zz


@triton.jit
def _stack_rows(r0, r1, r2, r3, MP: tl.constexpr):
    """[BN] partial sums of x rows 0..MP-1 -> [MP, BN]."""
    if MP == 1:
        return r0[None, :]
    elif MP == 2:
        return tl.trans(tl.join(r0, r1))
    else:
        # join(join(r0, r2), join(r1, r3))[n, a, b] = r_{a + 2b}
        t = tl.join(tl.join(r0, r2), tl.join(r1, r3))
        return tl.reshape(tl.permute(t, (1, 2, 0)), (4, r0.shape[0]))


@triton.jit
def _row_dot(dec, xp, X_FP16: tl.constexpr, ON_GPU: tl.constexpr):
    """Per-word sums of decoded weight * x (the 8 x values of a word come from one 16-byte load)."""
    d0, d1, d2, d3, d4, d5, d6, d7 = dec
    x0, x1, x2, x3, x4, x5, x6, x7 = _load_x8(xp, X_FP16, ON_GPU)
    p = d0 * x0
    p += d1 * x1
    p += d2 * x2
    p += d3 * x3
    p += d4 * x4
    p += d5 * x5
    p += d6 * x6
    p += d7 * x7
    return p


@triton.jit
def gemv_w4_fma_kernel(
    x_ptr, w_ptr, s_ptr, nested_ptr, tab_ptr, gs_ptr, rs_ptr, bias_ptr, out_ptr, ws_ptr, cnt_ptr,
    M, N, KW, SK,
    FMT: tl.constexpr, WPB: tl.constexpr, IPS: tl.constexpr, MP: tl.constexpr, BN: tl.constexpr, C: tl.constexpr,
    STAGES: tl.constexpr, SPLIT: tl.constexpr, HAS_BIAS: tl.constexpr, ACT: tl.constexpr,
    GS_KIND: tl.constexpr, ROW_SCALE: tl.constexpr, POST: tl.constexpr, X_FP16: tl.constexpr,
    ON_GPU: tl.constexpr,
):
    """out[m, n] = act(sum_k x[m, k] W[n, k] + bias[n]) for m < M <= MP (MP: 1, 2 or 4).

    w_ptr: int32 words [N, KW]; s_ptr: scales [N, SK] (one per WPB words). Each program runs IPS iterations
    of a ``[BN, 4 C]`` word tile starting at word ``pid_k * IPS * 4 C`` (grid axis 1 splits K; SPLIT * IPS *
    4 C = KW): 16-byte vectors along the row, lanes along the chunks of a row (a warp reads 512 contiguous
    bytes of one row), warps along the rows, so each thread loads the x values of its chunk once and reuses
    them for the BN / num_warps rows it holds. The scale is applied per word (no reshape, which would impose
    a layout that splits a 16-byte load across threads); words of one block load the same scale address."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    CW: tl.constexpr = 4 * C
    rows = pid_n * BN + tl.arange(0, BN)
    rows_c = tl.minimum(rows, N - 1)
    kq = tl.arange(0, CW)[None, :]                         # [1, CW] word offset inside the tile
    w_rows = w_ptr + rows_c.to(tl.int64)[:, None] * KW + kq
    row_blk = rows_c.to(tl.int64)[:, None] * SK
    xq = kq * 8
    x1 = tl.minimum(1, M - 1).to(tl.int64) * KW * 8
    x2 = tl.minimum(2, M - 1).to(tl.int64) * KW * 8
    x3 = tl.minimum(3, M - 1).to(tl.int64) * KW * 8

    acc0 = tl.zeros((BN, CW), dtype=tl.float32)
    acc1 = tl.zeros((BN, CW), dtype=tl.float32)
    acc2 = tl.zeros((BN, CW), dtype=tl.float32)
    acc3 = tl.zeros((BN, CW), dtype=tl.float32)
    kw_start = pid_k * (IPS * CW)
    raw, nest = _load_scales(s_ptr, (kq + kw_start) // WPB, row_blk, nested_ptr, FMT, ON_GPU)
    for it in tl.range(0, IPS, num_stages=STAGES):
        kw0 = kw_start + it * CW
        words = tl.load(w_rows + kw0)
        sf, zz = _decode_scales(raw, nest, tab_ptr, FMT, ON_GPU)
        kw_next = tl.minimum(kw0 + CW, KW - CW)
        raw, nest = _load_scales(s_ptr, (kq + kw_next) // WPB, row_blk, nested_ptr, FMT, ON_GPU)
        dec = _decode8(words, zz, tab_ptr, FMT, ON_GPU)
        xp = x_ptr + (xq + kw0 * 8)
        acc0 += _row_dot(dec, xp, X_FP16, ON_GPU) * sf
        if MP > 1:
            acc1 += _row_dot(dec, xp + x1, X_FP16, ON_GPU) * sf
        if MP > 2:
            acc2 += _row_dot(dec, xp + x2, X_FP16, ON_GPU) * sf
            acc3 += _row_dot(dec, xp + x3, X_FP16, ON_GPU) * sf

    acc = _stack_rows(tl.sum(acc0, axis=1), tl.sum(acc1, axis=1), tl.sum(acc2, axis=1), tl.sum(acc3, axis=1), MP)
    m = tl.arange(0, MP)
    gemv_epilogue(acc, cnt_ptr + pid_n, pid_k, m[:, None], rows[None, :], M, N, gs_ptr, rs_ptr, bias_ptr, out_ptr,
              ws_ptr, MP, SPLIT, POST, GS_KIND, ROW_SCALE, HAS_BIAS, ACT, 8)


@triton.jit
def gemv_w4_dot_kernel(
    x_ptr, w_ptr, s_ptr, nested_ptr, tab_ptr, gs_ptr, rs_ptr, bias_ptr, out_ptr, ws_ptr, cnt_ptr,
    M, N, KW, SK,
    FMT: tl.constexpr, WPB: tl.constexpr, IPS: tl.constexpr, MP: tl.constexpr, BN: tl.constexpr, C: tl.constexpr,
    STAGES: tl.constexpr, SPLIT: tl.constexpr, HAS_BIAS: tl.constexpr, ACT: tl.constexpr,
    GS_KIND: tl.constexpr, ROW_SCALE: tl.constexpr, POST: tl.constexpr, X_FP16: tl.constexpr,
    ON_GPU: tl.constexpr,
):
    """Same contract as the FMA kernel for M <= MP (16): the scaled weight tile, cast to x's dtype (fp32
    under the interpreter), goes through ``tl.dot`` with a [32 C, MP] x tile."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    BPC: tl.constexpr = 4 // WPB if WPB < 4 else 1
    CW: tl.constexpr = 4 * C
    rows = pid_n * BN + tl.arange(0, BN)
    rows_c = tl.minimum(rows, N - 1)
    cc = tl.arange(0, C)
    q4 = tl.arange(0, 4)
    kq = cc[:, None, None] * 4 + q4[None, None, :]
    w_rows = w_ptr + rows_c.to(tl.int64)[None, :, None] * KW + kq
    bq = (cc[:, None, None] * 4 + tl.arange(0, BPC)[None, None, :] * (4 // BPC)) // WPB
    row_blk = rows_c.to(tl.int64)[None, :, None] * SK
    m = tl.arange(0, MP)
    kk = tl.arange(0, 8 * CW)
    x_tile = x_ptr + m[None, :] * (KW * 8) + kk[:, None]
    x_mask = (m < M)[None, :]
    if ON_GPU:
        OP_TY: tl.constexpr = tl.float16 if X_FP16 else tl.bfloat16
    else:
        OP_TY: tl.constexpr = tl.float32

    acc = tl.zeros((BN, MP), dtype=tl.float32)
    kw_start = pid_k * (IPS * CW)
    # the scales of iteration i + 1 are loaded during iteration i (register prefetch: their latency is
    # not exposed); the prefetch after the last iteration re-reads the row's last tile
    raw, nest = _load_scales(s_ptr, bq + kw_start // WPB, row_blk, nested_ptr, FMT, ON_GPU)
    for it in tl.range(0, IPS, num_stages=STAGES):
        kw0 = kw_start + it * CW
        words = tl.load(w_rows + kw0)
        sf, zz = _decode_scales(raw, nest, tab_ptr, FMT, ON_GPU)
        kw_next = tl.minimum(kw0 + CW, KW - CW)
        raw, nest = _load_scales(s_ptr, bq + kw_next // WPB, row_blk, nested_ptr, FMT, ON_GPU)
        d0, d1, d2, d3, d4, d5, d6, d7 = _decode8(words, zz, tab_ptr, FMT, ON_GPU)
        s4 = tl.reshape(tl.broadcast_to(sf[:, :, :, None], (C, BN, BPC, 4 // BPC)), (C, BN, 4))
        # t[c, n, q, i, s, r] = element 8 (4c + q) + 4i + 2s + r (join appends the last dim): swapping c
        # and n gives the natural K order
        t = tl.join(tl.join(tl.join((d0 * s4).to(OP_TY), (d4 * s4).to(OP_TY)),
                            tl.join((d2 * s4).to(OP_TY), (d6 * s4).to(OP_TY))),
                    tl.join(tl.join((d1 * s4).to(OP_TY), (d5 * s4).to(OP_TY)),
                            tl.join((d3 * s4).to(OP_TY), (d7 * s4).to(OP_TY))))
        wt = tl.reshape(tl.permute(t, (1, 0, 2, 3, 4, 5)), (BN, 8 * CW))
        if ON_GPU:
            xt = tl.load(x_tile + kw0 * 8, mask=x_mask, other=0.0)
            acc = tl.dot(wt, xt, acc)
        else:
            if X_FP16:
                xf = tl.load(x_tile + kw0 * 8, mask=x_mask, other=0.0).to(tl.float32)
            else:
                xb = tl.load((x_tile + kw0 * 8).to(tl.pointer_type(tl.int16), bitcast=True), mask=x_mask, other=0)
                xf = (xb.to(tl.int32) << 16).to(tl.float32, bitcast=True)
            acc += tl.dot(wt, xf, input_precision="ieee")
    gemv_epilogue(tl.trans(acc), cnt_ptr + pid_n, pid_k, m[:, None], rows[None, :], M, N, gs_ptr, rs_ptr, bias_ptr,
              out_ptr, ws_ptr, MP, SPLIT, POST, GS_KIND, ROW_SCALE, HAS_BIAS, ACT, 8)
