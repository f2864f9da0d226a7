"""Sibling projections run as one GEMM: q/k/v and gate/up of a quantized model fused at run time, as serving
engines fuse them (vLLM's ``QKVParallelLinear`` and ``MergedColumnParallelLinear``), without changing the
model's code.

:func:`fuse_projections` replaces each group of sibling :class:`QuantLinear` layers (names from
:data:`lowbit.nn.FUSED_GROUPS` under one parent, one scheme, one input size) by :class:`FusedProjection`
members of one :class:`QuantLinear` holding the rows of all of them (:func:`lowbit.formats.rows.cat_rows`,
bit for bit the members' weights). The first member called runs the fused layer and keeps its output; a
sibling called next with the very same input tensor returns its columns of that output instead of running a
GEMM of its own. A member called with another input (cross-attention feeds k/v another tensor than q) runs the
fused layer on that input and keeps only its columns, so the result is always the member's own projection;
the order in which the model calls the members does not matter. One launch instead of three (or two) per
decode step, and one larger GEMV, which reads the weights at a better rate than three small ones. "The very
same input" is the same tensor object: the model must not change it in place between its siblings' calls
(transformers' and diffusers' attention and MLP blocks pass one unmodified tensor to each).

Gated MLPs (``gated_mlp=True``, the default): a block holding ``gate_proj``, ``up_proj``, ``down_proj`` and an
``act_fn`` (SiLU or GELU), whose forward is ``down_proj(act_fn(gate_proj(x)) * up_proj(x))`` as in transformers'
Llama, Mistral, Qwen2/3 and Gemma MLPs, is replaced by a :class:`GatedMLP`: one W4A16 :class:`QuantLinear` over
``[gate; up]`` with the gated activation (``"silu_and_mul"`` ...: the GEMV multiplies ``act(gate) * up`` in its
epilogue, in fp32, and writes the half-width result), then the block's own ``down_proj``. One launch instead of
three per decode step (two GEMVs, the activation and the product) and no [M, 2 I] intermediate. The product is
formed in fp32 and rounded once, where the unfused block rounds gate, up, the activation and the product each to
bf16: results differ from the unfused model's within that rounding. Weight-only schemes only (the gated
epilogue is the W4A16 GEMV's); other blocks get the sibling fusion above.

The fused model is for running: :func:`unfuse_projections` gives the members back as ordinary layers (their
own QTensors, copied out of the fused weight), which is what saving a checkpoint, tensor-parallel plans and
anything else that looks for the original layers need; those refuse a fused model
(:func:`refuse_fused`).

Tensor parallelism: fuse after :func:`lowbit.parallel.parallelize`. Column-parallel shards
(``ColwiseQuantLinear`` with the default placements) of one group fuse into one column-parallel layer holding
each member's local rows, as vLLM's merged column-parallel layers hold theirs: each rank runs one GEMM for its
q/k/v (or gate/up) shards. Unfused, the members come back as the shards they were.
"""

from __future__ import annotations

import itertools
import weakref
from dataclasses import fields, replace
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..formats.rows import ROW_ALIGN, cat_rows, slice_rows
from .modules import QuantLinear
from .quantize import fused_groups


FUSED_OUTPUTS: dict[int, _FusedOutput] = {}
"""key -> the output holder of a fused group, while any member lives. Members read their holder here, by the
group's key, not through an attribute of their own: under ``torch.compile`` one object reached through each
member's attribute costs an identity guard per member (evaluated in Python on every call of the compiled
code), and the holder's updates are written back through that path after every call."""
_keys = itertools.count()


class _FusedOutput:
    """The output of a group's fused layer for the last input it was called with, and which members have
    taken their columns of it (a plain object shared by the members, so that no module holds another). A copy
    (``copy.deepcopy``, pickling) is the holder of the copied group: empty, under its own key."""

    def __init__(self) -> None:
        self.x: torch.Tensor | None = None
        self.y: torch.Tensor | None = None
        self.served = 0
        self.members = 0
        self.key = next(_keys)
        FUSED_OUTPUTS[self.key] = self

    def __getstate__(self) -> dict:
        return {}

    def __setstate__(self, state: dict) -> None:
        self.__init__()


def _member_gone(key: int) -> None:
    out = FUSED_OUTPUTS.get(key)
    if out is not None:
        out.members -= 1
        if out.members <= 0:
            del FUSED_OUTPUTS[key]


class FusedProjection(nn.Module):
    """One member of a fused group: ``forward(x)`` is the member's own projection of ``x`` (its columns
    ``start:stop`` of the fused layer's output). The group's fused :class:`QuantLinear` is registered under
    the first member (``<first>.fused``); the others refer to it without registering it."""

    def __init__(self, fused: QuantLinear | None, group: list, index: int, start: int, stop: int,
                 out: _FusedOutput, members: int) -> None:
        super().__init__()
        if fused is not None:
            self.fused = fused
        self._group = group          # [fused layer]: shared by the members, not a registered submodule
        self.index = index
        self.start, self.stop = start, stop
        self.in_features = group[0].in_features
        self.out_features = stop - start
        self._out = out
        self._members = members
        self._shard: tuple[type, Any] | None = None
        """For a column-parallel member: its own class and ``tp``, given back by :func:`unfuse_projections`."""
        self._join_holder()

    def _join_holder(self) -> None:
        out = self._out
        self._out_key = out.key
        out.members += 1
        weakref.finalize(self, _member_gone, out.key)

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)
        self._join_holder()  # a copy's holder is a new one (see _FusedOutput)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = FUSED_OUTPUTS[self._out_key]
        bit = 1 << self.index
        if out.x is x and not out.served & bit:
            y = out.y
            out.served |= bit
        else:
            y = self._group[0](x)
            out.x, out.y, out.served = x, y, bit
        if out.served == (1 << self._members) - 1:
            out.x = out.y = None     # every member has its columns: nothing kept past the group
            out.served = 0
        return y[..., self.start:self.stop]

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, rows {self.start}:{self.stop} of a fused layer"


def _fusable(members: list[QuantLinear]) -> str | None:
    """None if these sibling layers can be fused, else why not."""
    first = members[0]
    for m in members:
        if not isinstance(m, QuantLinear):
            return f"{type(m).__name__} is not a QuantLinear"
        if m.weight_data is None:
            return "a layer has no weight yet"
        if type(m) is not type(first):
            return "the layers are of different classes"
    tp = getattr(first, "tp", None)
    if tp is not None:
        # tensor-parallel shards: only column-parallel ones with the default placements share a local weight
        if tp.style != "colwise":
            return "row-parallel layers sum their partial products across ranks, each on its own"
        for m in members:
            if not m.tp.default_io:
                return "a column-parallel layer has other than the default placements"
            if m.tp.exact:
                return "exact column shards plan their launches as their whole layer's; fused they would not"
            if m.tp.group is not tp.group or m.tp.world != tp.world:
                return "the layers are sharded over different groups"
    for m in members[1:]:
        for what, a, b in (("scheme", m.scheme.name, first.scheme.name), ("in_features", m.in_features, first.in_features),
                           ("activation", m.activation, first.activation), ("backend", m.backend, first.backend),
                           ("bias", m.bias is None, first.bias is None)):
            if a != b:
                return f"the layers differ in {what}"
        igs, igs0 = m.input_global_scale, first.input_global_scale
        if (igs is None) != (igs0 is None) or (igs is not None and not torch.equal(igs, igs0)):
            return "the layers have different static activation scales"
    if first.activation is not None:
        return "a fused activation applies to each layer's own output"
    if first.weight_nested_scale is not None:
        return "double-quantized absmax blocks of two weights do not line up"
    align = ROW_ALIGN.get(first.scheme.weight_format, 1)
    start = 0
    for m in members:
        if start % align:
            return f"a layer would start at row {start}, not a multiple of {align} (it could not be given back)"
        start += m.out_features
    return None


class GatedMLP(nn.Module):
    """A gated MLP block run as ``down_proj(gate_up_proj(x))``: ``gate_up_proj`` is one :class:`QuantLinear` over
    the block's ``[gate; up]`` weight with a gated activation (``"silu_and_mul"`` ...), ``down_proj`` the
    block's own. The original block (without its gate and up layers) is kept, unregistered, for
    :func:`unfuse_projections`."""

    def __init__(self, gate_up_proj: QuantLinear, down_proj: nn.Module, original: nn.Module) -> None:
        super().__init__()
        self.gate_up_proj = gate_up_proj
        self.down_proj = down_proj
        self._original = [original]  # a plain list: not a submodule (no second copy in state_dict)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.gate_up_proj(x))


_GATED_BY_TYPE = {"SiLU": "silu_and_mul", "SiLUActivation": "silu_and_mul", "GELUTanh": "gelu_tanh_and_mul",
                  "PytorchGELUTanh": "gelu_tanh_and_mul", "NewGELUActivation": "gelu_tanh_and_mul",
                  "GELUActivation": "gelu_and_mul"}
"""transformers' activation modules (by class name, so that transformers need not be imported) and the gated
activation of each; ``nn.GELU`` by its ``approximate``."""


def gated_activation(act: Any) -> str | None:
    """The gated activation (:data:`lowbit.ops.linear.GATED_ACTIVATIONS`) for a block's ``act_fn``, or None."""
    if isinstance(act, nn.GELU):
        return "gelu_tanh_and_mul" if act.approximate == "tanh" else "gelu_and_mul"
    if type(act).__name__ == "GELUActivation" and getattr(act, "act", F.gelu) is not F.gelu:
        return None  # transformers' python GELU: not the erf GELU of torch
    return _GATED_BY_TYPE.get(type(act).__name__)


def _gated_mlp(block: nn.Module) -> tuple[str, QuantLinear] | None:
    """(gated activation, the fused QuantLinear) for a gated MLP ``block``, or None where it is not one or its
    gate and up layers cannot share one gated weight."""
    gate, up = getattr(block, "gate_proj", None), getattr(block, "up_proj", None)
    if isinstance(block, GatedMLP) or not isinstance(getattr(block, "down_proj", None), nn.Module):
        return None
    act = gated_activation(getattr(block, "act_fn", None))
    # QuantLinear itself: a tensor-parallel shard class is left to the sibling fusion
    if act is None or type(gate) is not QuantLinear or type(up) is not QuantLinear:
        return None
    if (_fusable([gate, up]) is not None
            or not gate.scheme.weight_only or gate.out_features != up.out_features or gate.out_features % 8):
        return None
    try:
        weight = cat_rows([gate.weight_qtensor, up.weight_qtensor])
    except ValueError:
        return None
    bias = None if gate.bias is None else torch.cat([gate.bias, up.bias])
    fused = QuantLinear(gate.in_features, weight.shape[0], bias=bias is not None, scheme=gate.scheme, weight=weight,
                        bias_tensor=bias, input_global_scale=gate.input_global_scale, activation=act,
                        backend=gate.backend)
    return act, fused


def fuse_projections(model: nn.Module, *, gated_mlp: bool = True) -> list[tuple[str, ...]]:
    """Fuse the sibling projections of a quantized ``model`` in place (see the module docstring); returns the
    groups fused, by qualified module name. With ``gated_mlp`` (the default), gated MLP blocks of a weight-only
    scheme become :class:`GatedMLP` (their group is returned as ``(<block>.gate_proj, <block>.up_proj)`` too):
    on a Llama-3-8B-shaped decoder on an H200 it was ahead of the sibling fusion alone in every run mode
    measured (eager, CUDA graph, ``torch.compile``), and it is what serving engines run. Its outputs differ from
    the unfused model's within bf16 rounding; ``gated_mlp=False`` keeps the sibling fusion, whose outputs are
    the unfused model's. Groups whose layers cannot share one weight (another scheme,
    input size, bias presence, static activation scale, a fused activation, nvfp4 weights without one shared
    global scale, double-quantized nf4, row counts :func:`lowbit.formats.rows.slice_rows` could not cut back
    out, layouts :func:`lowbit.formats.rows.cat_rows` cannot stack) are left as they are.

    Raises:
        TypeError: ``model`` is not an ``nn.Module``.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    done = []
    if gated_mlp:
        for name, block in list(model.named_modules()):
            made = _gated_mlp(block)
            if made is None:
                continue
            del block.gate_proj, block.up_proj       # the fused layer holds their rows
            replacement = GatedMLP(made[1], block.down_proj, block)
            parent, _, child = name.rpartition(".")
            if not name:
                raise ValueError("fuse_projections: the model itself is a gated MLP block; fuse its parent")
            setattr(model.get_submodule(parent) if parent else model, child, replacement)
            done.append((f"{name}.gate_proj", f"{name}.up_proj"))
    modules = dict(model.named_modules())
    names = [n for n, m in modules.items() if isinstance(m, QuantLinear)]
    for group in fused_groups(names):
        members = [modules[n] for n in group]
        if _fusable(members) is not None:
            continue
        try:
            weight = cat_rows([m.weight_qtensor for m in members])
        except ValueError:
            continue
        first = members[0]
        bias = None if first.bias is None else torch.cat([m.bias for m in members])
        fused = QuantLinear(first.in_features, weight.shape[0], bias=bias is not None, scheme=first.scheme,
                            weight=weight, bias_tensor=bias, input_global_scale=first.input_global_scale,
                            activation=None, backend=first.backend)
        if getattr(first, "tp", None) is not None:
            # one column-parallel layer over the members' local rows: their full widths add up
            fused.__class__ = type(first)
            fused.tp = replace(first.tp, full_out=sum(m.tp.full_out for m in members))
        shared: list = [fused]
        out = _FusedOutput()
        start = 0
        for i, (name, m) in enumerate(zip(group, members)):
            member = FusedProjection(fused if i == 0 else None, shared, i, start, start + m.out_features, out,
                                     len(members))
            if getattr(m, "tp", None) is not None:
                member._shard = (type(m), m.tp)
            start += m.out_features
            parent, _, child = name.rpartition(".")
            setattr(modules[parent] if parent else model, child, member)
        done.append(tuple(group))
    return done


def unfuse_projections(model: nn.Module) -> list[tuple[str, ...]]:
    """Give every fused group of ``model`` its own :class:`QuantLinear` layers back (their weights copied out
    of the fused one, bit for bit the weights they had); returns the groups unfused."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    done = []
    for name, m in list(model.named_modules()):
        if isinstance(m, GatedMLP):
            block = m._original[0]
            fused = m.gate_up_proj
            q = fused.weight_qtensor
            half = q.shape[0] // 2
            for attr, (r0, r1) in (("gate_proj", (0, half)), ("up_proj", (half, 2 * half))):
                bias = None if fused.bias is None else fused.bias[r0:r1].clone()
                setattr(block, attr, QuantLinear(fused.in_features, half, bias=bias is not None,
                                                 scheme=fused.scheme, weight=_own_copy(slice_rows(q, r0, r1)),
                                                 bias_tensor=bias, input_global_scale=fused.input_global_scale,
                                                 activation=None, backend=fused.backend))
            block.down_proj = m.down_proj
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, child, block)
            done.append((f"{name}.gate_proj", f"{name}.up_proj"))
    by_group: dict[int, list[tuple[str, FusedProjection]]] = {}
    for name, m in model.named_modules():
        if isinstance(m, FusedProjection):
            by_group.setdefault(id(m._group), []).append((name, m))
    modules = dict(model.named_modules())
    for members in by_group.values():
        fused = members[0][1]._group[0]
        q = fused.weight_qtensor
        for name, m in members:
            part = _own_copy(slice_rows(q, m.start, m.stop))
            bias = None if fused.bias is None else fused.bias[m.start:m.stop].clone()
            layer = QuantLinear(fused.in_features, m.stop - m.start, bias=bias is not None, scheme=fused.scheme,
                                weight=part, bias_tensor=bias, input_global_scale=fused.input_global_scale,
                                activation=None, backend=fused.backend)
            if m._shard is not None:
                layer.__class__, layer.tp = m._shard
            parent, _, child = name.rpartition(".")
            setattr(modules[parent] if parent else model, child, layer)
        done.append(tuple(n for n, _ in members))
    return done


def _own_copy(q):
    """``q`` with every tensor a contiguous copy of its own (a row slice may be a view of the fused weight)."""
    changes: dict[str, Any] = {}
    for f in fields(q):
        v = getattr(q, f.name)
        if isinstance(v, torch.Tensor):
            changes[f.name] = v.contiguous().clone()
    return replace(q, **changes)


def refuse_fused(model: nn.Module, what: str) -> None:
    """ValueError naming ``what`` if ``model`` holds fused projections (:func:`fuse_projections`)."""
    for name, m in model.named_modules():
        if isinstance(m, FusedProjection | GatedMLP):
            raise ValueError(f"{what}: {name} is a fused projection; call lowbit.nn.unfuse_projections(model) "
                             "first (fusing is for running the model, checkpoints and plans name the original layers)")


__all__ = ["FusedProjection", "GatedMLP", "fuse_projections", "gated_activation", "refuse_fused",
           "unfuse_projections"]
