"""GPTQ's column loop replayed from CUDA graphs, and the one column step both loops run.

On a GPU the loop is launch-bound: each column is about thirty small kernels over the weight's rows (round
onto the format's grid, error, rank-1 update of the block), so launching them one by one costs more than
running them. :class:`BlockGraphs` records the steps of a lazy block's columns once (of a group-sized chunk
of them where a group's scales are fitted as the loop reaches it) and replays them for every block, with the
scales each column reads in static buffers; the kernels and data are the eager loop's, so the result is too,
bit for bit.
"""

from __future__ import annotations

import contextlib

import torch


def column_step(grid, W1: torch.Tensor, U1: torch.Tensor, Err1: torch.Tensor, i: int, state) -> tuple:
    """Round column ``i`` of the lazy block ``W1`` onto ``grid`` with the group scales ``state``, store its
    scaled error in ``Err1[:, i]`` and spread it over the block's later columns; returns (codes, values)."""
    w = W1[:, i]
    code, q = grid.round(w, state)
    err = (w - q) / U1[i, i]
    W1[:, i:].addr_(err, U1[i, i:], alpha=-1)
    Err1[:, i] = err
    return code, q


USE_CUDA_GRAPHS = True
"""On CUDA, replay the column loop of each full lazy block from CUDA graphs (:class:`BlockGraphs`): the same
kernels on the same data, so the same bits, without the host cost of launching the ~30 small kernels of every
column one by one. False: launch them eagerly (what the CPU always does)."""


def graphs_apply(device: torch.device, cols: int, bs: int) -> bool:
    return (USE_CUDA_GRAPHS and device.type == "cuda" and cols >= bs
            and not torch.cuda.is_current_stream_capturing())


class BlockGraphs:
    """The column loop of a full lazy block of ``bs`` columns as CUDA graphs (captured on first use). Each
    column reads its scales from static per-column state buffers. With ``static`` states (act-order: every
    group's scales are fitted before the loop) one graph holds the whole block and its state buffers are
    gathered from the groups once per block; otherwise a group's scales are fitted when the loop reaches it,
    from the block's updated weights, so there is one graph per group-sized chunk (``bs / group`` graphs) and
    the chunk's buffers are filled from that fit before each replay. Block weights, errors, rounded values and
    codes live in static buffers; each column runs :func:`column_step`, as the eager loop does, so the result
    equals the eager loop's bit for bit."""

    def __init__(self, grid, rows: int, bs: int, device: torch.device, states: list, group_of: list[int],
                 static: bool, capture: bool = True) -> None:
        # capture=False runs each graph's body directly: the same buffers and order, without CUDA (tests)
        self.capture, self.static = capture, static
        self.grid, self.rows, self.bs, self.G = grid, rows, bs, grid.group
        self.span = bs if static else grid.group  # columns per graph
        f32 = dict(dtype=torch.float32, device=device)
        self.W1 = torch.zeros(rows, bs, **f32)
        self.Err1 = torch.zeros(rows, bs, **f32)
        self.U1 = torch.zeros(bs, bs, **f32)
        self.Q1 = torch.zeros(rows, bs, **f32)
        self.codes1 = None
        self.bufs = None
        self.states, self.group_of = states, group_of
        self.group_idx = torch.tensor(group_of, dtype=torch.int64, device=device)
        self.stacked = None
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.pool = torch.cuda.graph_pool_handle() if capture else None

    def _gather(self, j0: int) -> None:
        """Static states: the buffers of the block of weight columns ``j0 .. j0 + bs``, one row per column."""
        if self.stacked is None:
            self.stacked = {k: torch.stack([st[k] for st in self.states]) for k in self.grid.round_reads}
            self.bufs = {k: torch.empty((self.bs, self.rows), dtype=v.dtype, device=v.device)
                         for k, v in self.stacked.items()}
        idx = self.group_idx[j0:j0 + self.bs]
        for k, v in self.stacked.items():
            torch.index_select(v, 0, idx, out=self.bufs[k])

    def _fit(self, o: int, j0: int) -> None:
        """Fitted states: the buffers of the chunk of block columns ``o .. o + G`` (weight columns from
        ``j0``), from a fit of the chunk's updated weights."""
        g = self.group_of[j0]
        self.states[g] = self.grid.fit(self.W1[:, o:o + self.G])
        if self.bufs is None:
            self.bufs = {k: torch.empty((self.G, self.rows), dtype=self.states[g][k].dtype, device=self.W1.device)
                         for k in self.grid.round_reads}
        for k, buf in self.bufs.items():
            buf.copy_(self.states[g][k].unsqueeze(0).expand(self.G, self.rows))

    def _state(self, r: int) -> tuple:
        n = max(self.grid.round_reads) + 1
        return tuple(self.bufs[k][r] if k in self.bufs else None for k in range(n))

    def _span(self, o: int) -> None:
        """The eager body of the columns ``o .. o + span`` (what each graph holds)."""
        for c in range(self.span):
            i = o + c
            # static buffers hold a row per block column, fitted ones a row per column of the chunk
            code, q = column_step(self.grid, self.W1, self.U1, self.Err1, i, self._state(i if self.static else c))
            self.codes1[:, i] = code
            self.Q1[:, i] = q

    def _replay(self, o: int) -> None:
        if not self.capture:
            if self.codes1 is None:
                code, _ = self.grid.round(self.W1[:, 0].clone(), self._state(0))
                self.codes1 = torch.zeros(self.rows, self.bs, dtype=code.dtype, device=self.W1.device)
            self._span(o)
            return
        graph = self.graphs.get(o)
        if graph is None:
            if self.codes1 is None:
                # the codes' dtype; also loads every kernel of a column once, outside any capture
                side = torch.cuda.Stream()
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    code, _ = self.grid.round(self.W1[:, 0].clone(), self._state(0))
                    scratch = self.W1[:, :2].clone()
                    scratch.addr_(code.float(), self.U1[0, :2], alpha=-1)
                torch.cuda.current_stream().wait_stream(side)
                self.codes1 = torch.zeros(self.rows, self.bs, dtype=code.dtype, device=self.W1.device)
            graph = torch.cuda.CUDAGraph()
            # a capture records without running: the columns run by the replay that follows
            with torch.cuda.graph(graph, pool=self.pool):
                self._span(o)
            self.graphs[o] = graph
        graph.replay()

    def run_block(self, W: torch.Tensor, U: torch.Tensor, Q: torch.Tensor, i1: int) -> torch.Tensor:
        """Round the block of columns ``i1 .. i1 + bs`` of ``W`` (its rounded values into ``Q``); returns the
        block's scaled errors ``[rows, bs]`` (valid until the next call)."""
        i2 = i1 + self.bs
        self.W1.copy_(W[:, i1:i2])
        self.Err1.zero_()
        self.U1.copy_(U[i1:i2, i1:i2])
        with few_threads(self.W1.device):  # on the CPU (tests): the eager loop's one thread, so its BLAS
            if self.static:
                self._gather(i1)
            for o in range(0, self.bs, self.span):
                if not self.static:
                    self._fit(o, i1 + o)
                self._replay(o)
        Q[:, i1:i2] = self.Q1
        return self.Err1

    def store_codes(self, codes: torch.Tensor | None, cols: int, i1: int) -> torch.Tensor:
        """``codes`` (created on the first block) with the last block's codes at columns ``i1 .. i1 + bs``."""
        if codes is None:
            codes = torch.zeros(self.rows, cols, dtype=self.codes1.dtype, device=self.codes1.device)
        codes[:, i1:i1 + self.bs] = self.codes1
        return codes


@contextlib.contextmanager
def few_threads(device: torch.device):
    """One intra-op thread on the CPU for the column loop: its ops are a few hundred elements each, and
    splitting those over threads costs far more than it saves (tens of times more on a busy machine)."""
    if device.type != "cpu":
        yield
        return
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)
