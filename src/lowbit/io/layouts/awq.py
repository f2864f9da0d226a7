"""The AutoAWQ GEMM layout (``qweight`` / ``qzeros`` / ``scales``, ``quant_method: awq``)."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from ...nn.modules import QuantLinear
from ..awq import from_autoawq, to_autoawq
from ..sharded import Axis, Stored
from .base import Layout, Loaded, find_scheme, single_group_size


class AWQLayout(Layout):
    """AutoAWQ GEMM (``qweight``/``qzeros``/``scales``, ``quant_method: awq``, ``version: gemm``)."""

    name = "awq"
    quant_method = "awq"
    weight_formats = ("int4_awq",)
    stores = "AutoAWQ stores int4"

    def export(self, m: QuantLinear) -> dict[str, torch.Tensor]:
        return to_autoawq(m.weight_qtensor)

    def config(self, mods, ignore, dtype) -> dict:
        return {
            "bits": 4,
            "group_size": single_group_size(mods, "AutoAWQ"),
            "modules_to_not_convert": sorted(ignore) or None,
            "quant_method": "awq",
            "version": "gemm",
            "zero_point": True,
        }

    def is_quantized(self, local: set[str]) -> bool:
        return "qweight" in local

    def read(self, name, local, get, qc, dtype) -> Loaded:
        version = str(qc.get("version", "gemm")).lower()
        if version != "gemm":
            raise ValueError(
                f"quantization_config.version: lowbit reads AutoAWQ 'gemm' checkpoints, got {version!r}"
            )
        if qc.get("zero_point", True) is not True or qc.get("bits", qc.get("w_bit", 4)) != 4:
            raise ValueError(
                "quantization_config: lowbit reads 4-bit AutoAWQ checkpoints with zero_point=true"
            )
        group = qc.get("group_size", qc.get("q_group_size"))
        q = from_autoawq(get("qweight"), get("qzeros"), get("scales"), group_size=group)
        return Loaded(find_scheme("int4_awq", None, f"module {name!r}"), q)

    def shard_axes(self, name, local, whole, qc) -> Mapping[str, Stored]:
        # qweight [K, N/8] (eight output columns per int32), qzeros [K/g, N/8], scales [K/g, N]
        g = whole.params["group_size"]
        return {"qweight": Stored(n=Axis(1, 8), k=Axis(0, 1)), "qzeros": Stored(n=Axis(1, 8), k=Axis(0, g)),
                "scales": Stored(n=Axis(1, 1), k=Axis(0, g))}
