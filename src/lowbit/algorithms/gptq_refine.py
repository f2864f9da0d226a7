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


@torch.no_grad()
def refine(grid, W: torch.Tensor, Q: torch.Tensor, codes: torch.Tensor, states: list, H: torch.Tensor,
           sweeps: int, block_size: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """``sweeps`` cyclic coordinate-descent sweeps, in input order, over the columns of ``Q`` (fp32
    ``[rows, cols]``, the values of ``codes`` under the group ``states`` of ``grid``) against ``W`` with the
    objective's ``H`` (``[cols, cols]``, symmetric).

    Columns with ``H_jj <= 0`` keep their values. Returns the refined (values, codes); the inputs are not
    modified.
    """
    rows, cols = W.shape
    G = grid.group
    W = W.float()
    Q = Q.clone()
    codes = codes.clone()
    Hp = H.float().contiguous()
    diag = torch.diagonal(Hp).tolist()
    # a column without a change costs no update; asking costs a synchronization on a GPU, so only the CPU asks
    skip_unchanged = W.device.type == "cpu"
    levels = [grid.levels(st) for st in states]
    # every grid's codes are 0 .. 15 in order: a level's index is its code
    assert levels and torch.equal(levels[0][0].long().cpu(), torch.arange(16))
    levels = [lv.contiguous() for _, lv in levels]
    # transposed ([cols, rows]): a column is a contiguous row here
    Wt, Qt, Ct = W.t().contiguous(), Q.t().contiguous(), codes.t().contiguous()
    for _ in range(sweeps):
        Et = Wt - Qt
        Gt = Hp @ Et  # (E H)^T, H symmetric
        for b1 in range(0, cols, block_size):
            b2 = min(b1 + block_size, cols)
            dEt = torch.zeros(b2 - b1, rows, dtype=W.dtype, device=W.device)
            Hb = Hp[b1:b2, b1:b2].contiguous()
            Gb = Gt[b1:b2]
            with few_threads(W.device):
                for i in range(b2 - b1):
                    j = b1 + i
                    d = diag[j]
                    if not d > 0:
                        continue
                    # q_j* = w_j + (sum_{k != j} H_jk E[:, k]) / H_jj, the sum being G[:, j] - H_jj E[:, j]
                    target = Wt[j].add(Gb[i].sub(Et[j], alpha=d), alpha=1.0 / d)
                    lv = levels[j // G]
                    dist = (lv - target.unsqueeze(1)).abs()
                    best = dist.argmin(dim=1, keepdim=True)
                    # a level's index is its code: the current value is lv[code], bit for bit
                    cur = Ct[j].unsqueeze(1).long()
                    better = dist.gather(1, best) < dist.gather(1, cur)
                    if skip_unchanged and not bool(better.any()):
                        continue
                    new = torch.where(better, best, cur)
                    q_new = lv.gather(1, new).squeeze(1)
                    delta = Qt[j] - q_new  # the change of E[:, j]
                    Ct[j] = new.squeeze(1).to(Ct.dtype)
                    Qt[j] = q_new
                    Et[j] += delta
                    dEt[i] = delta
                    Gb.addr_(Hb[i], delta)
            if b1 > 0:
                Gt[:b1].addmm_(Hp[:b1, b1:b2], dEt)
            if b2 < cols:
                Gt[b2:].addmm_(Hp[b2:, b1:b2], dEt)
    return Qt.t().contiguous(), Ct.t().contiguous()


__all__ = ["objective", "refine"]
