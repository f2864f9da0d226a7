"""Coordinate-descent refinement of a GPTQ result with its group scales fixed (in the spirit of QuantEase,
Behdin et al., "QuantEase: Optimization-based Quantization for Language Models").

GPTQ rounds each column once, greedily, against the columns not yet rounded. With every group's scales fixed
(they are, once the loop has passed), the objective ``tr((W - Q) H (W - Q)^T)`` is a quadratic in each
column ``q_j`` given the others, separable over the rows: with ``E = W - Q``, its minimizer without the grid
is ``q_j* = w_j + (sum_{k != j} H_jk E[:, k]) / H_jj``, and the best value the grid holds is the one nearest
to ``q_j*``. A sweep visits every column in turn and moves each value to the nearest of the 16 values its
group's grid holds (:meth:`Grid.levels`, decoded exactly as :meth:`Grid.round` decodes) when that is
strictly nearer than its current one, so the objective never increases and every value stays one the format
stores under the group's scales: the codes and scales still assemble into an ordinary QTensor that decodes to
the refined values bit for bit.

``G = E H`` is kept up to date lazily, as GPTQ's updates are: exactly inside the current block of columns
(one rank-1 update per changed column), for the other columns by one matrix product per block; it is
recomputed from ``E`` at the start of each sweep so that rounding errors do not accumulate.
"""

from __future__ import annotations

import torch

from .gptq_graphs import few_threads


def objective(W: torch.Tensor, Q: torch.Tensor, H: torch.Tensor) -> float:
    """``tr((W - Q) H (W - Q)^T)`` in float64."""
    E = (W.double() - Q.double())
    return float(((E @ H.double()) * E).sum())


def _column(Wj, Qj, Cj, Ej, Gb, gi, Hi, d, lv, dEi, positive, skip_unchanged: bool = False) -> None:
    """One column's move, in place: ``q_j* = w_j + (sum_{k != j} H_jk E[:, k]) / H_jj`` (the sum being
    ``G[:, j] - H_jj E[:, j]``), each value to the nearest level of its grid ``lv`` ``[rows, 16]`` when that is
    strictly nearer than its current one; ``d`` is ``H_jj`` as a 0-d tensor (``positive``: whether it is
    above 0, a 0-d bool tensor, or None where the caller skips the others), ``dEi`` receives the change of
    ``E[:, j]`` and ``Gb`` its rank-1 update. Tensor ops only (no host sync), so a CUDA graph can hold it;
    ``skip_unchanged`` asks the host whether any value moves and returns early if none does (CPU only)."""
    target = Wj + (gi - Ej * d) / d
    dist = (lv - target.unsqueeze(1)).abs()
    best = dist.argmin(dim=1, keepdim=True)
    # a level's index is its code: the current value is lv[code], bit for bit
    cur = Cj.unsqueeze(1).long()
    better = dist.gather(1, best) < dist.gather(1, cur)
    if positive is not None:
        better = better & positive
    if skip_unchanged and not bool(better.any()):
        return
    new = torch.where(better, best, cur)
    q_new = lv.gather(1, new).squeeze(1)
    delta = Qj - q_new  # the change of E[:, j]
    Cj.copy_(new.squeeze(1))
    Qj.copy_(q_new)
    Ej.add_(delta)
    dEi.copy_(delta)
    Gb.addr_(Hi, delta)


class _BlockGraph:
    """The column loop of a full block of ``bs`` columns on static buffers, captured once as a CUDA graph and
    replayed for every full block of every sweep (``capture=False``: the same buffers and ops run directly,
    for tests on the CPU). Every column runs :func:`_column`, as the eager loop does, so the result equals the
    eager loop's bit for bit; a column with ``H_jj <= 0`` is masked (its values stay) instead of skipped."""

    def __init__(self, rows: int, bs: int, group: int, code_dtype: torch.dtype, device: torch.device,
                 capture: bool) -> None:
        f32 = {"dtype": torch.float32, "device": device}
        self.bs, self.G, self.capture = bs, group, capture
        self.W, self.Q, self.E, self.Gb, self.dE = (torch.zeros(bs, rows, **f32) for _ in range(5))
        self.C = torch.zeros(bs, rows, dtype=code_dtype, device=device)
        self.H = torch.zeros(bs, bs, **f32)
        self.d = torch.ones(bs, **f32)
        self.pos = torch.ones(bs, dtype=torch.bool, device=device)
        self.lv = torch.zeros(bs // group, rows, 16, **f32)
        self.graph = None

    def _body(self) -> None:
        for i in range(self.bs):
            _column(self.W[i], self.Q[i], self.C[i], self.E[i], self.Gb, self.Gb[i], self.H[i], self.d[i],
                    self.lv[i // self.G], self.dE[i], self.pos[i].view(1, 1))

    def run(self, Wt, Qt, Ct, Et, Gt, Hp, diag_t, levels: list, b1: int) -> torch.Tensor:
        """The block ``b1 .. b1 + bs``: its rows of ``Qt``, ``Ct``, ``Et``, ``Gt`` updated in place; returns the
        block's changes of E (valid until the next call)."""
        b2 = b1 + self.bs
        self.W.copy_(Wt[b1:b2])
        self.Q.copy_(Qt[b1:b2])
        self.C.copy_(Ct[b1:b2])
        self.E.copy_(Et[b1:b2])
        self.Gb.copy_(Gt[b1:b2])
        self.H.copy_(Hp[b1:b2, b1:b2])
        d = diag_t[b1:b2]
        torch.gt(d, 0, out=self.pos)
        self.d.copy_(torch.where(self.pos, d, torch.ones_like(d)))
        self.lv.copy_(torch.stack(levels[b1 // self.G:b2 // self.G]))
        self.dE.zero_()
        if not self.capture:
            self._body()
        else:
            if self.graph is None:
                side = torch.cuda.Stream()  # the kernels loaded once outside the capture
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    saved = [t.clone() for t in (self.Q, self.C, self.E, self.Gb, self.dE)]
                    _column(self.W[0], saved[0][0], saved[1][0], saved[2][0], saved[3], saved[3][0], self.H[0],
                            self.d[0], self.lv[0], saved[4][0], self.pos[0].view(1, 1))
                torch.cuda.current_stream().wait_stream(side)
                self.graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(self.graph):  # records without running: the replay below runs it
                    self._body()
            self.graph.replay()
        Qt[b1:b2] = self.Q
        Ct[b1:b2] = self.C
        Et[b1:b2] = self.E
        Gt[b1:b2] = self.Gb
        return self.dE


USE_CUDA_GRAPHS = True
"""On CUDA without the fused kernel, run each full block of a sweep from one CUDA graph
(:class:`_BlockGraph`): about twenty small kernels per column, which launched one by one cost more host time
than they run (a sweep over a Llama-3-8B layer's 38912 columns is about 800 000 launches). The same ops on the
same data, so the same bits."""

USE_FUSED_KERNEL = True
"""On CUDA (with Triton), run each block of a sweep as one Triton kernel (``lowbit.kernels.gptq``): a program
per tile of rows takes the block's columns in order, the same per-column arithmetic as :func:`_column`
except the rank-1 update of ``G``, which may round differently (one FMA); tens of times faster than the
graphs, which still run one small kernel per operation per column."""


def _fused_kernel(device: torch.device, block_size: int):
    """``lowbit.kernels.gptq.refine_block`` where it runs (CUDA, Triton, no capture in progress, a block it
    takes), else None."""
    if not (USE_FUSED_KERNEL and device.type == "cuda") or torch.cuda.is_current_stream_capturing():
        return None
    from ..kernels import triton_available

    if triton_available() is not None:
        return None
    from ..kernels.gptq import MAX_BLOCK, refine_block

    return refine_block if block_size <= MAX_BLOCK else None


@torch.no_grad()
def refine(grid, W: torch.Tensor, Q: torch.Tensor, codes: torch.Tensor, states: list, H: torch.Tensor,
           sweeps: int, block_size: int = 128, graphs: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``sweeps`` cyclic coordinate-descent sweeps, in input order, over the columns of ``Q`` (fp32
    ``[rows, cols]``, the values of ``codes`` under the group ``states`` of ``grid``) against ``W`` with the
    objective's ``H`` (``[cols, cols]``, symmetric).

    Columns with ``H_jj <= 0`` keep their values. On CUDA every block runs as one fused kernel where
    :data:`USE_FUSED_KERNEL` (and ``graphs`` is None); otherwise ``graphs``: run full blocks through
    :class:`_BlockGraph` (None: on CUDA when :data:`USE_CUDA_GRAPHS`; True on the CPU runs its buffers
    without capturing, as the tests do). Returns the refined (values, codes); the inputs are not modified.
    """
    rows, cols = W.shape
    G = grid.group
    W = W.float()
    Q = Q.clone()
    codes = codes.clone()
    Hp = H.float().contiguous()
    diag_t = torch.diagonal(Hp).clone()
    diag = diag_t.tolist()
    cuda = W.device.type == "cuda"
    fused = _fused_kernel(W.device, block_size) if graphs is None else None
    if graphs is None:
        graphs = fused is None and cuda and USE_CUDA_GRAPHS and not torch.cuda.is_current_stream_capturing()
    block = None
    if graphs and block_size % G == 0 and cols >= block_size:
        block = _BlockGraph(rows, block_size, G, codes.dtype, W.device, capture=cuda)
    # a column without a change costs no update; asking costs a synchronization on a GPU, so only the CPU asks
    skip_unchanged = not cuda
    # every grid's codes are 0 .. 15 in order: a level's index is its code
    assert states and torch.equal(grid.levels(states[0])[0].long().cpu(), torch.arange(16))
    if fused is not None:
        # [groups, rows, 16], filled group by group (a list then a stack would hold it twice)
        stacked = torch.empty((len(states), rows, 16), dtype=torch.float32, device=W.device)
        for g, st in enumerate(states):
            stacked[g] = grid.levels(st)[1]
        dE_buf = torch.empty(block_size, rows, dtype=torch.float32, device=W.device)
    else:
        levels = [grid.levels(st)[1].contiguous() for st in states]
    # transposed ([cols, rows]): a column is a contiguous row here
    Wt, Qt, Ct = W.t().contiguous(), Q.t().contiguous(), codes.t().contiguous()
    for _ in range(sweeps):
        Et = Wt - Qt
        Gt = Hp @ Et  # (E H)^T, H symmetric
        for b1 in range(0, cols, block_size):
            b2 = min(b1 + block_size, cols)
            if fused is not None:
                fused(Wt, Qt, Ct, Et, Gt, Hp, diag_t, stacked, dE_buf, b1, b2 - b1, G)
                dEt = dE_buf[:b2 - b1]
            elif block is not None and b2 - b1 == block_size:
                with few_threads(W.device):
                    dEt = block.run(Wt, Qt, Ct, Et, Gt, Hp, diag_t, levels, b1)
            else:
                dEt = torch.zeros(b2 - b1, rows, dtype=W.dtype, device=W.device)
                Hb = Hp[b1:b2, b1:b2].contiguous()
                Gb = Gt[b1:b2]
                with few_threads(W.device):
                    for i in range(b2 - b1):
                        j = b1 + i
                        if diag[j] > 0:
                            _column(Wt[j], Qt[j], Ct[j], Et[j], Gb, Gb[i], Hb[i], diag_t[j], levels[j // G],
                                    dEt[i], None, skip_unchanged)
            if b1 > 0:
                Gt[:b1].addmm_(Hp[:b1, b1:b2], dEt)
            if b2 < cols:
                Gt[b2:].addmm_(Hp[b2:, b1:b2], dEt)
    return Qt.t().contiguous(), Ct.t().contiguous()



REFIT_ELEMENTS = 1 << 25
"""Bound on ``rows x cols x groups`` of one batch of :func:`refit_scales`'s normal equations (128 MB of fp32)."""


def row_objectives(W: torch.Tensor, Q: torch.Tensor, H: torch.Tensor) -> torch.Tensor:
    """``(w_r - q_r)^T H (w_r - q_r)`` of every row, in float64 ``[rows]``."""
    E = W.double() - Q.double()
    return ((E @ H.double()) * E).sum(dim=1)


def refit_scales(grid, W: torch.Tensor, Q: torch.Tensor, codes: torch.Tensor, states: list, H: torch.Tensor
                 ) -> tuple[list, torch.Tensor] | None:
    """The group scales that minimize ``tr((W - Q) H (W - Q)^T)`` with every code fixed, for grids whose scale
    is a free multiplier (:attr:`Grid.free_scale`; None for the others).

    With the codes fixed a row's values are ``Q[r, k] = u[r, k] * s[r, g(k)]`` (``u`` the codes' values at
    scale 1), so each row's objective is a quadratic in its ``K / group`` scales: the normal equations
    ``(V^T H V) s = V^T H w`` with ``V[k, g] = u[k]`` for the columns ``k`` of group ``g``. A solved scale that
    is not positive and finite keeps the group's old one, and a row keeps all of its old scales unless its
    objective goes down, so the total never increases. The new values are the grid's own decode of the codes
    under the new scales (fp32 scales stored as they are): the assembled QTensor decodes to them bit for bit.
    Returns (states, Q), the inputs unmodified."""
    if not getattr(grid, "free_scale", False):
        return None
    rows, cols = W.shape
    G = grid.group
    n = cols // G
    if n * G != cols or n != len(states):
        return None
    Hd = H.double()
    U = grid.unit_values(codes).double()
    old = torch.stack([st[0] for st in states], dim=1).double()
    b = (U * (W.double() @ Hd)).reshape(rows, n, G).sum(dim=-1)
    Hg = Hd.reshape(n, G, n, G)
    new = old.clone()
    step = max(1, REFIT_ELEMENTS // (cols * n))
    for r0 in range(0, rows, step):
        r1 = min(rows, r0 + step)
        Ur = U[r0:r1].reshape(r1 - r0, n, G)
        A = torch.einsum("rgi,gihj,rhj->rgh", Ur, Hg, Ur)
        dead = A.diagonal(dim1=1, dim2=2) <= 0  # a group whose codes are all zero, or whose inputs never moved
        A = A + torch.diag_embed(dead.double())
        rhs = torch.where(dead, torch.zeros_like(b[r0:r1]), b[r0:r1])
        sol, info = torch.linalg.solve_ex(A, rhs.unsqueeze(-1))
        sol = sol.squeeze(-1)
        ok = ~dead & (info == 0).unsqueeze(-1) & torch.isfinite(sol) & (sol > 0)
        new[r0:r1] = torch.where(ok, sol, old[r0:r1])
    dtype = states[0][0].dtype
    cand = new.to(dtype)
    Qn = torch.empty_like(Q)
    cand_states = []
    for g, st in enumerate(states):
        cs = grid.with_scale(st, cand[:, g])
        cand_states.append(cs)
        Qn[:, g * G:(g + 1) * G] = grid.decode(codes[:, g * G:(g + 1) * G], cs)
    better = row_objectives(W, Qn, H) < row_objectives(W, Q, H)
    Qn = torch.where(better.unsqueeze(1), Qn, Q)
    return [grid.with_scale(st, torch.where(better, cs[0], st[0])) for st, cs in zip(states, cand_states)], Qn


__all__ = ["objective", "refine", "refit_scales", "row_objectives"]
