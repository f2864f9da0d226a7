"""Weight-only 4-bit GEMV for the decode regime (M <= 16; the tensor-core GEMV to M = 64):
``gemv_w4(x, w, bias, activation)``.

``out = act(x @ dequant(w).T + bias)`` with fp32 accumulation, for ``w`` in nvfp4, mxfp4, fp4_b32, nf4 (plain
or double-quantized absmax) and int4_awq; the weight is decoded in registers, never written to HBM.

The weight arrives as a QTensor, laid out once for the kernels and cached (:mod:`lowbit.kernels.gemv_prepack`:
the support checks, ``PreparedW4``, ``prepare_w4``), or as that layout; the tensor-core kernel reads a further
layout (:mod:`lowbit.kernels.gemv_mma_layout`). Layers that own their weight call through runners made once
(:mod:`lowbit.kernels.gemv_runners`). This module holds the tile configurations and regime rules, the launch
plans, the launch and the public entry.

Kernels: NVFP4 / MXFP4 with bf16 x, and int4_awq (group a multiple of 64) and nf4 (blocksize a multiple of
64) with bf16 or fp16 x, at ``MMA["min_m"] <= M <= 16`` (and past 16 where ``MMA["row_blocks_max_m"]`` says so)
run the tensor-core GEMV (``_gemv_mma``: mma.sync over a weight laid out once by :func:`mma_layout`, a further
copy of the 4-bit words; at M = 1 only for large weights, see :data:`MMA`); otherwise M <= ``TILE["fma_max_m"]``
runs the CUDA-core FMA kernel (``_gemv_w4``; M rows of x per program, so the weights are read once) and larger M
the ``tl.dot`` kernel with M padded to 16. Both split K across programs when there are too few N tiles to fill
the GPU, and reduce the split-K partials inside the same launch (last-arriving program, self-resetting counter),
so a call is one kernel launch: safe to capture in a CUDA graph.

Bytes per weight element read from HBM (bf16 weights are 2 bytes, so the ideal speedup over a bf16 GEMV
is 2 / these): nvfp4 0.5 + 1/16 (E4M3 per 16; 3.56x), mxfp4 0.5 + 1/32 (3.76x), fp4_b32 0.5 + 4/32 (3.2x),
nf4 0.5 + 4/bs (fp32 absmax; bs 64: 3.56x) or 0.5 + 1/bs (double quant; 3.88x), int4_awq 0.5 + 4/g
(packed scale + zero; g 128: 3.76x, g 32: 3.2x). At M=1 the FMA loop issues about 4.5 instructions per
weight (nf4 about 6), close to what the SMs can issue while HBM streams the weights, so the kernel is
bandwidth-bound only just; the tl.dot path issues about 6.5 per weight for any M.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch
from triton.runtime.jit import JITFunction

from ..formats.qtensor import QTensor
from ..formats.shards import plan_rows
from . import _gemv_mma as km
from . import _gemv_w4 as k
from . import cdiv
from . import interpreting as _interpreting
from ._launch import Launch
from .device import GS_DIVIDE, GS_MULTIPLY, GS_NONE
from .gemv_mma_layout import MmaLayout, has_mma_layout, mma_layout
from .gemv_prepack import FMT_CODES, PreparedW4, cached, clear_prepared, gated_layout, prepare_w4, why_not
from .scratch import split_k_scratch


ACTIVATIONS = {None: 0, "gelu": 1, "gelu_tanh": 2, "silu": 3,
               "gelu_and_mul": 5, "gelu_tanh_and_mul": 6, "silu_and_mul": 7}
"""Epilogue codes; 4 + code is the gated form ``act(gate) * up`` (``lowbit.kernels.device.ACT_GATED``)."""
GATED = 4
MAX_M = 16
MMA_MAX_M = 64
"""M up to MAX_M runs on every GEMV kernel; up to MMA_MAX_M only on the tensor-core GEMV (blocks of up to
``MMA["block_rows"]`` x rows in programs of their own), where its config's ``max_m`` or ``row_blocks_max_m``
asks for it."""

TILE = {
    # M <= fma_max_m: CUDA-core FMA kernel (MP = 1, 2 or 4 rows of x per program); else the tl.dot kernel
    # (MP = 16)
    "fma_max_m": 4,
    # bn: output rows per program; chunks: 16-byte chunks (32 weights) per row per iteration;
    # stages: cp.async pipeline depth (stages - 1 tiles in flight while one is decoded)
    "fma": {"bn": 16, "chunks": 32, "warps": 4, "stages": 3},
    "dot": {"bn": 64, "chunks": 8, "warps": 4, "stages": 3},
    # split K until about ctas_per_sm programs per SM exist, at most max_split ways, each split at least
    # min_iters iterations long, the fp32 partials (split * M * N * 4 bytes, written and read back) at most
    # ws_ratio of the weight bytes
    "ctas_per_sm": 4,
    "max_split": 16,
    "min_iters": 2,
    "ws_ratio": 0.25,
}
"""Tile configuration per regime (data, no autotuning). ``benchmarks/experiments/sweep_w4a16_tiles.py gemv`` tries
variants; ``gemv_w4(..., config=...)`` overrides it per call."""


_X_DTYPES = (torch.bfloat16, torch.float16)


def supports(w: QTensor) -> str | None:
    """None if :func:`gemv_w4` covers ``w``, else the reason it does not (cheap for a prepared weight)."""
    if isinstance(w, PreparedW4):
        return None
    if isinstance(w, QTensor) and cached(w) is not None:
        return None
    return why_not(w)


def _unused(device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """A pointer for a per-call argument the kernel's constexprs make it skip (no bias, no row scale, no
    split-K): allocated without a fill, so it costs no launch."""
    return torch.empty(16, dtype=dtype, device=device)


def _epilogue_buffers(plan, n: int, row_scale, device: torch.device, dev_index: int):
    """(split-K partials, arrival counters, row scales) for a launch of ``plan``; dummies where unused."""
    if plan.split > 1:
        ws, cnt = split_k_scratch(device, dev_index, plan.split * plan.mp * n, plan.n_tiles)
    else:
        ws, cnt = _unused(device, torch.float32), _unused(device, torch.int32)
    return ws, cnt, row_scale if row_scale is not None else _unused(device, torch.float32)


def warm(w: QTensor) -> None:
    """Make and cache every layout the GEMV kernels use for ``w`` (call it in eager mode, e.g. at load; a
    compiled call with a cold cache builds them per call, or leaves the tensor-core GEMV out)."""
    if why_not(w) is None:
        mma_layout(prepare_w4(w))


def clear_cache() -> None:
    """Drop every cached prepared weight and launch plan (call it after editing :data:`TILE` in place)."""
    clear_prepared()
    _PLANS.clear()


# ------------------------------------------------------------------------------------- tensor-core regime

ROW_BLOCKS_MAX_M = {"nvfp4": 48, "mxfp4": 48}
"""The default ``MMA["row_blocks_max_m"]``, as measured. H200, CUDA graphs, against the tensor-core GEMMs
``lowbit.linear`` runs there without row blocks (``benchmarks/experiments/sweep_gemv_row_blocks.py``; blocks of
up to 24 rows), on 6144x4096, 4096x14336 and 28672x8192: nvfp4 1.44-2.24x at M = 17-24, mxfp4 1.16-1.75x; both
1.04-1.42x at M = 32 and 1.00-1.20x at M = 40-48; at M = 64 0.77-0.80x (the two larger shapes); int4_awq
0.70-1.12x, a loss on most: nvfp4 and mxfp4 up to 48."""

MMA = {"min_m": 1, "max_m": 16, "m1_min_weights": {"nf4": 1 << 25, "other": 1 << 27}, "rg": 2, "j": 4,
       "warps": 4, "ctas_per_sm": (8, 4), "row_blocks_max_m": dict(ROW_BLOCKS_MAX_M), "block_rows": 24}
"""The tensor-core GEMV (``_gemv_mma``): used for min_m <= M <= max_m where the weight allows it (see
:func:`mma_layout`), at M = 1 only for weights of at least m1_min_weights elements (an int, or per format with
"other" for the rest: the FMA kernel's NF4 table loads make it slower, so NF4 switches on smaller
weights; H100: 8192x8192 27.8 against 33.5 us, 4096x14336 26.6 against 33.2,
6144x4096 and 4096x4096 within 0.2 us of the FMA kernel, which they keep); rg: 16-row groups per
program, j: 64-column chunks per iteration (one per warp), ctas_per_sm: the split-K target for M <= 8 and for
M > 8 (an int for both). ``min_m=17`` turns it off. H200 sweeps (NVFP4, CUDA graphs): at M = 1 it beats the
row-major FMA kernel on 28672x8192 and 8192x28672 (42.0 / 44.2 us against 47.5 / 50.0) but not on the smaller
shapes
(8192x8192: 18.5 against 16.9 us); from M = 2 on it wins everywhere (28672x8192, M = 16: 52 against 168 us).
row_blocks_max_m: per format, the largest M past max_m it takes in blocks of x rows (at most MMA_MAX_M), with
bf16 x; block_rows: the most x rows (8, 16, 24 or 32) one block multiplies with each decoded weight register
(its n-tiles of 8 rows share the decode; H200, CUDA graphs, nvfp4 and mxfp4: one block of 3 n-tiles against
2 blocks of 2 at M = 17-24, 1.16-1.28x on 4096x14336 and 28672x8192, 0.94-0.99x on 6144x4096; 4 n-tiles
against 2 blocks of 2 at M = 32, 0.73-1.02x: ptxas keeps that kernel at 128 registers and spills); the
dispatch rules (``lowbit.ops.policy.linear_decide``), prepared layers and their compiled path follow
row_blocks_max_m. Change it before layers are prepared (``{}`` turns the row blocks off)."""


def mma_x_dtypes(fmt: str) -> tuple:
    """x dtypes the tensor-core GEMV takes for a format: the FP4 decode builds bf16 operands; int4's
    ``MAGIC + q - (MAGIC + z)`` is exact in bf16 and fp16 alike; the NF4 table is kept in both."""
    return (torch.bfloat16, torch.float16) if fmt in ("int4_awq", "nf4", "nf4_dq") else (torch.bfloat16,)


def mma_regime(n: int, kdim: int, m: int, cfg: dict, fmt: str = "") -> bool:
    """Whether ``cfg`` (an :data:`MMA`-shaped dict) sends M = ``m`` on an N x K weight to the tensor-core GEMV."""
    floor = cfg.get("m1_min_weights", 0)
    if isinstance(floor, dict):
        floor = floor.get("nf4" if fmt.startswith("nf4") else fmt, floor.get("other", 0))
    return cfg["min_m"] <= m <= mma_max_m(cfg, fmt) and (m > 1 or n * kdim >= floor)


def mma_max_m(cfg: dict, fmt: str) -> int:
    """The largest M ``cfg`` (an :data:`MMA`-shaped dict) gives the tensor-core GEMV on a ``fmt`` weight."""
    return min(MMA_MAX_M, max(cfg["max_m"], cfg.get("row_blocks_max_m", {}).get(fmt, 0)))


def row_blocks_apply(w: QTensor | PreparedW4, m: int, x_dtype: torch.dtype) -> bool:
    """Whether :func:`gemv_w4` with the default :data:`MMA` runs ``m`` > :data:`MAX_M` rows of ``x_dtype`` on
    ``w`` (the tensor-core GEMV in blocks of x rows); cheap once ``w``'s layouts are made (the first call for a
    weight makes them)."""
    if not MAX_M < m <= MMA.get("row_blocks_max_m", {}).get(w.fmt, 0) or _interpreting():
        return False
    if x_dtype not in mma_x_dtypes(w.fmt) or supports(w) is not None:
        return False
    p = w if type(w) is PreparedW4 else prepare_w4(w)
    return p.device.type == "cuda" and mma_regime(p.plan_n, p.k, m, MMA, p.fmt) and mma_layout(p) is not None


def mma_plan(m: int, n: int, kdim: int, fmt_code: int, cpg: int, gs_kind: int, post: float, has_bias: bool,
             act: int, x_dtype: torch.dtype, dev_index: int, cfg: dict, rs_mode: int = 0,
             plan_n: int | None = None) -> Plan:
    """The launch plan of the tensor-core GEMV (static facts only: no tensor is read, so the compiled path can
    build it from fake tensors). K is split as for a weight of ``plan_n`` rows (default ``n``)."""
    if m <= 16:
        nt, mb = (1 if m <= 8 else 2), 1
    else:
        # blocks of up to block_rows x rows, each in programs of its own; a block's n-tiles (8 rows each) share
        # the decoded weight, so fewer, larger blocks decode less
        rows = cfg.get("block_rows", 24)
        if rows not in (8, 16, 24, 32):
            raise ValueError(f"gemv_w4: mma_config['block_rows'] must be 8, 16, 24 or 32 (x rows a program "
                             f"multiplies with each decoded weight register), got {rows!r}")
        mb = cdiv(m, rows)
        nt = cdiv(cdiv(m, mb), 8)
    kq = kdim // 64
    rg = cfg["rg"]
    j = cfg["j"]
    while j > 1 and kq % j:
        j //= 2
    iters = kq // j
    n_tiles = cdiv(cdiv(n, 16), rg)
    cps = cfg.get("ctas_per_sm", TILE["ctas_per_sm"])
    cps = cps if isinstance(cps, int) else cps[0 if m <= 8 else 1]
    split = _split_k(iters, cdiv(cdiv(plan_n or n, 16), rg) * mb, kdim, 8 * nt * mb, _num_sms(dev_index),
                     {**TILE, "ctas_per_sm": cps})
    consts = {"FMT": fmt_code, "RG": rg, "J": j, "IPS": iters // split, "NT": nt, "MB": mb,
              "SPLIT": split, "HAS_BIAS": has_bias, "ACT": act, "GS_KIND": gs_kind,
              "ROW_SCALE": rs_mode, "CPG": cpg, "XF16": x_dtype == torch.float16,
              "POST": 1.0 if fmt_code in (km.FMT_INT4.value, km.FMT_NF4.value) else 2.0 ** 63 * (post / 64.0)}
    # the warps split the J chunks (then the row groups): a warp's 32 lanes must hold dim 2 whole, which
    # the mma asm relies on
    return Plan(fn=km.gemv_mma_kernel, grid=(n_tiles * mb, split, 1), consts=consts,
                num_warps=min(cfg["warps"], rg * j), ints=(m, n, kdim, kq), split=split,
                mp=8 * nt * mb, n_tiles=n_tiles * nt * mb)


# what decides whether the tensor-core GEMV runs, not how it launches (their values are per-format dicts)
_MMA_ROUTING_KEYS = ("m1_min_weights", "row_blocks_max_m")


def mma_plan_key(m: int, bias, act: int, x_dtype: torch.dtype, cfg: dict, rs_mode: int,
                 out_dtype: torch.dtype) -> tuple:
    """What a tensor-core GEMV launch plan depends on, as a hashable key (the config's routing keys left out)."""
    return (m, bias is None, None if bias is None else bias.dtype, act, x_dtype,
            tuple((k_, v) for k_, v in cfg.items() if k_ not in _MMA_ROUTING_KEYS), rs_mode, out_dtype)


def _mma_launch(x: torch.Tensor, p: PreparedW4, lay: MmaLayout, bias, act: int, out: torch.Tensor,
                dev_index: int, cfg: dict, row_scale: torch.Tensor | None = None, rs_mode: int = 0) -> None:
    m = x.shape[0]
    key = mma_plan_key(m, bias, act, x.dtype, cfg, rs_mode, out.dtype)
    plan = lay.plans.get(key)
    if plan is None:
        plan = lay.plans[key] = mma_plan(m, p.n, p.k, lay.fmt_code, lay.cpg, p.gs_kind, p.post, bias is not None,
                                         act, x.dtype, dev_index, cfg, rs_mode, p.plan_n)
    dev = x.device
    ws, cnt, rs = _epilogue_buffers(plan, p.n, row_scale, dev, dev_index)
    args = (x, lay.words, lay.scales, p.gs, rs, _unused(dev, x.dtype) if bias is None else bias, out, ws, cnt,
            *plan.ints, *lay.table(x.dtype))
    _launch(plan, args, dev_index)


# ------------------------------------------------------------------------------------------------ launch

@functools.lru_cache(maxsize=16)
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _chunks(kw: int, want: int) -> int:
    """Largest power of two <= want whose 4 c words divide the row (kw is a multiple of 4)."""
    c = want
    while c > 1 and kw % (4 * c):
        c //= 2
    return c


def _split_k(iters: int, n_tiles: int, kdim: int, mp: int, sms: int, cfg: dict) -> int:
    """Ways to split the K loop of ``iters`` iterations: until about ctas_per_sm programs per SM exist, at
    most max_split, each split at least min_iters long and dividing iters (equal splits: no tail
    iterations). The split-K partials (split * MP * N fp32, written and read back in L2) stay under
    ws_ratio of the N * K / 2 weight bytes."""
    ws_cap = max(1, int(cfg.get("ws_ratio", 0.25) * kdim / (16 * mp)))
    want = max(1, min(cfg["max_split"], ws_cap, (cfg["ctas_per_sm"] * sms) // n_tiles,
                      iters // max(1, cfg["min_iters"])))
    return max(d for d in range(1, want + 1) if iters % d == 0)


@dataclass
class Plan:
    fn: object
    grid: tuple
    consts: dict
    num_warps: int
    ints: tuple              # M, N, KW, SK
    split: int
    mp: int
    n_tiles: int
    launch: Launch = field(default=None, repr=False)

    def __post_init__(self) -> None:
        self.launch = Launch(self.fn, self.grid, self.consts, self.num_warps)


def make_plan(fmt_code: int, wpb: int, post: float, gs_kind: int, n: int, kdim: int, sk: int, m: int,
              x_fp16: bool, has_bias: bool, act: int, device_index: int | None, cfg: dict,
              rs_mode: int = 0, plan_n: int | None = None) -> Plan:
    use_fma = m <= cfg["fma_max_m"]
    t = cfg["fma"] if use_fma else cfg["dot"]
    kw = kdim // 8
    c = _chunks(kw, t["chunks"])
    bn = t["bn"]
    if act & GATED and bn % 16:
        raise ValueError(f"gemv_w4: the gated epilogue pairs rows within 16-row blocks; bn={bn} is not a multiple of 16")
    iters = kw // (4 * c)
    n_tiles = cdiv(n, bn)
    sms = _num_sms(device_index) if device_index is not None else 4
    mp = (1 if m == 1 else 2 if m == 2 else 4) if use_fma else 16
    split = _split_k(iters, cdiv(plan_n or n, bn), kdim, mp, sms, cfg)
    ips = iters // split
    consts = {"FMT": fmt_code, "WPB": wpb, "IPS": ips, "MP": mp, "BN": bn, "C": c, "STAGES": t["stages"], "SPLIT": split,
              "HAS_BIAS": has_bias, "ACT": act, "GS_KIND": gs_kind, "ROW_SCALE": rs_mode, "POST": post,
              "X_FP16": x_fp16,
              "ON_GPU": not _interpreting()}
    fn = k.gemv_w4_fma_kernel if use_fma else k.gemv_w4_dot_kernel
    return Plan(fn=fn, grid=(n_tiles, split, 1), consts=consts, num_warps=t["warps"],
                ints=(m, n, kw, sk), split=split, mp=mp, n_tiles=n_tiles)


_PLANS: dict = {}
_MAX_PLANS = 4096


def _cfg_key(cfg: dict) -> tuple:
    return (cfg["fma_max_m"], tuple(cfg["fma"].values()), tuple(cfg["dot"].values()), cfg["ctas_per_sm"],
            cfg["max_split"], cfg["min_iters"], cfg.get("ws_ratio", 0.25))


def _launch(plan: Plan, args: tuple, device: int | None) -> None:
    """Launch on ``device`` (made current for the launch if it is not); ``None``: the interpreter."""
    if device is None or type(plan.fn) is not JITFunction:
        plan.fn[plan.grid](*args, **plan.consts, num_warps=plan.num_warps)
    elif torch._C._cuda_getDevice() != device:
        with torch.cuda.device(device):
            plan.launch.run(device, *args)
    else:
        plan.launch.run(device, *args)


def _check_x(x: torch.Tensor, p: PreparedW4) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"gemv_w4: x must be a tensor, got {type(x).__name__}")
    if x.dtype not in _X_DTYPES:
        raise TypeError(f"gemv_w4: x must be bfloat16 or float16, got {x.dtype}")
    if x.dim() != 2:
        raise ValueError(f"gemv_w4: x must be 2-D [M, K], got shape {tuple(x.shape)}")
    if x.shape[1] != p.k:
        raise ValueError(f"gemv_w4: x has K={x.shape[1]}, the weight has K={p.k}")
    if x.shape[0] > MMA_MAX_M:
        raise ValueError(f"gemv_w4: M={x.shape[0]} rows; the GEMV covers M <= {MAX_M} (the tensor-core GEMV "
                         f"M <= {MMA_MAX_M})")
    if x.device != p.device:
        raise ValueError(f"gemv_w4: x is on {x.device}, the weight on {p.device}")


_OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _check_row_scale(rs, x: torch.Tensor) -> int:
    """1 for one factor, 2 for one per x row; clear errors otherwise."""
    if not isinstance(rs, torch.Tensor) or rs.dtype != torch.float32:
        raise TypeError(f"gemv_w4: row_scale must be a float32 tensor, got {getattr(rs, 'dtype', type(rs).__name__)}")
    if rs.device != x.device:
        raise ValueError(f"gemv_w4: row_scale is on {rs.device}, x on {x.device}")
    if not rs.is_contiguous():
        raise ValueError("gemv_w4: row_scale must be contiguous")
    if rs.numel() == 1:
        return 1
    if rs.numel() == x.shape[0]:
        return 2
    raise ValueError(f"gemv_w4: row_scale must have 1 or M = {x.shape[0]} elements, got {rs.numel()}")


def _check_bias(bias, x: torch.Tensor, n: int) -> torch.Tensor:
    if not isinstance(bias, torch.Tensor) or bias.shape != (n,) or not bias.dtype.is_floating_point:
        raise ValueError(f"gemv_w4: bias must be a float tensor of shape ({n},), got "
                         f"{getattr(bias, 'dtype', type(bias).__name__)} {tuple(getattr(bias, 'shape', ()))}")
    if bias.device != x.device:
        raise ValueError(f"gemv_w4: bias is on {bias.device}, x on {x.device}")
    # a cached compiled kernel assumes 16-byte aligned pointers (Triton specializes on it): copy others
    return bias if bias.is_contiguous() and bias.data_ptr() % 16 == 0 else bias.clone()


def describe(w: QTensor, m: int) -> str:
    """Which GEMV kernel the default configuration runs for ``w`` at M = ``m`` (what :func:`gemv_w4` chooses,
    for ``lowbit.explain``; it reads no tensor)."""
    n, kdim = plan_rows(w), w.shape[-1]
    params = getattr(w, "params", {})
    group = params.get("blocksize") if w.fmt == "nf4" else params.get("group_size")
    if has_mma_layout(w.fmt, kdim, group) and mma_regime(n, kdim, m, MMA, w.fmt):
        if w.fmt in ("int4_awq", "nf4"):
            return "tensor-core mma.sync GEMV (bf16 or fp16 x)"
        other = "CUDA-core FMA" if m <= TILE["fma_max_m"] else "tl.dot"
        return (f"tensor-core mma.sync GEMV for bf16 x ({other} GEMV for fp16 x"
                + (" or MXFP4 scale codes above 191)" if w.fmt == "mxfp4" else ")"))
    return "CUDA-core FMA GEMV" if m <= TILE["fma_max_m"] else "tl.dot GEMV"


def gemv_w4(x: torch.Tensor, w: QTensor | PreparedW4, bias: torch.Tensor | None = None,
            activation: str | None = None, config: dict | None = None,
            mma_config: dict | bool | None = None, *, row_scale: torch.Tensor | None = None,
            divide_by: torch.Tensor | None = None, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """``act(x @ dequant(w).T + bias)`` in x's dtype, accumulated in fp32, for M <= 16 (M <= 64 on the
    tensor-core GEMV where :data:`MMA` or ``mma_config`` asks for it: nvfp4 and mxfp4 with bf16 x to 48 by
    default).

    Args:
        x: ``[M, K]`` bfloat16/float16 CUDA tensor (CPU under ``TRITON_INTERPRET=1``), ``M <= 16`` (up to
            ``MMA_MAX_M`` where the tensor-core GEMV runs); a non-contiguous or misaligned x is copied.
        w: QTensor with logical shape ``[N, K]`` (see :func:`supports`), or :func:`prepare_w4`'s result.
        bias: None or ``[N]`` (any float dtype; added in fp32).
        activation: None, ``"gelu"`` (erf), ``"gelu_tanh"`` or ``"silu"``; or the gated forms
            ``"gelu_and_mul"``, ``"gelu_tanh_and_mul"``, ``"silu_and_mul"``: ``w`` is ``[gate; up]`` (N rows, a
            multiple of 16) and the result ``act(gate) * up`` has N / 2 columns, each product formed in fp32.
        config: a TILE-shaped dict overriding :data:`TILE` (sweeps). Without it the plan is cached on the
            prepared weight: call :func:`clear_cache` after editing :data:`TILE` in place.
        mma_config: an :data:`MMA`-shaped dict overriding it, or False for the FMA / dot kernels only (a
            ``config`` without ``mma_config`` also leaves the tensor-core GEMV out).
        row_scale: None, or a float32 tensor on x's device with 1 element (one factor) or M elements (one per
            x row) multiplying the fp32 product before the bias: what x's own scales leave over
            (``lowbit.scaled_mm`` passes an FP8 activation's per-token scale, or alpha / an nvfp4
            activation's global scale, this way).
        divide_by: instead of row_scale, a 1-element float32 tensor the fp32 product is divided by (IEEE
            division; an nvfp4 activation's global scale).
        out_dtype: the result dtype (default x's): bfloat16, float16 or float32.

    Returns:
        ``[M, N]`` tensor of x's dtype (``[M, N / 2]`` for a gated activation).
    """
    p = w if type(w) is PreparedW4 else prepare_w4(w)
    if not isinstance(x, torch.Tensor) or x.dtype not in _X_DTYPES or x.dim() != 2 or x.shape[1] != p.k \
            or x.shape[0] > MMA_MAX_M or x.device != p.device:
        _check_x(x, p)
    act = ACTIVATIONS.get(activation, -1) if activation is None or type(activation) is str else -1
    if act < 0:
        raise ValueError(f"gemv_w4: activation must be one of {list(ACTIVATIONS)}, got {activation!r}")
    m, n = x.shape[0], p.n
    n_out = n
    if act & GATED:
        # the weight is [gate; up]: run on its row-interleaved copy, the bias permuted the same way below
        p = gated_layout(p)
        n_out = n // 2
    if bias is not None:
        bias = _check_bias(bias, x, n)
        if act & GATED:
            bias = torch.cat([bias[:n_out].view(-1, 1, 8), bias[n_out:].view(-1, 1, 8)], 1).reshape(n)
    out_dtype = x.dtype if out_dtype is None else out_dtype
    if out_dtype not in _OUT_DTYPES:
        raise TypeError(f"gemv_w4: out_dtype must be bfloat16, float16 or float32, got {out_dtype}")
    if divide_by is not None:
        if row_scale is not None:
            raise ValueError("gemv_w4: give row_scale or divide_by, not both")
        if isinstance(divide_by, torch.Tensor) and divide_by.numel() != 1:
            raise ValueError(f"gemv_w4: divide_by must have 1 element, got {divide_by.numel()}")
        _check_row_scale(divide_by, x)
        row_scale, rs_mode = divide_by, 3
    else:
        rs_mode = 0 if row_scale is None else _check_row_scale(row_scale, x)
    out = torch.empty(m, n_out, dtype=out_dtype, device=x.device)
    if m == 0:
        return out
    if not x.is_contiguous() or x.data_ptr() % 16:
        x = x.clone(memory_format=torch.contiguous_format)
    dev_index = p.device.index if p.device.type == "cuda" else None
    if (dev_index is not None and x.dtype in mma_x_dtypes(p.fmt) and mma_config is not False
            and (config is None or mma_config is not None) and not _interpreting()):
        mcfg = MMA if mma_config is None else mma_config
        if mma_regime(p.plan_n, p.k, m, mcfg, p.fmt):
            lay = mma_layout(p)
            if lay is not None:
                _mma_launch(x, p, lay, bias, act, out, dev_index, mcfg, row_scale, rs_mode)
                return out
    if m > MAX_M:
        raise ValueError(f"gemv_w4: M={m} rows; the GEMV covers M <= {MAX_M}, and M <= {MMA_MAX_M} only on the "
                         "tensor-core GEMV, which this call does not take (an mma_config whose max_m covers M, "
                         "a weight with its layout, an x dtype it takes)")
    bias_dtype = None if bias is None else bias.dtype
    if config is None:
        pk = (m, x.dtype, bias_dtype, act, rs_mode, out_dtype)
        plan = p.plans.get(pk)
        if plan is None:
            plan = p.plans[pk] = make_plan(p.fmt_code, p.words_per_block, p.post, p.gs_kind, n, p.k, p.sk, m,
                                           x.dtype == torch.float16, bias is not None, act, dev_index, TILE,
                                           rs_mode, p.plan_n)
    else:
        pkey = (p.fmt_code, p.words_per_block, p.post, p.gs_kind, n, p.k, p.sk, m, x.dtype, bias_dtype, act,
                dev_index, _cfg_key(config), rs_mode, out_dtype, p.plan_n)
        plan = _PLANS.get(pkey)
        if plan is None:
            plan = make_plan(p.fmt_code, p.words_per_block, p.post, p.gs_kind, n, p.k, p.sk, m,
                             x.dtype == torch.float16, bias is not None, act, dev_index, config, rs_mode, p.plan_n)
            if len(_PLANS) >= _MAX_PLANS:
                _PLANS.clear()
            _PLANS[pkey] = plan
    dev = x.device
    ws, cnt, rs = _epilogue_buffers(plan, n, row_scale, dev, dev_index)
    args = (x, p.words, p.scales, p.nested, p.tab, p.gs, rs, _unused(dev, x.dtype) if bias is None else bias, out,
            ws, cnt, *plan.ints)
    _launch(plan, args, dev_index)
    return out


# ------------------------------------------------------------------------------------------- compile test

def _sig(fmt: str, x_dtype: str, bias_dtype: str) -> dict:
    s_ty = {"nvfp4": "*u8", "mxfp4": "*u8", "fp4_b32": "*fp32", "nf4": "*fp32", "nf4_dq": "*u8",
            "int4_awq": "*i32"}[fmt]
    return {"x_ptr": x_dtype, "w_ptr": "*i32", "s_ptr": s_ty, "nested_ptr": "*fp32", "tab_ptr": "*fp32",
            "gs_ptr": "*fp32", "rs_ptr": "*fp32", "bias_ptr": bias_dtype, "out_ptr": x_dtype, "ws_ptr": "*fp32",
            "cnt_ptr": "*i32",
            "M": "i32", "N": "i32", "KW": "i32", "SK": "i32"}


_WPB = {"nvfp4": 2, "mxfp4": 4, "fp4_b32": 4, "nf4": 8, "nf4_dq": 8, "int4_awq": 16}
_POST = {"nvfp4": 64.0, "mxfp4": 64.0, "fp4_b32": 64.0, "nf4": 1.0, "nf4_dq": 1.0, "int4_awq": 1.0}


def _variants():
    """(kernel, signature, constexprs) of the code paths the launcher starts (CI compiles them for sm_90):
    every format through both kernels (FMA at M = 1, 2, 4 and dot), bf16 and fp16 x, split-K, each
    activation, bias, each global-scale kind, and the other nf4 / int4 block sizes."""
    # the last field is ROW_SCALE (lowbit.scaled_mm's decode route): every mode on both kernels
    cases = []
    for fmt in FMT_CODES:
        gs = GS_DIVIDE.value if fmt == "nvfp4" else GS_NONE.value
        cases += [
            (fmt, "fma", 1, "*bf16", 1, False, 0, gs, _WPB[fmt], 3 if fmt == "nvfp4" else 0),
            (fmt, "fma", 2, "*fp16", 4, True, 1, gs, _WPB[fmt], 1),
            (fmt, "dot", 16, "*bf16", 2, True, 3, gs, _WPB[fmt], 2),
            (fmt, "dot", 16, "*fp16", 1, False, 0, gs, _WPB[fmt], 3 if fmt == "nvfp4" else 0),
        ]
    cases += [
        ("nvfp4", "fma", 4, "*bf16", 2, True, 2, GS_MULTIPLY.value, 2, 2),
        ("nvfp4", "fma", 1, "*bf16", 1, False, 0, GS_NONE.value, 2, 0),
        ("int4_awq", "fma", 1, "*bf16", 1, True, 1, GS_NONE.value, 4, 0),   # group 32
        ("int4_awq", "dot", 16, "*bf16", 1, False, 0, GS_NONE.value, 8, 1),  # group 64
        ("nf4_dq", "fma", 1, "*fp16", 1, False, 0, GS_NONE.value, 4, 0),     # blocksize 32
        # the gated epilogue (silu / gelu_tanh and mul), with and without split-K
        ("nvfp4", "fma", 1, "*bf16", 2, False, 7, GS_DIVIDE.value, 2, 0),
        ("int4_awq", "fma", 2, "*bf16", 1, True, 6, GS_NONE.value, 16, 0),
        ("mxfp4", "dot", 16, "*bf16", 4, False, 7, GS_NONE.value, 4, 0),
    ]
    for fmt, path, mp, xd, split, has_bias, act, gs_kind, wpb, rs in cases:
        t = TILE["fma"] if path == "fma" else TILE["dot"]
        consts = {"FMT": FMT_CODES[fmt], "WPB": wpb, "IPS": 16 // split, "MP": mp, "BN": t["bn"], "C": t["chunks"], "STAGES": t["stages"],
                  "SPLIT": split, "HAS_BIAS": has_bias, "ACT": act, "GS_KIND": gs_kind, "ROW_SCALE": rs,
                  "POST": _POST[fmt], "X_FP16": xd == "*fp16", "ON_GPU": True}
        fn = k.gemv_w4_fma_kernel if path == "fma" else k.gemv_w4_dot_kernel
        yield fn, _sig(fmt, xd, "*fp32" if has_bias and act == 1 else xd), consts
    mma_sig = {"x_ptr": "*bf16", "w_ptr": "*i32", "s_ptr": "*i16", "gs_ptr": "*fp32", "rs_ptr": "*fp32",
               "bias_ptr": "*bf16",
               "out_ptr": "*bf16", "ws_ptr": "*fp32", "cnt_ptr": "*i32", "M": "i32", "N": "i32", "K": "i32",
               "KQ": "i32", **{f"T{i}": "i32" for i in range(8)}}
    for fmt_code, nt, split, has_bias, act, gs_kind, rs in [(0, 1, 1, False, 0, 1, 0), (0, 2, 4, True, 1, 1, 2),
                                                            (1, 1, 4, True, 3, 0, 1), (1, 2, 1, False, 2, 0, 0),
                                                            (0, 1, 2, False, 0, 2, 2), (0, 2, 1, True, 0, 1, 3),
                                                            (0, 1, 4, False, 7, 1, 0), (1, 2, 1, True, 6, 0, 0)]:
        consts = {"FMT": fmt_code, "RG": MMA["rg"], "J": MMA["j"], "IPS": 4, "NT": nt,
                  "SPLIT": split, "HAS_BIAS": has_bias, "ACT": act, "GS_KIND": gs_kind, "ROW_SCALE": rs,
                  "POST": 2.0 ** 63}
        yield km.gemv_mma_kernel, mma_sig, consts
    # blocks of x rows (M > 16), 2, 3 or 4 n-tiles each: split-K, per-row scales, the gated epilogue
    for fmt_code, nt, mb, split, has_bias, act, rs in [(0, 2, 2, 4, True, 1, 2), (1, 2, 4, 1, False, 7, 0),
                                                       (0, 2, 3, 2, False, 6, 1), (0, 4, 1, 4, True, 1, 2),
                                                       (1, 3, 1, 1, False, 7, 0), (0, 4, 2, 2, False, 6, 1),
                                                       (1, 4, 2, 4, True, 0, 0)]:
        consts = {"FMT": fmt_code, "RG": MMA["rg"], "J": MMA["j"], "IPS": 4, "NT": nt,
                  "SPLIT": split, "HAS_BIAS": has_bias, "ACT": act, "GS_KIND": 1, "ROW_SCALE": rs,
                  "POST": 2.0 ** 63, "CPG": 1, "XF16": False, "MB": mb}  # in the kernel's argument order
        yield km.gemv_mma_kernel, mma_sig, consts
    # the post-scaled formats: int4 groups of 128 (2 chunks) and 64, NF4 blocks of 64 and 128; bf16 and fp16 x
    for fmt, nt, split, has_bias, act, cpg, xf16 in [
        (km.FMT_INT4, 1, 1, False, 0, 2, False), (km.FMT_INT4, 2, 4, True, 1, 2, False),
        (km.FMT_INT4, 1, 4, True, 3, 1, True), (km.FMT_INT4, 2, 1, False, 2, 2, True),
        (km.FMT_NF4, 1, 1, False, 0, 1, False), (km.FMT_NF4, 2, 4, True, 1, 1, False),
        (km.FMT_NF4, 1, 4, True, 3, 2, True), (km.FMT_NF4, 2, 1, False, 2, 1, True),
        (km.FMT_INT4, 2, 4, False, 7, 2, False), (km.FMT_NF4, 1, 1, False, 7, 1, False),
        (km.FMT_INT4, 4, 4, True, 1, 2, False), (km.FMT_NF4, 3, 1, False, 0, 1, True),
        (km.FMT_NF4, 4, 2, False, 7, 2, False), (km.FMT_INT4, 3, 1, False, 0, 1, True),
    ]:
        xd = "*fp16" if xf16 else "*bf16"
        sig = dict(mma_sig, x_ptr=xd, s_ptr="*i32", bias_ptr=xd, out_ptr=xd)
        consts = {"FMT": fmt.value, "RG": MMA["rg"], "J": MMA["j"], "IPS": 4, "NT": nt,
                  "SPLIT": split, "HAS_BIAS": has_bias, "ACT": act, "GS_KIND": GS_NONE.value, "ROW_SCALE": 0,
                  "POST": 1.0, "CPG": cpg, "XF16": xf16}
        yield km.gemv_mma_kernel, sig, consts


def compile_variants():
    """Every shipped variant's (kernel, signature, constexprs), as CI compiles them for sm_90. A compile outside
    the JIT fills in no default, so the tensor-core GEMV's trailing constexprs are given explicitly (in the
    kernel's argument order)."""
    for fn, sig, consts in _variants():
        if fn is km.gemv_mma_kernel:
            consts = {**consts, "CPG": consts.get("CPG", 1), "XF16": consts.get("XF16", False),
                      "MB": consts.get("MB", 1)}
        yield fn, sig, consts
