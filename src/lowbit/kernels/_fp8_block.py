"""Triton kernels for fp8_block (DeepSeek-V3 FP8: E4M3 values, fp32 scale per 1x128 or 128x128 block).

Every fp32 operation reproduces ``lowbit.formats.fp8_block`` bit for bit:

- amax is a max over ``bits & 0x7FFFFFFF`` as int32: for non-negative floats the integer order is the
  float order, and every NaN (of either sign) sorts above +Inf, so the max propagates NaN as
  ``torch.amax`` does (``tl.max`` on floats would drop it). The 1e-4 clamp is the same integer max, so
  a NaN amax stays NaN.
- ``s = amax / 448`` and ``1 / s`` use ``tl.div_rn`` (IEEE); a plain ``/`` is approximate in Triton.
- (1, 128) values are ``x / s`` correctly rounded, without a per-element ``div.rn`` (~10 instructions
  and a slow-path branch): per block ``r = RN(1/s)``, per element ``q0 = RN(x*r)`` and twice the
  correction ``q' = fma(fma(q, s, -x), -r, q) = RN(q + (x - q*s)*r)`` (the remainder ``q*s - x`` of a
  faithful q is exact in one fma). ``q0`` can be 1.1 ulp off (not faithful), so the first step only
  brings it within 0.5 + 2^-23 ulp; the second then meets Markstein's theorem (``r`` within half an ulp
  of 1/s, ``q`` within one ulp of x/s => ``q'`` = RN(x/s)), the last step of CUDA's ``div.rn.f32`` fast
  path too. No under/overflow: ``|x/s| <= 448`` and ``s >= 1e-4/448`` is normal, so only quotients
  below 2^-100 could be off, and those are +-0 in E4M3 either way. The negated remainder keeps
  ``-0 / s = -0`` (``fma(-q, s, x)`` would give ``+0`` there). A block with ``s = +Inf`` uses 0 for s in
  the fma: ``q0 + (-x)(-0) = x * 0`` (+-0; NaN for +-Inf elements), which is ``x / Inf``.
  With ``scale_fmt="ue8m0"`` s is a power of two and ``RN(x * (1/s))`` is already the quotient.
- (128, 128) values are ``x * RN(1/s)`` (DeepGEMM multiplies by the reciprocal).
- E4M3: ``cvt.rn.satfinite.e4m3x2.f32`` (what ``.to(tl.float8e4nv)`` emits on sm_90) rounds to nearest
  even like torch; quotients never exceed 448 * (1 + 2^-23) (or are NaN), so the reference's clamp to
  +-448 changes nothing, and NaN becomes 0x7F (see ``e4m3_codes``).
- NaN scales are stored as 0x7FC00000 and NaN outputs of dequantize as 0x7FC00000 / bf16 0x7FC0 /
  fp16 0x7E00 (GPU arithmetic makes 0x7FFFFFFF), selected on integer bits so no compiler pass can
  treat the select as a no-op.
"""

import triton
import triton.language as tl

from .device import e4m3_codes, rn_quotient, scale_from_amax_bits

GROUP = 128
FP8_MAX = 448.0
AMAX_EPS_BITS = 0x38D1B717  # fp32(1e-4)
CANONICAL_NAN_F32 = 0x7FC00000


@triton.jit
def _canonical_f32_bits(v):
    return tl.where(v != v, 0x7FC00000, v.to(tl.int32, bitcast=True))  # noqa: PLR0124


@triton.jit
def _batched_tile(M, K, n_mblocks, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    """The [BLOCK_M, BLOCK_K] tile of a program of the grid (B * n_mblocks, cdiv(K, BLOCK_K)) over [B, M, K]:
    (pid_k, rows m, columns, row mask, tile mask, batch index and rows as int64)."""
    pid = tl.program_id(0)
    b = pid // n_mblocks
    pid_m = pid - b * n_mblocks
    pid_k = tl.program_id(1)
    m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    row_ok = m < M
    mask = row_ok[:, None] & (cols < K)[None, :]
    b64 = b.to(tl.int64)
    m64 = m.to(tl.int64)
    return pid_k, m, cols, row_ok, mask, b64, m64


@triton.jit
def quantize_rowwise_kernel(x_ptr, q_ptr, s_ptr, M, K, stride_xm, MIN_SCALE_BITS: tl.constexpr,
                             BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    """fp8_rowwise (``lowbit.formats.fp8_rowwise``): x [M, K] (last dim contiguous) -> codes [M, K]
    contiguous, scales [M] with ``s = max(amax / 448, MIN_SCALE)`` and codes ``e4m3(x / s)``. Two passes over
    each row: its amax (integer max of the bits, which keeps NaN), then the quotients (the row is read again,
    from L2 for all but the longest rows). The scale's max is an integer max too, so a NaN amax stays NaN."""
    m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = m < M
    m64 = m.to(tl.int64)
    abits = tl.zeros((BLOCK_M,), dtype=tl.int32)
    for kt in range(tl.cdiv(K, BLOCK_K)):
        cols = kt * BLOCK_K + tl.arange(0, BLOCK_K)
        mask = row_ok[:, None] & (cols < K)[None, :]
        x = tl.load(x_ptr + m64[:, None] * stride_xm + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        abits = tl.maximum(abits, tl.max(x.to(tl.int32, bitcast=True) & 0x7FFFFFFF, axis=1))
    s = tl.div_rn(abits.to(tl.float32, bitcast=True), 448.0)
    s = tl.maximum(s.to(tl.int32, bitcast=True), MIN_SCALE_BITS).to(tl.float32, bitcast=True)
    r = tl.div_rn(1.0, s)
    for kt in range(tl.cdiv(K, BLOCK_K)):
        cols = kt * BLOCK_K + tl.arange(0, BLOCK_K)
        mask = row_ok[:, None] & (cols < K)[None, :]
        x = tl.load(x_ptr + m64[:, None] * stride_xm + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        q = rn_quotient(x, x.to(tl.int32, bitcast=True), s[:, None], r[:, None])
        tl.store(q_ptr + m64[:, None] * K + cols[None, :], e4m3_codes(q).to(tl.float8e4nv, bitcast=True),
                 mask=mask)
    tl.store(s_ptr + m64, _canonical_f32_bits(s).to(tl.float32, bitcast=True), mask=row_ok)


@triton.jit
def quantize_1x128_kernel(
    x_ptr, q_ptr, s_ptr,
    M, K, stride_xb, stride_xm, n_mblocks,
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, POW2_SCALE: tl.constexpr, COLUMN_SCALES: tl.constexpr,
):
    """x [B, M, K] (last dim contiguous) -> codes [B, M, K] contiguous, scales [B, M, G].

    Grid: (B * n_mblocks, cdiv(K, BLOCK_K)). Scales: row-major ``(b*M + m)*G + g``, or with
    COLUMN_SCALES the MN-major TMA-aligned storage ``[B, G, Mp]`` (Mp = round_up(M, 4)) at
    ``(b*G + g)*Mp + m``, whose padding rows m in [M, Mp) are written as 0 (BLOCK_M is a multiple of 4).
    """
    pid_k, m, cols, row_ok, mask, b64, m64 = _batched_tile(M, K, n_mblocks, BLOCK_M, BLOCK_K)
    x_row = b64 * stride_xb + m64 * stride_xm
    x = tl.load(x_ptr + x_row[:, None] + cols[None, :], mask=mask, other=0.0).to(tl.float32)

    NG: tl.constexpr = BLOCK_K // 128
    xg = tl.reshape(x, (BLOCK_M, NG, 128))
    xbits = xg.to(tl.int32, bitcast=True)
    s = scale_from_amax_bits(tl.max(xbits & 0x7FFFFFFF, axis=2), POW2_SCALE)
    r = tl.div_rn(1.0, s)
    if POW2_SCALE:
        q = xg * r[:, :, None]
    else:
        q = rn_quotient(xg, xbits, s[:, :, None], r[:, :, None])
    codes = tl.reshape(e4m3_codes(q), (BLOCK_M, BLOCK_K))
    row_g = b64 * M + m64
    tl.store(q_ptr + row_g[:, None] * K + cols[None, :], codes.to(tl.float8e4nv, bitcast=True), mask=mask)

    G = tl.cdiv(K, 128)
    g = pid_k * NG + tl.arange(0, NG)
    sbits = _canonical_f32_bits(s)
    if COLUMN_SCALES:
        mp = tl.cdiv(M, 4) * 4
        soff = (b64 * G + g[None, :]) * mp + m64[:, None]
        smask = (m < mp)[:, None] & (g < G)[None, :]
        sbits = tl.where(row_ok[:, None], sbits, 0)
    else:
        soff = row_g[:, None] * G + g[None, :]
        smask = row_ok[:, None] & (g < G)[None, :]
    tl.store(s_ptr + soff, sbits.to(tl.float32, bitcast=True), mask=smask)


@triton.jit
def quantize_128x128_kernel(
    x_ptr, q_ptr, s_ptr,
    N, K, stride_xn,
    POW2_SCALE: tl.constexpr,
):
    """x [N, K] (last dim contiguous) -> codes [N, K] contiguous, scales [cdiv(N,128), cdiv(K,128)].

    One program per 128x128 block; grid (cdiv(N, 128), cdiv(K, 128)).
    """
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rows = pid_n.to(tl.int64) * 128 + tl.arange(0, 128)
    cols = pid_k * 128 + tl.arange(0, 128)
    mask = (rows < N)[:, None] & (cols < K)[None, :]
    x = tl.load(x_ptr + rows[:, None] * stride_xn + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    abits = tl.max(tl.max(x.to(tl.int32, bitcast=True) & 0x7FFFFFFF, axis=1), axis=0)
    s = scale_from_amax_bits(abits, POW2_SCALE)
    q = x * tl.div_rn(1.0, s)
    codes = e4m3_codes(q)
    tl.store(q_ptr + rows[:, None] * K + cols[None, :], codes.to(tl.float8e4nv, bitcast=True), mask=mask)
    tl.store(s_ptr + pid_n * tl.cdiv(K, 128) + pid_k, _canonical_f32_bits(s).to(tl.float32, bitcast=True))


@triton.jit
def dequantize_fp8_block_kernel(
    q_ptr, s_ptr, out_ptr,
    M, K, n_mblocks, stride_sb, stride_sm, stride_sg,
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, ROWS_PER_SCALE: tl.constexpr, OUT_KIND: tl.constexpr,
):
    """codes [B, M, K] contiguous -> out [B, M, K] contiguous: ``fp32(code) * scale`` cast to the output.

    The scale of (b, m, k) is at ``b*stride_sb + (m // ROWS_PER_SCALE)*stride_sm + (k // 128)*stride_sg``
    (any layout: row-major, column-major, 128x128). OUT_KIND: 0 fp32, 1 bf16, 2 fp16.
    """
    pid_k, m, cols, row_ok, mask, b64, m64 = _batched_tile(M, K, n_mblocks, BLOCK_M, BLOCK_K)
    off = (b64 * M + m64)[:, None] * K + cols[None, :]
    codes = tl.load(q_ptr + off, mask=mask, other=0.0)

    NG: tl.constexpr = BLOCK_K // 128
    g = pid_k * NG + tl.arange(0, NG)
    smask = row_ok[:, None] & (g < tl.cdiv(K, 128))[None, :]
    soff = b64 * stride_sb + (m64 // ROWS_PER_SCALE)[:, None] * stride_sm + g[None, :] * stride_sg
    s = tl.load(s_ptr + soff, mask=smask, other=0.0)

    v = tl.reshape(codes.to(tl.float32), (BLOCK_M, NG, 128)) * s[:, :, None]
    v = tl.reshape(v, (BLOCK_M, BLOCK_K))
    if OUT_KIND == 0:
        out = _canonical_f32_bits(v).to(tl.float32, bitcast=True)
    elif OUT_KIND == 1:
        bits = v.to(tl.bfloat16).to(tl.int16, bitcast=True)
        nan = v != v  # noqa: PLR0124
        out = tl.where(nan, 0x7FC0, bits).to(tl.int16).to(tl.bfloat16, bitcast=True)
    else:
        bits = v.to(tl.float16).to(tl.int16, bitcast=True)
        nan = v != v  # noqa: PLR0124
        out = tl.where(nan, 0x7E00, bits).to(tl.int16).to(tl.float16, bitcast=True)
    tl.store(out_ptr + off, out, mask=mask)
