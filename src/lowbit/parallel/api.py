"""``parallelize``: tensor parallelism for a model holding lowbit ``QuantLinear`` layers, with torch's plan vocabulary.

A plan maps module names (fnmatch patterns per dotted segment, as ``parallelize_module`` matches them:
``"layers.*.self_attn.q_proj"``) to a style: lowbit's or torch's ``ColwiseParallel`` / ``RowwiseParallel``, or
transformers' plan strings ``"colwise"``, ``"rowwise"``, ``"colwise_gather_output"`` (alias
``"colwise_rep"``: a column-parallel layer whose output is gathered). ``plan=None`` takes a transformers model's
own ``config.base_model_tp_plan``.

Every matched QuantLinear is checked before any is changed: a weight that cannot be split into equal shards on
its blocks, an unknown style or a pattern that matches nothing raises ValueError and leaves the model as it was.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Mapping
from typing import Any

from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel as TorchColwiseParallel
from torch.distributed.tensor.parallel import ParallelStyle
from torch.distributed.tensor.parallel import RowwiseParallel as TorchRowwiseParallel

from ..nn.modules import QuantLinear
from .layers import mesh_facts, shard_reason_of
from .styles import ColwiseParallel, RowwiseParallel

PLAN_STRINGS = ("colwise", "rowwise", "colwise_gather_output", "colwise_rep")


def style_of(style: ParallelStyle | str, where: str = "plan", all_reduce: str | None = None,
             exact: bool | None = None) -> ParallelStyle:
    """lowbit's style for ``style`` (a plan string, or torch's ColwiseParallel / RowwiseParallel with their
    arguments kept); other ParallelStyles (SequenceParallel, PrepareModuleInput, ...) pass unchanged.
    ``all_reduce``: given, the row-parallel styles made here sum with it (``"nccl"`` or ``"symm_mem"``);
    ``exact``: given, the column-parallel styles made here take it."""
    reduce = {} if all_reduce is None else {"all_reduce": all_reduce}
    ex = {} if exact is None else {"exact": exact}
    if isinstance(style, str):
        if style == "colwise":
            return ColwiseParallel(**ex)
        if style == "rowwise":
            return RowwiseParallel(**reduce)
        if style in ("colwise_gather_output", "colwise_rep"):
            from torch.distributed.tensor import Replicate

            return ColwiseParallel(output_layouts=Replicate(), **ex)
        raise ValueError(f"{where}: unknown tensor-parallel style {style!r}; lowbit takes {PLAN_STRINGS} or a "
                         "torch.distributed.tensor.parallel ParallelStyle")
    if isinstance(style, (ColwiseParallel, RowwiseParallel)):
        return style
    if isinstance(style, (TorchColwiseParallel, TorchRowwiseParallel)):
        kw = {"input_layouts": style.input_layouts[0], "output_layouts": style.output_layouts[0],
              "use_local_output": style.use_local_output}
        if isinstance(style, TorchColwiseParallel):
            return ColwiseParallel(**kw, **ex)
        return RowwiseParallel(**kw, **reduce)
    if isinstance(style, ParallelStyle):
        return style
    raise TypeError(f"{where}: a style must be a ParallelStyle or one of {PLAN_STRINGS}, got {type(style).__name__}")


def _matches(name: str, pattern: str) -> bool:
    parts, pats = name.split("."), pattern.split(".")
    return len(parts) == len(pats) and all(fnmatch.fnmatchcase(p, q) for p, q in zip(parts, pats))


def model_plan(model: nn.Module) -> dict[str, str]:
    """A transformers model's own tensor-parallel plan (``config.base_model_tp_plan``), with the base model's
    prefix where ``model`` wraps it (``LlamaForCausalLM`` holds ``model.layers...``)."""
    config = getattr(model, "config", None)
    plan = getattr(config, "base_model_tp_plan", None)
    if not plan:
        raise ValueError("plan: the model has no config.base_model_tp_plan (not a transformers model with a "
                         "tensor-parallel plan); pass plan={module pattern: style}")
    prefix = getattr(model, "base_model_prefix", "")
    names = {n for n, _ in model.named_modules()}
    if prefix and prefix in names:
        return {f"{prefix}.{k}": v for k, v in plan.items()}
    return dict(plan)


def resolve_plan(model: nn.Module, plan: Mapping[str, Any] | None, all_reduce: str | None = None,
                 exact: bool | None = None) -> list[tuple[str, nn.Module, ParallelStyle]]:
    """``[(module name, module, style)]`` for every module the plan matches, in the model's module order.
    ValueError for a pattern that matches nothing or a module matched by two patterns."""
    if plan is None:
        plan = model_plan(model)
    if not isinstance(plan, Mapping):
        raise TypeError(f"plan must be a dict of module pattern -> style, got {type(plan).__name__}")
    styles = {pattern: style_of(style, f"plan[{pattern!r}]", all_reduce, exact) for pattern, style in plan.items()}
    out, seen = [], {}
    hit = dict.fromkeys(styles, False)
    for name, module in model.named_modules():
        for pattern, style in styles.items():
            if _matches(name, pattern):
                if name in seen:
                    raise ValueError(f"plan: module {name!r} matches both {seen[name]!r} and {pattern!r}")
                seen[name] = pattern
                hit[pattern] = True
                out.append((name, module, style))
    missing = [p for p, h in hit.items() if not h]
    if missing:
        raise ValueError(f"plan: pattern(s) {missing} match no module of the model")
    return out


def parallelize(model: nn.Module, device_mesh, plan: Mapping[str, Any] | None = None, *,
                all_reduce: str | None = None, exact: bool | None = None) -> nn.Module:
    """Shard ``model`` (in place) for tensor parallelism over the 1-D ``device_mesh`` and return it.

    Each rank calls this on the same model (same weights on every rank, e.g. the same seed or the same
    checkpoint). Matched QuantLinear layers become this rank's shard (``lowbit.parallel.ColwiseQuantLinear`` /
    ``RowwiseQuantLinear``); ``nn.Linear`` and ``nn.Embedding`` go to torch's styles (DTensor parameters); the
    model moves nothing else. Attention modules must size their heads from the projections' outputs (as
    transformers' do, ``view(..., -1, head_dim)``) and the KV cache holds the rank's heads.

    Args:
        model: a model quantized with lowbit (any mix of QuantLinear and dense layers).
        device_mesh: a 1-D ``torch.distributed.device_mesh.DeviceMesh`` (``init_device_mesh("cuda", (tp,))``).
        plan: ``{module pattern: style}`` (module docstring); None: the transformers model's own plan.
        all_reduce: how row-parallel QuantLinear layers sum their outputs, ``"nccl"`` or ``"symm_mem"``
            (:mod:`lowbit.parallel.collectives`); None keeps each style's own (default ``"nccl"``).
        exact: column-parallel QuantLinear layers plan their launches as the whole layer's, for outputs equal to
            one GPU's bit for bit (``lowbit.parallel.parallelize_quant_linear``); None keeps each style's own
            (default False).

    Raises:
        ValueError: the mesh is not 1-D, the plan names an unknown style or matches nothing, or a matched layer
            cannot be split into equal shards on its blocks (every such layer is named); the model holds fused
            projections (``lowbit.nn.unfuse_projections`` first); nothing is changed then.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    from ..nn.fuse import refuse_fused

    refuse_fused(model, "parallelize")
    _, _, world = mesh_facts(device_mesh)
    if all_reduce is not None:
        from .collectives import ALL_REDUCES

        if all_reduce not in ALL_REDUCES:
            raise ValueError(f"all_reduce must be one of {ALL_REDUCES}, got {all_reduce!r}")
    targets = resolve_plan(model, plan, all_reduce, exact)
    bad = []
    for name, module, style in targets:
        if isinstance(module, QuantLinear):
            kind = "colwise" if isinstance(style, ColwiseParallel) else "rowwise" if isinstance(
                style, RowwiseParallel) else None
            why = (f"style {type(style).__name__} does not shard a QuantLinear" if kind is None
                   else shard_reason_of(module, kind, world))
            if why is not None:
                bad.append(f"{name}: {why}")
    if bad:
        raise ValueError(f"parallelize over {world} ranks: {len(bad)} layer(s) cannot be sharded: " + "; ".join(bad[:8]))
    for _name, module, style in targets:
        style._apply(module, device_mesh)
    return model


__all__ = ["PLAN_STRINGS", "model_plan", "parallelize", "resolve_plan", "style_of"]
