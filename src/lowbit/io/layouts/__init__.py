"""Checkpoint layouts: how each ecosystem stores a quantized Linear, and its ``quantization_config``.

One :class:`Layout` per ecosystem format, one module each; each turns a ``QuantLinear`` into the producer's
tensors (reusing the bit-exact tensor converters of ``lowbit.io``) and back. :data:`LAYOUTS` holds one of each
by ``save_quantized(format=...)`` name. See ``docs/models.md`` for the tables.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .awq import AWQLayout
from .base import DTYPE_NAMES, NAME_DTYPES, Getter, Layout, Loaded, codes_per_entry, find_scheme
from .bitsandbytes import BitsAndBytesLayout
from .compressed_tensors import CompressedTensorsLayout
from .fp8 import FP8BlockLayout
from .gptq import GPTQLayout
from .lightx2v import LightX2VLayout
from .modelopt import ModelOptLayout
from .native import LowbitLayout, params_from_json, params_to_json


LAYOUTS: dict[str, Layout] = {
    lay.name: lay
    for lay in (
        CompressedTensorsLayout(), BitsAndBytesLayout(), AWQLayout(), GPTQLayout(), FP8BlockLayout(), ModelOptLayout(),
        LowbitLayout(), LightX2VLayout(),
    )
}  # fmt: skip
FORMAT_ALIASES = {"ct": "compressed-tensors", "llm-compressor": "compressed-tensors", "bnb": "bitsandbytes",
                  "deepseek": "fp8", "native": "lowbit", "autoawq": "awq"}  # fmt: skip


def layouts_storing(weight_format: str) -> tuple[str, ...]:
    """The ``save_quantized(format=...)`` names of the layouts that can store ``weight_format`` weights (each may
    still refuse a layer for its activation format or options: ``Layout.unsupported`` says why)."""
    return tuple(name for name, lay in LAYOUTS.items() if weight_format in lay.weight_formats)


def layout_for_config(qc: Mapping[str, Any], where: str) -> Layout:
    """The layout of a ``quantization_config`` (by ``quant_method``)."""
    method = str(qc.get("quant_method", "")).lower()
    if method == "fp8" and "weight_block_size" not in qc:
        raise ValueError(
            f"{where}: quant_method 'fp8' without weight_block_size (per-tensor FP8) is not supported"
        )
    for lay in LAYOUTS.values():
        if lay.quant_method == method:
            return lay
    raise ValueError(
        f"{where}: quantization_config.quant_method {qc.get('quant_method')!r} is not supported; lowbit reads "
        f"{sorted(lay.quant_method for lay in LAYOUTS.values())}"
    )


__all__ = [
    "AWQLayout",
    "BitsAndBytesLayout",
    "CompressedTensorsLayout",
    "DTYPE_NAMES",
    "FORMAT_ALIASES",
    "FP8BlockLayout",
    "GPTQLayout",
    "Getter",
    "LAYOUTS",
    "layouts_storing",
    "Layout",
    "LightX2VLayout",
    "Loaded",
    "LowbitLayout",
    "ModelOptLayout",
    "NAME_DTYPES",
    "codes_per_entry",
    "find_scheme",
    "layout_for_config",
    "params_from_json",
    "params_to_json",
]
