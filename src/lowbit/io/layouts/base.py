"""What every checkpoint layout shares: the :class:`Layout` interface, what a layout reads for one module
(:class:`Loaded`), the scheme lookup and the dtype names of ``config.json``."""

from __future__ import annotations

from typing import Any

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from fractions import Fraction

import torch

from ...formats.qtensor import QTensor
from ...formats.spec import FORMATS
from ...nn.modules import QuantLinear
from ...nn.schemes import SCHEMES, Scheme
from ..sharded import ShardInfo, Stored

DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
NAME_DTYPES = {v: k for k, v in DTYPE_NAMES.items()}

Getter = Callable[[str], torch.Tensor]
"""Reads one module-local tensor (``"weight_packed"``) of the module being loaded."""


@dataclass
class Loaded:
    """What a layout read for one module."""

    scheme: Scheme
    weight: QTensor
    input_global_scale: torch.Tensor | None = None
    input_transform: Any = None
    """An online ``lowbit.algorithms.rotation.InputTransform`` of the layer's input (lowbit-native only)."""


def find_scheme(weight_format: str, act_format: str | None, where: str) -> Scheme:
    """The registered scheme with this weight and activation format (ValueError naming ``where`` otherwise)."""
    for s in SCHEMES.values():
        if s.weight_format == weight_format and s.act_format == act_format:
            return s
    act = "16-bit activations" if act_format is None else f"{act_format} activations"
    raise ValueError(
        f"{where}: {weight_format} weights with {act} match no lowbit scheme "
        f"(schemes: {', '.join(f'{s.name}={s.weight_format}/{s.act_format or 16}' for s in SCHEMES.values())})"
    )


class Layout:
    """Base class. ``name`` is the ``save_quantized(format=...)`` value."""

    name = ""
    quant_method = ""
    weight_formats: tuple[str, ...] = ()
    """The weight formats the layout stores; :meth:`unsupported` refuses the others, saying :attr:`stores`."""
    stores = ""
    """What the layout stores, as its refusal of another weight format says it (``"AutoAWQ stores int4"``)."""

    def unsupported(self, m: QuantLinear) -> str | None:
        """Why this layout cannot store ``m`` (None if it can)."""
        if m.scheme.weight_format not in self.weight_formats:
            return f"{self.stores}, not {m.scheme.weight_format}"
        return None

    def export(self, m: QuantLinear) -> dict[str, torch.Tensor]:
        """Module-local tensors (bias excluded; it is written as ``<mod>.bias`` by the caller)."""
        raise NotImplementedError

    def config(self, mods: Mapping[str, QuantLinear], ignore: list[str], dtype: torch.dtype | None) -> dict:
        """The ``quantization_config`` of ``config.json``."""
        raise NotImplementedError

    def extra_files(self, mods: Mapping[str, QuantLinear], ignore: list[str]) -> dict[str, dict]:
        return {}

    def is_quantized(self, local: set[str]) -> bool:
        """Whether the module-local tensor names (bias excluded) are this layout's quantized tensors."""
        raise NotImplementedError

    def read(self, name: str, local: set[str], get: Getter, qc: dict, dtype: torch.dtype) -> Loaded:
        raise NotImplementedError

    # sharded loading (lowbit.io.sharded): where one rank's rows or columns of the weight lie in the stored tensors

    def shard_replicated(self, local: set[str]) -> set[str]:
        """The module-local tensors that are metadata every rank reads whole (scalars, code tables, a stored
        shape, ``g_idx``), not parts of the weight. Their values are checked before any weight is read."""
        return set()

    def shard_axes(self, name: str, local: set[str], whole: QTensor, qc: dict) -> Mapping[str, Stored] | None:
        """For each stored tensor of the weight (``local``: the module's tensors less the replicated ones): which
        stored dim follows the rows N and which the columns K, and how many rows or columns one stored index covers
        (:class:`lowbit.io.sharded.Stored`). ``whole`` is the whole weight read with meta tensors (its format,
        shape and params). None: no slice reads for this weight (it is read whole, then cut)."""
        return None

    def shard_parts(
        self, name: str, local: set[str], get: Getter, shard: ShardInfo, qc: dict
    ) -> tuple[set[str], Getter, dict]:
        """The tensor names, getter and ``quantization_config`` that :meth:`read` turns into ``shard``, from
        ``get`` returning this rank's part of each stored tensor (and replicated tensors whole). Layouts whose
        metadata describes the whole weight (a stored shape, ``g_idx``, bitsandbytes' quant_state, lowbit's
        per-module shape) rewrite it for the shard here. Default: unchanged."""
        return local, get, qc


def single_group_size(mods: Mapping[str, QuantLinear], producer: str) -> int:
    """The group size every int4 module of ``mods`` has (ValueError naming ``producer``, whose
    ``quantization_config`` holds one group size, when they differ)."""
    sizes = {m.group_size for m in mods.values()}
    if len(sizes) != 1:
        raise ValueError(f"{producer} checkpoints have one group size; these layers use {sorted(sizes)}")
    return sizes.pop()


def codes_per_entry(fmt: str) -> Fraction:
    """Elements of a block-scaled format per stored entry of its codes along K (2 per FP4 byte, 4 per 3 FP6
    bytes, 1 per FP8 code)."""
    return Fraction(8, FORMATS[fmt].element.bits)


def exact_fp32(scale: torch.Tensor, where: str) -> torch.Tensor:
    """``scale`` in fp32, checked to convert exactly. A meta tensor (the shape-only read that plans a sharded load)
    has no values: each rank checks its part when it reads it."""
    s32 = scale.float()
    if not s32.is_meta and not torch.equal(s32.to(scale.dtype), scale):
        raise ValueError(f"{where} does not convert to fp32 exactly")
    return s32
