"""Triton GEMM on two quantized operands: ``out = alpha * dequant(a) @ dequant(b).T + bias`` (fp32 accumulation).

One kernel, specialized per operand by constexprs. Each operand is read as its packed tile and becomes the
``tl.dot`` input in registers; its scales are applied where that is exact, so the result equals the reference up
to fp32 accumulation order:

- KIND 0 FP8 (E4M3/E5M2 data, one byte per element); KIND 1 E2M1 (two per byte, element 2i in the low nibble);
  KIND 2 FP6 (E2M3 or E3M2, four elements in three bytes, little-endian bit stream).
- SMODE 1: fp32 scale per 128-element K block (fp8_block: [rows or rows/128, K/128], any strides). The partial
  product of each 128-wide K tile is multiplied by ``sa[m] * sb[n]`` in fp32 before it is added (DeepSeek-V3's
  promotion), so the FP8 operands go to the FP8 tensor cores raw.
- SMODE 2: E8M0 scale per 32 elements (MX), SMODE 4: E4M3 scale per 16 (nvfp4), linear or 128x4 swizzled:
  multiplied into the decoded tile in bf16. Every element x scale product here is exact in bf16 (at most
  4 + 4 significant bits, exponents in bf16's range), so these tiles feed a bf16 ``tl.dot`` exactly. E2M1
  codes become bf16 through their bit patterns (``device.e2m1_pairs``).
- SMODE 3: fp32 scale per row (fp8_rowwise activations), applied to the accumulator in the epilogue.
- GMODE 1/2: nvfp4 per-tensor scale (1 / global multiplier, or torchao's per_tensor_scale), in the epilogue.

FP8 x FP8 with SMODE 1 on both sides runs ``tl.dot`` on float8 (wgmma e4m3); every other pair runs a bf16
``tl.dot`` on decoded tiles (an FP8 value is exact in bf16).
"""

import triton
import triton.language as tl

from .device import (
    decode_minifloat,
    e2m1_pairs,
    e4m3_codes,
    e8m0_to,
    fp6_codes,
    mul_groups,
    rn_quotient,
    scale_from_amax_bits,
    settled,
    swizzled_offsets,
)


@triton.jit
def _fp8_tile(d_ptr, rows, k0, K, stride_d, BK: tl.constexpr, EVEN_K: tl.constexpr):
    """Raw float8 [R, BK] tile; columns >= K read as zero."""
    kk = k0 + tl.arange(0, BK)
    ptrs = d_ptr + rows[:, None] * stride_d + kk[None, :]
    if EVEN_K:
        return tl.load(ptrs)
    return tl.load(ptrs, mask=(kk < K)[None, :], other=0.0)


@triton.jit
def _quantized_x_tile(x_ptr, rows, k0, K, stride_x, BK: tl.constexpr, EVEN_K: tl.constexpr, POW2: tl.constexpr):
    """fp8_block (1x128) activation quantization of an unquantized x tile [R, 128] in registers: (float8 codes,
    fp32 scale per row), the bits ``_fp8_block.quantize_1x128_kernel`` writes (same amax, scale and quotient
    steps), so the product below equals the two-launch path's. Columns >= K read as zero."""
    kk = k0 + tl.arange(0, BK)
    ptrs = x_ptr + rows[:, None] * stride_x + kk[None, :]
    if EVEN_K:
        x = tl.load(ptrs).to(tl.float32)
    else:
        x = tl.load(ptrs, mask=(kk < K)[None, :], other=0.0).to(tl.float32)
    xbits = x.to(tl.int32, bitcast=True)
    s = scale_from_amax_bits(tl.max(xbits & 0x7FFFFFFF, axis=1), POW2)
    r = tl.div_rn(1.0, s)
    if POW2:
        q = x * r[:, None]
    else:
        q = rn_quotient(x, xbits, s[:, None], r[:, None])
    return e4m3_codes(q).to(tl.float8e4nv, bitcast=True), s


@triton.jit
def _operand_tile(
    d_ptr,
    s_ptr,
    rows,
    k0,
    K,
    stride_d,
    stride_s0,
    stride_s1,
    s_cols4,
    KIND: tl.constexpr,
    SMODE: tl.constexpr,
    SWIZZLED: tl.constexpr,
    EBITS: tl.constexpr,
    MBITS: tl.constexpr,
    BIAS: tl.constexpr,
    BK: tl.constexpr,
    EVEN_K: tl.constexpr,
    ON_GPU: tl.constexpr,
):
    """The [R, BK] tile of K columns k0.. of the operand rows ``rows`` (int64 [R]) in bf16, with the in-tile
    (SMODE 2/4) scales applied in bf16 (exact products). Columns >= K read as zero."""
    if KIND == 0:
        v = _fp8_tile(d_ptr, rows, k0, K, stride_d, BK, EVEN_K).to(tl.bfloat16)
    elif KIND == 1:
        kb = (k0 >> 1) + tl.arange(0, BK // 2)
        ptrs = d_ptr + rows[:, None] * stride_d + kb[None, :]
        if EVEN_K:
            byte = tl.load(ptrs).to(tl.int32)
        else:
            byte = tl.load(ptrs, mask=(kb < K // 2)[None, :], other=0).to(tl.int32)
        v = e2m1_pairs(byte, tl.bfloat16, ON_GPU)
    else:
        # 4 elements in 3 bytes: read bytes 3j, 3j+1, 3j+2 as slots 0..2 of the 4 element slots of group j
        e = tl.arange(0, BK)
        off = (k0 // 4) * 3 + (e // 4) * 3 + e % 4
        ok = (e % 4 < 3)[None, :]
        if not EVEN_K:
            ok = ok & ((k0 + e) < K)[None, :]
        slots = tl.load(d_ptr + rows[:, None] * stride_d + off[None, :], mask=ok, other=0).to(tl.int32)
        v = decode_minifloat(fp6_codes(slots), EBITS, MBITS, BIAS).to(tl.bfloat16)

    if SMODE == 2 or SMODE == 4:
        GROUP: tl.constexpr = 32 if SMODE == 2 else 16
        NG: tl.constexpr = BK // GROUP
        cols = k0 // GROUP + tl.arange(0, NG)
        if SWIZZLED:
            soff = swizzled_offsets(rows[:, None], cols[None, :], s_cols4)
        else:
            soff = rows[:, None] * stride_s0 + cols[None, :]
        if EVEN_K:
            sc = tl.load(s_ptr + soff).to(tl.int32)
        else:
            sc = tl.load(s_ptr + soff, mask=(cols < K // GROUP)[None, :], other=0).to(tl.int32)
        if SMODE == 2:
            sv = e8m0_to(sc, tl.bfloat16)
        else:
            sv = sc.to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float32).to(tl.bfloat16)
        v = mul_groups(v, sv)
    return v


@triton.jit
def _block_scale(s_ptr, rows, k0, stride_s0, stride_s1, ROWS_PER_SCALE: tl.constexpr):
    """fp32 [R] scales of K block k0 / 128 for ``rows`` (fp8_block; 128x128 weights share one per 128 rows)."""
    return tl.load(s_ptr + (rows // ROWS_PER_SCALE) * stride_s0 + (k0 // 128) * stride_s1)


@triton.jit
def scaled_mm_kernel(
    a_ptr,
    as_ptr,
    ag_ptr,
    b_ptr,
    bs_ptr,
    bg_ptr,
    alpha_ptr,
    bias_ptr,
    out_ptr,
    ws_ptr,
    cnt_ptr,
    guard_ptr,
    M,
    N,
    K,
    K_PER,
    stride_a,
    stride_as0,
    stride_as1,
    a_cols4,
    stride_b,
    stride_bs0,
    stride_bs1,
    b_cols4,
    stride_om,
    A_KIND: tl.constexpr,
    A_SMODE: tl.constexpr,
    A_SWIZZLED: tl.constexpr,
    A_GMODE: tl.constexpr,
    A_EBITS: tl.constexpr,
    A_MBITS: tl.constexpr,
    A_BIAS: tl.constexpr,
    B_KIND: tl.constexpr,
    B_SMODE: tl.constexpr,
    B_SWIZZLED: tl.constexpr,
    B_GMODE: tl.constexpr,
    B_EBITS: tl.constexpr,
    B_MBITS: tl.constexpr,
    B_BIAS: tl.constexpr,
    B_ROWS_PER_SCALE: tl.constexpr,
    HAS_ALPHA: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    GROUP_M: tl.constexpr,
    EVEN_K: tl.constexpr,
    SPLIT: tl.constexpr,
    ON_GPU: tl.constexpr,
    GUARD: tl.constexpr = False,
    A_QUANT: tl.constexpr = False,
    A_POW2: tl.constexpr = False,
):
    """A_QUANT (an fp8_block activation, any weight, BK = 128): ``a_ptr`` is the unquantized activation (bf16,
    fp16 or fp32, row stride ``stride_a``) and each program quantizes its tiles to fp8_block 1x128 in registers
    (A_POW2: ue8m0 scales), so decode runs one launch instead of quantize + GEMM; ``as_ptr`` is unused.

    GUARD: run only when the int32 at ``guard_ptr`` is nonzero (every program returns at once otherwise): the
    exact fallback of the FP8 re-encoded path, launched behind it and armed by the re-encoding kernel.

    SPLIT > 1: program (pid, pid_k) runs K columns [pid_k * K_PER, (pid_k + 1) * K_PER) (K_PER a multiple of
    BK) and the tile's last program reduces the partials (fp32 workspace ws_ptr [SPLIT, M, N], one arrival
    counter per tile in cnt_ptr, zero between launches)."""
    if GUARD:
        if tl.load(guard_ptr) == 0:
            return
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
    num_m = tl.cdiv(M, BM)
    num_n = tl.cdiv(N, BN)
    per_group = GROUP_M * num_n
    first_m = (pid // per_group) * GROUP_M
    size_m = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % size_m
    pid_n = (pid % per_group) // size_m

    # rows past the end re-read a valid row; their results are not stored
    rows_a = ((pid_m * BM + tl.arange(0, BM)) % M).to(tl.int64)
    rows_b = ((pid_n * BN + tl.arange(0, BN)) % N).to(tl.int64)
    RAW_FP8: tl.constexpr = A_KIND == 0 and B_KIND == 0 and A_SMODE == 1 and B_SMODE == 1
    PROMOTE: tl.constexpr = A_SMODE == 1 or B_SMODE == 1

    acc = tl.zeros((BM, BN), dtype=tl.float32)
    k_first = pid_k * K_PER
    for k0 in range(k_first, tl.minimum(K, k_first + K_PER), BK):
        if RAW_FP8:
            b = _fp8_tile(b_ptr, rows_b, k0, K, stride_b, BK, EVEN_K)
        else:
            b = _operand_tile(
                b_ptr,
                bs_ptr,
                rows_b,
                k0,
                K,
                stride_b,
                stride_bs0,
                stride_bs1,
                b_cols4,
                B_KIND,
                B_SMODE,
                B_SWIZZLED,
                B_EBITS,
                B_MBITS,
                B_BIAS,
                BK,
                EVEN_K,
                ON_GPU,
            )
        if A_QUANT:
            a, a_scale = _quantized_x_tile(a_ptr, rows_a, k0, K, stride_a, BK, EVEN_K, A_POW2)
            if not RAW_FP8:
                a = a.to(tl.bfloat16)  # an E4M3 value is exact in bf16, as _operand_tile's KIND 0 tile
        elif RAW_FP8:
            a = _fp8_tile(a_ptr, rows_a, k0, K, stride_a, BK, EVEN_K)
        else:
            a = _operand_tile(
                a_ptr,
                as_ptr,
                rows_a,
                k0,
                K,
                stride_a,
                stride_as0,
                stride_as1,
                a_cols4,
                A_KIND,
                A_SMODE,
                A_SWIZZLED,
                A_EBITS,
                A_MBITS,
                A_BIAS,
                BK,
                EVEN_K,
                ON_GPU,
            )
        if PROMOTE:
            part = tl.dot(a, tl.trans(b))
            if A_QUANT:
                part = part * a_scale[:, None]
            elif A_SMODE == 1:
                part = part * _block_scale(as_ptr, rows_a, k0, stride_as0, stride_as1, 1)[:, None]
            if B_SMODE == 1:
                part = (
                    part * _block_scale(bs_ptr, rows_b, k0, stride_bs0, stride_bs1, B_ROWS_PER_SCALE)[None, :]
                )
            acc += part
        else:
            acc = settled(tl.dot(a, tl.trans(b), acc), ON_GPU)

    if SPLIT == 1:
        _mm_epilogue(acc, pid_m, pid_n, rows_a, M, N, as_ptr, stride_as0, ag_ptr, bg_ptr, alpha_ptr, bias_ptr,
                     out_ptr, stride_om, A_SMODE, A_GMODE, B_GMODE, HAS_ALPHA, HAS_BIAS, BM, BN)
    else:
        # split-K: park this K range's partial sums; the last program of the tile adds them and finishes
        offs_m = pid_m * BM + tl.arange(0, BM)
        offs_n = pid_n * BN + tl.arange(0, BN)
        wmask = (offs_m < M)[:, None] & (offs_n < N)[None, :]
        ws_off = offs_m.to(tl.int64)[:, None] * N + offs_n[None, :]
        tl.store(ws_ptr + pid_k * M * N + ws_off, acc, mask=wmask)
        tl.debug_barrier()
        prev = tl.atomic_add(cnt_ptr + pid, 1, sem="acq_rel", scope="gpu")
        if prev == SPLIT - 1:
            tot = tl.zeros((BM, BN), dtype=tl.float32)
            for s in range(SPLIT):
                tot += tl.load(ws_ptr + s * M * N + ws_off, mask=wmask, other=0.0, cache_modifier=".cg")
            # every program of this tile has arrived: reset the counter for the next launch
            tl.atomic_xchg(cnt_ptr + pid, 0, sem="relaxed", scope="gpu")
            _mm_epilogue(tot, pid_m, pid_n, rows_a, M, N, as_ptr, stride_as0, ag_ptr, bg_ptr, alpha_ptr, bias_ptr,
                         out_ptr, stride_om, A_SMODE, A_GMODE, B_GMODE, HAS_ALPHA, HAS_BIAS, BM, BN)


@triton.jit
def fp8_block_decode_kernel(
    x_ptr, w_ptr, ws_ptr, bias_ptr, out_ptr, part_ptr, cnt_ptr, M, N, K, K_PER,
    HAS_BIAS: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, SPLIT: tl.constexpr, EVEN_K: tl.constexpr,
    POW2: tl.constexpr, ROWS_PER_SCALE: tl.constexpr, ON_GPU: tl.constexpr,
):
    """fp8_block decode with the activation quantized in the GEMM: ``scaled_mm_kernel`` with A_QUANT on an
    fp8_block weight, for contiguous x ``[M, K]``, weight ``[N, K]``, weight scales ``[N / ROWS_PER_SCALE,
    cdiv(K, 128)]`` and output ``[M, N]``, whose strides follow from the shapes. The same code and bits; a
    tenth of the launch arguments (each costs the launcher host time on every call). ``part_ptr`` /
    ``cnt_ptr``: the split-K workspace and counters."""
    scaled_mm_kernel(
        x_ptr, x_ptr, x_ptr, w_ptr, ws_ptr, ws_ptr, out_ptr, bias_ptr, out_ptr, part_ptr, cnt_ptr, cnt_ptr,
        M, N, K, K_PER, K, 0, 0, 0, K, tl.cdiv(K, 128), 1, 0, N,
        0, 1, False, 0, 0, 0, 0,            # A: fp8_block (quantized here)
        0, 1, False, 0, 0, 0, 0,            # B: fp8_block
        ROWS_PER_SCALE, False, HAS_BIAS, BM, BN, 128, 1, EVEN_K, SPLIT, ON_GPU, False, True, POW2,
    )


@triton.jit
def _mm_epilogue(acc, pid_m, pid_n, rows_a, M, N, as_ptr, stride_as0, ag_ptr, bg_ptr, alpha_ptr, bias_ptr, out_ptr,
                 stride_om, A_SMODE: tl.constexpr, A_GMODE: tl.constexpr, B_GMODE: tl.constexpr,
                 HAS_ALPHA: tl.constexpr, HAS_BIAS: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr):
    """The per-row / per-tensor scales, alpha and bias on the fp32 tile, then the masked store."""
    if A_SMODE == 3:
        acc = acc * tl.load(as_ptr + rows_a * stride_as0)[:, None]
    if A_GMODE == 1:
        acc = acc * tl.div_rn(1.0, tl.load(ag_ptr))
    elif A_GMODE == 2:
        acc = acc * tl.load(ag_ptr)
    if B_GMODE == 1:
        acc = acc * tl.div_rn(1.0, tl.load(bg_ptr))
    elif B_GMODE == 2:
        acc = acc * tl.load(bg_ptr)
    if HAS_ALPHA:
        acc = acc * tl.load(alpha_ptr)
    offs_m = pid_m * BM + tl.arange(0, BM)
    offs_n = pid_n * BN + tl.arange(0, BN)
    if HAS_BIAS:
        acc = acc + tl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
    mask = (offs_m < M)[:, None] & (offs_n < N)[None, :]
    ptrs = out_ptr + offs_m.to(tl.int64)[:, None] * stride_om + offs_n[None, :]
    tl.store(ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def fp8_block_mm_tma_kernel(
    a_desc,
    b_desc,
    as_ptr,
    bs_ptr,
    alpha_ptr,
    bias_ptr,
    out_ptr,
    M,
    N,
    K,
    stride_as0,
    stride_as1,
    stride_bs0,
    stride_bs1,
    stride_om,
    num_programs,
    B_ROWS_PER_SCALE: tl.constexpr,
    HAS_ALPHA: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    """fp8_block x fp8_block through TMA: ``a_desc`` [M, K] and ``b_desc`` [N, K] float8 descriptors with
    [BM, BK] / [BN, BK] boxes (TMA zero-fills past M, N and K, so no masks in the main loop), fp32 block
    scales read with plain loads. BK is 128, the scale block: each K tile's FP8 product is promoted by
    ``sa[m] * sb`` in fp32 (DeepSeek-V3's promotion). With 128x128 weight blocks and BN dividing 128, ``sb`` is
    one scalar per tile, so the promotion is one FMA per accumulator element.

    ``num_programs`` programs stride over the tiles: one per tile, or fewer for a persistent launch
    (``tl.range(..., flatten=True)`` lets the pipeliner prefetch the next tile's first K tiles while this one
    finishes)."""
    num_m = tl.cdiv(M, BM)
    num_n = tl.cdiv(N, BN)
    k_tiles = tl.cdiv(K, BK)
    tiles = num_m * num_n
    per_group = GROUP_M * num_n
    SCALAR_B: tl.constexpr = B_ROWS_PER_SCALE % BN == 0
    for tile in tl.range(tl.program_id(0), tiles, num_programs, flatten=True):
        group_first_m = (tile // per_group) * GROUP_M
        size_m = tl.minimum(num_m - group_first_m, GROUP_M)
        pid_m = group_first_m + (tile % per_group) % size_m
        pid_n = (tile % per_group) // size_m
        off_m = pid_m * BM
        off_n = pid_n * BN
        rows_a = off_m + tl.arange(0, BM)
        ok_a = rows_a < M
        sa_ptrs = as_ptr + rows_a.to(tl.int64) * stride_as0
        if SCALAR_B:
            sb_ptr = bs_ptr + (off_n // B_ROWS_PER_SCALE) * stride_bs0
        else:
            rows_b = off_n + tl.arange(0, BN)
            sb_ptrs = bs_ptr + (tl.minimum(rows_b, N - 1) // B_ROWS_PER_SCALE).to(tl.int64) * stride_bs0
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for kt in range(k_tiles):
            a = a_desc.load([off_m, kt * BK])
            b = b_desc.load([off_n, kt * BK])
            sa = tl.load(sa_ptrs + kt * stride_as1, mask=ok_a, other=0.0)
            part = tl.dot(a, b.T)
            if SCALAR_B:
                acc += part * (sa * tl.load(sb_ptr + kt * stride_bs1))[:, None]
            else:
                acc += part * sa[:, None] * tl.load(sb_ptrs + kt * stride_bs1)[None, :]
        if HAS_ALPHA:
            acc = acc * tl.load(alpha_ptr)
        offs_n = off_n + tl.arange(0, BN)
        if HAS_BIAS:
            acc = acc + tl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
        mask = ok_a[:, None] & (offs_n < N)[None, :]
        ptrs = out_ptr + rows_a.to(tl.int64)[:, None] * stride_om + offs_n[None, :]
        tl.store(ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def dequant_epilogue_kernel(acc_ptr, out_ptr, inv_a_ptr, inv_b_ptr, alpha_ptr, bias_ptr, M, C, stride_out,
                            HAS_A: tl.constexpr, HAS_B: tl.constexpr, HAS_ALPHA: tl.constexpr,
                            HAS_BIAS: tl.constexpr, BM: tl.constexpr, BC: tl.constexpr):
    """The ``"dequant"`` route's epilogue in one pass: ``out[m, c] = acc[m, c] * inv_a * inv_b * alpha +
    bias[c]`` for an fp32 partial product ``acc`` [M, C] (contiguous) and ``out`` rows ``stride_out`` apart,
    each step one fp32 rounding in that order (the launcher turns fused multiply-adds off), then one rounding
    to out's dtype: the bits of the same steps as separate torch ops. With ``acc`` a bfloat16 product and
    ``out`` the same tensor (in place), only a bias: the bias pass of the DeepGEMM routes."""
    pid_m = tl.program_id(0)
    pid_c = tl.program_id(1)
    rows = pid_m * BM + tl.arange(0, BM)
    cols = pid_c * BC + tl.arange(0, BC)
    mask = (rows < M)[:, None] & (cols < C)[None, :]
    r64 = rows.to(tl.int64)[:, None]
    v = tl.load(acc_ptr + r64 * C + cols[None, :], mask=mask, other=0.0)
    if HAS_A:
        v = v * tl.load(inv_a_ptr)
    if HAS_B:
        v = v * tl.load(inv_b_ptr)
    if HAS_ALPHA:
        v = v * tl.load(alpha_ptr)
    if HAS_BIAS:
        v = v + tl.load(bias_ptr + cols, mask=cols < C, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + r64 * stride_out + cols[None, :], v.to(out_ptr.dtype.element_ty), mask=mask)
