"""AWQ-style activation-aware scale search for ``w4a16-int4`` (used by ``quantize_model`` with calibration data).

For a group of Linear layers that read the same input ``X`` (q/k/v after a norm, gate/up after a norm, down after
up, ...), AWQ (Lin et al. 2023) scales the weight's input channels by ``s`` and divides the previous operation's
output by ``s`` (a norm's weight and bias, or a Linear's output rows), which leaves the float model unchanged but
lets the channels with large activations keep more precision after INT4 rounding. ``s = mean|X|^alpha``
(normalised by ``sqrt(max*min)``), with ``alpha`` picked from a grid by the output error
``||X W^T - X (Q(W s)/s)^T||^2`` summed over the group. ``alpha = 0`` (``s = 1``) is in the grid, so the chosen
scale never has a larger calibration error than plain round-to-nearest.

Only groups whose previous operation is known and foldable are searched: the pre-norms of attention and MLP
(Llama/Mistral/Qwen ``input_layernorm`` / ``post_attention_layernorm``), ``up_proj -> down_proj``, and
``v_proj -> o_proj`` / BERT ``value -> attention.output.dense`` when the shapes match (no grouped-query
attention). Post-LN models (BERT) cannot fold into their LayerNorms (the normalised output is also the residual),
so there only the value/output pair is searched; other layers keep round-to-nearest. In diffusers
transformers the value/output pair of attention without added key/value projections is searched, and Wan's
cross-attention norm with its query projection; their other norms are modulated by the timestep
(``norm * (1 + scale) + shift``) and cannot take a fixed scale.
AutoAWQ's weight clipping search is not done. The folded scales end up inside the saved checkpoint's
non-quantized norms and weights, so any AWQ-unaware reader loads the result.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from .quantize import recording_inputs

N_GRID = 20
"""Grid points for alpha in [0, 1)."""
MAX_ROWS = 4096
"""Activation rows kept per group for the search (a deterministic stride subsample beyond that)."""


@dataclass
class AwqGroup:
    """Linear layers reading one input, and the operation whose output that input is."""

    prev: str
    prev_kind: str  # "norm" or "linear"
    linears: tuple[str, ...]


def _has(modules: Mapping[str, nn.Module], *names: str) -> bool:
    return all(n in modules for n in names)


def _is_norm(m: nn.Module | None) -> bool:
    """A norm whose output is ``normalized * weight (+ bias)`` (Gemma's ``(1 + weight)`` RMSNorm is not)."""
    if m is None or "Gemma" in type(m).__name__:
        return False
    return isinstance(getattr(m, "weight", None), torch.Tensor) and m.weight.dim() == 1


def find_groups(model: nn.Module) -> list[AwqGroup]:
    """The foldable groups of ``model`` (Llama-style decoder layers and BERT-style encoder layers)."""
    modules = dict(model.named_modules())
    groups: list[AwqGroup] = []
    bert_layers = []
    for name in modules:
        p = f"{name}." if name else ""
        # Llama / Mistral / Qwen / Gemma decoder layer
        if _has(
            modules,
            p + "input_layernorm",
            p + "self_attn.q_proj",
            p + "self_attn.k_proj",
            p + "self_attn.v_proj",
        ):
            if _is_norm(modules[p + "input_layernorm"]):
                groups.append(
                    AwqGroup(p + "input_layernorm", "norm", tuple(p + f"self_attn.{x}_proj" for x in "qkv"))
                )
            v, o = modules[p + "self_attn.v_proj"], modules.get(p + "self_attn.o_proj")
            if isinstance(o, nn.Linear) and isinstance(v, nn.Linear) and v.out_features == o.in_features:
                groups.append(AwqGroup(p + "self_attn.v_proj", "linear", (p + "self_attn.o_proj",)))
        if _has(modules, p + "post_attention_layernorm", p + "mlp.gate_proj", p + "mlp.up_proj") and _is_norm(
            modules[p + "post_attention_layernorm"]
        ):
            groups.append(
                AwqGroup(p + "post_attention_layernorm", "norm", (p + "mlp.gate_proj", p + "mlp.up_proj"))
            )
        if _has(modules, p + "mlp.gate_proj", p + "mlp.up_proj", p + "mlp.down_proj"):  # down(act(gate) * up)
            groups.append(AwqGroup(p + "mlp.up_proj", "linear", (p + "mlp.down_proj",)))
        # diffusers attention (Wan, SD3's second attention, PixArt, ...): the values reach ``to_out.0``
        # through the attention average, which is linear per channel. Joint attention with added key/value
        # projections (Flux, SD3's first attention, Wan I2V) averages values of two projections; scaling one
        # alone would change the model, so such attention is left out.
        added_v = isinstance(modules.get(p + "add_v_proj"), nn.Module)
        if _has(modules, p + "to_v", p + "to_out.0") and not added_v:
            v, o = modules[p + "to_v"], modules[p + "to_out.0"]
            if isinstance(v, nn.Linear) and isinstance(o, nn.Linear) and v.out_features == o.in_features:
                groups.append(AwqGroup(p + "to_v", "linear", (p + "to_out.0",)))
        # diffusers Wan block: the affine cross-attention norm ``norm2`` is read by ``attn2.to_q`` alone (the
        # residual takes the un-normalised stream)
        if (
            "Wan" in type(modules[name]).__name__
            and _has(modules, p + "norm2", p + "attn2.to_q")
            and _is_norm(modules[p + "norm2"])
            and isinstance(modules[p + "attn2.to_q"], nn.Linear)
        ):
            groups.append(AwqGroup(p + "norm2", "norm", (p + "attn2.to_q",)))
        # BERT encoder layer
        if _has(
            modules, p + "attention.self.query", p + "attention.output.LayerNorm", p + "intermediate.dense"
        ):
            bert_layers.append(p)
    # BERT is post-LN: its LayerNorm outputs are also the residual stream, so no scale can be folded into them;
    # the value projection feeds attention.output.dense through the (channel-wise linear) attention average
    for p in bert_layers:
        v, o = modules[p + "attention.self.value"], modules.get(p + "attention.output.dense")
        if isinstance(o, nn.Linear) and isinstance(v, nn.Linear) and v.out_features == o.in_features:
            groups.append(AwqGroup(p + "attention.self.value", "linear", (p + "attention.output.dense",)))
    return groups


@torch.no_grad()
def _collect_inputs(model: nn.Module, groups: list[AwqGroup], run) -> dict[str, torch.Tensor]:
    modules = dict(model.named_modules())
    first = {g.linears[0] for g in groups}
    rows: dict[str, list[torch.Tensor]] = {n: [] for n in first}

    def record(name: str, x: torch.Tensor) -> None:
        rows[name].append(x.detach().reshape(-1, x.shape[-1]).float().cpu())

    with recording_inputs({n: modules[n] for n in first}, record):
        run()
    out = {}
    for n, xs in rows.items():
        if xs:
            x = torch.cat(xs)
            if x.shape[0] > MAX_ROWS:
                x = x[torch.linspace(0, x.shape[0] - 1, MAX_ROWS).long()]
            out[n] = x
    return out


def _fake_quant(w: torch.Tensor, group_size: int) -> torch.Tensor:
    """AutoAWQ's ``pseudo_quantize_tensor`` rule (min/max zero point, RNE) evaluated in fp32 (AutoAWQ uses fp16):
    the search's error model only; the layers are then quantized by ``lowbit.quantize`` (AutoAWQ's exact
    arithmetic)."""
    out_f, in_f = w.shape
    wg = w.float().reshape(out_f, in_f // group_size, group_size)
    mx, mn = wg.amax(-1, keepdim=True), wg.amin(-1, keepdim=True)
    scales = (mx - mn).clamp(min=1e-5) / 15
    zeros = (-torch.round(mn / scales)).clamp(0, 15)
    q = (torch.clamp(torch.round(wg / scales) + zeros, 0, 15) - zeros) * scales
    return q.reshape(out_f, in_f)


def search_scale(
    x: torch.Tensor, weights: list[torch.Tensor], group_size: int, n_grid: int = N_GRID
) -> tuple[torch.Tensor, float, float]:
    """The best AWQ scale ``s`` [K] for these weights and inputs; also (best loss, loss at s = 1)."""
    x_mean = x.abs().mean(0)
    ref = [x @ w.float().T for w in weights]
    best, best_loss, rtn_loss = torch.ones_like(x_mean), float("inf"), float("inf")
    for i in range(n_grid):
        alpha = i / n_grid
        s = x_mean.pow(alpha).clamp(min=1e-4)
        s = s / (s.max() * s.min()).sqrt()
        if i == 0:
            s = torch.ones_like(x_mean)
        loss = 0.0
        for w, r in zip(weights, ref):
            wq = _fake_quant((w.float() * s).to(w.dtype), group_size) / s
            loss += float(((x @ wq.T - r) ** 2).mean())
        if i == 0:
            rtn_loss = loss
        if loss < best_loss:
            best, best_loss = s, loss
    return best, best_loss, rtn_loss


@torch.no_grad()
def _fold(model: nn.Module, group: AwqGroup, s: torch.Tensor) -> None:
    modules = dict(model.named_modules())
    prev = modules[group.prev]
    if group.prev_kind == "norm":
        prev.weight.div_(s.to(prev.weight))
        if getattr(prev, "bias", None) is not None:
            prev.bias.div_(s.to(prev.bias))
    else:
        prev.weight.div_(s.to(prev.weight).unsqueeze(1))
        if prev.bias is not None:
            prev.bias.div_(s.to(prev.bias))
    for n in group.linears:
        lin = modules[n]
        lin.weight.mul_(s.to(lin.weight).unsqueeze(0))


def apply_awq(
    model: nn.Module, targets: Mapping[str, nn.Linear], group_size_of, run, n_grid: int = N_GRID
) -> dict[str, dict[str, Any]]:
    """Search and fold AWQ scales for every group whose layers are all in ``targets`` (modifies float weights).

    Args:
        model: the float model (before its Linear layers are swapped).
        targets: the Linear layers that will be quantized, by name.
        group_size_of: ``in_features -> int4 group size``.
        run: runs the model on the calibration data.

    Returns:
        ``{first linear of each group: {"prev", "alpha_loss", "rtn_loss"}}``.
    """
    groups = [g for g in find_groups(model) if all(n in targets for n in g.linears)]
    if not groups:
        return {}
    inputs = _collect_inputs(model, groups, run)
    report = {}
    modules = dict(model.named_modules())
    for g in groups:
        x = inputs.get(g.linears[0])
        if x is None:
            continue
        ws = [modules[n].weight.detach().cpu() for n in g.linears]
        gs = group_size_of(ws[0].shape[1])
        s, loss, rtn = search_scale(x, ws, gs, n_grid)
        _fold(model, g, s.to(ws[0].device if ws[0].device.type != "meta" else "cpu"))
        report[g.linears[0]] = {"prev": g.prev, "loss": loss, "rtn_loss": rtn}
    return report


__all__ = ["AwqGroup", "apply_awq", "find_groups", "search_scale"]
