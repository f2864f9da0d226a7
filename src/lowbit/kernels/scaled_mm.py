"""Launcher of the two-quantized-operand GEMM (``_scaled_mm``) behind ``lowbit.scaled_mm`` on CUDA.

Contract (``lowbit.ops.scaled_mm``): ``supports(a, b)`` returns None or the reason this module cannot run the
pair; ``scaled_mm(a, b, alpha, bias, out_dtype)`` gets QTensors ``a`` [M, K] and ``b`` [N, K] the op layer has
validated, ``alpha`` None or a fp32 [1] tensor, ``bias`` None or contiguous [N], and returns [M, N].

Tiles are data (``CONFIGS``, by M regime); nothing is autotuned. No host synchronization: calls can be captured
in CUDA graphs.
"""

from __future__ import annotations

import dataclasses
import functools

import torch

from ..formats.qtensor import QTensor
from ..formats.registry import formats_with
from ..formats.shards import plan_rows
from . import _scaled_mm as k
from . import cublas_fp8_block as cb
from .scratch import KeptScratch, split_k_scratch
from . import interpreting as _interpreting
from ._launch import Launch, launch


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)  # triton.cdiv is a constexpr function: microseconds per host call

# (largest M, config); the last entry covers every larger M
CONFIGS: list[tuple[int, dict]] = [
    (64, {"BM": 64, "BN": 128, "BK": 128, "GROUP_M": 1, "num_warps": 4, "num_stages": 3, "split_k": 16}),
    # 4 warps beat 8 for decoded (FP4/FP6/MX) tiles on the H200: 0.41x vs 0.32x cuBLAS bf16 at 4096x7168x16384
    (1 << 62, {"BM": 128, "BN": 128, "BK": 128, "GROUP_M": 8, "num_warps": 4, "num_stages": 4}),
]
# FP8 x FP8 (fp8_block): both raw tiles go to shared memory through TMA descriptors ("tma"; the pointer kernel
# when a base or row stride is not 16-byte aligned). H200 sweep at M=4096 (DeepSeek-V3 shapes, 8192^3):
# persistent 128x128, 8 warps, 3 stages reached 0.57-0.67x torch._scaled_mm per-tensor FP8; the pointer kernel
# 0.39-0.48x, DeepSeek-V3's autotuned Triton fp8_gemm 0.43-0.55x. A second sweep found persistent 64x128,
# 4 warps, 3 stages, two programs per SM best on all six shapes: 0.60-0.72x (128x128 in the same run:
# 0.53-0.68x).
# Decode (M <= 64) splits K over programs, about two per SM (sweep_fp8_decode, CUDA-graph replays over
# weights out of L2, H200).
# M > 1024: the warp-specialized Gluon kernel (_fp8_block_ws: a TMA producer warp, two consumer warpgroups, output
# through TMA stores). H100: 0.67-0.83x torch._scaled_mm on
# five of the six M=4096 / 8192^3 shapes against 0.52-0.67x for the one-partition persistent 64x128 kernel (kept
# as ONE_PARTITION_CONFIG for weights without 128x128 scale blocks). On 4096x7168x2048 it is 0.58 against 0.68
# eagerly: its Gluon launch costs more host time (as graph replays 124 against 154 us).
WS_CONFIG = {"BM": 128, "BN": 128, "BK": 128, "GROUP_M": 8, "num_warps": 4, "num_stages": 4, "tma": True, "ws": True}
ONE_PARTITION_CONFIG = {"BM": 64, "BN": 128, "BK": 128, "GROUP_M": 8, "num_warps": 4, "num_stages": 3, "tma": True,
                        "persistent": True, "per_sm": 2}
# From M = 65 (M % 4 == 0, aligned, bias rules) fp8_block pairs run cuBLASLt's block-scaled GEMM instead
# (lowbit.ops.policy: the "cublas" route); these configs serve the rest (route "kernel").
FP8_CONFIGS: list[tuple[int, dict]] = [
    (16, {"BM": 16, "BN": 128, "BK": 128, "GROUP_M": 1, "num_warps": 4, "num_stages": 3, "split_k": 16,
          "min_k_tiles": 2}),
    (64, {"BM": 64, "BN": 64, "BK": 128, "GROUP_M": 1, "num_warps": 4, "num_stages": 3, "split_k": 16,
          "min_k_tiles": 2}),
    (1024, {"BM": 64, "BN": 128, "BK": 128, "GROUP_M": 8, "num_warps": 4, "num_stages": 4, "tma": True}),
    (1 << 62, WS_CONFIG),
]

# The FP8 re-encoded mxfp4 pairs (the "fold" route) run the TMA kernel on 128x128-block weights; M starts at
# lowbit.ops.policy.FOLD_MIN_M. The fp8_block TMA configs, checked in an H200 sweep with per-row weight
# scales: persistent 64x128, 4 warps, 3 stages, two programs
# per SM was best at M = 4096 on all three shapes; at M = 1024 it and the non-persistent 4-stage config each won
# some shapes.
# The ws kernel would help here on the GPU (H100 graph replays: 135 vs 167 us on
# 4096x7168x2048), but eagerly the route's several launches become host-bound with the Gluon launch (473 vs
# 370 us): it stays on the one-partition kernel until that launch is cheaper.
FOLD_CONFIGS: list[tuple[int, dict]] = [
    (1024, {"BM": 64, "BN": 128, "BK": 128, "GROUP_M": 8, "num_warps": 4, "num_stages": 4, "tma": True}),
    (1 << 62, ONE_PARTITION_CONFIG),
]

_MINIFLOAT = {"mxfp6_e2m3": (2, 3, 1), "mxfp6_e3m2": (3, 2, 3), "mxfp4": (2, 1, 1), "nvfp4": (2, 1, 1)}
_FP8 = ("fp8_block", "fp8_rowwise", "mxfp8_e4m3", "mxfp8_e5m2")
FORMATS = formats_with("scaled_mm")  # the operand formats: _FP8, nvfp4, mxfp4, mxfp6_e2m3, mxfp6_e3m2


def operand_args(q: QTensor) -> tuple[list, dict]:
    """(data, scale, gscale, stride_d, stride_s0, stride_s1, s_cols4) and the constexprs of one operand."""
    fmt = q.fmt
    _rows, k_dim = q.shape
    c = {"KIND": 0, "SMODE": 0, "SWIZZLED": False, "GMODE": 0, "EBITS": 0, "MBITS": 0, "BIAS": 0}
    data = q.data
    scale = q.scale
    gscale = scale
    cols4 = 0
    if fmt == "fp8_block":
        c["SMODE"] = 1
        s0, s1 = scale.stride()
        c["ROWS_PER_SCALE"] = q.params["block"][0]
    elif fmt == "fp8_rowwise":
        c["SMODE"] = 3
        s0, s1 = scale.stride()
    else:
        block = 16 if fmt == "nvfp4" else 32
        c["SMODE"] = 4 if fmt == "nvfp4" else 2
        c["SWIZZLED"] = q.scale_layout == "swizzled"
        scale = scale.contiguous().view(torch.uint8)
        gscale = scale
        cols = k_dim // block
        cols4 = -(-cols // 4) * 4
        s0, s1 = cols, 1
        if fmt in _MINIFLOAT:
            c["KIND"] = 2 if fmt.startswith("mxfp6") else 1
            c["EBITS"], c["MBITS"], c["BIAS"] = _MINIFLOAT[fmt]
            data = data.view(torch.uint8)
        if fmt == "nvfp4":
            pts = q.params.get("per_tensor_scale")
            if pts is not None:
                gscale = torch.as_tensor(pts, dtype=torch.float32, device=data.device).reshape(1)
                c["GMODE"] = 2
            elif q.global_scale is not None:
                gscale = q.global_scale.reshape(1).to(device=data.device, dtype=torch.float32)
                c["GMODE"] = 1
    if data.stride(-1) != 1:
        data = data.contiguous()
    return [data, scale, gscale, data.stride(0), s0, s1, cols4], c


def supports(a, b) -> str | None:
    if not isinstance(a, QTensor) or not isinstance(b, QTensor):
        return "a and b must be QTensors"
    for name, q in (("a", a), ("b", b)):
        if q.fmt not in FORMATS:
            return f"no scaled_mm kernel operand for format {q.fmt!r} ({name})"
        if len(q.shape) != 2:
            return f"{name} must be 2-D, got shape {tuple(q.shape)}"
    if b.fmt == "fp8_rowwise":
        return "fp8_rowwise is an activation (a) format"
    if a.fmt == "fp8_block" and tuple(a.params.get("block", ())) != (1, 128):
        return "fp8_block activation (a) must have block (1, 128)"
    if b.fmt == "fp8_block" and tuple(b.params.get("block", ())) not in ((128, 128), (1, 128)):
        return "fp8_block weight (b) must have block (128, 128) or (1, 128)"
    return None


def _config(m: int, raw_fp8: bool, fold: bool = False) -> dict:
    for limit, cfg in FOLD_CONFIGS if fold else FP8_CONFIGS if raw_fp8 else CONFIGS:
        if m <= limit:
            return dict(cfg)
    raise AssertionError("unreachable")


def _split_k(tiles: int, k_tiles: int, bk: int, cfg: dict, device: torch.device) -> tuple[int, int]:
    """(ways, K columns per way) for configs with ``"split_k"`` (at most that many ways): enough programs for
    about ``ctas_per_sm`` (default 2) per SM when the output has few tiles (decode), each way at least
    ``min_k_tiles`` (default 4) K tiles long; (1, whole K) otherwise."""
    want = cfg.get("split_k", 1)
    if want == 1:
        return 1, k_tiles * bk
    sms = _num_sms(device.index) if device.type == "cuda" else 4
    ways = min(want, max(1, (cfg.get("ctas_per_sm", 2) * sms) // tiles), max(1, k_tiles // cfg.get("min_k_tiles", 4)))
    per = _cdiv(k_tiles, ways)
    return _cdiv(k_tiles, per), per * bk


def _tma_ready(t: torch.Tensor, elem_bytes: int = 1) -> bool:
    """A TMA descriptor needs a 16-byte aligned base and row stride."""
    return t.stride(-1) == 1 and t.data_ptr() % 16 == 0 and (t.stride(0) * elem_bytes) % 16 == 0


@functools.cache
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _fp8_block_ws(a_args, b_args, bc, m, n, k_dim, alpha, bias, out, cfg) -> None:
    """The warp-specialized Gluon kernel (``_fp8_block_ws``): 128 x BN tiles (64 rows per consumer
    warpgroup), one persistent program per SM;
    weights with 128 x 128 scale blocks (one weight scale per tile and K tile)."""
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    from . import _fp8_block_ws as kws

    bm, bn = cfg["BM"], cfg["BN"]
    consumers = bm // 64
    a_data, b_data = a_args[0], b_args[0]
    a_layout = gl.NVMMASharedLayout.get_default_for([64, 128], gl.float8e4nv)
    b_layout = gl.NVMMASharedLayout.get_default_for([bn, 128], gl.float8e4nv)
    a_desc = TensorDescriptor(a_data, [m, k_dim], [a_data.stride(0), 1], [64, 128], a_layout)
    b_desc = TensorDescriptor(b_data, [n, k_dim], [b_data.stride(0), 1], [bn, 128], b_layout)
    tiles = _cdiv(m, bm) * _cdiv(n, bn)
    programs = min(tiles, _num_sms(out.device.index))
    tma_store = cfg.get("tma_store", True) and _tma_ready(out, out.element_size())
    c_desc = a_desc
    if tma_store:
        c_type = gl.bfloat16 if out.dtype == torch.bfloat16 else (gl.float16 if out.dtype == torch.float16
                                                                   else gl.float32)
        c_layout = gl.NVMMASharedLayout.get_default_for([64, bn], c_type)
        c_desc = TensorDescriptor(out, [m, n], [out.stride(0), 1], [64, bn], c_layout)
    kws.fp8_block_mm_ws_kernel[(programs,)](
        a_desc,
        b_desc,
        c_desc,
        a_args[1],
        b_args[1],
        alpha if alpha is not None else out,
        bias if bias is not None else out,
        out,
        m,
        n,
        k_dim,
        a_args[4],
        a_args[5],
        b_args[4],
        b_args[5],
        out.stride(0),
        B_ROWS_PER_SCALE=bc.get("ROWS_PER_SCALE", 1),
        HAS_ALPHA=alpha is not None,
        HAS_BIAS=bias is not None,
        BN=bn,
        STAGES=cfg["num_stages"],
        GROUP_M=cfg["GROUP_M"],
        CONSUMERS=consumers,
        CONSUMER_REGS=cfg.get("consumer_regs", 240),
        PRODUCER_REGS=cfg.get("producer_regs", 24),
        TMA_STORE=tma_store,
        **kws.launch_options(consumers),
    )


def _fp8_block_tma(a_args, b_args, bc, m, n, k_dim, alpha, bias, out, cfg) -> None:
    from triton.tools.tensor_descriptor import TensorDescriptor

    if cfg.get("ws"):
        if bc.get("ROWS_PER_SCALE", 1) % cfg["BN"] == 0:
            _fp8_block_ws(a_args, b_args, bc, m, n, k_dim, alpha, bias, out, cfg)
            return
        cfg = ONE_PARTITION_CONFIG
    bm, bn, bk = cfg["BM"], cfg["BN"], cfg["BK"]
    a_data, b_data = a_args[0], b_args[0]
    a_desc = TensorDescriptor(a_data, [m, k_dim], [a_data.stride(0), 1], [bm, bk])
    b_desc = TensorDescriptor(b_data, [n, k_dim], [b_data.stride(0), 1], [bn, bk])
    tiles = _cdiv(m, bm) * _cdiv(n, bn)
    persistent = bool(cfg.get("persistent"))
    programs = min(tiles, _num_sms(out.device.index) * cfg.get("per_sm", 1)) if persistent else tiles
    launch(k.fp8_block_mm_tma_kernel, (programs,), (
            a_desc, b_desc, a_args[1], b_args[1], alpha if alpha is not None else out,
            bias if bias is not None else out, out, m, n, k_dim, a_args[4], a_args[5], b_args[4], b_args[5],
            out.stride(0), programs,
        ),
        B_ROWS_PER_SCALE=bc.get("ROWS_PER_SCALE", 1), HAS_ALPHA=alpha is not None,
        HAS_BIAS=bias is not None, BM=bm, BN=bn, BK=bk, GROUP_M=cfg["GROUP_M"], num_warps=cfg["num_warps"],
        num_stages=cfg["num_stages"],
    )


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


def _scaled_gemv(a: QTensor, b: QTensor, alpha, bias, out_dtype) -> torch.Tensor:
    from . import blockscaled, gemv_w4

    factor = divisor = None
    if a.fmt == "fp8_rowwise":
        x = a.data.to(torch.bfloat16)
        factor = a.scale.reshape(-1)
    else:
        plain, g, divides = _without_global(a)
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


def dequant_unsupported(a: QTensor, b: QTensor) -> str | None:
    """None when this pair can run the ``"dequant"`` route (:func:`_dequant_mm`), else why not.

    An nvfp4 value without its global scale, an E2M1 element times its E4M3 block scale, has at most 6
    significant bits and an exponent inside bf16's range: both operands decode to bf16 exactly, and cuBLAS's
    bf16 GEMM with fp32 accumulation then computes the block-scaled product up to accumulation order, as the
    decoding kernel does. (E2M1 x E4M3 does not fit E4M3, so the FP8 tensor cores cannot take it exactly.)"""
    if a.fmt != "nvfp4" or b.fmt != "nvfp4":
        return "the dequant route takes nvfp4 x nvfp4 pairs"
    if len(a.shape) != 2 or len(b.shape) != 2:
        return "the dequant route takes 2-D operands"
    if _interpreting():
        return "the dequant route is for the GPU"
    return None


def _without_global(q: QTensor) -> tuple[QTensor, torch.Tensor | None, bool]:
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


DEQUANT_CHUNK_BYTES = 64 << 20
"""Largest decoded weight chunk and fp32 partial product the ``"dequant"`` route holds at once."""


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


def _dequant_mm(a: QTensor, b: QTensor, alpha, bias, out_dtype) -> torch.Tensor:
    """The ``"dequant"`` route: ``a`` decoded exactly to bf16, ``b`` a chunk of rows at a time (at most
    :data:`DEQUANT_CHUNK_BYTES` of decoded weight or fp32 partial product), each chunk through cuBLAS's bf16
    GEMM with fp32 accumulation, then the decoding kernel's epilogue in its order (1 / global multiplier or
    per_tensor_scale of a, of b, alpha, bias) and one rounding to ``out_dtype``."""
    from ..formats.rows import ROW_ALIGN, slice_rows, slice_rows_reason
    from . import blockscaled

    pa, ga, ga_div = _without_global(a)
    pb, gb, gb_div = _without_global(b)
    m, k_dim = a.shape
    n = b.shape[0]
    x = blockscaled.dequantize_nvfp4(pa, torch.bfloat16)
    out = torch.empty((m, n), dtype=out_dtype, device=a.data.device)
    align = ROW_ALIGN.get(b.fmt, 128)
    rows = max(align, min(DEQUANT_CHUNK_BYTES // (2 * k_dim), DEQUANT_CHUNK_BYTES // (4 * max(m, 1))))
    rows = rows // align * align
    if rows >= n or slice_rows_reason(pb) is not None:
        rows = n
    inv_a = None if ga is None else (torch.div(1.0, ga) if ga_div else ga)
    inv_b = None if gb is None else (torch.div(1.0, gb) if gb_div else gb)
    for n0 in range(0, n, rows):
        n1 = min(n, n0 + rows)
        wq = pb if (n0, n1) == (0, n) else slice_rows(pb, n0, n1)
        acc = _mm_fp32(x, blockscaled.dequantize_nvfp4(wq, torch.bfloat16))
        if inv_a is not None:
            acc.mul_(inv_a)
        if inv_b is not None:
            acc.mul_(inv_b)
        if alpha is not None:
            acc.mul_(alpha.reshape(1).to(torch.float32))
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
    return _fold_pair(a, b)


def _fold_pair(a: QTensor, b: QTensor) -> str | None:
    if b.fmt != "mxfp4" or a.fmt not in _FOLD_ACTIVATIONS:
        return f"the FP8 re-encoding takes mxfp4 weights with {'/'.join(_FOLD_ACTIVATIONS)} activations"
    if _interpreting():
        return "the FP8 re-encoding feeds the TMA kernel, which is for the GPU"
    return None


def _fold_mm(a: QTensor, b: QTensor, alpha, bias, out_dtype, cfg: dict, cublas: bool | None = None) -> torch.Tensor:
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
    # 128x128 weight blocks: one scale per weight tile, so the promotion is one FMA per accumulator element
    wb = blockscaled.mxfp4_fold(b, (128, 128), dropped, cublas_scales=use_cublas)
    if a.fmt == "mxfp4":
        wa = blockscaled.mxfp4_fold(a, (1, 128), dropped, cublas_scales=use_cublas)
        a_data, a_scale = wa.data, wa.scale
    else:
        a_data, a_scale = a.data, a.scale
    if use_cublas:
        out = cb.mm(a_data, a_scale, wb.data, wb.scale, alpha, bias, out_dtype, b_scale_zero_padded=True)
    else:
        if not _tma_ready(a_data):
            a_data = a_data.clone(memory_format=torch.contiguous_format)
        # fp8_rowwise: one scale per row serves every K tile (K-tile stride 0)
        s0, s1 = a_scale.stride(0), 0 if a.fmt == "fp8_rowwise" else a_scale.stride(1)
        out = torch.empty((m, n), dtype=out_dtype, device=device)
        _fp8_block_tma([a_data, a_scale, None, None, s0, s1],
                       [wb.data, wb.scale, None, None, wb.scale.stride(0), wb.scale.stride(1)],
                       {"ROWS_PER_SCALE": 128}, m, n, k_dim, alpha, bias, out, cfg)
    a_args, ac = operand_args(a)
    b_args, bc = operand_args(b)
    _launch(a_args, ac, b_args, bc, m, n, k_dim, alpha, bias, out, _config(m, False), guard=dropped,
            plan_n=plan_rows(b))
    return out


def cublas_unsupported(a: QTensor, b: QTensor, bias, out_dtype) -> str | None:
    """None when this fp8_block pair can run on cuBLASLt's block-scaled FP8 GEMM (the ``"cublas"`` route;
    :mod:`lowbit.kernels.cublas_fp8_block`), else why not."""
    if a.fmt != "fp8_block" or b.fmt != "fp8_block" or tuple(b.params.get("block", ())) != (128, 128):
        return "cuBLAS takes fp8_block activations with 128x128-block fp8_block weights"
    if a.data.dtype != torch.float8_e4m3fn or b.data.dtype != torch.float8_e4m3fn:
        return "cuBLAS takes E4M3 data"
    m, k_dim = a.shape
    return cb.unsupported(m, b.shape[0], k_dim, a.data.device, cb.aligned(a.data) and cb.aligned(b.data), bias,
                          out_dtype)


ROUTES = ("gemv", "fold", "cublas", "dequant", "kernel")


def scaled_mm(a: QTensor, b: QTensor, alpha, bias, out_dtype, route: str = "kernel", config: dict | None = None,
              cublas: bool | None = None) -> torch.Tensor:
    """The product on ``route`` (:data:`ROUTES`; ``lowbit.ops.policy.scaled_route`` decides it for
    ``lowbit.scaled_mm``; the capability checks above say where each can run):

    - ``"gemv"``: the activation decoded to bf16, then the W4A16 GEMV;
    - ``"fold"``: the exact E4M3 re-encoding, then cuBLASLt's FP8 GEMM where it can run (``cublas=False``:
      never; True: ValueError where it cannot), else the TMA kernel (with ``config``, that config and no cuBLAS);
    - ``"cublas"``: cuBLASLt's block-scaled FP8 GEMM (ValueError where it cannot run);
    - ``"dequant"``: nvfp4 x nvfp4 decoded exactly to bf16, then cuBLAS's bf16 GEMM (:func:`dequant_unsupported`);
    - ``"kernel"``: lowbit's block-scaled GEMM kernels (``config``: a tile config instead of the table's)."""
    if route not in ROUTES:
        raise ValueError(f"route must be one of {ROUTES}, got {route!r}")
    m, k_dim = a.shape
    n = b.shape[0]
    if route == "gemv":
        why = gemv_unsupported(a, b)
        if why is not None:
            raise ValueError(f"route 'gemv': {why}")
        return _scaled_gemv(a, b, alpha, bias, out_dtype)
    if route == "fold":
        why = _fold_pair(a, b)
        if why is not None:
            raise ValueError(f"route 'fold': {why}")
        cfg = dict(config) if config is not None else _config(m, True, fold=True)
        return _fold_mm(a, b, alpha, bias, out_dtype, cfg, cublas if config is None else False)
    if route == "cublas":
        why = cublas_unsupported(a, b, bias, out_dtype)
        if why is not None:
            raise ValueError(f"route 'cublas': {why}")
        return cb.mm(a.data, a.scale, b.data, b.scale, alpha, bias, out_dtype)
    if route == "dequant":
        why = dequant_unsupported(a, b)
        if why is not None:
            raise ValueError(f"route 'dequant': {why}")
        return _dequant_mm(a, b, alpha, bias, out_dtype)
    a_args, ac = operand_args(a)
    b_args, bc = operand_args(b)
    raw_fp8 = ac["KIND"] == 0 and bc["KIND"] == 0 and ac["SMODE"] == 1 and bc["SMODE"] == 1
    cfg = dict(config) if config is not None else _config(m, raw_fp8)
    out = torch.empty((m, n), dtype=out_dtype, device=a.data.device)
    if (
        raw_fp8
        and cfg.get("tma")
        and cfg["BK"] == 128
        and not _interpreting()
        and _tma_ready(a_args[0])
        and _tma_ready(b_args[0])
    ):
        _fp8_block_tma(a_args, b_args, bc, m, n, k_dim, alpha, bias, out, cfg)
        return out
    _launch(a_args, ac, b_args, bc, m, n, k_dim, alpha, bias, out, cfg, plan_n=plan_rows(b))
    return out


class KernelRoute:
    """The ``"kernel"`` route (lowbit's decoding GEMM) of one weight ``b`` for one activation layout (format,
    options, M), alpha and bias presence and output dtype, decided once: the tile config, split-K, constexprs
    and the weight's arguments. A call takes a fresh activation of that layout and launches the cached compiled
    kernel (``lowbit.kernels._launch.Launch``). :meth:`covers` says whether a pair takes this launch (the TMA
    kernel of raw FP8 pairs does not)."""

    def __init__(self, a: QTensor, b: QTensor, has_alpha: bool, has_bias: bool, out_dtype: torch.dtype) -> None:
        a_args, ac = operand_args(a)
        b_args, bc = operand_args(b)
        m, k_dim = a.shape
        n = b.shape[0]
        raw_fp8 = ac["KIND"] == 0 and bc["KIND"] == 0 and ac["SMODE"] == 1 and bc["SMODE"] == 1
        cfg = _config(m, raw_fp8)
        self.ok = not (raw_fp8 and cfg.get("tma") and cfg["BK"] == 128) and not _interpreting()
        bm, bn, bk = cfg["BM"], cfg["BN"], cfg["BK"]
        self.tiles = _cdiv(m, bm) * _cdiv(n, bn)
        device = a.data.device
        # K is split as for the whole weight when b is a column shard (lowbit.formats.shards.plan_rows)
        self.split, self.k_per = _split_k(_cdiv(m, bm) * _cdiv(plan_rows(b), bn), _cdiv(k_dim, bk), bk, cfg, device)
        consts = _kernel_consts(ac, bc, cfg, has_alpha, has_bias, k_dim, self.split, guard=False)
        self.launch = Launch(k.scaled_mm_kernel, (self.tiles, self.split), consts, cfg["num_warps"],
                             cfg["num_stages"])
        self.b3, self.b_strides = tuple(b_args[:3]), tuple(b_args[3:7])
        self.m, self.n, self.k_dim, self.dtype, self.device = m, n, k_dim, out_dtype, device
        self.dev_index = device.index if device.index is not None else torch.cuda.current_device()

    def __call__(self, a: QTensor, alpha: torch.Tensor | None, bias: torch.Tensor | None) -> torch.Tensor:
        """``a``: an activation of the layout this route was made for; ``bias`` contiguous and 16-byte aligned."""
        a_args, _ = operand_args(a)
        return self.run(a_args[0], a_args[1], a_args[2], tuple(a_args[3:7]), alpha, bias)

    def run(self, data: torch.Tensor, scale: torch.Tensor, gscale: torch.Tensor, a_strides: tuple,
            alpha: torch.Tensor | None, bias: torch.Tensor | None) -> torch.Tensor:
        """The launch on an activation's operand arguments (``operand_args``: data, scale, global scale and
        (data row stride, scale strides, padded scale columns)), for callers that keep them."""
        m, n = self.m, self.n
        out = torch.empty((m, n), dtype=self.dtype, device=self.device)
        if self.split > 1:
            ws, cnt = split_k_scratch(self.device, self.dev_index, self.split * m * n, self.tiles)
        else:
            ws = cnt = out
        self.launch.run(self.dev_index, data, scale, gscale, *self.b3, out if alpha is None else alpha,
                        out if bias is None else bias, out, ws, cnt, cnt, m, n, self.k_dim, self.k_per,
                        *a_strides, *self.b_strides, n)
        return out


    def quant_in_gemm(self, pow2: bool) -> QuantInGemm | None:
        """This launch with the activation quantized inside the kernel (``A_QUANT``), for an fp8_block (1x128)
        activation with 128-wide K tiles: x goes straight in, one launch instead of the quantize kernel and this
        one, the same codes and scales in registers, so the same bits. On an fp8_block weight whose tensors
        are contiguous it is ``fp8_block_decode_kernel`` (the same code with strides derived from the shapes:
        fewer launch arguments). ``pow2``: the activation's ue8m0 scales. None where the route is another
        kind."""
        c = self.launch.consts
        if not (self.ok and c["A_KIND"] == 0 and c["A_SMODE"] == 1 and c["BK"] == 128 and not c["GUARD"]
                and not c["HAS_ALPHA"]):
            return None
        data, scale = self.b3[0], self.b3[1]
        if (c["B_KIND"] == 0 and c["B_SMODE"] == 1 and data.is_contiguous() and scale.is_contiguous()
                and c["GROUP_M"] == 1):
            consts = dict(HAS_BIAS=c["HAS_BIAS"], BM=c["BM"], BN=c["BN"], SPLIT=c["SPLIT"], EVEN_K=c["EVEN_K"],
                          POW2=bool(pow2), ROWS_PER_SCALE=c["B_ROWS_PER_SCALE"], ON_GPU=c["ON_GPU"])
            return QuantInGemm(Launch(k.fp8_block_decode_kernel, self.launch.grid, consts, **self.launch.options),
                               self, minimal=True)
        launch = Launch(k.scaled_mm_kernel, self.launch.grid, {**c, "A_QUANT": True, "A_POW2": bool(pow2)},
                        **self.launch.options)
        return QuantInGemm(launch, self, minimal=False)


class QuantInGemm:
    """``run(x, bias) -> out`` for x ``[M, K]`` (bf16, fp16 or fp32; contiguous, 16-byte aligned) and ``bias``
    None or ``[N]`` of the output dtype, contiguous and aligned (the caller checks; nothing is checked here):
    :meth:`KernelRoute.quant_in_gemm`'s single launch, with the route's split-K scratch kept per stream as the
    GEMV runners keep theirs."""

    __slots__ = ("launch", "minimal", "m", "n", "k_dim", "k_per", "split", "tiles", "b3", "b_strides", "dtype",
                 "device", "dev_index", "scratch")

    def __init__(self, launch: Launch, route: KernelRoute, minimal: bool) -> None:
        self.launch, self.minimal = launch, minimal
        self.m, self.n, self.k_dim, self.k_per = route.m, route.n, route.k_dim, route.k_per
        self.split, self.tiles = route.split, route.tiles
        self.b3, self.b_strides = route.b3, route.b_strides
        self.dtype, self.device, self.dev_index = route.dtype, route.device, route.dev_index
        self.scratch = KeptScratch(self.device, self.dev_index, self.split * self.m * self.n, self.tiles)

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        m, n = self.m, self.n
        out = torch.empty((m, n), dtype=self.dtype, device=self.device)
        stream = torch._C._cuda_getCurrentRawStream(self.dev_index)
        if self.split > 1:
            ws, cnt = self.scratch.get(stream)
        else:
            ws = cnt = out
        b = out if bias is None else bias
        if self.minimal:
            self.launch.run_on(stream, x, self.b3[0], self.b3[1], b, out, ws, cnt, m, n, self.k_dim, self.k_per)
        else:
            self.launch.run_on(stream, x, x, x, *self.b3, out, b, out, ws, cnt, cnt, m, n, self.k_dim, self.k_per,
                               x.stride(0), 0, 0, 0, *self.b_strides, n)
        return out


def traced_quant_in_gemm(x: torch.Tensor, w_data: torch.Tensor, w_scale: torch.Tensor, ws: torch.Tensor,
                         cnt: torch.Tensor, bias: torch.Tensor | None, pow2: bool, rows_per_scale: int,
                         plan_n: int = 0) -> torch.Tensor:
    """fp8_block decode (x ``[M, K]`` contiguous, M <= the first FP8 config's limit; the weight's data and
    scales contiguous) as ``torch.compile`` traces it inside a ``triton_op`` body: the launch of
    :meth:`KernelRoute.quant_in_gemm`, planned from the shapes alone (the grid does not depend on M within
    the config). ``ws`` / ``cnt``: a split-K workspace and zeroed counters that cover the plan
    (``lowbit.kernels.scratch.traced_scratch``; a larger plan gets its own)."""
    m, k_dim = x.shape
    n = w_data.shape[0]
    dev = x.device
    cfg = dict(FP8_CONFIGS[0][1])
    tiles = _cdiv(n, cfg["BN"])  # one row of tiles: M <= BM
    split, k_per = _split_k(_cdiv(plan_n or n, cfg["BN"]), _cdiv(k_dim, cfg["BK"]), cfg["BK"], cfg, dev)
    out = torch.empty((m, n), dtype=x.dtype, device=dev)
    if split > 1 and (ws.numel() < split * cfg["BM"] * n or cnt.numel() < tiles):
        ws = torch.empty(split * cfg["BM"] * n, dtype=torch.float32, device=dev)
        cnt = torch.zeros(tiles, dtype=torch.int32, device=dev)
    consts = dict(HAS_BIAS=bias is not None, BM=cfg["BM"], BN=cfg["BN"], SPLIT=split,
                  EVEN_K=k_dim % cfg["BK"] == 0, POW2=bool(pow2), ROWS_PER_SCALE=rows_per_scale,
                  ON_GPU=not _interpreting())
    launch = Launch(k.fp8_block_decode_kernel, (tiles, split), consts, cfg["num_warps"], cfg["num_stages"])
    if split == 1:
        ws = cnt = out
    launch.traced(x, w_data, w_scale, out if bias is None else bias, out, ws, cnt, m, n, k_dim, k_per)
    return out


def quant_in_gemm_scratch_size(n: int, k_dim: int) -> tuple[int, int]:
    """(workspace floats, counters) that cover :func:`traced_quant_in_gemm`'s plan for an ``[N, K]`` weight."""
    cfg = FP8_CONFIGS[0][1]
    return cfg.get("split_k", 1) * cfg["BM"] * n, _cdiv(n, cfg["BN"])


def _kernel_consts(ac: dict, bc: dict, cfg: dict, has_alpha: bool, has_bias: bool, k_dim: int, split: int,
                   guard: bool) -> dict:
    return dict(
        A_KIND=ac["KIND"], A_SMODE=ac["SMODE"], A_SWIZZLED=ac["SWIZZLED"], A_GMODE=ac["GMODE"],
        A_EBITS=ac["EBITS"], A_MBITS=ac["MBITS"], A_BIAS=ac["BIAS"], B_KIND=bc["KIND"], B_SMODE=bc["SMODE"],
        B_SWIZZLED=bc["SWIZZLED"], B_GMODE=bc["GMODE"], B_EBITS=bc["EBITS"], B_MBITS=bc["MBITS"],
        B_BIAS=bc["BIAS"], B_ROWS_PER_SCALE=bc.get("ROWS_PER_SCALE", 1), HAS_ALPHA=has_alpha, HAS_BIAS=has_bias,
        BM=cfg["BM"], BN=cfg["BN"], BK=cfg["BK"], GROUP_M=cfg["GROUP_M"], EVEN_K=k_dim % cfg["BK"] == 0,
        SPLIT=split, ON_GPU=not _interpreting(), GUARD=guard,
    )


def _launch(a_args, ac, b_args, bc, m, n, k_dim, alpha, bias, out, cfg, guard=None, plan_n: int = 0) -> None:
    """The decoding kernel (``scaled_mm_kernel``) into ``out``; with ``guard`` (int32 [1]) every program
    returns at once unless it is nonzero. K is split as for ``plan_n`` weight rows (0: ``n``)."""
    bm, bn, bk = cfg["BM"], cfg["BN"], cfg["BK"]
    tiles = _cdiv(m, bm) * _cdiv(n, bn)
    split, k_per = _split_k(_cdiv(m, bm) * _cdiv(plan_n or n, bn), _cdiv(k_dim, bk), bk, cfg, out.device)
    if split > 1:
        ws, cnt = split_k_scratch(out.device, out.device.index, split * m * n, tiles)
    else:
        ws, cnt = out, out
    alpha_t = alpha if alpha is not None else out
    bias_t = bias if bias is not None else out
    launch(k.scaled_mm_kernel, (tiles, split), (
            a_args[0], a_args[1], a_args[2], b_args[0], b_args[1], b_args[2], alpha_t, bias_t, out, ws, cnt,
            guard if guard is not None else cnt, m, n, k_dim, k_per, a_args[3], a_args[4], a_args[5], a_args[6],
            b_args[3], b_args[4], b_args[5], b_args[6], out.stride(0),
        ),
        **_kernel_consts(ac, bc, cfg, alpha is not None, bias is not None, k_dim, split, guard is not None),
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )


_DTYPES = {
    "fp8_block": "*fp8e4nv",
    "fp8_rowwise": "*fp8e4nv",
    "mxfp8_e4m3": "*fp8e4nv",
    "mxfp8_e5m2": "*fp8e5",
}


def compile_variants():
    """(kernel, signature, constexprs) for every pair kind, both M regimes, swizzled scales, masked K, epilogues."""
    pairs = [
        ("fp8_block", "fp8_block", {}),
        ("nvfp4", "nvfp4", {}),
        ("mxfp4", "mxfp4", {}),
        ("mxfp8_e4m3", "mxfp8_e4m3", {}),
        ("mxfp8_e5m2", "mxfp8_e4m3", {}),
        ("mxfp8_e4m3", "mxfp6_e3m2", {}),
        ("mxfp6_e2m3", "mxfp8_e4m3", {}),
        ("fp8_rowwise", "nvfp4", {}),
        ("fp8_block", "mxfp4", {}),
        ("nvfp4", "nvfp4", {"swizzled": True, "even_k": False, "bias": True, "alpha": True, "small": True}),
        ("fp8_block", "fp8_block", {"even_k": False, "small": True, "bias": True}),
        # decode with the activation quantized in the GEMM (one launch): bf16 / fp16 x, ue8m0 scales, masked K
        ("fp8_block", "fp8_block", {"small": True, "bias": True, "a_quant": "*bf16"}),
        ("fp8_block", "fp8_block", {"small": True, "even_k": False, "a_quant": "*fp16", "pow2": True}),
        ("fp8_block", "mxfp4", {"small": True, "a_quant": "*bf16", "bias": True}),
        ("mxfp4", "mxfp4", {"swizzled": True, "small": True}),
        # the guarded exact fallback of the FP8 re-encoded pairs
        ("mxfp4", "mxfp4", {"guard": True}),
        ("fp8_rowwise", "mxfp4", {"guard": True, "even_k": False}),
        ("fp8_block", "mxfp4", {"guard": True, "swizzled": True}),
    ]
    for fa, fb, opt in pairs:
        raw = fa == fb == "fp8_block"
        cfg = dict((FP8_CONFIGS if raw else CONFIGS)[0 if opt.get("small") else 1][1])
        consts = {}
        for side, fmt in (("A", fa), ("B", fb)):
            kind = 0 if fmt in _FP8 else (2 if fmt.startswith("mxfp6") else 1)
            smode = {"fp8_block": 1, "fp8_rowwise": 3, "nvfp4": 4}.get(fmt, 2)
            e, mb, bias = _MINIFLOAT.get(fmt, (0, 0, 0))
            consts.update(
                {
                    f"{side}_KIND": kind,
                    f"{side}_SMODE": smode,
                    f"{side}_SWIZZLED": bool(opt.get("swizzled")) and smode in (2, 4),
                    f"{side}_GMODE": 1 if fmt == "nvfp4" else 0,
                    f"{side}_EBITS": e,
                    f"{side}_MBITS": mb,
                    f"{side}_BIAS": bias,
                }
            )
        consts["B_ROWS_PER_SCALE"] = 128 if fb == "fp8_block" else 1
        consts.update(
            HAS_ALPHA=bool(opt.get("alpha")),
            HAS_BIAS=bool(opt.get("bias")),
            BM=cfg["BM"],
            BN=cfg["BN"],
            BK=cfg["BK"],
            GROUP_M=cfg["GROUP_M"],
            EVEN_K=opt.get("even_k", True),
            SPLIT=4 if opt.get("small") else 1,
            ON_GPU=True,
            GUARD=bool(opt.get("guard")),
            A_QUANT=bool(opt.get("a_quant")),
            A_POW2=bool(opt.get("pow2")),
        )
        sig = {
            "a_ptr": opt.get("a_quant") or _DTYPES.get(fa, "*u8"),
            "as_ptr": "*fp32" if fa in ("fp8_block", "fp8_rowwise") else "*u8",
            "ag_ptr": "*fp32",
            "b_ptr": _DTYPES.get(fb, "*u8"),
            "bs_ptr": "*fp32" if fb == "fp8_block" else "*u8",
            "bg_ptr": "*fp32",
            "alpha_ptr": "*fp32",
            "bias_ptr": "*bf16",
            "out_ptr": "*bf16",
            "ws_ptr": "*fp32",
            "cnt_ptr": "*i32",
            "guard_ptr": "*i32",
        }
        sig.update(
            {
                n: "i32"
                for n in (
                    "M",
                    "N",
                    "K",
                    "K_PER",
                    "stride_a",
                    "stride_as0",
                    "stride_as1",
                    "a_cols4",
                    "stride_b",
                    "stride_bs0",
                    "stride_bs1",
                    "b_cols4",
                    "stride_om",
                )
            }
        )
        yield k.scaled_mm_kernel, sig, consts
    # the fp8_block decode kernel (activation quantized in the GEMM): each x dtype, ue8m0, masked K, bias, split-K
    for x_ty, pow2, even_k, bias in (("*bf16", False, True, True), ("*fp16", True, False, False),
                                     ("*fp32", False, True, False)):
        cfg = FP8_CONFIGS[0][1]
        sig = {"x_ptr": x_ty, "w_ptr": "*fp8e4nv", "ws_ptr": "*fp32", "bias_ptr": x_ty,
               "out_ptr": x_ty, "part_ptr": "*fp32", "cnt_ptr": "*i32", "M": "i32", "N": "i32", "K": "i32",
               "K_PER": "i32"}
        yield k.fp8_block_decode_kernel, sig, dict(HAS_BIAS=bias, BM=cfg["BM"], BN=cfg["BN"], SPLIT=4,
                                                    EVEN_K=even_k, POW2=pow2, ROWS_PER_SCALE=128, ON_GPU=True)
    # the TMA fp8_block kernel: every shipped config, plus per-row weight scales (block (1, 128)) with bias/alpha,
    # and every config of the FP8 re-encoded pairs (128x128 weight blocks, with bias/alpha)
    tma_cases = []
    for i, (_limit, cfg) in enumerate(FP8_CONFIGS):
        if cfg.get("ws"):
            cfg = ONE_PARTITION_CONFIG  # what a ws config runs for weights without 128x128 scale blocks
        if cfg.get("tma"):
            tma_cases.append((cfg, 128, False))
            if i == len(FP8_CONFIGS) - 1:
                tma_cases.append((cfg, 1, True))
    tma_cases += [(cfg, 128, True) for _limit, cfg in FOLD_CONFIGS if not cfg.get("ws")]
    for cfg, rows_per_scale, extras in tma_cases:
        bm, bn, bk = cfg["BM"], cfg["BN"], cfg["BK"]
        sig = {
            "a_desc": f"tensordesc<fp8e4nv[{bm}, {bk}]>",
            "b_desc": f"tensordesc<fp8e4nv[{bn}, {bk}]>",
            "as_ptr": "*fp32",
            "bs_ptr": "*fp32",
            "alpha_ptr": "*fp32",
            "bias_ptr": "*bf16",
            "out_ptr": "*bf16",
        }
        sig.update({n: "i32" for n in ("M", "N", "K", "stride_as0", "stride_as1", "stride_bs0", "stride_bs1",
                                       "stride_om", "num_programs")})
        consts = dict(B_ROWS_PER_SCALE=rows_per_scale, HAS_ALPHA=extras, HAS_BIAS=extras, BM=bm, BN=bn, BK=bk,
                      GROUP_M=cfg["GROUP_M"])
        yield k.fp8_block_mm_tma_kernel, sig, consts
    yield from _ws_compile_variants()


def _ws_compile_variants():
    """The Gluon kernel: the shipped config (TMA and plain output stores, bf16 and fp32 out, bias/alpha). Descriptor signatures come from host descriptors over small CPU
    tensors, as the JIT would write them."""
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import BaseBackend
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    from . import _fp8_block_ws as kws

    def desc_sig(dtype, gl_dtype, block):
        t = torch.empty(256, 256, dtype=dtype)
        d = TensorDescriptor.from_tensor(t, block, gl.NVMMASharedLayout.get_default_for(block, gl_dtype))
        return native_specialize_impl(BaseBackend, d, False, True, True)[0]

    cases = [(WS_CONFIG, torch.bfloat16, True, True), (WS_CONFIG, torch.float32, True, False),
             (WS_CONFIG, torch.bfloat16, False, True)]
    for cfg, out_dtype, tma_store, extras in cases:
        bn, consumers = cfg["BN"], cfg["BM"] // 64
        gl_out, ptr_out = (gl.bfloat16, "*bf16") if out_dtype == torch.bfloat16 else (gl.float32, "*fp32")
        sig = {
            "a_desc": desc_sig(torch.float8_e4m3fn, gl.float8e4nv, [64, 128]),
            "b_desc": desc_sig(torch.float8_e4m3fn, gl.float8e4nv, [bn, 128]),
            "c_desc": desc_sig(out_dtype, gl_out, [64, bn]),
            "as_ptr": "*fp32",
            "bs_ptr": "*fp32",
            "alpha_ptr": "*fp32",
            "bias_ptr": "*bf16",
            "out_ptr": ptr_out,
        }
        sig.update({n: "i32" for n in ("M", "N", "K", "stride_as0", "stride_as1", "stride_bs0", "stride_bs1",
                                       "stride_om")})
        consts = dict(B_ROWS_PER_SCALE=128, HAS_ALPHA=extras, HAS_BIAS=extras, BN=bn, STAGES=cfg["num_stages"],
                      GROUP_M=cfg["GROUP_M"], CONSUMERS=consumers, CONSUMER_REGS=240,
                      PRODUCER_REGS=24, TMA_STORE=tma_store)
        yield kws.fp8_block_mm_ws_kernel, sig, consts
