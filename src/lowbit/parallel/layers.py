"""Tensor-parallel shards of a ``QuantLinear``: the layer's rows (column-parallel) or columns (row-parallel) on
each rank of a 1-D device mesh, running lowbit's kernels on the local shard.

- :class:`ColwiseQuantLinear` holds rows ``r*N/t : (r+1)*N/t`` of the weight (and of the bias). Its input is the
  whole activation (replicated); its output the local columns of ``y``. Every output element is computed from the
  same data as on one GPU.
- :class:`RowwiseQuantLinear` holds columns ``r*K/t : (r+1)*K/t``. Its input is the local columns of ``x``; the
  partial products are summed across ranks (an all-reduce, in the output dtype), then the bias and the fused
  activation are applied once. For NVFP4 activations quantized with a dynamic per-tensor scale, the amax is
  taken over the whole input (an all-reduce of one value), so every rank quantizes its columns exactly as one
  GPU quantizes them; a static (calibrated) ``input_global_scale`` needs no collective.

The placements follow ``torch.distributed.tensor.parallel``'s ``ColwiseParallel`` / ``RowwiseParallel``
(``input_layouts``, ``output_layouts``, ``use_local_output``); the default ones run without DTensor (a plain
tensor in, a plain tensor out, one in-place NCCL all-reduce for row-parallel layers), so an eager decode step
pays no DTensor dispatch. Other placements (sequence-parallel inputs, a replicated column-parallel output)
go through DTensor's redistribution.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist

from ..formats.blockscaled import finite_amax, nvfp4_default_global_scale
from ..formats.shards import PLAN_ROWS, plan_rows, shard, shard_range, shard_reason
from ..formats.spec import FORMATS
from ..nn.modules import QuantLinear
from ..ops.linear import apply_activation
from .collectives import ALL_REDUCES, all_reduce_for

STYLES = ("colwise", "rowwise")


def _placements():
    from torch.distributed.tensor import Partial, Replicate, Shard

    return Partial, Replicate, Shard


@dataclass
class TensorParallel:
    """How a QuantLinear shard sits on its mesh (kept on the module as ``tp``)."""

    style: str
    mesh: Any
    group: Any
    rank: int
    world: int
    full_in: int
    full_out: int
    input_layout: Any
    output_layout: Any
    use_local_output: bool
    default_io: bool
    """The default placements (see the module docstring): no DTensor on the call path."""
    reduce: Any = None
    """Row-parallel layers: the sum of the partial outputs (:mod:`lowbit.parallel.collectives`)."""
    exact: bool = False
    """Column-parallel layers: launches planned as the whole layer's (``parallelize_quant_linear``)."""


def _is_shard_last(p, ndim: int | None = None) -> bool:
    _, _, Shard = _placements()
    return isinstance(p, Shard) and (p.dim == -1 or (ndim is not None and p.dim == ndim - 1))


def shard_reason_of(module: QuantLinear, style: str, world: int) -> str | None:
    """None if ``module`` splits into ``world`` shards under ``style``, else why not."""
    if style not in STYLES:
        return f"style must be one of {STYLES}, got {style!r}"
    if not isinstance(module, QuantLinear):
        return f"expected a lowbit QuantLinear, got {type(module).__name__}"
    if isinstance(module, (ColwiseQuantLinear, RowwiseQuantLinear)):
        return "the layer is already tensor-parallel"
    if module.weight_data is None:
        return "the layer has no weight yet"
    return shard_reason(module.weight_qtensor, 0 if style == "colwise" else 1, world)


def mesh_facts(mesh) -> tuple[Any, int, int]:
    if getattr(mesh, "ndim", 1) != 1:
        raise ValueError(f"device_mesh must be 1-D (slice a tensor-parallel dimension: mesh['tp']), got {mesh.ndim}-D")
    return mesh.get_group(), mesh.get_local_rank(), mesh.size()


def mesh_device(mesh) -> torch.device:
    if mesh.device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(mesh.device_type)


def parallelize_quant_linear(module: QuantLinear, mesh, style: str, *, input_layouts=None, output_layouts=None,
                             use_local_output: bool = True, sharded: bool = False,
                             all_reduce: str = "nccl", exact: bool = False) -> QuantLinear:
    """Turn ``module`` into this rank's shard (in place) and return it.

    Args:
        module: a QuantLinear holding the whole weight, or (``sharded=True``) already this rank's shard, read
            by a sharded load: then ``module.in_features`` / ``out_features`` are the shard's and nothing is
            sliced.
        mesh: a 1-D ``DeviceMesh``; the shard moves to its device (``cuda:<current device>`` for CUDA meshes).
        style: ``"colwise"`` (split N) or ``"rowwise"`` (split K, reduce the outputs).
        input_layouts, output_layouts, use_local_output: as torch's ``ColwiseParallel`` / ``RowwiseParallel``
            (defaults: colwise ``Replicate`` in, ``Shard(-1)`` out; rowwise ``Shard(-1)`` in, ``Replicate`` out).
        all_reduce: how a row-parallel layer sums its partial outputs: ``"nccl"`` (the group's all-reduce) or
            ``"symm_mem"`` (one-shot over symmetric memory for small messages; :mod:`lowbit.parallel.collectives`).
        exact: column-parallel layers plan their kernel launches as the whole layer does (the same kernel
            variant and the same split of K, ``lowbit.formats.shards.PLAN_ROWS``), so that their outputs equal
            the one-GPU layer's bit for bit wherever lowbit's own kernels run (cuBLAS routes choose their own
            kernels per shape). False lets each shard plan for its own size (more programs per GPU for small
            shards at decode; the outputs differ from one GPU's in fp32 summation order).

    Raises:
        ValueError: the weight's format or shape cannot be split into equal shards on its blocks (the rule is
            named), the mesh is not 1-D, or a row-parallel layer transforms its input online.
    """
    from ..algorithms.rotation import input_transform_of

    if style == "rowwise" and input_transform_of(module) is not None:
        # a row shard sees part of K, while the transform (scale vector, Hadamard blocks) spans all of it
        raise ValueError("module: a row-parallel QuantLinear cannot transform its input online (smoothing "
                         "scales or a rotation from lowbit.algorithms); keep this layer whole or fold the "
                         "transform into its weights")
    Partial, Replicate, Shard = _placements()
    group, rank, world = mesh_facts(mesh)
    colwise = style == "colwise"
    if input_layouts is None:
        input_layouts = Replicate() if colwise else Shard(-1)
    if output_layouts is None:
        output_layouts = Shard(-1) if colwise else Replicate()
    if all_reduce not in ALL_REDUCES:
        raise ValueError(f"all_reduce must be one of {ALL_REDUCES}, got {all_reduce!r}")
    if sharded:
        if style not in STYLES:
            raise ValueError(f"style must be one of {STYLES}, got {style!r}")
        full_out = module.out_features * (world if colwise else 1)
        full_in = module.in_features * (1 if colwise else world)
        if colwise and exact and module.weight_data is not None:
            q = module.weight_qtensor
            module.set_weight(replace(q, params={**q.params, PLAN_ROWS: plan_rows(q) * world}))
    else:
        why = shard_reason_of(module, style, world)
        if why is not None:
            raise ValueError(f"{style} sharding over {world} ranks: {why}")
        full_out, full_in = module.out_features, module.in_features
        part = shard(module.weight_qtensor, 0 if colwise else 1, rank, world)
        if colwise and exact:
            # the whole weight's own plan rows (its N, or more if it is itself a shard planned so)
            part = replace(part, params={**part.params, PLAN_ROWS: plan_rows(module.weight_qtensor)})
        bias = module._buffers.get("bias")
        if colwise:
            module.out_features = part.shape[0]
            if bias is not None:
                n0, n1 = shard_range(full_out, rank, world)
                module._buffers["bias"] = bias[n0:n1].clone()
        else:
            module.in_features = part.shape[1]
        module.set_weight(part)
    if isinstance(input_layouts, tuple):
        (input_layouts,) = input_layouts
    if isinstance(output_layouts, tuple):
        (output_layouts,) = output_layouts
    default_io = (isinstance(input_layouts, Replicate) and _is_shard_last(output_layouts)) if colwise else (
        _is_shard_last(input_layouts) and isinstance(output_layouts, Replicate))
    device = mesh_device(mesh)
    reduce = None if colwise else all_reduce_for(all_reduce, group, device)
    tp = TensorParallel(style, mesh, group, rank, world, full_in, full_out, input_layouts, output_layouts,
                        bool(use_local_output), default_io and bool(use_local_output), reduce, bool(exact))
    module.__class__ = ColwiseQuantLinear if colwise else RowwiseQuantLinear
    if not colwise:
        # the fused activation goes after the reduction: the local product runs without it
        module.output_activation = module.activation
        module.activation = None
    module.tp = tp
    module.to(device)
    return module


def _reduce_max(t: torch.Tensor, group) -> torch.Tensor:
    if torch.compiler.is_compiling():
        import torch.distributed._functional_collectives as funcol

        return funcol.all_reduce(t, "max", group)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return t


class ColwiseQuantLinear(QuantLinear):
    """A column-parallel shard of a QuantLinear (module docstring); ``tp`` says where it sits."""

    tp: TensorParallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tp = self.tp
        if not tp.default_io:
            return self._forward_placed(x)
        if _is_dtensor(x):
            x = _to_local(x, tp, [_placements()[1]()])
        return super().forward(x)

    def _forward_placed(self, x: torch.Tensor):
        from torch.distributed.tensor import DTensor

        Partial, Replicate, Shard = _placements()
        tp = self.tp
        if _is_dtensor(x):
            x = _to_local(x, tp, [Replicate()])
        elif not isinstance(tp.input_layout, Replicate):
            x = DTensor.from_local(x, tp.mesh, [tp.input_layout], run_check=False)
            x = x.redistribute(placements=[Replicate()]).to_local()
        y = super().forward(x)
        out = DTensor.from_local(y, tp.mesh, [Shard(y.dim() - 1)], run_check=False)
        if not (_is_shard_last(tp.output_layout, y.dim())):
            out = out.redistribute(placements=[tp.output_layout])
        return out.to_local() if tp.use_local_output else out

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, colwise {self.tp.rank}/{self.tp.world} of out_features={self.tp.full_out}"


class RowwiseQuantLinear(QuantLinear):
    """A row-parallel shard of a QuantLinear (module docstring); ``tp`` says where it sits, and
    ``output_activation`` is the fused activation it applies after the reduction."""

    tp: TensorParallel
    output_activation: str | None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tp = self.tp
        if not tp.default_io or _is_dtensor(x):
            return self._forward_placed(x)
        if x.shape[-1] != self.in_features:
            raise ValueError(
                f"x's last dim is {x.shape[-1]}; this row-parallel shard takes its {self.in_features} of the "
                f"{tp.full_in} input columns (columns {tp.rank * self.in_features} onwards); pass "
                "input_layouts=Replicate() when the whole input is given"
            )
        return self._finish(tp.reduce(self._local(x)), None)

    def _local(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's partial product (no bias, no activation)."""
        buffers = self._buffers
        igs = buffers["input_global_scale"]
        if igs is None and self.scheme.act_format == "nvfp4" and "global_scale" not in self.scheme.act_options:
            igs = self._global_act_scale(x)
        return self.call_weight(x, None, igs)

    def _global_act_scale(self, x: torch.Tensor) -> torch.Tensor:
        """The dynamic NVFP4 activation scale of the whole input: its finite amax taken over every rank's
        columns (max is exact), then the convention's formula on that one value, which is what
        ``nvfp4_default_global_scale`` of the whole input computes."""
        amax = finite_amax(x).float().reshape(1)
        amax = _reduce_max(amax, self.tp.group)
        convention = self.scheme.act_options.get("convention", FORMATS["nvfp4"].options["convention"])
        return nvfp4_default_global_scale(amax.to(x.dtype), convention).reshape(1)

    def _finish(self, y: torch.Tensor, bias_slice: tuple[int, int] | None) -> torch.Tensor:
        bias = self._buffers["bias"]
        if bias is not None:
            b = bias if bias_slice is None else bias[bias_slice[0] : bias_slice[1]]
            y = y + b.to(y.dtype)
        return apply_activation(y, self.output_activation)

    def _forward_placed(self, x):
        from torch.distributed.tensor import DTensor

        Partial, Replicate, Shard = _placements()
        tp = self.tp
        if _is_dtensor(x):
            x = _to_local(x, tp, [Shard(x.dim() - 1)])
        elif isinstance(tp.input_layout, Replicate):
            k0, k1 = shard_range(tp.full_in, tp.rank, tp.world)
            if x.shape[-1] != tp.full_in:
                raise ValueError(f"x's last dim is {x.shape[-1]}, the layer's input has {tp.full_in} features")
            x = x[..., k0:k1]
        elif not _is_shard_last(tp.input_layout, x.dim()):
            x = DTensor.from_local(x, tp.mesh, [tp.input_layout], run_check=False)
            x = x.redistribute(placements=[Shard(x.dim() - 1)]).to_local()
        y = self._local(x)
        out = tp.output_layout
        if isinstance(out, Replicate):
            y, bias_slice = tp.reduce(y), None
        else:
            y = DTensor.from_local(y, tp.mesh, [Partial()], run_check=False).redistribute(placements=[out])
            y = y.to_local()
            bias_slice = shard_range(tp.full_out, tp.rank, tp.world) if _is_shard_last(out, y.dim()) else None
        y = self._finish(y, bias_slice)
        if tp.use_local_output:
            return y
        return DTensor.from_local(y, tp.mesh, [out], run_check=False)

    def extra_repr(self) -> str:
        act = f", activation={self.output_activation} (after the reduction)" if self.output_activation else ""
        return f"{super().extra_repr()}, rowwise {self.tp.rank}/{self.tp.world} of in_features={self.tp.full_in}{act}"


def _is_dtensor(x) -> bool:
    if type(x) is torch.Tensor:
        return False
    from torch.distributed.tensor import DTensor

    return isinstance(x, DTensor)


def _to_local(x, tp: TensorParallel, placements) -> torch.Tensor:
    if tuple(x.placements) != tuple(placements):
        x = x.redistribute(placements=placements)
    return x.to_local()


__all__ = ["STYLES", "mesh_device", "mesh_facts", "ColwiseQuantLinear", "RowwiseQuantLinear", "TensorParallel", "parallelize_quant_linear",
           "shard_reason_of"]
