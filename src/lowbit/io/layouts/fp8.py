"""The block FP8 layout of DeepSeek-V3 and HF fine-grained FP8 (``weight`` + ``weight_scale_inv``)."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from ...nn.modules import QuantLinear
from ..deepseek import deepseek_quantization_config, from_deepseek_fp8, to_deepseek_fp8
from ..sharded import Axis, Stored
from .base import Layout, Loaded, exact_fp32, find_scheme


class FP8BlockLayout(Layout):
    """DeepSeek-V3 / HF fine-grained FP8: ``weight`` float8_e4m3fn + ``weight_scale_inv`` fp32 per 128x128."""

    name = "fp8"
    quant_method = "fp8"
    weight_formats = ("fp8_block",)
    stores = "the FP8 block layout stores fp8_block weights"

    def unsupported(self, m: QuantLinear) -> str | None:
        if (why := super().unsupported(m)) is not None:
            return why
        if tuple(m._meta.get("params", {}).get("block", (128, 128))) != (128, 128):
            return "the FP8 block layout stores 128x128 blocks"
        return None

    def export(self, m: QuantLinear) -> dict[str, torch.Tensor]:
        return to_deepseek_fp8(m.weight_qtensor)

    def config(self, mods, ignore, dtype) -> dict:
        qc = deepseek_quantization_config()
        fmts = {m._meta.get("params", {}).get("scale_fmt") for m in mods.values()}
        if fmts == {"ue8m0"}:
            qc["scale_fmt"] = "ue8m0"
        if ignore:
            qc["modules_to_not_convert"] = sorted(ignore)
        return qc

    def is_quantized(self, local: set[str]) -> bool:
        return "weight_scale_inv" in local

    def read(self, name, local, get, qc, dtype) -> Loaded:
        block = qc.get("weight_block_size")
        if block is None or list(block) != [128, 128]:
            raise ValueError(
                f"quantization_config.weight_block_size must be [128, 128] (lowbit's fp8_block weights), got {block!r}"
            )
        fmt = qc.get("fmt", "e4m3")
        if fmt != "e4m3":
            raise ValueError(f"quantization_config.fmt must be 'e4m3', got {fmt!r}")
        scale_fmt = qc.get("scale_fmt")
        if scale_fmt not in (None, "float", "ue8m0"):
            raise ValueError(f"quantization_config.scale_fmt must be 'float' or 'ue8m0', got {scale_fmt!r}")
        scale = get("weight_scale_inv")
        if scale.dtype == torch.float8_e8m0fnu:  # transformers stores ue8m0 scales as e8m0 bytes
            scale = scale.float()
        elif scale.dtype != torch.float32:
            scale = exact_fp32(scale, f"module {name!r}: weight_scale_inv")
        fmt8 = "ue8m0" if scale_fmt == "ue8m0" else None
        q = from_deepseek_fp8(get("weight"), scale.contiguous(), dtype=dtype, scale_fmt=fmt8)
        return Loaded(find_scheme("fp8_block", "fp8_block", f"module {name!r}"), q)

    def shard_axes(self, name, local, whole, qc) -> Mapping[str, Stored]:
        # weight [N, K] float8, weight_scale_inv [N/128, K/128]
        bn, bk = whole.params["block"]
        return {"weight": Stored(n=Axis(0, 1), k=Axis(1, 1)),
                "weight_scale_inv": Stored(n=Axis(0, bn), k=Axis(1, bk))}
