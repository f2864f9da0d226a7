"""The GPTQ layout (AutoGPTQ / GPTQModel, ``checkpoint_format`` ``gptq`` and ``gptq_v2``)."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from ...nn.modules import QuantLinear
from ..gptq import V1_OFFSET, from_gptq, to_gptq, word_add
from ..sharded import Axis, Stored
from .base import Layout, Loaded, find_scheme, single_group_size


class GPTQLayout(Layout):
    """GPTQ v1 (AutoGPTQ / GPTQModel ``checkpoint_format: gptq``; ``gptq_v2`` stores raw zeros)."""

    name = "gptq"
    quant_method = "gptq"
    weight_formats = ("int4_awq",)
    stores = "GPTQ stores int4"

    def export(self, m: QuantLinear) -> dict[str, torch.Tensor]:
        return to_gptq(m.weight_qtensor)

    def config(self, mods, ignore, dtype) -> dict:
        return {
            "bits": 4,
            "checkpoint_format": "gptq",
            "desc_act": False,
            "group_size": single_group_size(mods, "GPTQ"),
            "modules_in_block_to_quantize": None,
            "quant_method": "gptq",
            "sym": False,
        }

    def is_quantized(self, local: set[str]) -> bool:
        return "qweight" in local

    def read(self, name, local, get, qc, dtype) -> Loaded:
        if qc.get("bits", 4) != 4:
            raise ValueError(f"quantization_config.bits: lowbit reads 4-bit GPTQ, got {qc.get('bits')!r}")
        if qc.get("desc_act"):
            raise ValueError(
                "quantization_config.desc_act=true (act-order) cannot be expressed in lowbit's int4 layout"
            )
        qzeros = get("qzeros")
        fmt = str(qc.get("checkpoint_format", "gptq")).lower()
        if fmt == "gptq_v2":
            qzeros = word_add(qzeros, -V1_OFFSET)
        elif fmt != "gptq":
            raise ValueError(
                f"quantization_config.checkpoint_format {fmt!r}: lowbit reads 'gptq' and 'gptq_v2'"
            )
        g_idx = get("g_idx") if "g_idx" in local else None
        q = from_gptq(get("qweight"), qzeros, get("scales"), g_idx)
        return Loaded(find_scheme("int4_awq", None, f"module {name!r}"), q)

    def shard_replicated(self, local: set[str]) -> set[str]:
        return {"g_idx"}

    def shard_axes(self, name, local, whole, qc) -> Mapping[str, Stored]:
        # qweight [K/8, N] (eight input rows per int32), qzeros [K/g, N/8], scales [K/g, N]
        g = whole.params["group_size"]
        return {"qweight": Stored(n=Axis(1, 1), k=Axis(0, 8)), "qzeros": Stored(n=Axis(1, 8), k=Axis(0, g)),
                "scales": Stored(n=Axis(1, 1), k=Axis(0, g))}

    def shard_parts(self, name, local, get, shard, qc):
        if shard.dim == 0:
            return local, get, qc
        g = shard.whole.params["group_size"]

        def shard_get(k: str) -> torch.Tensor:
            t = get(k)
            # checked whole (the trivial i // g) when the load was planned: the shard's columns from group 0
            return t[shard.start : shard.stop] - shard.start // g if k == "g_idx" else t

        return local, shard_get, qc
