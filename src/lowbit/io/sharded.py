"""Sharded (tensor-parallel) loading: each rank reads only its shard of every quantized Linear a plan names.

``lowbit.load_quantized(path, device_mesh=mesh, tp_plan=plan)`` builds the same model, tensor for tensor, as
``lowbit.parallel.parallelize(lowbit.load_quantized(path), mesh, plan)``, but a rank never holds a whole
quantized weight: it reads its rows (column-parallel) or columns (row-parallel) of each stored tensor with
safetensors' slice reads, builds a :class:`~lowbit.nn.QuantLinear` of the shard's shape and makes it parallel with
``parallelize_quant_linear(..., sharded=True)``.

Where a logical shard (rows ``n0:n1`` or columns ``k0:k1`` of the weight ``[N, K]``) lies in each stored tensor is
declared by the layout that defines the tensors (:meth:`lowbit.io.layouts.Layout.shard_axes`): per stored tensor a
:class:`Stored`, saying which stored dim follows N and which follows K and how many logical rows or columns one
stored index covers (:class:`Axis`). The tensors a layout names in ``shard_replicated`` (global scales, code
tables, shapes, ``g_idx``) are metadata every rank reads whole. Three kinds of storage:

- plain dims (packed codes, linear scales, zero points): a shard is one rectangular slice read;
- flattened (bitsandbytes' packed weight and absmax, nf4 / bnb_fp4 in lowbit's native layout: the row-major
  flattening of ``[N, K]``): a row range is one contiguous slice; a column range is N separate runs;
- 128x4-swizzled scales (LightX2V, lowbit native with ``scale_layout="swizzled"``): a row shard reads the
  128-row tiles that hold its rows (one contiguous row range of the stored tensor; exactly its own tiles when its
  rows start and end on tiles, else at most one partial tile more on each side); a column shard reads, in each
  128-row tile, the stored rows holding the 4-column groups of its scale columns (up to 3 scale columns of its
  neighbours on each side, plus less than one stored row at each end of the tile's run). Both are rebuilt as the
  shard's own swizzled scales with :mod:`lowbit.formats.shards`' rule (unswizzle, slice, swizzle).

Fallback: a layer whose shard cannot be slice-read is read whole (that module's tensors only, one module at a
time) and cut with :func:`lowbit.formats.shards.shard`. That happens for row-parallel (column) shards of nf4 /
bnb_fp4 weights (bitsandbytes layout, or lowbit native), because their flattened storage puts a column range in
N separate runs; and for any layer whose layout declares no slice rule for one of its tensors (lowbit native
fp8_block with non-linear scales, or a format the layout has no rule for). nf4 double quantization follows
``shard``: a row shard that starts on a nested block (256 absmax blocks) keeps it; otherwise its absmax codes
(and the nested blocks covering them) are read and decoded to the exact fp32 absmax.

Everything is checked before any weight is read, on every rank alike: the mesh is 1-D, the plan resolves, each
planned quantized layer has a sharding style and splits on its blocks (:func:`lowbit.formats.shards.shard_reason`,
on the weight's format and shape read as meta tensors), and every stored tensor's shape matches its declaration
and the shard boundaries fall on whole stored entries.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from fractions import Fraction
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ..formats.nf4 import NESTED_BLOCKSIZE, dequantize_blockwise_8bit
from ..formats.packing import swizzle_scales, swizzled_scale_shape, unswizzle_scales
from ..formats.qtensor import QTensor
from ..formats.shards import shard_range, shard_reason
from ..nn.modules import QuantLinear

if TYPE_CHECKING:
    from .files import TensorSource
    from .layouts import Layout

_TILE_ROWS = 128
_TILE_COLS = 4
_TILE_BYTES = _TILE_ROWS * _TILE_COLS  # one 128x4 tile of 1-byte scales


@dataclass(frozen=True)
class Axis:
    """A stored dim that follows one logical axis of the weight ``[N, K]``.

    ``per`` is how many logical rows (or columns) one stored index covers: 8 for AutoAWQ's ``qweight`` along N
    (eight output columns per int32), 2 for packed FP4 bytes along K, the block for block scales, ``2 / K`` for a
    flattened packed weight along N (one row is K/2 bytes). ``cover``: the stored range is the one covering the
    logical range (rounded outwards), for tensors whose entries straddle shard boundaries by design (nf4's
    nested absmax blocks, resolved by the layout); otherwise a boundary inside a stored entry is an error.
    """

    dim: int
    per: Fraction
    cover: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "per", Fraction(self.per))

    def size(self, logical: int) -> int:
        """Stored entries along ``dim`` for ``logical`` rows or columns (a partial last entry counts)."""
        return math.ceil(Fraction(logical) / self.per)

    def stored_range(self, start: int, stop: int, logical: int) -> tuple[int, int] | None:
        """The stored index range of logical ``start:stop``; None when a boundary falls inside a stored entry."""
        lo, hi = Fraction(start) / self.per, Fraction(stop) / self.per
        if self.cover:
            return math.floor(lo), math.ceil(hi)
        if stop == logical:
            hi = Fraction(math.ceil(hi))  # the last entry may be partial (padding)
        if lo.denominator != 1 or hi.denominator != 1:
            return None
        return int(lo), int(hi)


@dataclass(frozen=True)
class Stored:
    """How one stored tensor of a quantized Linear follows its weight ``[N, K]`` (declared by its layout).

    Attributes:
        n: the stored dim that follows the rows N, or None if the tensor does not vary with N.
        k: the stored dim that follows the columns K, or None if it does not vary with K (or, ``flat``, cannot be
            cut along K).
        flat: the tensor is the row-major flattening of ``[N, K/per]`` along ``n.dim``: row ranges are contiguous,
            column ranges are not (a column shard falls back to a whole read).
        swizzled: 128x4-swizzled block scales, 2-D ``[round_up(N / n.per, 128), round_up(K / k.per, 4)]`` for the
            logical scales ``[N / n.per, K / k.per]`` (n.per is 1, k.per the block).
    """

    n: Axis | None = None
    k: Axis | None = None
    flat: bool = False
    swizzled: bool = False

    def axis(self, dim: int) -> Axis | None:
        return self.n if dim == 0 else self.k

    def header_reason(self, shape: list[int], n: int, k: int) -> str | None:
        """None if the stored shape is what this declaration says for a weight ``[n, k]``, else why not."""
        if self.swizzled:
            want = list(swizzled_scale_shape(self.n.size(n), self.k.size(k)))
            return None if shape == want else f"shape {shape}, but swizzled scales of [{n}, {k}] are {want}"
        if self.flat:
            rest = math.prod(shape) // max(shape[self.n.dim], 1) if shape else 0
            want = self.n.size(n)
            if len(shape) <= self.n.dim or shape[self.n.dim] != want or rest != 1:
                return (f"shape {shape}, but the flattened tensor of [{n}, {k}] holds {want} entries along dim "
                        f"{self.n.dim}")
            return None
        for axis, logical in ((self.n, n), (self.k, k)):
            if axis is None:
                continue
            if len(shape) <= axis.dim or shape[axis.dim] != axis.size(logical):
                return (f"shape {shape}, but dim {axis.dim} holds one entry per {axis.per} of {logical} "
                        f"({axis.size(logical)} entries)")
        return None


@dataclass(frozen=True)
class ShardInfo:
    """The part of one weight a rank loads: rows (``dim`` 0) or columns (``dim`` 1) ``start:stop``."""

    whole: QTensor
    """The whole weight as read from the headers (meta tensors): its format, shape and params."""
    dim: int
    start: int
    stop: int
    rank: int
    world: int

    @property
    def shape(self) -> tuple[int, int]:
        n, k = self.whole.shape
        return (self.stop - self.start, k) if self.dim == 0 else (n, self.stop - self.start)


def unnest_absmax(codes: torch.Tensor, nested: torch.Tensor, offset: torch.Tensor, first_block: int) -> torch.Tensor:
    """The fp32 absmax of nf4 blocks ``first_block`` onwards from their double-quantized codes.

    ``nested`` holds the nested absmax of the 256-block groups covering them (from ``first_block // 256``).
    Decoded as :func:`lowbit.formats.nf4.nf4_absmax` decodes the whole weight (the same fp32 operations per
    block): the codes are put back at their place in their first nested group.
    """
    pad = first_block % NESTED_BLOCKSIZE
    padded = torch.cat([codes.new_zeros(pad), codes.reshape(-1)])
    absmax = dequantize_blockwise_8bit(padded, nested.reshape(-1), None, NESTED_BLOCKSIZE)[pad:]
    return absmax + offset.reshape(()).to(absmax.device)


def _swizzled_rows(source: TensorSource, key: str, rows: int, cols: int, n0: int, n1: int) -> torch.Tensor:
    t0, t1 = n0 // _TILE_ROWS, -(-n1 // _TILE_ROWS)
    part = source.read_slice(key, (slice(t0 * _TILE_ROWS, t1 * _TILE_ROWS), slice(None)))
    if n0 == t0 * _TILE_ROWS and (n1 % _TILE_ROWS == 0 or n1 == rows):
        return part  # whole tiles: already the shard's own swizzled scales
    linear = unswizzle_scales(part, min(t1 * _TILE_ROWS, rows) - t0 * _TILE_ROWS, cols)
    return swizzle_scales(linear[n0 - t0 * _TILE_ROWS : n1 - t0 * _TILE_ROWS])


def _swizzled_cols(source: TensorSource, key: str, rows: int, cols: int, c0: int, c1: int) -> torch.Tensor:
    prow, pcol = swizzled_scale_shape(rows, cols)
    g0, g1 = c0 // _TILE_COLS, -(-c1 // _TILE_COLS)
    pieces = []
    for t in range(prow // _TILE_ROWS):
        # tile t's 4-column group g is the 512 bytes at t*128*pcol + g*512 of the stored tensor
        b0 = t * _TILE_ROWS * pcol + g0 * _TILE_BYTES
        b1 = t * _TILE_ROWS * pcol + g1 * _TILE_BYTES
        r0, r1 = b0 // pcol, -(-b1 // pcol)
        run = source.read_slice(key, (slice(r0, r1), slice(None))).contiguous().view(torch.uint8).reshape(-1)
        pieces.append(run[b0 - r0 * pcol : b1 - r0 * pcol])
    dtype = source.meta(key).dtype
    groups = torch.cat(pieces).view(prow, (g1 - g0) * _TILE_COLS).view(dtype)
    linear = unswizzle_scales(groups, rows, (g1 - g0) * _TILE_COLS)
    return swizzle_scales(linear[:, c0 - g0 * _TILE_COLS : c1 - g0 * _TILE_COLS])


def read_part(source: TensorSource, key: str, stored: Stored, shard: ShardInfo) -> torch.Tensor:
    """This rank's part of the stored tensor ``key`` under its declaration (module docstring)."""
    n, k = shard.whole.shape
    axis = stored.axis(shard.dim)
    if stored.swizzled:
        rows, cols = stored.n.size(n), stored.k.size(k)
        lo, hi = stored.axis(shard.dim).stored_range(shard.start, shard.stop, (n, k)[shard.dim])
        if shard.dim == 0:
            return _swizzled_rows(source, key, rows, cols, lo, hi)
        return _swizzled_cols(source, key, rows, cols, lo, hi)
    if axis is None:
        if stored.flat and shard.dim == 1:
            raise ValueError(f"{key}: a flattened tensor has no column slices")
        return source.get(key)  # does not vary along the sharded axis
    lo, hi = axis.stored_range(shard.start, shard.stop, (n, k)[shard.dim])
    ndim = len(source.shape(key))
    index = tuple(slice(lo, hi) if d == axis.dim else slice(None) for d in range(ndim))
    return source.read_slice(key, index)


@dataclass
class PlannedLayer:
    """One quantized Linear of the plan: how this rank loads it."""

    name: str
    style: Any
    kind: str
    """``"colwise"`` or ``"rowwise"``."""
    local: dict[str, str]
    """Module-local tensor name -> checkpoint key (bias included)."""
    shard: ShardInfo
    axes: Mapping[str, Stored] | None
    """None: read whole and cut with ``lowbit.formats.shards.shard`` (``fallback`` says why)."""
    fallback: str | None = None


def check_mesh(device_mesh) -> tuple[int, int]:
    """``(rank, world)`` of a 1-D device mesh; ValueError for another mesh."""
    ndim = getattr(device_mesh, "ndim", None)
    if ndim is None or not hasattr(device_mesh, "get_local_rank"):
        raise TypeError(f"device_mesh must be a torch.distributed DeviceMesh, got {type(device_mesh).__name__}")
    if ndim != 1:
        raise ValueError(f"device_mesh must be 1-D (slice a tensor-parallel dimension: mesh['tp']), got {ndim}-D")
    return device_mesh.get_local_rank(), device_mesh.size()


class ShardedLoad:
    """The sharded part of one ``load_quantized`` call on this rank: plans every layer up front, then loads
    each planned quantized Linear as this rank's parallel shard, and applies the plan's other styles."""

    def __init__(self, model: nn.Module, device_mesh, plan: Mapping[str, Any] | None, *, layout: Layout, qc: dict,
                 source: TensorSource, dtype: torch.dtype, local_of: Callable[[str], dict[str, str]]) -> None:
        from ..parallel.api import resolve_plan
        from ..parallel.styles import ColwiseParallel, RowwiseParallel

        self.rank, self.world = check_mesh(device_mesh)
        self.mesh = device_mesh
        self.layout, self.qc, self.source, self.dtype = layout, qc, source, dtype
        self.layers: dict[str, PlannedLayer] = {}
        self.others: list[tuple[str, Any]] = []
        errors = []
        for name, module, style in resolve_plan(model, plan):
            local = local_of(name) if isinstance(module, nn.Linear) else {}
            qlocal = set(local) - {"bias"}
            if not qlocal or not layout.is_quantized(qlocal):
                self.others.append((name, style))  # dense layers, embeddings, ...: torch's styles after loading
                continue
            kind = ("colwise" if isinstance(style, ColwiseParallel)
                    else "rowwise" if isinstance(style, RowwiseParallel) else None)
            if kind is None:
                errors.append(f"{name}: style {type(style).__name__} does not shard a QuantLinear")
                continue
            try:
                planned = self._plan(name, module, style, kind, local)
            except (ValueError, TypeError) as e:
                errors.append(f"{name}: {e}")
                continue
            if isinstance(planned, str):
                errors.append(f"{name}: {planned}")
            else:
                self.layers[name] = planned
        if errors:
            raise ValueError(f"load_quantized over {self.world} ranks: {len(errors)} layer(s) cannot be sharded: "
                             + "; ".join(errors[:8]))

    # ------------------------------------------------------------------ planning (no weight is read)

    def _plan(self, name: str, lin: nn.Linear, style, kind: str, local: dict[str, str]) -> PlannedLayer | str:
        layout, source = self.layout, self.source
        qlocal = set(local) - {"bias"}
        replicated = layout.shard_replicated(qlocal) & qlocal

        def header(k: str) -> torch.Tensor:
            # the metadata is read (it is small and its values are checked); the weight's tensors are meta
            return source.get(local[k]) if k in replicated else source.meta(local[k])

        whole = layout.read(name, qlocal, header, self.qc, self.dtype).weight
        n, k = whole.shape if len(whole.shape) == 2 else (None, None)
        if (n, k) != (lin.out_features, lin.in_features):
            return (f"the checkpoint holds a weight of shape {list(whole.shape)} but the config's model has Linear "
                    f"[{lin.out_features}, {lin.in_features}] (checkpoint and config.json do not match)")
        dim = 0 if kind == "colwise" else 1
        why = shard_reason(whole, dim, self.world)
        if why is not None:
            return why
        start, stop = shard_range(whole.shape[dim], self.rank, self.world)
        shard = ShardInfo(whole, dim, start, stop, self.rank, self.world)
        layer = PlannedLayer(name, style, kind, local, shard, None)
        axes = layout.shard_axes(name, qlocal - replicated, whole, self.qc)
        if axes is None:
            layer.fallback = f"the {layout.name} layout has no slice rule for {whole.fmt} weights stored this way"
            return layer
        missing = sorted(qlocal - replicated - set(axes))
        if missing:
            layer.fallback = f"the {layout.name} layout has no slice rule for {missing}"
            return layer
        for t, stored in sorted(axes.items()):
            if t not in qlocal:
                continue
            bad = stored.header_reason(source.shape(local[t]), n, k)
            if bad is not None:
                return f"stored tensor {t!r} has {bad} (the checkpoint does not match its layout)"
            if stored.flat and dim == 1:
                layer.fallback = (f"{t!r} is stored flattened (row-major [N, K]), so a column shard is {n} runs, "
                                  "not one slice")
                continue
            axis = stored.axis(dim)
            if axis is None:
                continue
            for r in range(self.world):  # every rank's boundaries, so every rank raises the same error
                a, b = shard_range(whole.shape[dim], r, self.world)
                if axis.stored_range(a, b, whole.shape[dim]) is None:
                    what = "rows" if dim == 0 else "columns"
                    return (f"{what} {a}:{b} do not fall on whole entries of stored tensor {t!r} (one entry per "
                            f"{axis.per} {what})")
        if layer.fallback is None:
            layer.axes = axes
        return layer

    # ------------------------------------------------------------------ loading

    def planned(self, name: str) -> bool:
        return name in self.layers

    def load(self, name: str, lin: nn.Linear, bias_dtype: torch.dtype | None) -> QuantLinear:
        """Read this rank's shard of the planned layer ``name`` and return it as a parallel QuantLinear."""
        from ..parallel.layers import parallelize_quant_linear

        layer = self.layers[name]
        layout, source, shard = self.layout, self.source, layer.shard
        qlocal = set(layer.local) - {"bias"}
        if layer.axes is None:
            loaded = layout.read(name, qlocal, lambda k: source.get(layer.local[k]), self.qc, self.dtype)
            out_f, in_f = lin.out_features, lin.in_features
            bias = source.get(layer.local["bias"]) if "bias" in layer.local else None
        else:
            parts: dict[str, torch.Tensor] = {}

            def part(k: str) -> torch.Tensor:
                if k not in parts:
                    stored = layer.axes.get(k)
                    key = layer.local[k]
                    parts[k] = source.get(key) if stored is None else read_part(source, key, stored, shard)
                return parts[k]

            local, get, qc = layout.shard_parts(name, qlocal, part, shard, self.qc)
            loaded = layout.read(name, local, get, qc, self.dtype)
            if tuple(loaded.weight.shape) != shard.shape:
                raise ValueError(f"the shard read has shape {list(loaded.weight.shape)}, expected {list(shard.shape)}")
            out_f, in_f = shard.shape
            bias = None
            if "bias" in layer.local:
                key = layer.local["bias"]
                bias = source.read_slice(key, (slice(shard.start, shard.stop),)) if shard.dim == 0 else source.get(key)
        if bias is not None and bias_dtype is not None and bias.is_floating_point():
            bias = bias.to(bias_dtype)
        q = QuantLinear(in_f, out_f, bias is not None, scheme=loaded.scheme, weight=loaded.weight, bias_tensor=bias,
                        input_global_scale=loaded.input_global_scale)
        # the style's own arguments, as its _apply passes them (exact launches, the all-reduce)
        style = layer.style
        extra = ({"exact": getattr(style, "exact", False)} if layer.kind == "colwise"
                 else {"all_reduce": getattr(style, "all_reduce", "nccl")})
        return parallelize_quant_linear(q, self.mesh, layer.kind, input_layouts=style.input_layouts,
                                        output_layouts=style.output_layouts, use_local_output=style.use_local_output,
                                        sharded=layer.axes is not None, **extra)

    def finish(self, model: nn.Module) -> None:
        """Apply the plan's styles to the layers that were not loaded as quantized shards (dense Linear layers,
        embeddings, ...), in the model's module order, as ``parallelize`` does."""
        for name, style in self.others:
            style._apply(model.get_submodule(name), self.mesh)


__all__ = ["Axis", "PlannedLayer", "ShardInfo", "ShardedLoad", "Stored", "check_mesh", "read_part", "unnest_absmax"]
