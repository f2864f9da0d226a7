"""Triton tensor-core GEMM with a 4-bit weight: ``out = act(x @ dequant(w).T + bias)`` (prefill regime).

The weight is decoded tile by tile in registers and is the *left* operand of ``tl.dot``: every program
computes the transposed tile ``acc[BLOCK_N, BLOCK_M] = w_tile[BLOCK_N, BLOCK_K] @ x_tile[BLOCK_M, BLOCK_K].T``.
On Hopper this is a wgmma whose A operand comes from registers (the decoded weight, never stored in global
memory) and whose B operand (x) is streamed into shared memory by the software pipeline (TMA with a host
descriptor where x's rows are 16-byte aligned, else cp.async; ``num_stages`` deep); with A in registers the
wgmma stays asynchronous across loop iterations, so decoding the next tile overlaps the tensor cores. (The
other orientation, the decoded weight as the shared-memory operand, makes Triton 3.6 wait for every wgmma.)
Weight rows are the wgmma M dimension (64 per warpgroup), x rows its N dimension (16..256). The packed weight
bytes and the scales are pipelined like x (scales are read as 4-byte elements for that: Triton leaves loads
narrower than 4 bytes per thread in the loop, where their latency shows).

What the sm_90 build looks like (checked in SASS): HGMMA.64xBLOCK_Mx16 with the A
operand in registers, ``WARPGROUP.DEPBAR.LE gsb0, 0x3`` between them (not serialized), no spills in the main
loop. FP4 and int4 tiles are decoded directly in the wgmma operand layout (LDS.U8 of the packed bytes); the
nf4 tile goes through one shared-memory layout conversion after its table loads (inline asm ends Triton's
layout rematerialization). The first K tile is peeled: with the accumulator born from a wgmma no path into
the loop exit defines it with ordinary instructions, which would make ptxas serialize every wgmma (C7515).

Every format is read as a packed-byte tile [BLOCK_N, BLOCK_K / 2] plus per-group scales:

- FMT 0 nvfp4: uint8 [N, K/2] (element 2i in the low nibble), e4m3 scales [N, K/16] (linear or 128x4
  swizzled); the fp32 global multiplier S (value = e2m1 * sf / S) or an exact per-tensor divisor p
  (value = e2m1 * sf * p) is applied to the fp32 accumulator.
- FMT 1 mxfp4: same data, e8m0 scales [N, K/32].
- FMT 2 fp4_b32: same data, fp32 scales [N, K/32].
- FMT 3 nf4: bitsandbytes, blocks of BLOCKSIZE over the flattened [N, K], element 2i in the high nibble,
  fp32 absmax or double-quantized uint8 absmax codes + fp32 nested absmax per 256 blocks + fp32 offset.
- FMT 4 int4: the AutoAWQ weight after the launcher's one-time pre-layout: codes uint8 [N, K/2] (element 2i
  in the low nibble) and int32 [N, K/g] words ``fp16 scale bits | zero point << 16``; value = (q - z) * s.

Decoding: an E2M1 code becomes its value through its bit pattern in the activation dtype (bf16: the three
magnitude bits at the bottom of the exponent field, times 2^126; fp16: times 2^14; code 1 is a subnormal
there), then the block scale in that dtype multiplies it; e2m1 x e4m3 and e2m1 x e8m0 products are exact in
bf16 (and in fp16 within its range). INT4 codes and zero points are or-ed into the mantissa of 128.0 (bf16)
or 1024.0 (fp16), so ``q - z`` is exact and the product with the scale rounds once (in fp16 that is the
reference's own fp16 multiply). fp32 block scales, NF4 levels, nf4 absmax and AWQ scales in bf16 round once
to the activation dtype (relative error <= 2^-9). All multiplies are packed bf16x2/f16x2.
"""

import triton
import triton.language as tl

from .device import e2m1_pairs, e8m0_to, load_nc, mul_groups, settled, sub_groups, swizzled_offsets

FMT_NVFP4 = tl.constexpr(0)
FMT_MXFP4 = tl.constexpr(1)
FMT_FP4_B32 = tl.constexpr(2)
FMT_NF4 = tl.constexpr(3)
FMT_INT4 = tl.constexpr(4)


@triton.jit
def _join16(lo, hi, DT: tl.constexpr):
    """int16 bit patterns lo, hi [R, P] -> ``DT`` [R, 2P] with lo at the even columns."""
    return tl.reshape(tl.join(lo, hi), (lo.shape[0], 2 * lo.shape[1])).to(DT, bitcast=True)


@triton.jit
def _u4_pairs(b, DT: tl.constexpr):
    """Packed bytes (element 2i in the low nibble) -> ``MAGIC + q`` [R, 2P] in ``DT`` (MAGIC = 128.0 in bf16,
    1024.0 in fp16, whose ulp is 1: q sits in the low mantissa bits). Built as two 16-bit halves and
    joined (one or per half and one pack per pair; spreading the byte over one 32-bit word first made
    the compiler swap the halves twice)."""
    if DT == tl.float16:
        magic = 0x6400
    else:
        magic = 0x4300
    return _join16(((b & 15) | magic).to(tl.int16), ((b >> 4) | magic).to(tl.int16), DT)


@triton.jit
def _lut16(table_ptr, idx, ON_GPU: tl.constexpr):
    """``table_ptr[idx]`` (16-bit entries, returned as int16) for a 32-byte read-only table (one L1 sector)."""
    ptrs = table_ptr.to(tl.pointer_type(tl.int16), bitcast=True) + idx
    return load_nc(ptrs, "ld.global.nc.b16 $0, [$1];", "=h,l", tl.int16, ON_GPU)


@triton.jit
def _load_bytes(w_ptr, row_off, k0, K, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, OTHER: tl.constexpr):
    """Packed-byte tile [BLOCK_N, BLOCK_K / 2]: row n starts at byte ``row_off[n]``; masked bytes read OTHER."""
    kb = (k0 >> 1) + tl.arange(0, BLOCK_K // 2)
    ptrs = w_ptr + row_off[:, None] + kb[None, :]
    if EVEN_K:
        return tl.load(ptrs)
    return tl.load(ptrs, mask=(kb < K // 2)[None, :], other=OTHER)


@triton.jit
def _load_scales(s_ptr, z_ptr, nested_ptr, offs_n, k0, K, stride_sn, s_cols4,
                 FMT: tl.constexpr, BLOCK_K: tl.constexpr, GROUP: tl.constexpr, SCALE_SWIZZLED: tl.constexpr,
                 SCALE_WORDS: tl.constexpr, DOUBLE_QUANT: tl.constexpr, NF4_MODE: tl.constexpr,
                 EVEN_K: tl.constexpr):
    """Per-group data of the tile at k0: (sa, sb).

    Every load reads 4-byte elements where it can (SCALE_WORDS: one-byte scales fetched as the int32 words
    that hold them), so that Triton's software pipeline streams them through shared memory with the x and
    weight tiles (it leaves loads narrower than 4 bytes per thread in the loop, where their latency shows).

    FP4 formats: sa = scales [BLOCK_N, NG] (int32 codes of one-byte scales, or fp32), sb = sa.
    int4: sa = int32 [BLOCK_N, NG], fp16 scale bits | zero point << 16; sb = sa.
    nf4: sa = absmax fp32 or its uint8 code (int32), sb = the nested absmax (double quant) or sa;
    [BLOCK_N] (NF4_MODE 0), [BLOCK_N, BLOCK_K / BLOCKSIZE] (1) or [BLOCK_N, BLOCK_K] (2).
    """
    if FMT == 3:
        flat_row = offs_n.to(tl.int64) * K
        if NF4_MODE == 0:
            blk = (flat_row + k0) // GROUP
            ok = blk >= 0
        elif NF4_MODE == 1:
            j = tl.arange(0, BLOCK_K // GROUP)
            blk = (flat_row + k0)[:, None] // GROUP + j[None, :]
            ok = (k0 + j * GROUP < K)[None, :]
        else:
            kk = k0 + tl.arange(0, BLOCK_K)
            blk = (flat_row[:, None] + kk[None, :]) // GROUP
            ok = (kk < K)[None, :]
        masked: tl.constexpr = not (EVEN_K or NF4_MODE == 0)
        if DOUBLE_QUANT:
            wptr = s_ptr.to(tl.pointer_type(tl.int32), bitcast=True) + (blk >> 2)
            if masked:
                word = tl.load(wptr, mask=ok, other=0)
                sb = tl.load(nested_ptr + (blk >> 8), mask=ok, other=0.0)
            else:
                word = tl.load(wptr)
                sb = tl.load(nested_ptr + (blk >> 8))
            sa = (word >> (8 * (blk & 3)).to(tl.int32)) & 0xFF
        else:
            if masked:
                sa = tl.load(s_ptr + blk, mask=ok, other=0.0)
            else:
                sa = tl.load(s_ptr + blk)
            sb = sa
    else:
        NG: tl.constexpr = BLOCK_K // GROUP if BLOCK_K >= GROUP else 1
        col0 = k0 // GROUP
        if FMT <= 1 and SCALE_WORDS:
            # one-byte scales read through the int32 words that hold them (4 consecutive scales of a row are 4
            # aligned bytes in the linear layout, whose row stride is then a multiple of 4, and in the 128x4
            # swizzle); one word per scale, so the tile keeps the shape [BLOCK_N, NG] of the byte loads
            cols = col0 + tl.arange(0, NG)
            wcols = cols & -4
            if SCALE_SWIZZLED:
                off = swizzled_offsets(offs_n[:, None], wcols[None, :], s_cols4).to(tl.int64)
            else:
                off = offs_n.to(tl.int64)[:, None] * stride_sn + wcols[None, :]
            wptr = s_ptr.to(tl.pointer_type(tl.int32), bitcast=True) + (off >> 2)
            if EVEN_K:
                words = tl.load(wptr)
            else:
                words = tl.load(wptr, mask=(cols < K // GROUP)[None, :], other=0)
            sa = (words >> (8 * (cols & 3))[None, :]) & 0xFF
        else:
            cols = col0 + tl.arange(0, NG)
            if SCALE_SWIZZLED:
                off = swizzled_offsets(offs_n[:, None], cols[None, :], s_cols4).to(tl.int64)
            else:
                off = offs_n.to(tl.int64)[:, None] * stride_sn + cols[None, :]
            if EVEN_K:
                sa = tl.load(s_ptr + off)
            else:
                sa = tl.load(s_ptr + off, mask=(cols < K // GROUP)[None, :], other=0)
            if FMT <= 1:
                sa = sa.to(tl.int32)
        sb = sa
    return sa, sb


@triton.jit
def _decode_tile(b, sa, sb, offset_ptr, lut_ptr, dmap_ptr,
                 FMT: tl.constexpr, GROUP: tl.constexpr, DOUBLE_QUANT: tl.constexpr, NF4_MODE: tl.constexpr,
                 DT: tl.constexpr, ON_GPU: tl.constexpr):
    """Packed bytes [BLOCK_N, BLOCK_K / 2] + per-group data -> decoded weight tile [BLOCK_N, BLOCK_K] in DT."""
    b = b.to(tl.int32)
    if FMT <= 2:
        if FMT == 0:
            s = sa.to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float32).to(DT)
        elif FMT == 1:
            s = e8m0_to(sa, DT)
        else:
            s = sa.to(DT)
        return mul_groups(e2m1_pairs(b, DT, ON_GPU), s)
    elif FMT == 4:
        s = (sa & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(DT)
        if DT == tl.float16:
            z = ((sa >> 16) | 0x6400).to(tl.int16).to(tl.float16, bitcast=True)
        else:
            z = ((sa >> 16) | 0x4300).to(tl.int16).to(tl.bfloat16, bitcast=True)
        return mul_groups(sub_groups(_u4_pairs(b, DT), z), s)
    else:
        # element 2i is the high nibble
        v = _join16(_lut16(lut_ptr, b >> 4, ON_GPU), _lut16(lut_ptr, b & 15, ON_GPU), DT)
        if DOUBLE_QUANT:
            a = tl.load(dmap_ptr + sa) * sb + tl.load(offset_ptr)
        else:
            a = sa
        a = a.to(DT)
        if NF4_MODE == 0:
            return v * a[:, None]
        elif NF4_MODE == 1:
            return mul_groups(v, a)
        else:
            return v * a


@triton.jit
def _tanh(x, ON_GPU: tl.constexpr):
    if ON_GPU:
        return tl.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=f,f", [x], dtype=tl.float32,
                                         is_pure=True, pack=1)
    else:
        e = tl.exp(-2.0 * tl.abs(x))
        t = (1.0 - e) / (1.0 + e)
        return tl.where(x < 0, -t, t)


@triton.jit
def _activation(v, ACT: tl.constexpr, ON_GPU: tl.constexpr):
    """fp32 activation; tanh is the hardware approximation on the GPU (max relative error ~2^-11, far below
    the bf16/fp16 output rounding)."""
    if ACT == 1:
        return 0.5 * v * (1.0 + tl.math.erf(v * 0.7071067811865476))
    elif ACT == 2:
        return 0.5 * v * (1.0 + _tanh(0.7978845608028654 * (v + 0.044715 * v * v * v), ON_GPU))
    elif ACT == 3:
        # v * sigmoid(v), sigmoid(v) = (1 + tanh(v / 2)) / 2
        return v * (0.5 + 0.5 * _tanh(0.5 * v, ON_GPU))
    else:
        return v


@triton.jit
def _epilogue(acc, offs_n, N, gscale_ptr, bias_ptr,
              GSCALE_MODE: tl.constexpr, HAS_BIAS: tl.constexpr, ACT: tl.constexpr, ON_GPU: tl.constexpr):
    """acc [BLOCK_N, *] fp32 -> act(acc * g + bias[n]) in fp32: GSCALE_MODE 1 g = 1 / S (nvfp4 global
    multiplier S), 2 g = p (an exact per-tensor divisor ``params["per_tensor_scale"]``), 0 g = 1."""
    if GSCALE_MODE == 1:
        acc = acc * tl.div_rn(1.0, tl.load(gscale_ptr))
    elif GSCALE_MODE == 2:
        acc = acc * tl.load(gscale_ptr)
    if HAS_BIAS:
        bias = tl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)
        acc = acc + bias[:, None]
    return _activation(acc, ACT, ON_GPU)


@triton.jit
def _tile_product(x_desc, m0, x_rows, offs_k, w_ptr, w_rows, s_ptr, z_ptr, nested_ptr, offset_ptr, lut_ptr,
                  dmap_ptr, offs_n, k0, K, stride_sn, s_cols4, acc,
                  FMT: tl.constexpr, BLOCK_K: tl.constexpr, GROUP: tl.constexpr, SCALE_SWIZZLED: tl.constexpr,
                  SCALE_WORDS: tl.constexpr, DOUBLE_QUANT: tl.constexpr, NF4_MODE: tl.constexpr,
                  EVEN_K: tl.constexpr, X_TMA: tl.constexpr, DT: tl.constexpr, ON_GPU: tl.constexpr):
    """acc + w_tile @ x_tile.T for the K tile at k0 (acc None: a fresh fp32 accumulator)."""
    if X_TMA:
        # a TMA box [BLOCK_M, BLOCK_K]: rows >= M and columns >= K read as zeros
        x = x_desc.load([m0, k0])
    elif EVEN_K:
        x = tl.load(x_rows + (k0 + offs_k)[None, :])
    else:
        x = tl.load(x_rows + (k0 + offs_k)[None, :], mask=(k0 + offs_k < K)[None, :], other=0.0)
    # nf4 code 7 is 0.0; every other format decodes byte 0 to 0 (int4: (0 - 0) * 0 with masked groups)
    b = _load_bytes(w_ptr, w_rows, k0, K, BLOCK_K, EVEN_K, 0x77 if FMT == 3 else 0)
    sa, sb = _load_scales(s_ptr, z_ptr, nested_ptr, offs_n, k0, K, stride_sn, s_cols4, FMT, BLOCK_K, GROUP,
                          SCALE_SWIZZLED, SCALE_WORDS, DOUBLE_QUANT, NF4_MODE, EVEN_K)
    w = _decode_tile(b, sa, sb, offset_ptr, lut_ptr, dmap_ptr, FMT, GROUP, DOUBLE_QUANT, NF4_MODE, DT, ON_GPU)
    return settled(tl.dot(w, tl.trans(x), acc), ON_GPU)


@triton.jit
def gemm_w4_kernel(
    x_ptr, x_desc, w_ptr, s_ptr, z_ptr, nested_ptr, offset_ptr, lut_ptr, dmap_ptr, gscale_ptr, bias_ptr, out_ptr,
    M, N, K, stride_xm, stride_om, stride_wn, stride_sn, s_cols4,
    FMT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, SPLIT_K: tl.constexpr, EVEN_K: tl.constexpr, X_TMA: tl.constexpr,
    SCALE_SWIZZLED: tl.constexpr, SCALE_WORDS: tl.constexpr, GROUP: tl.constexpr, DOUBLE_QUANT: tl.constexpr,
    NF4_MODE: tl.constexpr, GSCALE_MODE: tl.constexpr, HAS_BIAS: tl.constexpr, ACT: tl.constexpr,
    ON_GPU: tl.constexpr,
):
    """One program computes out[m0:m0+BLOCK_M, n0:n0+BLOCK_N] (with SPLIT_K > 1: the fp32 partial sum of its
    K slice into ``out_ptr`` [SPLIT_K, M, N], no epilogue).

    Program ids run over GROUP_M row tiles of x per weight column tile, so a wave of programs shares weight
    and x tiles in L2. ``GROUP``: the scale group along K (16/32), the int4 group size or the nf4 blocksize.
    ``stride_wn``: bytes per packed weight row (K / 2; unused for nf4, whose rows start at byte n * K / 2).
    X_TMA: x is read through ``x_desc``, a host TMA descriptor of x with box [BLOCK_M, BLOCK_K] (one TMA
    copy per tile instead of per-thread cp.async and its address arithmetic); else through ``x_ptr``.
    """
    DT: tl.constexpr = x_ptr.dtype.element_ty
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * num_n
    group = pid // per_group
    first_m = group * GROUP_M
    size_m = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % size_m
    pid_n = (pid % per_group) // size_m

    # rows past the end re-read a valid row (their results are not stored): no row masks in the main loop
    offs_m = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)) % M
    offs_n = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)) % N
    offs_k = tl.arange(0, BLOCK_K)
    x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm
    if FMT == 3:
        w_rows = offs_n.to(tl.int64) * (K // 2)
    else:
        w_rows = offs_n.to(tl.int64) * stride_wn

    k_tiles = tl.cdiv(K, BLOCK_K)
    if SPLIT_K == 1:
        t_begin = 0
        t_end = k_tiles
    else:
        tiles_per_split = tl.cdiv(k_tiles, SPLIT_K)
        t_begin = pid_k * tiles_per_split
        t_end = tl.minimum(t_begin + tiles_per_split, k_tiles)
    # the launcher never starts a program with an empty K range (K > 0, no empty split)

    # the first tile is peeled: the accumulator is born from a wgmma, so no path into the loop's exit defines
    # it with ordinary instructions (which makes ptxas serialize every wgmma of the loop: C7515)
    m0 = pid_m * BLOCK_M
    acc = _tile_product(x_desc, m0, x_rows, offs_k, w_ptr, w_rows, s_ptr, z_ptr, nested_ptr, offset_ptr, lut_ptr,
                        dmap_ptr, offs_n, t_begin * BLOCK_K, K, stride_sn, s_cols4, None,
                        FMT, BLOCK_K, GROUP, SCALE_SWIZZLED, SCALE_WORDS, DOUBLE_QUANT, NF4_MODE, EVEN_K, X_TMA, DT,
                        ON_GPU)
    for t in range(t_begin + 1, t_end):
        acc = _tile_product(x_desc, m0, x_rows, offs_k, w_ptr, w_rows, s_ptr, z_ptr, nested_ptr, offset_ptr,
                            lut_ptr, dmap_ptr, offs_n, t * BLOCK_K, K, stride_sn, s_cols4, acc,
                            FMT, BLOCK_K, GROUP, SCALE_SWIZZLED, SCALE_WORDS, DOUBLE_QUANT, NF4_MODE, EVEN_K, X_TMA,
                            DT, ON_GPU)

    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    mask = (offs_n < N)[:, None] & (offs_m < M)[None, :]
    if SPLIT_K > 1:
        ptrs = out_ptr + (pid_k * M + offs_m.to(tl.int64))[None, :] * N + offs_n[:, None]
        tl.store(ptrs, acc, mask=mask)
    else:
        acc = _epilogue(acc, offs_n, N, gscale_ptr, bias_ptr, GSCALE_MODE, HAS_BIAS, ACT, ON_GPU)
        ptrs = out_ptr + offs_m.to(tl.int64)[None, :] * stride_om + offs_n[:, None]
        tl.store(ptrs, acc.to(DT), mask=mask)


@triton.jit
def split_k_reduce_kernel(
    ws_ptr, gscale_ptr, bias_ptr, out_ptr, M, N, stride_om,
    SPLIT_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    GSCALE_MODE: tl.constexpr, HAS_BIAS: tl.constexpr, ACT: tl.constexpr, ON_GPU: tl.constexpr,
):
    """out = epilogue(sum of the SPLIT_K fp32 partials in ws [SPLIT_K, M, N], in a fixed order)."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (offs_n < N)[:, None] & (offs_m < M)[None, :]
    ptrs = ws_ptr + offs_m.to(tl.int64)[None, :] * N + offs_n[:, None]
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for s in tl.static_range(SPLIT_K):
        acc += tl.load(ptrs + s * M * N, mask=mask, other=0.0)
    acc = _epilogue(acc, offs_n, N, gscale_ptr, bias_ptr, GSCALE_MODE, HAS_BIAS, ACT, ON_GPU)
    optrs = out_ptr + offs_m.to(tl.int64)[None, :] * stride_om + offs_n[:, None]
    tl.store(optrs, acc.to(out_ptr.dtype.element_ty), mask=mask)
