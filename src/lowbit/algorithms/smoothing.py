"""SmoothQuant-style smoothing for activation-quantized schemes (Xiao et al., "SmoothQuant: Accurate and
Efficient Post-Training Quantization for Large Language Models").

A Linear's inputs often have a few channels with much larger values than the rest; once activations are
quantized, those channels set the scale of every block (or tensor) they fall in. Smoothing moves part of that
range into the weight: for input channel ``j``

    s_j = max|X_j| ** alpha / max|W_j| ** (1 - alpha)

(``X`` the layer's calibration inputs, ``W_j`` the ``j``-th weight column, maximised over the layers that read
the same input), the weight becomes ``W diag(s)`` and the input ``X diag(1/s)``; the float function is
unchanged. ``1/s`` is folded into the operation that produces the input, so the quantized model costs nothing
more at run time:

- a norm (LayerNorm, RMSNorm: ``normalized * weight (+ bias)``) whose output is read only by Linear layers
  (Llama's ``input_layernorm -> q/k/v``, ``post_attention_layernorm -> gate/up``): its weight and bias are
  divided by ``s``;
- a Linear whose output reaches the layer through channel-wise operations only: the value projection feeding
  the attention output projection (``v_proj -> o_proj``, BERT ``value -> attention.output.dense``, diffusers
  ``to_v -> to_out.0``, without grouped-query attention) and Llama's ``up_proj -> down_proj``; its rows and bias
  are divided by ``s``.

Which norms qualify is not guessed from names: one calibration forward is traced at the level of torch
functions (a ``TorchFunctionMode``, :mod:`lowbit.algorithms.dataflow`), following every norm's and Linear's
output through views and eval-mode dropout to the operations that read it. A producer is folded only if every
reader is a Linear layer that reads nothing else and gets the compensation, and if, after the fold, the
producer's output on the traced input is its old output divided by ``s`` (a norm computing
``normalized * (1 + weight)`` fails this check and is left alone). Post-norm models such as BERT fail the first
test: their LayerNorm output is also the residual stream (``LayerNorm(x + attention(x))``), which a per-channel
``1/s`` would change; there only the value -> output-projection pairs fold.

Layers whose input cannot take ``1/s`` offline are left unsmoothed, unless ``online=True``: then an online
per-channel scale (:class:`lowbit.algorithms.rotation.InputTransform`, applied by a forward pre-hook) divides
the input by ``s`` before it is quantized. That costs one elementwise multiply per layer call in pure torch
(a fused kernel would apply it while quantizing the activation) and, like every online transform, is not part
of any checkpoint format.

``alphas`` turns on a per-group search: each alpha of the grid is tried on a subsample of the group's
calibration inputs, the layers are quantized with the target scheme, and the alpha whose outputs are closest
(squared error summed over the group) to the float outputs is kept.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from .dataflow import ReaderTrace, trace_readers
from .rotation import InputTransform, attach_input_transform, input_transform_of

MAX_SCALE = 1e4
"""``s`` is clamped to ``[1/MAX_SCALE, MAX_SCALE]``."""


@dataclass(frozen=True)
class SmoothQuant:
    """Smoothing options (``quantize_model(algorithm=SmoothQuant(...))`` or ``"smoothquant"``).

    Attributes:
        alpha: migration strength in ``[0, 1]`` (0: ``s = 1 / max|W|``, 1: ``s = max|X|``); SmoothQuant's 0.5.
        alphas: a grid of alphas to search per group instead (each in ``[0, 1]``); empty: use ``alpha``.
        online: smooth the layers whose input has no foldable producer with an online per-channel scale
            (runtime cost, see the module docstring); False leaves them unsmoothed.
        max_rows: calibration rows kept per group for the search (a strided subsample beyond that).
    """

    alpha: float = 0.5
    alphas: tuple[float, ...] = field(default=())
    online: bool = False
    max_rows: int = 2048

    def __post_init__(self) -> None:
        if isinstance(self.alpha, bool) or not isinstance(self.alpha, (int, float)):
            raise TypeError(f"alpha must be a float, got {type(self.alpha).__name__}")
        if not 0.0 <= self.alpha <= 1.0:
            raise ValueError(f"alpha must be in [0, 1], got {self.alpha}")
        if isinstance(self.alphas, (str, bytes)) or not isinstance(self.alphas, (tuple, list)):
            raise TypeError(f"alphas must be a tuple of floats, got {type(self.alphas).__name__}")
        object.__setattr__(self, "alphas", tuple(self.alphas))
        for a in self.alphas:
            if isinstance(a, bool) or not isinstance(a, (int, float)) or not 0.0 <= a <= 1.0:
                raise ValueError(f"alphas must hold floats in [0, 1], got {a!r}")
        if not isinstance(self.online, bool):
            raise TypeError(f"online must be a bool, got {type(self.online).__name__}")
        if isinstance(self.max_rows, bool) or not isinstance(self.max_rows, int) or self.max_rows <= 0:
            raise ValueError(f"max_rows must be a positive int, got {self.max_rows!r}")


@dataclass
class SmoothGroup:
    """Linear layers reading one input, and how ``1/s`` reaches that input."""

    linears: tuple[str, ...]
    producer: str | None  # module folded into, None: online
    kind: str  # "norm", "linear" or "online"


# ------------------------------------------------------------------------------------------ smoothing groups


def find_smooth_groups(model: nn.Module, targets: Mapping[str, nn.Linear], trace: ReaderTrace) -> tuple[
        list[SmoothGroup], dict[str, str]]:
    """The groups of ``targets`` whose input can take ``1/s`` offline, from the trace and the known
    attention/MLP pairs; also ``{target: why it has no foldable producer}`` for the others."""
    from ..nn.awq_search import find_groups

    modules = dict(model.named_modules())
    groups: list[SmoothGroup] = []
    taken: set[str] = set()
    why: dict[str, str] = {}
    for producer, readers in trace.readers.items():
        lins = sorted(r.split(":", 1)[1] for r in readers if r.startswith("linear:"))
        lins = [n for n in lins if n != producer]
        if not lins or not any(n in targets for n in lins):
            continue
        ops = sorted({r.split(":", 1)[1] for r in readers if r.startswith("op:")})
        mixed = [n for n in lins if set(trace.inputs.get(n, [])) != {producer}]
        if ops:
            reason = f"{producer}'s output is also read by {', '.join(ops)} (e.g. a residual connection)"
        elif mixed:
            reason = f"{', '.join(mixed)} also read(s) inputs other than {producer}'s output"
        else:
            reason = None
        if reason is not None:
            for n in lins:
                why.setdefault(n, reason)
            continue
        kind = "linear" if isinstance(modules[producer], nn.Linear) else "norm"
        order = [n for n in modules if n in lins]
        groups.append(SmoothGroup(tuple(order), producer, kind))
        taken.update(order)
    for g in find_groups(model):
        if g.prev_kind != "linear" or any(n in taken or n not in targets for n in g.linears):
            continue
        if not all(isinstance(modules.get(n), nn.Linear) for n in (g.prev, *g.linears)):
            continue
        groups.append(SmoothGroup(tuple(g.linears), g.prev, "linear"))
        taken.update(g.linears)
    for n in targets:
        if n not in taken:
            why.setdefault(n, "its input does not come straight from a norm or Linear layer")
    return groups, {n: w for n, w in why.items() if n in targets and n not in taken}


# ------------------------------------------------------------------------------------------ statistics


class _Stats:
    """Per layer: input channel absmax over all calibration rows, and a strided row subsample."""

    def __init__(self, max_rows: int, keep_rows: bool) -> None:
        self.max_rows = max_rows
        self.keep_rows = keep_rows
        self.absmax: dict[str, torch.Tensor] = {}
        self.rows: dict[str, list[torch.Tensor]] = {}

    def hook(self, name: str):
        def fn(module, args):
            x = args[0].detach()
            x2 = x.reshape(-1, x.shape[-1])
            a = x2.abs().amax(0).float() if x2.shape[0] else torch.zeros(x2.shape[-1], device=x.device)
            self.absmax[name] = a if name not in self.absmax else torch.maximum(self.absmax[name], a)
            if self.keep_rows:
                rows = self.rows.setdefault(name, [])
                rows.append(x2.float().cpu())
                if sum(r.shape[0] for r in rows) > 4 * self.max_rows:
                    self.rows[name] = [_subsample(torch.cat(rows), 2 * self.max_rows)]
        return fn

    def sample(self, name: str) -> torch.Tensor | None:
        rows = self.rows.get(name)
        return _subsample(torch.cat(rows), self.max_rows) if rows else None


def _subsample(x: torch.Tensor, n: int) -> torch.Tensor:
    if x.shape[0] <= n:
        return x
    return x[torch.linspace(0, x.shape[0] - 1, n).long()]


def smooth_scale(x_absmax: torch.Tensor, w_absmax: torch.Tensor, alpha: float) -> torch.Tensor:
    """``s = max|X|^alpha / max|W|^(1 - alpha)`` (fp32), clamped to ``[1/MAX_SCALE, MAX_SCALE]``; channels
    that never saw a non-zero input keep ``s = 1``."""
    xa = x_absmax.float()
    wa = w_absmax.float().to(xa.device)
    s = xa.clamp(min=1e-5).pow(alpha) / wa.clamp(min=1e-5).pow(1.0 - alpha)
    s = s.clamp(1.0 / MAX_SCALE, MAX_SCALE)
    return torch.where((xa > 0) & torch.isfinite(xa), s, torch.ones_like(s))


@torch.no_grad()
def _search(x: torch.Tensor, weights: list[torch.Tensor], x_absmax, w_absmax, alphas, scheme):
    """The alpha of ``alphas`` whose quantized outputs on ``x`` are closest to the float ones; (alpha, s,
    {alpha: error})."""
    from ..nn.modules import QuantLinear

    errs: dict[float, float] = {}
    best = None
    refs = [x @ w.float().t() for w in weights]
    for a in alphas:
        s = smooth_scale(x_absmax, w_absmax, a).cpu()
        err = 0.0
        for w, r in zip(weights, refs):
            lin = nn.Linear(w.shape[1], w.shape[0], bias=False)
            lin.weight.copy_(w.float() * s)
            q = QuantLinear.from_linear(lin, scheme, backend="torch")
            err += float(((q(x / s) - r) ** 2).mean())
        errs[a] = err
        if best is None or err < best[0]:
            best = (err, a, s)
    assert best is not None
    return best[1], best[2], errs


# ------------------------------------------------------------------------------------------ folding


def _fold_producer(m: nn.Module, s: torch.Tensor) -> None:
    if isinstance(m, nn.Linear):
        m.weight.div_(s.to(m.weight).unsqueeze(1))
    else:
        m.weight.div_(s.to(m.weight))
    bias = getattr(m, "bias", None)
    if isinstance(bias, torch.Tensor):
        bias.div_(s.to(bias))


def _unfold_producer(m: nn.Module, s: torch.Tensor) -> None:
    _fold_producer(m, 1.0 / s)


def _fold_checked(m: nn.Module, s: torch.Tensor, sample: tuple | None) -> bool:
    """Fold ``1/s`` into ``m``; True if its output on the traced input became its output before the fold
    divided by ``s`` (else the fold is undone)."""
    if sample is None:
        _fold_producer(m, s)
        return True
    args = sample[0]
    try:
        before = m(*args)
        _fold_producer(m, s)
        after = m(*args)
    except Exception:  # noqa: BLE001 - a producer that cannot be rerun alone is not folded
        return False
    ok = isinstance(before, torch.Tensor) and isinstance(after, torch.Tensor) and after.shape == before.shape
    if ok:
        want = before.float() / s.to(before.device)
        # a few roundings of the output's dtype (bf16 weights are rounded by the fold itself); a norm that
        # does not scale with its weight is off by tens of percent
        rtol = max(1e-3, 4 * torch.finfo(after.dtype).eps) if after.is_floating_point() else 1e-3
        tol = rtol * 0.1 * float(want.abs().max()) if want.numel() else 0.0
        ok = bool(((after.float() - want).abs() <= tol + rtol * want.abs()).all())
    if not ok:
        _unfold_producer(m, s)
    return ok


@torch.no_grad()
def apply_smoothing(
    model: nn.Module,
    targets: Mapping[str, nn.Linear],
    scheme: Any,
    run_calibration: Callable[[], Any],
    config: SmoothQuant | None = None,
) -> dict[str, dict[str, Any]]:
    """Smooth every group of ``targets`` (modifies the float weights of ``model``; see the module docstring).

    Args:
        model: the float model, before its Linear layers are quantized.
        targets: the Linear layers that will be quantized, by name.
        scheme: their :class:`lowbit.nn.Scheme`; it must quantize activations.
        run_calibration: runs the model over the calibration data once.
        config: :class:`SmoothQuant` options.

    Returns:
        ``{layer: {"how": "norm" | "linear" | "online" | "none", "producer", "alpha", "why"}}``.

    Raises:
        ValueError: a weight-only scheme (nothing to smooth), or no calibration data reached the layers.
    """
    config = SmoothQuant() if config is None else config
    if not isinstance(config, SmoothQuant):
        raise TypeError(f"config must be a lowbit.algorithms.SmoothQuant, got {type(config).__name__}")
    if scheme.act_format is None:
        raise ValueError(
            f"algorithm 'smoothquant' needs a scheme that quantizes activations (w8a8-*, w4a8-*, w4a4-*); "
            f"{scheme.name} is weight-only: its activations stay 16-bit, there is nothing to smooth"
        )
    modules = dict(model.named_modules())
    stats = _Stats(config.max_rows, keep_rows=bool(config.alphas))
    trace, samples = trace_readers(model, run_calibration, {lin: stats.hook(n) for n, lin in targets.items()})
    groups, why = find_smooth_groups(model, targets, trace)
    if config.online:
        # layers without a foldable producer, grouped by the input tensor they share (q/k/v of post-norm
        # attention): one s per group
        by_input: dict[int, list[str]] = {}
        for n in targets:
            if n in why and n in trace.input_ids and input_transform_of(targets[n]) is None:
                by_input.setdefault(trace.input_ids[n], []).append(n)
        groups += [SmoothGroup(tuple(ns), None, "online") for ns in by_input.values()]
    report: dict[str, dict[str, Any]] = {}
    for g in groups:
        names = [n for n in g.linears if n in stats.absmax]
        if not names:
            continue
        lins = [modules[n] for n in g.linears]
        x_absmax = torch.stack([stats.absmax[n] for n in names]).amax(0)
        w_absmax = torch.stack(
            [lin.weight.detach().abs().amax(0).float().to(x_absmax.device) for lin in lins]
        ).amax(0)
        alpha, errs = config.alpha, None
        x = stats.sample(names[0]) if config.alphas else None
        if x is not None:
            ws = [lin.weight.detach().cpu() for lin in lins]
            alpha, s, errs = _search(x, ws, x_absmax.cpu(), w_absmax.cpu(), config.alphas, scheme)
        s = smooth_scale(x_absmax, w_absmax, alpha)
        if g.kind in ("norm", "linear"):
            prod = modules[g.producer]
            s_p = s.to(prod.weight.device)
            if not _fold_checked(prod, s_p, samples.get(g.producer)):
                reason = f"folding into {g.producer} does not scale its output by 1/s (not a plain norm)"
                for n in g.linears:
                    report[n] = {"how": "none", "producer": None, "alpha": None, "why": reason}
                continue
        for lin in lins:
            lin.weight.mul_(s.to(lin.weight).unsqueeze(0))
        if g.kind == "online":
            for lin in lins:
                attach_input_transform(lin, InputTransform(lin.in_features, (1.0 / s).to(lin.weight.device)))
        for n in g.linears:
            report[n] = {"how": g.kind, "producer": g.producer, "alpha": alpha, "why": None}
            if errs is not None:
                report[n]["search"] = errs
    for n in targets:
        if n not in report:
            report[n] = {"how": "none", "producer": None, "alpha": None,
                         "why": why.get(n, "never ran during calibration")}
    if all(r["how"] == "none" for r in report.values()):
        warnings.warn(
            "lowbit smoothquant: no layer could be smoothed (no producer can take 1/s offline"
            + ("" if config.online else "; SmoothQuant(online=True) smooths such layers with an online scale")
            + ")",
            stacklevel=3,
        )
    return report


def summary(report: Mapping[str, Mapping[str, Any]]) -> str:
    """One line: how many layers were smoothed and how."""
    counts: dict[str, int] = {}
    for r in report.values():
        counts[r["how"]] = counts.get(r["how"], 0) + 1
    names = {"norm": "folded into norms", "linear": "folded into Linear layers", "online": "online",
             "none": "not smoothed"}
    return ", ".join(f"{counts[k]} {names[k]}" for k in names if k in counts)


__all__ = [
    "MAX_SCALE",
    "SmoothGroup",
    "SmoothQuant",
    "apply_smoothing",
    "find_smooth_groups",
    "smooth_scale",
    "summary",
]
