"""Prepared-layer calls of the 4-bit GEMV.

A layer that owns its weight decides everything once: the layouts (``prepare_w4``, ``mma_layout``), then per row
count M and x dtype a :class:`GemvRunner` with the plan, the compiled kernel and every argument but x, the output
and the split-K scratch. Its call allocates the output and launches the cached kernel: nothing else. The same
plans, built from the static facts alone (:class:`GemvFacts`), serve the compiled path (:func:`traced_gemv`), where
the tensors arrive as fake tensors and the launch goes through wrap_triton.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import interpreting as _interpreting
from .gemv_mma_layout import mma_layout, mma_table
from .gemv_prepack import PreparedW4
from .gemv_w4 import GATED, MMA, TILE, Plan, make_plan, mma_max_m, mma_plan, mma_regime, mma_x_dtypes
from .scratch import KeptScratch


@dataclass(frozen=True)
class GemvFacts:
    """What the GEMV plan of a prepared weight depends on (no tensors): format, shape, decode constants and
    the tensor-core layout's format code (-1: none) and chunks per group."""

    fmt: str
    fmt_code: int
    n: int
    k: int
    sk: int
    wpb: int
    post: float
    gs_kind: int
    mma_fmt: int
    cpg: int
    plan_n: int = 0
    """Rows the plans are made for (0: ``n``; a column shard's whole weight, see ``lowbit.formats.shards``)."""


def facts(p: PreparedW4) -> GemvFacts:
    """The static facts of ``p``; builds its tensor-core layout first (call in eager mode, at load time)."""
    lay = mma_layout(p)
    return GemvFacts(p.fmt, p.fmt_code, p.n, p.k, p.sk, p.words_per_block, p.post, p.gs_kind,
                     -1 if lay is None else lay.fmt_code, 1 if lay is None else lay.cpg, p.plan_n)


def mma_rule(f: GemvFacts) -> tuple[tuple, int, int, bool]:
    """(x dtypes, smallest M, largest M, whether M = 1 qualifies) of the tensor-core GEMV on a weight with facts
    ``f`` under :data:`MMA`: plain values, so that traced code can apply the rule to a symbolic M."""
    if f.mma_fmt < 0 or _interpreting():
        return (), 1, 0, False
    return (mma_x_dtypes(f.fmt), MMA["min_m"], mma_max_m(MMA, f.fmt),
            mma_regime(f.plan_n or f.n, f.k, 1, {**MMA, "min_m": 1}, f.fmt))


def uses_mma(f: GemvFacts, m: int, x_dtype: torch.dtype) -> bool:
    """Whether the default plan of ``m`` rows of ``x_dtype`` runs the tensor-core GEMV (else the FMA or dot
    kernel on the row-major layout)."""
    dtypes, lo, hi, m1 = mma_rule(f)
    return x_dtype in dtypes and lo <= m <= hi and (m > 1 or m1)


def _default_plan(f: GemvFacts, m: int, x_dtype: torch.dtype, has_bias: bool, act: int,
                  dev_index: int, rs_mode: int = 0) -> tuple[bool, Plan]:
    """(tensor-core?, plan) that :func:`gemv_w4` picks under the default :data:`TILE` and :data:`MMA`
    (``rs_mode``: its row-scale mode, 0 none, 1 one factor, 3 one divisor)."""
    if uses_mma(f, m, x_dtype):
        return True, mma_plan(m, f.n, f.k, f.mma_fmt, f.cpg, f.gs_kind, f.post, has_bias, act, x_dtype,
                              dev_index, MMA, rs_mode, f.plan_n)
    return False, make_plan(f.fmt_code, f.wpb, f.post, f.gs_kind, f.n, f.k, f.sk, m, x_dtype == torch.float16,
                            has_bias, act, dev_index, TILE, rs_mode, f.plan_n)


class GemvRunner:
    """``runner(x, bias) -> out`` for one prepared weight, row count M, x dtype, bias presence and activation:
    ``x`` is ``[M, K]`` contiguous and 16-byte aligned on the weight's device, ``bias`` None or ``[N]`` of x's
    dtype, contiguous and aligned (the caller checks; nothing is checked here). With ``rs_mode`` (as
    :func:`gemv_w4`'s ``row_scale`` / ``divide_by``: 1 one factor, 3 one divisor) the call takes ``rs``, a
    1-element float32 tensor on the device."""

    __slots__ = ("launch", "w_args", "tail", "rs", "no_bias", "ws", "cnt", "split", "ws_numel", "n_cnt",
                 "m", "n", "dtype", "device", "dev_index", "scratch")

    def __init__(self, p: PreparedW4, m: int, x_dtype: torch.dtype, has_bias: bool, act: int,
                 rs_mode: int = 0) -> None:
        dev = p.device
        self.dev_index = dev.index if dev.index is not None else torch.cuda.current_device()
        mma, plan = _default_plan(facts(p), m, x_dtype, has_bias, act, self.dev_index, rs_mode)
        if mma:
            lay = mma_layout(p)
            self.w_args = (lay.words, lay.scales, p.gs)
            self.tail = (*plan.ints, *lay.table(x_dtype))
        else:
            self.w_args = (p.words, p.scales, p.nested, p.tab, p.gs)
            self.tail = plan.ints
        self.launch = plan.launch
        self.split, self.ws_numel, self.n_cnt = plan.split, plan.split * plan.mp * p.n, plan.n_tiles
        self.rs = torch.empty(16, dtype=torch.float32, device=dev)
        self.no_bias = torch.empty(16, dtype=x_dtype, device=dev)
        self.ws = torch.empty(16, dtype=torch.float32, device=dev)
        self.cnt = torch.empty(16, dtype=torch.int32, device=dev)
        # a gated activation (p then the gated layout, gemv_prepack.gated_layout) writes N / 2 columns
        self.m, self.n, self.dtype, self.device = m, p.n // 2 if act & GATED else p.n, x_dtype, dev
        self.scratch = KeptScratch(dev, self.dev_index, self.ws_numel, self.n_cnt)

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None, rs: torch.Tensor | None = None) -> torch.Tensor:
        out = torch.empty((self.m, self.n), dtype=self.dtype, device=self.device)
        stream = torch._C._cuda_getCurrentRawStream(self.dev_index)
        if self.split > 1:
            ws, cnt = self.scratch.get(stream)
        else:
            ws, cnt = self.ws, self.cnt
        self.launch.run_on(stream, x, *self.w_args, self.rs if rs is None else rs,
                           self.no_bias if bias is None else bias, out, ws, cnt, *self.tail)
        return out


def traced_gemv(x: torch.Tensor, words: torch.Tensor | None, scales: torch.Tensor | None,
                nested: torch.Tensor | None, tab: torch.Tensor | None, gs: torch.Tensor | None,
                mma_words: torch.Tensor | None, mma_scales: torch.Tensor | None,
                ws: torch.Tensor, cnt: torch.Tensor, rs: torch.Tensor, no_bias: torch.Tensor,
                bias: torch.Tensor | None, f: GemvFacts, act: int) -> torch.Tensor:
    """The GEMV as ``torch.compile`` traces it (inside a ``triton_op`` body): the plan of :func:`gemv_w4`'s
    default configuration, built from ``f`` and x's shape alone. The layouts of the kernel the plan does not
    run may be None (:func:`uses_mma` says which one runs); so may the nested scale, the table and the global
    scale where the format has none. ``ws`` / ``cnt``: the device's split-K workspace and zeroed counters
    (``lowbit.kernels.scratch.traced_shared``; a plan needing more than they hold gets its own, allocated by
    the graph); ``rs``: an fp32 placeholder, for the unused row scale and for the absent tensors above;
    ``no_bias``: a placeholder of x's dtype for the bias pointer when ``bias`` is None."""
    m, dev = x.shape[0], x.device
    nested = rs if nested is None else nested
    tab = rs if tab is None else tab
    gs = rs if gs is None else gs
    mma, plan = _default_plan(f, m, x.dtype, bias is not None, act, dev.index)
    out = torch.empty((m, f.n // 2 if act & GATED else f.n), dtype=x.dtype, device=dev)
    if plan.split > 1 and (ws.numel() < plan.split * plan.mp * f.n or cnt.numel() < plan.n_tiles):
        ws = torch.empty(plan.split * plan.mp * f.n, dtype=torch.float32, device=dev)
        cnt = torch.zeros(plan.n_tiles, dtype=torch.int32, device=dev)
    b = no_bias if bias is None else bias
    if (mma_words is None) if mma else (words is None):
        raise ValueError("traced_gemv: the layouts of the kernel this plan runs were not passed")
    if mma:
        plan.launch.traced(x, mma_words, mma_scales, gs, rs, b, out, ws, cnt, *plan.ints,
                           *mma_table(f.mma_fmt, x.dtype))
    else:
        plan.launch.traced(x, words, scales, nested, tab, gs, rs, b, out, ws, cnt, *plan.ints)
    return out


def traced_scratch_size(n: int, k: int) -> tuple[int, int]:
    """(workspace floats, counters) that cover every GEMV plan of an [N, K] weight: ``gemv_w4._split_k`` keeps
    split * MP * N fp32 partials under ``ws_ratio`` of the weight's bytes (at least one split of MP <= 16
    rows), and a plan has at most one counter per 8 output rows per tile row."""
    ratio = max(TILE.get("ws_ratio", 0.25), MMA.get("ws_ratio", 0.25))
    return n * max(16, int(ratio * k / 16) + 16), n + 64
