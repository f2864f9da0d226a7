"""Tile configurations and launches of lowbit's block-scaled GEMM kernels: the decoding kernel
(``_scaled_mm.scaled_mm_kernel``, every pair), the TMA kernel of raw fp8_block pairs
(``_scaled_mm.fp8_block_mm_tma_kernel``) and the warp-specialized Gluon kernel (``_fp8_block_ws``).

Tiles are data (``CONFIGS``, ``FP8_CONFIGS``, ``FOLD_CONFIGS``, by M regime); nothing is autotuned. No host
synchronization: the launches can be captured in CUDA graphs.
"""

from __future__ import annotations

import functools

import torch

from ..formats.qtensor import QTensor
from . import _scaled_mm as k
from . import cdiv
from . import interpreting as _interpreting
from ._launch import LazyDescriptor, launch
from .scratch import split_k_scratch


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
# From M = 65 (aligned, bias rules) fp8_block pairs run cuBLASLt's block-scaled GEMM instead
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

MINIFLOAT = {"mxfp6_e2m3": (2, 3, 1), "mxfp6_e3m2": (3, 2, 3), "mxfp4": (2, 1, 1), "nvfp4": (2, 1, 1)}


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
        if fmt in MINIFLOAT:
            c["KIND"] = 2 if fmt.startswith("mxfp6") else 1
            c["EBITS"], c["MBITS"], c["BIAS"] = MINIFLOAT[fmt]
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


def config_for(m: int, raw_fp8: bool, fold: bool = False) -> dict:
    for limit, cfg in FOLD_CONFIGS if fold else FP8_CONFIGS if raw_fp8 else CONFIGS:
        if m <= limit:
            return dict(cfg)
    raise AssertionError("unreachable")


def split_k(tiles: int, k_tiles: int, bk: int, cfg: dict, device: torch.device) -> tuple[int, int]:
    """(ways, K columns per way) for configs with ``"split_k"`` (at most that many ways): enough programs for
    about ``ctas_per_sm`` (default 2) per SM when the output has few tiles (decode), each way at least
    ``min_k_tiles`` (default 4) K tiles long; (1, whole K) otherwise."""
    want = cfg.get("split_k", 1)
    if want == 1:
        return 1, k_tiles * bk
    sms = _num_sms(device.index) if device.type == "cuda" else 4
    ways = min(want, max(1, (cfg.get("ctas_per_sm", 2) * sms) // tiles), max(1, k_tiles // cfg.get("min_k_tiles", 4)))
    per = cdiv(k_tiles, ways)
    return cdiv(k_tiles, per), per * bk


def tma_ready(t: torch.Tensor, elem_bytes: int = 1) -> bool:
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
    tiles = cdiv(m, bm) * cdiv(n, bn)
    programs = min(tiles, _num_sms(out.device.index))
    tma_store = cfg.get("tma_store", True) and tma_ready(out, out.element_size())
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


def launch_fp8_block_tma(a_args, b_args, bc, m, n, k_dim, alpha, bias, out, cfg) -> None:
    if cfg.get("ws"):
        if bc.get("ROWS_PER_SCALE", 1) % cfg["BN"] == 0:
            _fp8_block_ws(a_args, b_args, bc, m, n, k_dim, alpha, bias, out, cfg)
            return
        cfg = ONE_PARTITION_CONFIG
    bm, bn, bk = cfg["BM"], cfg["BN"], cfg["BK"]
    a_data, b_data = a_args[0], b_args[0]
    a_desc = LazyDescriptor(a_data, [bm, bk], [m, k_dim], [a_data.stride(0), 1])
    b_desc = LazyDescriptor(b_data, [bn, bk], [n, k_dim], [b_data.stride(0), 1])
    tiles = cdiv(m, bm) * cdiv(n, bn)
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


def kernel_consts(ac: dict, bc: dict, cfg: dict, has_alpha: bool, has_bias: bool, k_dim: int, split: int,
                  guard: bool) -> dict:
    return dict(
        A_KIND=ac["KIND"], A_SMODE=ac["SMODE"], A_SWIZZLED=ac["SWIZZLED"], A_GMODE=ac["GMODE"],
        A_EBITS=ac["EBITS"], A_MBITS=ac["MBITS"], A_BIAS=ac["BIAS"], B_KIND=bc["KIND"], B_SMODE=bc["SMODE"],
        B_SWIZZLED=bc["SWIZZLED"], B_GMODE=bc["GMODE"], B_EBITS=bc["EBITS"], B_MBITS=bc["MBITS"],
        B_BIAS=bc["BIAS"], B_ROWS_PER_SCALE=bc.get("ROWS_PER_SCALE", 1), HAS_ALPHA=has_alpha, HAS_BIAS=has_bias,
        BM=cfg["BM"], BN=cfg["BN"], BK=cfg["BK"], GROUP_M=cfg["GROUP_M"], EVEN_K=k_dim % cfg["BK"] == 0,
        SPLIT=split, ON_GPU=not _interpreting(), GUARD=guard,
    )


def launch_decoding(a_args, ac, b_args, bc, m, n, k_dim, alpha, bias, out, cfg, guard=None, plan_n: int = 0) -> None:
    """The decoding kernel (``scaled_mm_kernel``) into ``out``; with ``guard`` (int32 [1]) every program
    returns at once unless it is nonzero. K is split as for ``plan_n`` weight rows (0: ``n``)."""
    bm, bn, bk = cfg["BM"], cfg["BN"], cfg["BK"]
    tiles = cdiv(m, bm) * cdiv(n, bn)
    split, k_per = split_k(cdiv(m, bm) * cdiv(plan_n or n, bn), cdiv(k_dim, bk), bk, cfg, out.device)
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
        **kernel_consts(ac, bc, cfg, alpha is not None, bias is not None, k_dim, split, guard is not None),
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )
