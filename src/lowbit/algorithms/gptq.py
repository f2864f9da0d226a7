"""GPTQ: round a weight column by column onto its format's grid, compensating each column's error with the
layer's input statistics (Frantar et al., "GPTQ: Accurate Post-Training Quantization for Generative
Pre-trained Transformers"; the loop of its reference implementation, with lowbit's format grids).

For a Linear with inputs ``x`` (rows of ``X``), ``H = 2 X^T X / n`` is the Hessian of the layer's squared
output error. With ``U`` the upper Cholesky factor of ``(H + damp * mean(diag H) * I)^-1``, column ``j`` is
rounded to ``q_j`` and the error ``(w_j - q_j) / U[j, j]`` is spread over the columns not yet rounded with
the weights ``U[j, j+1:]``; updates outside the current lazy block of 128 columns are applied once per block
(one matrix product instead of one rank-1 update per column).

Block scales come from the format's own rules (:mod:`lowbit.algorithms.grids`): a group's scales are computed
from the current, error-updated weights of that group when its first column is reached, and every value is
rounded as the format's reference rounds it with those scales, so the result is an ordinary QTensor that
decodes to exactly the weights the loop used. With ``act_order`` columns are taken in decreasing
``diag(H)`` order; groups are then static (scales computed from the original weight up front), since a group's
columns are no longer reached together and the checkpoint layout keeps one scale per group of consecutive
columns.

With ``refine_sweeps`` the loop's result is refined by coordinate descent with every group's scales fixed
(:mod:`lowbit.algorithms.gptq_refine`): GPTQ rounds each column once, against the columns after it; a sweep
revisits every column given all the others.

Calibration is streamed: ``H`` is accumulated per Linear by forward hooks (only the ``[K, K]`` sums are kept,
never the activations). With ``sequential`` the layers are quantized stage by stage (a stage is one numbered
block of the model, ``encoder.layer.3``, ``transformer_blocks.7``, ... or a Linear outside any): each stage
is calibrated on the outputs of the stages already quantized, as GPTQ does, at the cost of one calibration
pass per stage.

With ``asymmetric`` (the objective of GPTAQ, also published as GPTQv2: Li et al., 2025, "asymmetric
calibration") a layer's quantized output on the inputs it really sees (``X``, from the stages
already quantized) is fitted to the float model's output on the float model's inputs (``X_f``):
``||X Q^T - X_f W^T||^2``. With ``C = 2 X_f^T X / n`` that equals ``||X (Q - W~)^T||^2`` plus a constant for
``W~ = W C H^-1``, so GPTQ runs unchanged on the target ``W~`` (computed as ``W (C + d) (H + d)^-1``: a
ridge penalty ``d``, ``asymmetric_damp``, pulls ``W~`` towards ``W`` where the calibration says little). The
rounding of a layer then also absorbs the drift that the earlier layers' rounding put into its inputs. The
float inputs come from a copy of the model made before any layer is quantized, run on the same calibration
batches. The layers of a stage are then also quantized one after the other (layers reading one same input,
q/k/v, together), each calibrated on the quantized outputs of those before it: calibrated on unquantized ones,
a layer would absorb the drift that the layers before it already absorbed.
"""

from __future__ import annotations

import contextlib
import copy
import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..formats.qtensor import QTensor
from ..nn.quantize import recording_inputs, warn_layers
from . import gptq_graphs
from .gptq_graphs import column_step, few_threads
from .gptq_refine import refine, refit_scales
from .grids import GRID_FORMATS, Grid, check_scale_search, grid_for


@dataclass(frozen=True)
class GPTQ:
    """GPTQ options.

    Attributes:
        damp: dampening added to ``diag(H)``, as a fraction of its mean (GPTQ's ``percdamp``); > 0. Larger
            than GPTQ's 0.01: calibration sets are often small next to ``in_features`` (64 sentences give
            about 800 tokens, fewer than the 1536 inputs of a MiniLM MLP output), so ``H`` is rank-deficient
            and a weak dampening fits the few directions it saw; on the bundled MiniLM with NVFP4 and 64
            sentences 0.1 gave embedding cosine 0.988 where 0.01 gave 0.986. With more tokens a weaker one
            does better: with 379 sentences (about 5300 tokens), act-order and a scale search, 0.03 gave a
            higher embedding cosine than 0.1 on all six 4-bit weight formats, and with 4 refinement sweeps
            0.01 as high as 0.03 (``lowbit quantize --algorithm gptq`` uses 0.01 and 4 sweeps).
        block_size: columns per lazy update block (rounded up to a multiple of the format's group).
        act_order: quantize columns in decreasing ``diag(H)`` order, with static groups.
        sequential: quantize stage by stage, calibrating each on the already quantized stages' outputs
            (False: one calibration pass on the original model for every layer).
        scale_search: clipping factors in ``(0, 1]``. A group's scales are fitted by the format's own rule
            to the group's weights and to the weights times each factor, and for each row the candidate whose
            rounding of the group has the least squared error is kept (a factor below 1 clips the largest
            values for a finer grid under the others; an mxfp4 power-of-two scale steps down only for the
            blocks whose range the factor takes below a power of two, 0.5 for every block). ``()``
            (default): the format's scales, as round-to-nearest fits them. Every candidate is a scale the
            format stores, so the result is still an ordinary QTensor decoding to the values the loop chose.
        refine_sweeps: after the loop, this many cyclic coordinate-descent sweeps over the columns with every
            group's scales fixed (:mod:`lowbit.algorithms.gptq_refine`): each value moves to the grid value of
            its group that minimizes ``tr((W - Q) H (W - Q)^T)`` given the others, so that objective never
            increases and the result stays an ordinary QTensor. 0 (default): GPTQ's values as the loop left
            them.
        refine_damp: dampening of the refinement's ``H``, as a fraction of its mean diagonal (>= 0; 0: the
            calibration Hessian itself; None, the default: ``damp``, the loop's own).
        scale_refits: after the refinement, this many rounds of a scale refit followed by one refinement
            sweep, for the formats whose group scale is a free fp32 multiplier (fp4_b32, nf4 and bnb_fp4
            without double quantization; the others ignore it): with the codes fixed, each row's group scales
            are solved for the least objective (:func:`lowbit.algorithms.gptq_refine.refit_scales`, a row
            keeping its old scales unless its objective goes down), then the codes are refined under them.
            The objective never increases; the stored scales are no longer the blocks' absmax, which the
            formats do not require. 0 (default): the fitted scales.
        asymmetric: fit each layer's output to the float model's output on the float model's inputs rather
            than to its own weights on the quantized model's inputs (see the module docstring). Needs
            ``sequential``; holds a float copy of the model and, per stage, that copy's inputs to the stage's
            layers over the whole calibration set.
        asymmetric_damp: the ridge penalty of the asymmetric target, as a fraction of ``H``'s mean diagonal
            (> 0): how strongly the target stays at ``W`` where the calibration says little. Much larger than
            GPTQ's ``damp``: the drift correction is estimated from the calibration rows and overfits them
            easily. On the bundled MiniLM (int4, the CLI's GPTQ settings, 379 calibration sentences) the
            held-out embedding cosine was 0.9902 at 0.01, 0.9913 at 0.1, 0.9916 at 1, 0.9912 at 3 and 0.9909
            at 10 (symmetric GPTQ: 0.9902), while on the calibration sentences themselves it fell from 0.9984
            (0.01) to 0.9959 (10) (symmetric: 0.9946).
    """

    damp: float = 0.1
    block_size: int = 128
    act_order: bool = False
    sequential: bool = True
    scale_search: tuple[float, ...] = ()
    refine_sweeps: int = 0
    refine_damp: float | None = None
    scale_refits: int = 0
    asymmetric: bool = False
    asymmetric_damp: float = 1.0

    def __post_init__(self) -> None:
        if isinstance(self.damp, bool) or not isinstance(self.damp, (int, float)):
            raise TypeError(f"damp must be a float, got {type(self.damp).__name__}")
        if not (self.damp > 0 and math.isfinite(self.damp)):
            raise ValueError(f"damp must be a positive finite float, got {self.damp}")
        if isinstance(self.block_size, bool) or not isinstance(self.block_size, int):
            raise TypeError(f"block_size must be an int, got {type(self.block_size).__name__}")
        if self.block_size <= 0:
            raise ValueError(f"block_size must be positive, got {self.block_size}")
        for name in ("act_order", "sequential", "asymmetric"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be a bool, got {type(getattr(self, name)).__name__}")
        if isinstance(self.refine_sweeps, bool) or not isinstance(self.refine_sweeps, int):
            raise TypeError(f"refine_sweeps must be an int, got {type(self.refine_sweeps).__name__}")
        if self.refine_sweeps < 0:
            raise ValueError(f"refine_sweeps must be >= 0, got {self.refine_sweeps}")
        if isinstance(self.scale_refits, bool) or not isinstance(self.scale_refits, int):
            raise TypeError(f"scale_refits must be an int, got {type(self.scale_refits).__name__}")
        if self.scale_refits < 0:
            raise ValueError(f"scale_refits must be >= 0, got {self.scale_refits}")
        if self.refine_damp is None:
            pass
        elif isinstance(self.refine_damp, bool) or not isinstance(self.refine_damp, (int, float)):
            raise TypeError(f"refine_damp must be a float or None, got {type(self.refine_damp).__name__}")
        elif not (self.refine_damp >= 0 and math.isfinite(self.refine_damp)):
            raise ValueError(f"refine_damp must be a finite float >= 0, got {self.refine_damp}")
        if isinstance(self.asymmetric_damp, bool) or not isinstance(self.asymmetric_damp, (int, float)):
            raise TypeError(f"asymmetric_damp must be a float, got {type(self.asymmetric_damp).__name__}")
        if not (self.asymmetric_damp > 0 and math.isfinite(self.asymmetric_damp)):
            raise ValueError(f"asymmetric_damp must be a positive finite float, got {self.asymmetric_damp}")
        if self.asymmetric and not self.sequential:
            raise ValueError("asymmetric=True needs sequential=True: without quantized stages before a layer, "
                             "its inputs are the float model's and there is no drift to fit")
        # a tuple of floats whatever sequence was given: the options stay hashable and compare equal
        object.__setattr__(self, "scale_search", check_scale_search(self.scale_search))


class HessianAccumulator:
    """Running ``H = 2 X^T X / n`` (fp32 ``[K, K]``) over the rows of every input given to :meth:`add`."""

    def __init__(self, in_features: int, device: torch.device | str | None = None) -> None:
        if isinstance(in_features, bool) or not isinstance(in_features, int) or in_features <= 0:
            raise ValueError(f"in_features must be a positive int, got {in_features!r}")
        self.in_features = in_features
        self.H = torch.zeros(in_features, in_features, dtype=torch.float32, device=device)
        self.n = 0

    @torch.no_grad()
    def add(self, x: torch.Tensor) -> None:
        """Add the rows of ``x`` (``[..., K]``, any float dtype)."""
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
        if x.shape[-1] != self.in_features:
            raise ValueError(f"x must have last dim {self.in_features}, got {tuple(x.shape)}")
        self._add_rows(self._rows(x))

    def _rows(self, x: torch.Tensor) -> torch.Tensor:
        """``x``'s rows on ``H``'s device: kept in bf16/fp16 where :func:`_half_products` applies, else fp32."""
        x = x.detach().reshape(-1, self.in_features).to(self.H.device)
        return x if _half_products(x) else x.float()

    def _add_rows(self, x: torch.Tensor) -> None:
        m = x.shape[0]
        if m == 0:
            return
        # kept as a mean so that the sums of many batches stay in fp32 range
        beta = self.n / (self.n + m)
        self.n += m
        if _half_products(x):
            self.H = torch.addmm(self.H, x.t(), x, out_dtype=torch.float32, beta=beta, alpha=2.0 / self.n)
            return
        self.H.mul_(beta)
        x = x * math.sqrt(2.0 / self.n)
        self.H.addmm_(x.t(), x)


def _half_products(x: torch.Tensor) -> bool:
    """Whether ``x``'s Gram products run as a bf16/fp16 GEMM with fp32 output (CUDA, x in bf16 or fp16).

    The products of two bf16 or fp16 values are exact in fp32 and the tensor cores sum them in fp32
    accumulators: a few 1e-6 from the float64 sums on an H200 (the fp32 GEMM of fp32 copies: under 2e-6), at
    tensor-core speed. The fp32 GEMM took seconds per Llama-3-8B layer (about 1.3e14 flops for H and as many
    for the asymmetric cross term; the layer's GPTQ went from 22.4 to 17.1 s). Elsewhere the rows are
    converted to fp32 first."""
    return x.is_cuda and x.dtype in (torch.bfloat16, torch.float16) and _ADDMM_OUT_DTYPE


_ADDMM_OUT_DTYPE = hasattr(torch.ops.aten.addmm, "dtype")
"""torch has ``addmm(..., out_dtype=...)`` (bf16/fp16 inputs, fp32 output)."""


class CrossAccumulator(HessianAccumulator):
    """:class:`HessianAccumulator` of the quantized model's inputs ``x`` plus the running cross term
    ``C = 2 X_f^T X / n`` with the float model's inputs ``x_f`` to the same layer on the same rows."""

    def __init__(self, in_features: int, device: torch.device | str | None = None) -> None:
        super().__init__(in_features, device)
        self.C = torch.zeros_like(self.H)

    @torch.no_grad()
    def add_pair(self, x: torch.Tensor, x_float: torch.Tensor) -> None:
        """Add the rows of ``x`` (to ``H``) and the pairs of rows of ``x_float`` and ``x`` (to ``C``)."""
        if not isinstance(x_float, torch.Tensor) or tuple(x_float.shape) != tuple(x.shape):
            raise ValueError(
                f"x_float must have the shape of x {tuple(x.shape)}, got "
                f"{tuple(getattr(x_float, 'shape', ()))} (the float model's calibration calls must match the "
                "quantized model's one for one)"
            )
        xq, xf = self._rows(x), self._rows(x_float)
        if xq.shape[0] == 0:
            return
        n = self.n
        self._add_rows(xq)
        if xq.dtype == xf.dtype and _half_products(xq):
            self.C = torch.addmm(self.C, xf.t(), xq, out_dtype=torch.float32, beta=n / self.n, alpha=2.0 / self.n)
            return
        self.C.mul_(n / self.n)
        self.C.addmm_(xf.t().float(), xq.float(), alpha=2.0 / self.n)


def _damped_choleskys(H: torch.Tensor, damp: float):
    """Lower Cholesky factors ``L`` of ``H + d I`` with ``d`` (yielded with it) ``damp * mean(diag H)``, then
    tenfold, up to three times: the attempts at which ``H`` is positive definite enough in fp32."""
    mean = torch.mean(torch.diag(H))
    eye = torch.eye(H.shape[0], dtype=H.dtype, device=H.device)
    for attempt in range(4):
        d = (damp * 10**attempt) * mean
        L, info = torch.linalg.cholesky_ex(H + d * eye)
        if int(info) == 0:
            yield L, d


def _singular(damp: float) -> ValueError:
    return ValueError(
        f"damp: H stays singular after dampening {damp * 1000:g}x its mean diagonal (non-finite inputs?)"
    )


def _inverse_cholesky(H: torch.Tensor, damp: float) -> torch.Tensor:
    """Upper Cholesky factor of ``(H + damp * mean(diag H) I)^-1`` (dampened more if needed, see
    :func:`_damped_choleskys`)."""
    for L, _ in _damped_choleskys(H, damp):
        U, info = torch.linalg.cholesky_ex(torch.cholesky_inverse(L), upper=True)
        if int(info) == 0:
            return U
    raise _singular(damp)


@torch.no_grad()
def gptq_quantize(
    weight: torch.Tensor,
    H: torch.Tensor,
    fmt: str,
    *,
    config: GPTQ | None = None,
    C: torch.Tensor | None = None,
    **options: Any,
) -> tuple[QTensor, torch.Tensor]:
    """GPTQ of one weight ``[out, in]`` to ``fmt`` with the layer's input Hessian ``H`` ``[in, in]``.

    Args:
        weight: float32/bfloat16/float16 ``[out, in]`` (not modified), on any device (the work runs there).
        H: ``2 X^T X / n`` of the layer's inputs (:class:`HessianAccumulator`).
        fmt: one of :data:`lowbit.algorithms.grids.GRID_FORMATS`.
        config: :class:`GPTQ` options (default ``GPTQ()``).
        C: ``2 X_f^T X / n`` (:class:`CrossAccumulator`) for the asymmetric objective: the values are fitted
            to ``X_f W^T`` instead of ``X W^T`` (None: the symmetric objective, as GPTQ).
        **options: ``lowbit.quantize`` options of the format (nvfp4 ``global_scale``, int4_awq ``group_size``,
            nf4/bnb_fp4 ``blocksize``, ...); ``scale_search=`` overrides ``config.scale_search``.

    Returns:
        (QTensor laid out as ``lowbit.quantize(weight, fmt, **options)`` lays it out, fp32 ``[out, in]`` of
        the values the loop chose, equal to ``lowbit.dequantize(q, torch.float32)`` bit for bit).

    Raises:
        TypeError / ValueError: naming the argument (``weight``, ``H``, ``fmt``, ``config``, an option).
    """
    config = GPTQ() if config is None else config
    if not isinstance(config, GPTQ):
        raise TypeError(f"config must be a lowbit.algorithms.GPTQ, got {type(config).__name__}")
    if not isinstance(weight, torch.Tensor) or not weight.is_floating_point():
        got = getattr(weight, "dtype", type(weight))
        raise TypeError(f"weight must be a floating-point tensor, got {got}")
    if not isinstance(H, torch.Tensor) or not H.is_floating_point():
        raise TypeError(f"H must be a floating-point tensor, got {getattr(H, 'dtype', type(H))}")
    if weight.dim() != 2:
        raise ValueError(f"weight must be 2-D [out, in], got shape {tuple(weight.shape)}")
    k = weight.shape[1]
    if tuple(H.shape) != (k, k):
        raise ValueError(
            f"H must have shape ({k}, {k}) for a weight {tuple(weight.shape)}, got {tuple(H.shape)}"
        )
    if not torch.isfinite(H).all():
        raise ValueError("H must be finite (the calibration inputs held NaN/Inf)")
    if C is not None:
        if not isinstance(C, torch.Tensor) or not C.is_floating_point() or tuple(C.shape) != (k, k):
            raise ValueError(f"C must be a floating-point tensor of shape ({k}, {k}), got "
                             f"{getattr(C, 'dtype', type(C))} {tuple(getattr(C, 'shape', ()))}")
        if not torch.isfinite(C).all():
            raise ValueError("C must be finite (the calibration inputs held NaN/Inf)")
        C = C.to(weight.device, torch.float32)
    options.setdefault("scale_search", config.scale_search)
    grid = grid_for(weight, fmt, **options)
    return _run(weight, H.to(weight.device, torch.float32), grid, config, C)


def _asymmetric_target(W: torch.Tensor, H: torch.Tensor, C: torch.Tensor, damp: float) -> torch.Tensor:
    """``W (C + d I) (H + d I)^-1`` with ``d = damp * mean(diag H)`` (``GPTQ.asymmetric_damp``): the weight
    whose output on the quantized model's inputs best matches ``W``'s on the float model's, with a ridge
    penalty ``d ||W~ - W||^2`` that pulls it towards ``W`` (towards zero, the plain ridge solution shrinks the
    weights along every direction the calibration saw little of). Without drift (``C == H``) it is ``W``
    itself."""
    for L, d in _damped_choleskys(H, damp):
        # (H + d)^-1 is symmetric: W (C + d) (H + d)^-1 = ((H + d)^-1 (C^T + d) W^T)^T
        eye = torch.eye(H.shape[0], dtype=H.dtype, device=H.device)
        return torch.cholesky_solve((C.t() + d * eye) @ W.t(), L).t().contiguous()
    raise _singular(damp)


def _run(weight: torch.Tensor, H: torch.Tensor, grid: Grid, config: GPTQ,
         C: torch.Tensor | None = None) -> tuple[QTensor, torch.Tensor]:
    W = weight.detach().float().clone()
    rows, cols = W.shape
    G = grid.group
    H = H.clone()
    dead = torch.diag(H) == 0
    # inputs that were always zero: their weights cannot matter, and a zero diagonal breaks the inverse
    H[dead, dead] = 1
    if C is not None:
        W = _asymmetric_target(W, H, C, config.asymmetric_damp)
    W[:, dead] = 0
    refining = config.refine_sweeps or (config.scale_refits and grid.free_scale)
    if refining:
        # W is updated in place by the loop; H is not (it is permuted into a copy, and dampened into a new
        # tensor), so the refinement's objective keeps this one without a copy
        W0, H0 = W.clone(), H
    n_groups = cols // G
    states: list = [None] * n_groups
    if config.act_order:
        # static groups: the scales of every group from the (dead-zeroed) weight before any update
        states = grid.fit_groups(W[:, :n_groups * G])
        perm = torch.argsort(torch.diag(H), descending=True, stable=True)
        W, H = W[:, perm], H[perm][:, perm]
        group_of = (perm // G).tolist()
    else:
        perm = None
        group_of = [j // G for j in range(cols)]
    U = _inverse_cholesky(H, config.damp)
    del H
    Q = torch.zeros_like(W)
    codes = None
    # a group never straddles two lazy blocks: its scales are fitted on weights that are all up to date
    bs = -(-config.block_size // G) * G
    graphs = None
    if gptq_graphs.graphs_apply(W.device, cols, bs):
        graphs = gptq_graphs.BlockGraphs(grid, rows, bs, W.device, states, group_of, static=perm is not None,
                                         capture=W.device.type == "cuda")
    for i1 in range(0, cols, bs):
        i2 = min(i1 + bs, cols)
        if graphs is not None and i2 - i1 == bs:
            Err1 = graphs.run_block(W, U, Q, i1)
            codes = graphs.store_codes(codes, Q.shape[1], i1)
        else:
            W1 = W[:, i1:i2].clone()
            Err1 = torch.zeros_like(W1)
            # contiguous, as the graph runner's copy: the CPU's rank-1 update rounds by the rows' alignment
            U1 = U[i1:i2, i1:i2].contiguous()
            with few_threads(W.device):
                codes = _columns(grid, W1, Err1, U1, Q, codes, states, group_of, i1, perm is None)
        W[:, i2:] -= Err1 @ U[i1:i2, i2:]
    if perm is not None:
        inv = torch.argsort(perm)
        Q, codes = Q[:, inv], codes[:, inv]
    if refining:
        rd = config.damp if config.refine_damp is None else config.refine_damp
        H0.diagonal().add_(rd * torch.mean(torch.diag(H0)))
        if config.refine_sweeps:
            Q, codes = refine(grid, W0, Q, codes, states, H0, config.refine_sweeps, bs)
        for _ in range(config.scale_refits if grid.free_scale else 0):
            refit = refit_scales(grid, W0, Q, codes, states, H0)
            if refit is None:
                break
            states, Q = refit
            Q, codes = refine(grid, W0, Q, codes, states, H0, 1, bs)
    return grid.assemble(codes, states), Q


def _columns(grid, W1, Err1, U1, Q, codes, states, group_of, i1, fit_here):
    """Round the columns of one lazy block in order, spreading each one's error over the block's later
    columns; returns the codes tensor (created on the first column)."""
    G = grid.group
    rows = W1.shape[0]
    for i in range(W1.shape[1]):
        j = i1 + i
        g = group_of[j]
        if fit_here and j % G == 0:
            states[g] = grid.fit(W1[:, i:i + G])
        c, q = column_step(grid, W1, U1, Err1, i, states[g])
        if codes is None:
            codes = torch.zeros(rows, Q.shape[1], dtype=c.dtype, device=Q.device)
        codes[:, j] = c
        Q[:, j] = q
    return codes


# ---------------------------------------------------------------------------------------------- model driver


def stage_of(name: str) -> str:
    """The stage a Linear belongs to: its name up to the first all-digit part (``encoder.layer.3``), or the
    whole name for a Linear outside numbered blocks."""
    parts = name.split(".")
    for i, p in enumerate(parts):
        if p.isdigit():
            return ".".join(parts[: i + 1])
    return name


def _stages(names: Iterable[str], sequential: bool) -> list[list[str]]:
    names = list(names)
    if not sequential:
        return [names]
    order: dict[str, list[str]] = {}
    for n in names:
        order.setdefault(stage_of(n), []).append(n)
    return list(order.values())


@contextlib.contextmanager
def _stopping_after(model: nn.Module, block: nn.Module | None):
    """While open, a calibration pass over ``model`` ends each batch's forward once ``block`` (the stage's
    numbered block, or the Linear that is the stage) has returned: what a stage's statistics need has run,
    and the rest of the model would only be computed and thrown away (``lowbit.nn.quantize.StopForward``,
    which ``run_calibration`` catches per batch).

    It stops only from the second batch on, and only if the first batch ran ``block`` exactly once: a block
    that runs twice in one forward (shared weights) or not at all keeps the whole forward, as does a block
    that is the model itself (None). A model whose later batches run the block more often than the first
    (data-dependent repetition) needs :data:`STOP_EARLY` off."""
    if block is None or block is model:
        yield
        return
    from ..nn.quantize import StopForward

    state = {"batch": -1, "calls": 0, "first": None}

    def on_model(module, args, kwargs):
        if state["batch"] == 0:
            state["first"] = state["calls"]
        state["batch"] += 1
        state["calls"] = 0

    def on_block(module, args, output):
        state["calls"] += 1
        if state["batch"] >= 1 and state["first"] == 1:
            raise StopForward

    handles = [model.register_forward_pre_hook(on_model, with_kwargs=True), block.register_forward_hook(on_block)]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


STOP_EARLY = True
"""Sequential GPTQ's calibration passes end each batch's forward after the stage being calibrated (see
:func:`_stopping_after`); False runs every pass through the whole model. Either way the statistics are the
same, bit for bit."""


@torch.no_grad()
def apply_gptq(
    model: nn.Module,
    targets: Mapping[str, nn.Linear],
    build: Callable[[str, nn.Linear, QTensor | None], nn.Module],
    quantize_options: Callable[[str, nn.Linear], tuple[str, dict[str, Any]]],
    run_calibration: Callable[[], Any],
    config: GPTQ | None = None,
    log: Callable[[str], None] | None = None,
    calibrate_on: Callable[[nn.Module], Any] | None = None,
    stop_early: bool = False,
) -> dict[str, str]:
    """GPTQ every Linear of ``targets`` in place, stage by stage (see the module docstring).

    Args:
        model: the model ``targets`` belong to.
        targets: name -> ``nn.Linear``, in model order.
        build: ``build(name, linear, qtensor)`` returns the module replacing ``linear`` (``qtensor`` None:
            quantize it by round-to-nearest).
        quantize_options: ``(fmt, lowbit.quantize options)`` of a layer's weight.
        run_calibration: runs the model over the calibration data once.
        config: :class:`GPTQ` options.
        log: progress lines (None: silent).
        calibrate_on: ``calibrate_on(m)`` runs the model ``m`` (a float copy of ``model``) over the same
            calibration data as ``run_calibration``, in the same order; needed by ``config.asymmetric``.
        stop_early: both run ``lowbit.nn.quantize.run_calibration`` over an iterable, so a sequential pass
            may end each batch's forward after the stage it calibrates (:data:`STOP_EARLY`).

    Returns:
        name -> ``"gptq"`` or why the layer was rounded to nearest instead (it never ran during calibration,
        or its format/shape has no GPTQ grid).
    """
    config = GPTQ() if config is None else config
    modules = dict(model.named_modules())
    how: dict[str, str] = {}
    reference = None
    if config.asymmetric:
        if calibrate_on is None:
            raise ValueError("config.asymmetric needs calibrate_on (runs the float copy over the calibration data)")
        # the float model whose outputs every quantized layer is fitted to, copied before any layer changes
        reference = copy.deepcopy(model)
        ref_modules = dict(reference.named_modules())

    def replace(name: str, new: nn.Module) -> None:
        parent_name, _, child = name.rpartition(".")
        setattr(modules[parent_name] if parent_name else model, child, new)

    def quantize_group(group: list[str], acc: dict) -> None:
        stacked = _gptq_stacked_siblings(group, acc, targets, quantize_options, config)
        for n in group:
            lin = targets[n]
            fmt, opts = quantize_options(n, lin)
            a = acc.pop(n)
            why = None
            if fmt not in GRID_FORMATS:
                why = f"{fmt} has no GPTQ grid"
            elif a.n == 0:
                why = "never ran during calibration"
            q = stacked.pop(n, None)
            if why is None and q is None:
                try:
                    q, _ = gptq_quantize(lin.weight, a.H, fmt, config=config, C=getattr(a, "C", None), **opts)
                except ValueError as e:
                    if "straddle" not in str(e):
                        raise
                    why = str(e)
            del a
            how[n] = "gptq" if why is None else f"round-to-nearest: {why}"
            replace(n, build(n, lin, q))

    stop = stop_early and STOP_EARLY and config.sequential

    def block_of(mods: dict, stage: list[str]) -> nn.Module | None:
        return mods.get(stage_of(stage[0])) if stop else None

    for stage in _stages(targets, config.sequential):
        if reference is None:
            acc = {n: HessianAccumulator(targets[n].in_features, targets[n].weight.device) for n in stage}
            with (recording_inputs({n: targets[n] for n in stage}, lambda name, x: acc[name].add(x)),
                  _stopping_after(model, block_of(modules, stage))):
                run_calibration()
            quantize_group(stage, acc)
        else:
            # inside a stage too, each layer is calibrated on the outputs of the layers before it already
            # quantized: a layer fitted to the float output absorbs the drift of its inputs, and a later layer
            # calibrated on the unquantized ones would absorb the same drift a second time
            with _stopping_after(reference, block_of(ref_modules, stage)):
                kept, groups = _float_inputs(stage, ref_modules, reference, calibrate_on)
            for group in groups:
                with _stopping_after(model, block_of(modules, stage)):
                    acc = _paired_statistics(group, targets, kept, run_calibration)
                quantize_group(group, acc)
        if log is not None:
            log(f"gptq: {', '.join(stage)}")
    fallback = [f"{n} ({w.split(': ', 1)[1]})" for n, w in how.items() if w != "gptq"]
    warn_layers("lowbit GPTQ", "rounded to nearest instead", fallback, stacklevel=3)
    return how


def _float_inputs(stage, ref_modules, reference, calibrate_on):
    """The float copy's inputs to every layer of ``stage`` over the calibration (one pass), and the stage's
    layers in groups in the order they first run, the layers that read one same input together (q/k/v)."""
    kept: dict[str, list] = {n: [] for n in stage}
    # each layer's first input itself (not a copy) is held until the pass ends, so no later tensor can take its
    # memory: equal addresses mean one same input
    first: dict[str, torch.Tensor] = {}
    # the latest input and its copy: a sibling called on that very tensor (q/k/v) keeps the same copy, so the
    # siblings' lists hold one copy per call between them (the input is held, so its address is not reused)
    latest: list = [None, None, None]

    def record(name: str, x: torch.Tensor) -> None:
        first.setdefault(name, x)
        key = _input_key(x)
        if latest[0] != key:
            latest[:] = [key, x, x.detach().clone()]
        kept[name].append(latest[2])

    with recording_inputs({n: ref_modules[n] for n in stage}, record):
        calibrate_on(reference)
    latest.clear()
    groups: dict[tuple, list[str]] = {}
    for n, x in first.items():  # in the order of the layers' first calls
        groups.setdefault(_input_key(x), []).append(n)
    ran = set(first)
    first.clear()
    # layers that never ran go last, each alone (they are rounded to nearest)
    return kept, [*groups.values(), *([n] for n in stage if n not in ran)]


def _same_options(a: Mapping, b: Mapping) -> bool:
    """Whether two ``lowbit.quantize`` option dicts are equal (tensor values compared by value)."""
    if a.keys() != b.keys():
        return False
    for k, v in a.items():
        w = b[k]
        if isinstance(v, torch.Tensor) or isinstance(w, torch.Tensor):
            if not (isinstance(v, torch.Tensor) and isinstance(w, torch.Tensor) and v.shape == w.shape
                    and v.dtype == w.dtype and torch.equal(v, w.to(v.device))):
                return False
        elif v != w:
            return False
    return True


def _gptq_stacked_siblings(group, acc, targets, quantize_options, config) -> dict[str, QTensor]:
    """GPTQ of siblings sharing one accumulator (q/k/v, see :func:`_paired_statistics`) as one weight: their
    rows stacked, one column loop (and refinement) for all, each member's rows cut back out with
    :func:`lowbit.formats.rows.slice_rows`. GPTQ treats rows independently (each row's updates use only that
    row and the shared ``H``), so this computes what separate runs compute, up to the rounding of the block
    updates' matrix products; it runs a third of the per-column launches for q/k/v. Siblings of other
    formats or options, row counts that ``slice_rows`` cannot cut at, double-quantized nf4 (its nested
    statistics span the whole weight) and nvfp4 without a given (shared) global scale are left to separate
    runs. Returns member name -> QTensor."""
    from ..formats.rows import ROW_ALIGN, slice_rows, slice_rows_reason

    out: dict[str, QTensor] = {}
    by_acc: dict[int, list[str]] = {}
    for n in group:
        by_acc.setdefault(id(acc[n]), []).append(n)
    for members in by_acc.values():
        a = acc[members[0]]
        if len(members) < 2 or a.n == 0:
            continue
        lins = [targets[n] for n in members]
        fmt, opts = quantize_options(members[0], lins[0])
        if (fmt not in GRID_FORMATS or fmt not in ROW_ALIGN or opts.get("double_quant", fmt in ("nf4", "bnb_fp4"))
                or (fmt == "nvfp4" and opts.get("global_scale") is None)):
            continue  # (an nvfp4 global scale not given is the weight's own: the stack's would differ)
        w0 = lins[0].weight
        if any(lin.weight.dtype != w0.dtype or lin.weight.device != w0.device
               or lin.weight.shape[1] != w0.shape[1] for lin in lins[1:]):
            continue
        if any(not _same_options(opts, o) or f != fmt for f, o in (quantize_options(n, lin)
                                                                  for n, lin in zip(members[1:], lins[1:]))):
            continue
        starts = [0]
        for lin in lins:
            starts.append(starts[-1] + lin.weight.shape[0])
        if any(s % ROW_ALIGN[fmt] for s in starts[:-1]):
            continue
        try:
            q, _ = gptq_quantize(torch.cat([lin.weight.detach() for lin in lins]), a.H, fmt, config=config,
                                 C=getattr(a, "C", None), **opts)
        except ValueError:
            continue  # e.g. a group straddling a member boundary: each member alone says which one
        if slice_rows_reason(q) is not None:
            continue
        for n, n0, n1 in zip(members, starts, starts[1:]):
            out[n] = slice_rows(q, n0, n1)
    return out


def _input_key(x: torch.Tensor) -> tuple:
    """What identifies one input tensor while it is alive: its memory, view and in-place version."""
    return x.data_ptr(), x.storage_offset(), tuple(x.shape), tuple(x.stride()), x._version


def _paired_statistics(group, targets, kept, run_calibration):
    """``H`` and ``C`` of every layer of ``group``: the quantized model's inputs paired call by call with the
    float copy's (``kept``, emptied as they are paired).

    Siblings that read the very same input in every call on the float copy (q/k/v: their ``kept`` lists hold
    the same copies) share one accumulator: each call's pair is added once, by the first of them, and the
    others' calls are checked to be on that same tensor. Their ``H`` and ``C`` are equal, computed once."""
    lead = group[0]
    shared = [n for n in group[1:] if len(kept[n]) == len(kept[lead])
              and all(a is b for a, b in zip(kept[n], kept[lead]))]
    acc = {n: CrossAccumulator(targets[n].in_features, targets[n].weight.device)
           for n in group if n not in shared}
    acc.update(dict.fromkeys(shared, acc[lead]))
    calls = dict.fromkeys(group, 0)
    lead_input: list = [None]

    def pair(name: str, x: torch.Tensor) -> None:
        i = calls[name]
        calls[name] = i + 1
        if i >= len(kept[name]):
            raise ValueError(f"asymmetric GPTQ: {name} ran more often on the quantized model than on the float "
                             "copy; the calibration must run the same batches in the same order every time")
        x_float, kept[name][i] = kept[name][i], None  # freed as soon as it is paired (by every sibling)
        if name in shared:
            if calls[lead] != i + 1 or lead_input[0] is None or _input_key(lead_input[0]) != _input_key(x):
                raise ValueError(f"asymmetric GPTQ: {name} and {lead} read one input on the float copy but not "
                                 "on the quantized model; the calibration must run the model the same way every "
                                 "time")
            return
        if name == lead:
            lead_input[0] = x
        acc[name].add_pair(x, x_float)

    with recording_inputs({n: targets[n] for n in group}, pair):
        run_calibration()
    lead_input.clear()
    for n in group:
        if calls[n] != len(kept[n]):
            raise ValueError(f"asymmetric GPTQ: {n} ran {len(kept[n])} times on the float copy and {calls[n]} "
                             "on the quantized model; the calibration must run the same batches every time")
    return acc


ALGORITHMS = ("rtn", "awq", "gptq")
"""``quantize_model(algorithm=...)`` names (or a :class:`GPTQ`)."""


def resolve_algorithm(algorithm: Any, awq: bool | None, calibration: Any) -> tuple[GPTQ | None, bool | None]:
    """``quantize_model``'s ``algorithm`` and ``awq`` arguments -> (GPTQ options or None for
    round-to-nearest, the ``awq`` flag to use). ``"awq"`` is ``awq=True``; with GPTQ, AWQ runs only when asked
    (``awq=True``), since the two are separate choices of what to do with the calibration data.

    Raises:
        TypeError: ``algorithm`` is neither a name nor a :class:`GPTQ`.
        ValueError: an unknown name, ``"awq"`` with ``awq=False``, or GPTQ without calibration.
    """
    if isinstance(algorithm, GPTQ):
        config = algorithm
    elif isinstance(algorithm, str):
        if algorithm not in ALGORITHMS:
            raise ValueError(
                f"algorithm must be one of {ALGORITHMS} or a lowbit.algorithms.GPTQ, got {algorithm!r}"
            )
        if algorithm == "rtn":
            return None, awq
        if algorithm == "awq":
            if awq is False:
                raise ValueError("algorithm='awq' contradicts awq=False")
            return None, True
        config = GPTQ()
    else:
        raise TypeError(
            f"algorithm must be one of {ALGORITHMS} or a lowbit.algorithms.GPTQ, "
            f"got {type(algorithm).__name__}"
        )
    if calibration is None:
        raise ValueError("algorithm='gptq' needs calibration data (calibration=...)")
    return config, (False if awq is None else awq)


def apply_gptq_scheme(
    model: nn.Module,
    targets: Mapping[str, nn.Linear],
    scheme: Any,
    run_calibration: Callable[[], Any],
    config: GPTQ,
    global_scales: Mapping[str, torch.Tensor],
    input_scales: Mapping[str, torch.Tensor],
    backend: str | None,
    calibrate_on: Callable[[nn.Module], Any] | None = None,
    stop_early: bool = False,
) -> dict[str, str]:
    """:func:`apply_gptq` with ``QuantLinear`` layers of ``scheme`` (what ``quantize_model`` calls): nvfp4
    weights keep the global scale ``quantize_model`` chose (shared by fused siblings), activations their
    static scales."""
    from ..nn.modules import QuantLinear
    from .rotation import carry_input_transform

    def options(name: str, lin: nn.Linear) -> tuple[str, dict[str, Any]]:
        opts = scheme.weight_quantize_options(lin.in_features)
        if name in global_scales:
            opts["global_scale"] = global_scales[name]
        return scheme.weight_format, opts

    def build(name: str, lin: nn.Linear, q: QTensor | None) -> nn.Module:
        # an online input transform (smoothing, rotation) moves to the new layer: the later stages are
        # calibrated on, and the model runs with, the inputs the weights were transformed for
        if q is None:
            return carry_input_transform(lin, QuantLinear.from_linear(
                lin, scheme, global_scale=global_scales.get(name), input_global_scale=input_scales.get(name),
                backend=backend))
        bias = lin.bias.detach() if lin.bias is not None else None
        return carry_input_transform(lin, QuantLinear(
            lin.in_features, lin.out_features, bias is not None, scheme=scheme, weight=q, bias_tensor=bias,
            input_global_scale=input_scales.get(name), backend=backend))

    return apply_gptq(model, targets, build, options, run_calibration, config, calibrate_on=calibrate_on,
                      stop_early=stop_early)


__all__ = [
    "ALGORITHMS",
    "GPTQ",
    "CrossAccumulator",
    "HessianAccumulator",
    "apply_gptq",
    "apply_gptq_scheme",
    "gptq_quantize",
    "resolve_algorithm",
    "stage_of",
]
