"""The routes of ``lowbit.kernels.scaled_mm`` that do not run lowbit's decoding GEMM as it is: each one's
capability check (``*_unsupported``: None where the pair can take it, else why not; ``lowbit.ops.policy`` routes
with them) and its implementation.

- ``"gemv"``: the activation decoded to bf16 exactly, then the W4A16 GEMV (``lowbit.kernels.gemv_w4``);
- ``"dequant"``: nvfp4 x nvfp4, or a pair of 6/8-bit MX operands, decoded to bf16 exactly, then cuBLAS's bf16
  GEMM (the MX pairs with the decoding kernel as a guarded exact fallback);
- ``"fold"``: mxfp4 re-encoded exactly as E4M3, then an FP8 GEMM (cuBLASLt's or the TMA kernel), with the
  decoding kernel as a guarded exact fallback; ``"fold_deepgemm"``: the same with DeepGEMM's FP8 GEMM;
- ``"cublas"``: cuBLASLt's block-scaled FP8 GEMM (:mod:`lowbit.kernels.cublas_fp8_block`);
- ``"deepgemm"``: DeepGEMM's FP8 GEMM where it is installed (:mod:`lowbit.kernels.deep_gemm_fp8`).
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
import triton

from ..formats.qtensor import QTensor
from ..formats.shards import plan_rows
from . import cublas_fp8_block as cb
from . import deep_gemm_fp8 as dg
from . import interpreting as _interpreting
from .scaled_mm_launch import config_for, launch_fp8_block_tma, launch_decoding, operand_args, tma_ready


_GEMV_ACTIVATIONS = ("nvfp4", "mxfp4", "fp8_rowwise")


def gemv_unsupported(a: QTensor, b: QTensor) -> str | None:
    """None when this pair can run through ``lowbit.kernels.gemv_w4`` (the ``"gemv"`` route), else why not.

    At small M the GEMM streams the 4-bit weight and the GEMV streams it faster. The activation is decoded
    to bf16 first, exactly: an E2M1 value times its E4M3 or E8M0 block scale, or an E4M3 value, is a bf16
    value. What its scales leave over (nvfp4's global scale, fp8_rowwise's per-token scale, alpha) is one
    fp32 factor per row in the GEMV's epilogue, so the result is the block-scaled product up to fp32
    accumulation order, as in the GEMM."""
    from . import gemv_w4

    if a.shape[0] > gemv_w4.MAX_M:
        return f"M = {a.shape[0]} > {gemv_w4.MAX_M} (the GEMV's rows)"
    if b.fmt not in ("nvfp4", "mxfp4") or a.fmt not in _GEMV_ACTIVATIONS:
        return f"the GEMV takes nvfp4/mxfp4 weights with {'/'.join(_GEMV_ACTIVATIONS)} activations"
    if _interpreting():
        return "the GEMV route is for the GPU"
    return gemv_w4.supports(b)


def scaled_gemv(a: QTensor, b: QTensor, alpha, bias, out_dtype) -> torch.Tensor:
    from . import blockscaled, gemv_w4

    factor = divisor = None
    if a.fmt == "fp8_rowwise":
        x = a.data.to(torch.bfloat16)
        factor = a.scale.reshape(-1)
    else:
        plain, g, divides = without_global(a)
        if a.fmt == "nvfp4":
            x = blockscaled.dequantize_nvfp4(plain, torch.bfloat16)
            if divides:
                divisor = g
            else:
                factor = g
        else:
            x = blockscaled.dequantize_mx(plain, torch.bfloat16)
    if alpha is not None:
        if divisor is not None:
            factor, divisor = alpha / divisor, None
        else:
            factor = alpha if factor is None else factor * alpha
    return gemv_w4.gemv_w4(x, b, bias=bias, row_scale=factor, divide_by=divisor, out_dtype=out_dtype)


DEQUANT_MX_FORMATS = ("mxfp8_e4m3", "mxfp8_e5m2", "mxfp6_e2m3", "mxfp6_e3m2")
"""MX element formats whose pairs the ``"dequant"`` route takes (mxfp4 weights take the ``"fold"`` route)."""

MX_BF16_EXACT_SCALES = (10, 239)
"""Biased E8M0 scales (inclusive) for which every element of these MX formats times 2^(s - 127) is a bf16 value:
at most 4 significant bits stay inside bf16's finite range and above its subnormal step 2^-133. E5M2, the widest
(57344 = 1.75 * 2^15 down to the subnormal 2^-16), sets both ends; E4M3 (448 down to 2^-9) and the FP6 formats
fit inside, so one range serves every pair."""


def dequant_unsupported(a: QTensor, b: QTensor) -> str | None:
    """None when this pair can run the ``"dequant"`` route (:func:`dequant_mm`), else why not.

    An nvfp4 value without its global scale, an E2M1 element times its E4M3 block scale, has at most 6
    significant bits and an exponent inside bf16's range: both operands decode to bf16 exactly, and cuBLAS's
    bf16 GEMM with fp32 accumulation then computes the block-scaled product up to accumulation order, as the
    decoding kernel does. (E2M1 x E4M3 does not fit E4M3, so the FP8 tensor cores cannot take it exactly.)

    An MX element of 6 or 8 bits times its power-of-two scale is a bf16 value while the scale stays within
    :data:`MX_BF16_EXACT_SCALES`; a block outside it (or a NaN scale) sets a device flag, and the decoding kernel,
    launched behind the GEMM with that flag as its guard, recomputes the whole output, as the ``"fold"`` route
    does. (Per-32 scales would need a promotion every 32 columns of K on the FP8 tensor cores.)"""
    mx_pair = a.fmt in DEQUANT_MX_FORMATS and b.fmt in DEQUANT_MX_FORMATS
    if not mx_pair and (a.fmt != "nvfp4" or b.fmt != "nvfp4"):
        return "the dequant route takes nvfp4 x nvfp4 pairs and pairs of " + "/".join(DEQUANT_MX_FORMATS)
    if len(a.shape) != 2 or len(b.shape) != 2:
        return "the dequant route takes 2-D operands"
    if _interpreting():
        return "the dequant route is for the GPU"
    return None


def without_global(q: QTensor) -> tuple[QTensor, torch.Tensor | None, bool]:
    """(q without its per-tensor scale, that scale as fp32 [1] or None, whether it divides (a global
    multiplier) rather than multiplies (torchao's per_tensor_scale))."""
    pts = q.params.get("per_tensor_scale")
    plain = dataclasses.replace(
        q, global_scale=None, params={key: v for key, v in q.params.items() if key != "per_tensor_scale"})
    if pts is not None:
        return plain, torch.as_tensor(pts, dtype=torch.float32, device=q.data.device).reshape(1), False
    if q.global_scale is not None:
        return plain, q.global_scale.reshape(1).to(device=q.data.device, dtype=torch.float32), True
    return plain, None, False


DEQUANT_CHUNK_BYTES = 1 << 30
"""Largest decoded weight chunk and fp32 partial product the ``"dequant"`` route holds at once: 1 GiB, so the
Wan2.1-14B-shaped projections run as one GEMM up to M = 32760 where N = 5120 (13824 x 5120 in two), at the cost
of that much transient memory. H200, one w4a4-nvfp4 ``QuantLinear`` against cuBLAS bf16
(``benchmarks/experiments/profile_dequant_route.py``, graph / eager): at M = 32760, 256 MiB chunks ran
5120 x 5120 at 0.82 / 0.83x, 5120 x 13824 at 0.90 / 0.83x, 13824 x 5120 at 0.88 / 0.90x; 1 GiB at 0.82 / 0.84x,
0.91 / 0.94x, 0.93 / 0.92x; at M = 8190 on 13824 x 5120 0.82 / 0.91x against 0.85 / 0.90x. (Before: 64 MiB
chunks at M = 8190 on 5120 x 5120, three GEMMs, ran at 0.49 / 0.70x, 256 MiB at 0.74 / 0.77x.)"""


def _mm_fp32(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``x @ w.T`` of bf16 operands as the fp32 accumulator cuBLAS computes (``mm`` with ``out_dtype``), or
    rounded to bf16 first where this torch has no such ``mm`` (one more rounding, inside the GEMM tolerance)."""
    kind = x.device.type
    if _MM_DTYPE.get(kind, True):
        try:
            return torch.mm(x, w.t(), out_dtype=torch.float32)
        except (TypeError, RuntimeError, NotImplementedError):
            _MM_DTYPE[kind] = False
    return torch.mm(x, w.t()).float()


_MM_DTYPE: dict = {}  # device type -> whether mm takes out_dtype there


def mx_scales_outside_bf16(q: QTensor) -> torch.Tensor:
    """int32 [1] on q's device, nonzero when a block scale of the MX tensor ``q`` lies outside
    :data:`MX_BF16_EXACT_SCALES` (NaN included): its decoding to bf16 would round. No host synchronization."""
    from ..formats.blockscaled_generic import linear_scales

    s = linear_scales(q, 32).view(torch.uint8)
    lo, hi = MX_BF16_EXACT_SCALES
    return ((s < lo) | (s > hi)).any().to(torch.int32).reshape(1)


def _decode_bf16(q: QTensor) -> torch.Tensor:
    from . import blockscaled

    if q.fmt == "nvfp4":
        return blockscaled.dequantize_nvfp4(q, torch.bfloat16)
    return blockscaled.dequantize_mx(q, torch.bfloat16)


DEQUANT_EPILOGUE_TILE = {"BM": 16, "BC": 256}


def dequant_epilogue(acc: torch.Tensor, out: torch.Tensor, inv_a: torch.Tensor | None, inv_b: torch.Tensor | None,
                     alpha: torch.Tensor | None, bias: torch.Tensor | None) -> None:
    """``out[:] = ((acc * inv_a) * inv_b) * alpha + bias`` rounded once to out's dtype, for an fp32 ``acc``
    [M, C] (contiguous), ``out`` [M, C] with unit column stride, fp32 [1] factors and ``bias`` [C] (any dtype,
    exact in fp32), each optional: one launch reading ``acc`` once, where the torch ops it replaces made three
    passes over it; the same bits (no fused multiply-add). ``acc`` may be a bfloat16 product and ``out`` that
    same tensor: the in-place bias pass of the DeepGEMM routes. The compiled launch is kept
    (``lowbit.kernels._launch.launch``)."""
    from . import _scaled_mm as k
    from ._launch import launch

    m, c = acc.shape
    if m == 0 or c == 0:
        return
    t = DEQUANT_EPILOGUE_TILE
    grid = (triton.cdiv(m, t["BM"]), triton.cdiv(c, t["BC"]))
    launch(k.dequant_epilogue_kernel, grid, (
        acc, out, acc if inv_a is None else inv_a, acc if inv_b is None else inv_b, acc if alpha is None else alpha,
        acc if bias is None else bias, m, c, out.stride(0)), HAS_A=inv_a is not None, HAS_B=inv_b is not None,
        HAS_ALPHA=alpha is not None, HAS_BIAS=bias is not None, num_warps=4, enable_fp_fusion=False, **t)


def dequant_mm(a: QTensor, b: QTensor, alpha, bias, out_dtype) -> torch.Tensor:
    """The ``"dequant"`` route: ``a`` decoded exactly to bf16, ``b`` a chunk of rows at a time (at most
    :data:`DEQUANT_CHUNK_BYTES` of decoded weight or fp32 partial product), each chunk through cuBLAS's bf16
    GEMM with fp32 accumulation, then the decoding kernel's epilogue in its order (1 / global multiplier or
    per_tensor_scale of a, of b, alpha, bias) and one rounding to ``out_dtype``. Without global scales or
    alpha and with a bf16 output, cuBLAS writes the output itself (bias in its epilogue): one ``F.linear``
    when the decoded weight fits one chunk, else each chunk's columns in place. MX pairs end with the guarded
    decoding kernel (:func:`dequant_unsupported`)."""
    pa, ga, ga_div = without_global(a)
    m, k_dim = a.shape
    n = b.shape[0]
    guard = None
    if a.fmt != "nvfp4":
        guard = mx_scales_outside_bf16(a) | mx_scales_outside_bf16(b)
    x = _decode_bf16(pa)
    inv_a = None if ga is None else (torch.div(1.0, ga) if ga_div else ga)
    out = _dequant_gemm(x, inv_a, b, alpha, bias, out_dtype)
    if guard is not None:
        a_args, ac = operand_args(a)
        b_args, bc = operand_args(b)
        launch_decoding(a_args, ac, b_args, bc, m, n, k_dim, alpha, bias, out, config_for(m, False), guard=guard,
                        plan_n=plan_rows(b))
    return out


def dequant_mm_decoded(x: torch.Tensor, global_scale: torch.Tensor | None, b: QTensor, alpha, bias,
                       out_dtype, w_decoded: torch.Tensor | None = None) -> torch.Tensor:
    """The ``"dequant"`` route of an nvfp4 weight ``b`` for an activation already decoded: ``x`` the bf16 values
    of its codes without the global multiplier ``global_scale`` (fp32 [1] or None), as
    ``lowbit.kernels.blockscaled.quantize_nvfp4_decoded`` writes them. The bits of :func:`dequant_mm` on the
    quantized activation. ``w_decoded``: the whole weight already decoded without its global scale (bf16, as
    the route decodes it), where the route takes it in one chunk (:func:`dequant_chunk_rows`)."""
    return _dequant_gemm(x, None if global_scale is None else torch.div(1.0, global_scale), b, alpha, bias,
                         out_dtype, w_decoded)


def dequant_chunk_rows(m: int, k_dim: int, b_plain: QTensor, direct: bool) -> int:
    """Weight rows per chunk of the ``"dequant"`` route's GEMMs at M = ``m`` (``b_plain``: the weight without its
    per-tensor scale; ``direct``: cuBLAS writes the output, no fp32 partial product): the whole weight where
    its decoding and the product fit :data:`DEQUANT_CHUNK_BYTES` or its rows cannot be sliced."""
    from ..formats.rows import ROW_ALIGN, slice_rows_reason

    n = b_plain.shape[0]
    align = ROW_ALIGN.get(b_plain.fmt, 128)
    rows = DEQUANT_CHUNK_BYTES // (2 * k_dim)
    if not direct:
        rows = min(rows, DEQUANT_CHUNK_BYTES // (4 * max(m, 1)))
    rows = max(align, rows) // align * align
    if rows >= n or slice_rows_reason(b_plain) is not None:
        rows = n
    return rows


def _dequant_gemm(x: torch.Tensor, inv_a: torch.Tensor | None, b: QTensor, alpha, bias, out_dtype,
                  w_decoded: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`dequant_mm` after the activation's decoding: ``x`` [M, K] bf16, ``inv_a`` its per-tensor factor;
    ``w_decoded`` as :func:`dequant_mm_decoded` takes it."""
    from ..formats.rows import slice_rows

    pb, gb, gb_div = without_global(b)
    m, k_dim = x.shape
    n = b.shape[0]
    inv_b = None if gb is None else (torch.div(1.0, gb) if gb_div else gb)
    # no epilogue of ours: cuBLAS writes the bf16 output (and adds the bias) itself, no fp32 partial product
    direct = inv_a is None and inv_b is None and alpha is None and out_dtype == torch.bfloat16
    # a weight decoded whole is taken whole (its memory is spent already)
    rows = n if w_decoded is not None else dequant_chunk_rows(m, k_dim, pb, direct)
    one_linear = direct and rows == n  # F.linear allocates the output
    out = None if one_linear else torch.empty((m, n), dtype=out_dtype, device=x.device)
    b16 = None if bias is None or not direct else bias.to(torch.bfloat16)
    for n0 in range(0, n, rows):
        n1 = min(n, n0 + rows)
        if w_decoded is not None:
            w = w_decoded
        else:
            w = _decode_bf16(pb if (n0, n1) == (0, n) else slice_rows(pb, n0, n1))
        if direct:
            if one_linear:
                out = F.linear(x, w, b16)
            elif b16 is None:
                torch.mm(x, w.t(), out=out[:, n0:n1])
            else:
                torch.addmm(b16[n0:n1], x, w.t(), out=out[:, n0:n1])
            continue
        acc = _mm_fp32(x, w)
        a32 = None if alpha is None else alpha.reshape(1).to(torch.float32)
        if acc.is_cuda and not _interpreting():
            dequant_epilogue(acc, out[:, n0:n1], inv_a, inv_b, a32, None if bias is None else bias[n0:n1])
            continue
        if inv_a is not None:
            acc.mul_(inv_a)
        if inv_b is not None:
            acc.mul_(inv_b)
        if a32 is not None:
            acc.mul_(a32)
        if bias is not None:
            acc.add_(bias[n0:n1].to(torch.float32))
        out[:, n0:n1] = acc
    return out


_FOLD_ACTIVATIONS = ("mxfp4", "fp8_rowwise", "fp8_block")


def fold_unsupported(a: QTensor, b: QTensor) -> str | None:
    """None when this pair can run on the FP8 tensor cores through ``mxfp4_as_fp8_block`` (the ``"fold"``
    route), else why not.

    An E2M1 value times a power of two is exact in E4M3 while the exponent stays in range, so MXFP4 data
    becomes E4M3 values with one fp32 scale per 128x128 block (the weight) or per row and 128 columns (an
    mxfp4 activation) and the same fp32 value per element (``lowbit.formats.blockscaled.mxfp4_as_fp8_block``).
    The operands are re-encoded on every call by a memory-bound kernel (the weight is read at 4 bits and
    written at 8: the FP8 copy is a per-call scratch, never kept), and the product is the fp8_block GEMM of
    DeepSeek-V3 weights (cuBLASLt's where :mod:`lowbit.kernels.cublas_fp8_block` takes it, else the TMA kernel).
    A block the re-encoding cannot hold (a NaN scale, or a nonzero MX block more than
    ``lowbit.formats.blockscaled.FOLD_WINDOW`` (11) binades below the largest of its 128x128 or 1x128 block)
    sets a device flag, and the decoding kernel, launched behind the GEMM with that flag as its guard,
    recomputes the whole output: the result is the block-scaled product up to fp32 accumulation order either
    way, without a host synchronization."""
    if b.fmt != "mxfp4" or a.fmt not in _FOLD_ACTIVATIONS:
        return f"the FP8 re-encoding takes mxfp4 weights with {'/'.join(_FOLD_ACTIVATIONS)} activations"
    if _interpreting():
        return "the FP8 re-encoding feeds the TMA kernel, which is for the GPU"
    return None


def fold_deepgemm_unsupported(a: QTensor, b: QTensor, bias, out_dtype) -> str | None:
    """None when this pair can take the ``"fold_deepgemm"`` route: the ``"fold"`` route's re-encoding with
    DeepGEMM's FP8 GEMM behind it (:mod:`lowbit.kernels.deep_gemm_fp8`), else why not."""
    why = fold_unsupported(a, b)
    if why is not None:
        return why
    m, k_dim = a.shape
    # the re-encoding writes contiguous E4M3 data and fp32 scales; an E4M3 activation must be so already
    contiguous = a.fmt == "mxfp4" or a.data.is_contiguous()
    return dg.unsupported(m, b.shape[0], k_dim, a.data.device, contiguous, True, bias, out_dtype)


def fold_mm(a: QTensor, b: QTensor, alpha, bias, out_dtype, cfg: dict, cublas: bool | None = None,
            deepgemm: bool = False) -> torch.Tensor:
    """The ``"fold"`` route (``deepgemm``: the ``"fold_deepgemm"`` one, :func:`fold_deepgemm_unsupported` must
    have said yes; cuBLASLt's or the TMA kernel's GEMM instead should DeepGEMM's first call fail)."""
    from . import blockscaled

    m, k_dim = a.shape
    n = b.shape[0]
    device = a.data.device
    # an mxfp4 activation is re-encoded into a fresh, aligned tensor
    why = cb.unsupported(m, n, k_dim, device, a.fmt == "mxfp4" or cb.aligned(a.data), bias, out_dtype)
    if cublas and why is not None:
        raise ValueError(f"cublas=True: {why}")
    use_cublas = why is None and cublas is not False
    dropped = torch.zeros(1, dtype=torch.int32, device=device)
    # 128x128 weight blocks: one scale per weight tile, so the promotion is one FMA per accumulator element;
    # DeepGEMM reads them [N/128, K/128] contiguous, cuBLASLt in rows padded to 4 K tiles
    wb = blockscaled.mxfp4_fold(b, (128, 128), dropped, cublas_scales=use_cublas and not deepgemm)
    if a.fmt == "mxfp4":  # M-major activation scales for cuBLASLt and DeepGEMM alike
        wa = blockscaled.mxfp4_fold(a, (1, 128), dropped, cublas_scales=use_cublas or deepgemm)
        a_data, a_scale = wa.data, wa.scale
    else:
        a_data, a_scale = a.data, a.scale
    if deepgemm:
        def fallback() -> torch.Tensor:
            return fold_mm(a, b, alpha, bias, out_dtype, cfg, cublas)

        sa = cb.activation_scales(a_scale, m, k_dim // 128, alpha)
        out = dg.mm(a_data, sa, wb.data, wb.scale, fallback, bias)
    elif use_cublas:
        out = cb.mm(a_data, a_scale, wb.data, wb.scale, alpha, bias, out_dtype, b_scale_zero_padded=True)
    else:
        if not tma_ready(a_data):
            a_data = a_data.clone(memory_format=torch.contiguous_format)
        # fp8_rowwise: one scale per row serves every K tile (K-tile stride 0)
        s0, s1 = a_scale.stride(0), 0 if a.fmt == "fp8_rowwise" else a_scale.stride(1)
        out = torch.empty((m, n), dtype=out_dtype, device=device)
        launch_fp8_block_tma([a_data, a_scale, None, None, s0, s1],
                       [wb.data, wb.scale, None, None, wb.scale.stride(0), wb.scale.stride(1)],
                       {"ROWS_PER_SCALE": 128}, m, n, k_dim, alpha, bias, out, cfg)
    a_args, ac = operand_args(a)
    b_args, bc = operand_args(b)
    launch_decoding(a_args, ac, b_args, bc, m, n, k_dim, alpha, bias, out, config_for(m, False), guard=dropped,
            plan_n=plan_rows(b))
    return out


def _library_pair_reason(a: QTensor, b: QTensor, library: str) -> str | None:
    """Why a library's FP8 GEMM cannot take this pair as DeepSeek-V3's recipe (None: it can)."""
    if a.fmt != "fp8_block" or b.fmt != "fp8_block" or tuple(b.params.get("block", ())) != (128, 128):
        return f"{library} takes fp8_block activations with 128x128-block fp8_block weights"
    if a.data.dtype != torch.float8_e4m3fn or b.data.dtype != torch.float8_e4m3fn:
        return f"{library} takes E4M3 data"
    return None


def cublas_unsupported(a: QTensor, b: QTensor, bias, out_dtype) -> str | None:
    """None when this fp8_block pair can run on cuBLASLt's block-scaled FP8 GEMM (the ``"cublas"`` route;
    :mod:`lowbit.kernels.cublas_fp8_block`), else why not."""
    why = _library_pair_reason(a, b, "cuBLAS")
    if why is not None:
        return why
    m, k_dim = a.shape
    return cb.unsupported(m, b.shape[0], k_dim, a.data.device, cb.aligned(a.data) and cb.aligned(b.data), bias,
                          out_dtype)


def deepgemm_unsupported(a: QTensor, b: QTensor, bias, out_dtype) -> str | None:
    """None when this fp8_block pair can run on DeepGEMM's FP8 GEMM (the ``"deepgemm"`` route;
    :mod:`lowbit.kernels.deep_gemm_fp8`), else why not."""
    why = _library_pair_reason(a, b, "DeepGEMM")
    if why is not None:
        return why
    m, k_dim = a.shape
    contiguous = a.data.is_contiguous() and b.data.is_contiguous()
    fp32 = a.scale.dtype == torch.float32 and b.scale.dtype == torch.float32 and a.scale.shape[-1] == k_dim // 128
    return dg.unsupported(m, b.shape[0], k_dim, a.data.device, contiguous, fp32, bias, out_dtype)


def deepgemm_mm(a: QTensor, b: QTensor, alpha, bias, out_dtype) -> torch.Tensor:
    """The ``"deepgemm"`` route; should DeepGEMM's first call fail, cuBLASLt's route (or lowbit's kernel)."""

    def fallback() -> torch.Tensor:
        if cublas_unsupported(a, b, bias, out_dtype) is None:
            return cb.mm(a.data, a.scale, b.data, b.scale, alpha, bias, out_dtype)
        from .scaled_mm import scaled_mm

        return scaled_mm(a, b, alpha, bias, out_dtype, "kernel")

    # M-major activation scales, as DeepGEMM reads them (its layout when M is a multiple of 4, so no copy in
    # DeepGEMM), with alpha folded in as on cuBLASLt's route (one fp32 rounding per scale)
    sa = cb.activation_scales(a.scale, a.shape[0], a.shape[1] // 128, alpha)
    return dg.mm(a.data, sa, b.data, b.scale, fallback, bias)
