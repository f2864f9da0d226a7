"""The compressed-tensors layout (llm-compressor): its ``quantization_config`` groups and tensors."""

from __future__ import annotations

import re
from collections.abc import Mapping

import torch

from ...formats.spec import FORMATS
from ...nn.modules import QuantLinear
from ..compressed_tensors import from_compressed_tensors, to_compressed_tensors
from ..deepseek import from_deepseek_fp8, to_deepseek_fp8
from ..sharded import Axis, Stored
from .base import Layout, Loaded, codes_per_entry, exact_fp32, find_scheme


_CT_WEIGHT_ARGS: dict[str, dict] = {
    "nvfp4": {"dynamic": False, "group_size": 16, "num_bits": 4, "scale_dtype": "torch.float8_e4m3fn",
              "strategy": "tensor_group", "symmetric": True, "type": "float"},
    "mxfp4": {"dynamic": False, "group_size": 32, "num_bits": 4, "scale_dtype": "torch.uint8", "strategy": "group",
              "symmetric": True, "type": "float"},
    "mxfp8_e4m3": {"dynamic": False, "group_size": 32, "num_bits": 8, "scale_dtype": "torch.uint8",
                   "strategy": "group", "symmetric": True, "type": "float"},
    "int4_awq": {"dynamic": False, "group_size": 128, "num_bits": 4, "strategy": "group", "symmetric": False,
                 "type": "int"},
    "fp8_block": {"block_structure": [128, 128], "dynamic": False, "group_size": None, "num_bits": 8,
                  "strategy": "block", "symmetric": True, "type": "float"},
}  # fmt: skip
_CT_ACT_ARGS: dict[str, dict] = {
    "nvfp4": {"dynamic": "local", "group_size": 16, "num_bits": 4, "observer": "static_minmax",
              "scale_dtype": "torch.float8_e4m3fn", "strategy": "tensor_group", "symmetric": True, "type": "float"},
    "mxfp4": {"dynamic": True, "group_size": 32, "num_bits": 4, "scale_dtype": "torch.uint8", "strategy": "group",
              "symmetric": True, "type": "float"},
    "mxfp8_e4m3": {"dynamic": True, "group_size": 32, "num_bits": 8, "scale_dtype": "torch.uint8",
                   "strategy": "group", "symmetric": True, "type": "float"},
    "fp8_block": {"dynamic": True, "group_size": 128, "num_bits": 8, "strategy": "group", "symmetric": True,
                  "type": "float"},
}  # fmt: skip
_CT_DYNAMIC_NVFP4_ACT = {k: v for k, v in _CT_ACT_ARGS["nvfp4"].items() if k != "observer"} | {
    "dynamic": True
}
_CT_FORMATS = {
    "nvfp4": "nvfp4-pack-quantized",
    "mxfp4": "mxfp4-pack-quantized",
    "mxfp8_e4m3": "mxfp8-quantized",
    "int4_awq": "pack-quantized",
    "fp8_block": "float-quantized",
}


def _ct_act_format(args: Mapping | None, where: str) -> str | None:
    """lowbit activation format of a compressed-tensors ``input_activations`` entry."""
    if not args:
        return None
    bits, typ = args.get("num_bits"), args.get("type")
    strategy, group = args.get("strategy"), args.get("group_size")
    if typ == "float" and bits == 4 and strategy == "tensor_group" and group == 16:
        return "nvfp4"
    if typ == "float" and bits == 4 and strategy == "group" and group == 32:
        return "mxfp4"
    if (
        typ == "float"
        and bits == 8
        and strategy == "group"
        and group == 32
        and "uint8" in str(args.get("scale_dtype"))
    ):
        return "mxfp8_e4m3"
    if typ == "float" and bits == 8 and strategy == "group" and group == 128 and args.get("dynamic") is True:
        return "fp8_block"
    raise ValueError(f"{where}: input_activations {dict(args)} match no lowbit activation format")


def _ct_matches(target: str, name: str) -> bool:
    if target.startswith("re:"):
        return re.match(target[3:], name) is not None
    return target in (name, "Linear")


class CompressedTensorsLayout(Layout):
    """compressed-tensors 0.20 (llm-compressor): nvfp4-pack-quantized, mxfp4-pack-quantized, mxfp8-quantized,
    pack-quantized (int4 asym), float-quantized (fp8 128x128 blocks)."""

    name = "compressed-tensors"
    quant_method = "compressed-tensors"
    weight_formats = tuple(_CT_FORMATS)
    stores = "compressed-tensors stores " + ", ".join(_CT_FORMATS)

    def unsupported(self, m: QuantLinear) -> str | None:
        fmt = m.scheme.weight_format
        if fmt not in _CT_FORMATS:
            return f"compressed-tensors has no format for {fmt} weights"
        if m.scheme.act_format is not None and m.scheme.act_format not in _CT_ACT_ARGS:
            return f"compressed-tensors has no {m.scheme.act_format} activations"
        if fmt == "fp8_block" and tuple(m._meta.get("params", {}).get("block", (128, 128))) != (128, 128):
            return "compressed-tensors fp8 block weights are 128x128"
        return None

    def export(self, m: QuantLinear) -> dict[str, torch.Tensor]:
        q = m.weight_qtensor
        if q.fmt == "fp8_block":
            t = to_deepseek_fp8(q)
            return {"weight": t["weight"], "weight_scale": t["weight_scale_inv"]}
        igs = m.input_global_scale if q.fmt == "nvfp4" else None
        return to_compressed_tensors(q, igs)

    def _group(self, m: QuantLinear) -> tuple:
        fmt = m.scheme.weight_format
        group = m.group_size if fmt == "int4_awq" else None
        static = m.input_global_scale is not None
        return (fmt, group, m.scheme.act_format, static)

    def config(self, mods, ignore, dtype) -> dict:
        groups: dict[tuple, list[str]] = {}
        for name, m in mods.items():
            groups.setdefault(self._group(m), []).append(name)
        single = len(groups) == 1
        config_groups = {}
        formats = set()
        for i, ((fmt, group, act, static), names) in enumerate(groups.items()):
            weights = dict(_CT_WEIGHT_ARGS[fmt])
            if group is not None:
                weights["group_size"] = group
            if act is None:
                acts = None
            elif act == "nvfp4" and not static:
                acts = dict(_CT_DYNAMIC_NVFP4_ACT)
            else:
                acts = dict(_CT_ACT_ARGS[act])
            formats.add(_CT_FORMATS[fmt])
            config_groups[f"group_{i}"] = {
                "format": _CT_FORMATS[fmt],
                "input_activations": acts,
                "output_activations": None,
                "targets": ["Linear"] if single else sorted(names),
                "weights": weights,
            }
        return {
            "config_groups": config_groups,
            "format": formats.pop() if len(formats) == 1 else "mixed-precision",
            "global_compression_ratio": None,
            "ignore": sorted(ignore),
            "kv_cache_scheme": None,
            "moe_sparsity_config": None,
            "quant_method": "compressed-tensors",
            "quantization_status": "compressed",
            "sparsity_config": {},
            "transform_config": {},
            "version": "0.20.0",
        }

    def is_quantized(self, local: set[str]) -> bool:
        return "weight_packed" in local or ("weight" in local and "weight_scale" in local)

    def _group_for(self, name: str, qc: dict) -> dict:
        groups = qc.get("config_groups") or {}
        if not isinstance(groups, dict) or not groups:
            raise ValueError("quantization_config.config_groups must be a non-empty object")
        hits = [g for g in groups.values() if any(_ct_matches(t, name) for t in g.get("targets", []))]
        exact = [g for g in hits if name in g.get("targets", [])]
        if exact:
            return exact[0]
        if hits:
            return hits[0]
        raise ValueError(f"quantization_config: no config group targets module {name!r}")

    def read(self, name, local, get, qc, dtype) -> Loaded:
        group = self._group_for(name, qc)
        where = f"module {name!r}"
        act = _ct_act_format(group.get("input_activations"), where)
        if "weight_packed" in local:
            tensors = {k: get(k) for k in local}
            q = from_compressed_tensors(tensors, dtype=dtype)
        else:
            weight, scale = get("weight"), get("weight_scale")
            if weight.dtype != torch.float8_e4m3fn:
                raise ValueError(
                    f"{where}: compressed-tensors 'weight' with a scale must be float8_e4m3fn, got {weight.dtype}"
                )
            if scale.dtype in (torch.uint8, torch.float8_e8m0fnu):
                q = from_compressed_tensors(
                    {"weight": weight, "weight_scale": scale}, "mxfp8_e4m3", dtype=dtype
                )
            else:
                wargs = group.get("weights") or {}
                if wargs.get("strategy") != "block" or list(wargs.get("block_structure") or []) != [128, 128]:
                    raise ValueError(
                        f"{where}: float-quantized FP8 with strategy {wargs.get('strategy')!r} is not supported "
                        "(lowbit reads 128x128 block FP8 only)"
                    )
                s32 = exact_fp32(scale, f"{where}: weight_scale")
                q = from_deepseek_fp8(weight, s32.contiguous(), dtype=dtype)
        igs = None
        if "input_global_scale" in local and act == "nvfp4":
            igs = get("input_global_scale").float().reshape(1)
        return Loaded(find_scheme(q.fmt, act, where), q, igs)

    def shard_replicated(self, local: set[str]) -> set[str]:
        return {"weight_global_scale", "input_global_scale", "weight_shape", "weight_g_idx"}

    def shard_axes(self, name, local, whole, qc) -> Mapping[str, Stored]:
        fmt = whole.fmt
        if fmt == "int4_awq":
            # weight_packed [N, ceil(K/8)] (eight columns per int32), weight_scale [N, K/g], zero points [N/8, K/g]
            g = whole.params["group_size"]
            return {"weight_packed": Stored(n=Axis(0, 1), k=Axis(1, 8)),
                    "weight_scale": Stored(n=Axis(0, 1), k=Axis(1, g)),
                    "weight_zero_point": Stored(n=Axis(0, 8), k=Axis(1, g))}
        if fmt == "fp8_block":
            # weight [N, K] float8, weight_scale [N/128, K/128]
            bn, bk = whole.params["block"]
            return {"weight": Stored(n=Axis(0, 1), k=Axis(1, 1)), "weight_scale": Stored(n=Axis(0, bn), k=Axis(1, bk))}
        # nvfp4 / MX: codes [N, K*bits/8] (mxfp8's float8 'weight', else 'weight_packed'), linear scales [N, K/block]
        data = "weight" if fmt == "mxfp8_e4m3" else "weight_packed"
        return {data: Stored(n=Axis(0, 1), k=Axis(1, codes_per_entry(fmt))),
                "weight_scale": Stored(n=Axis(0, 1), k=Axis(1, FORMATS[fmt].block))}

    def shard_parts(self, name, local, get, shard, qc):
        if shard.whole.fmt != "int4_awq":
            return local, get, qc
        g = shard.whole.params["group_size"]

        def shard_get(k: str) -> torch.Tensor:
            t = get(k)
            if k == "weight_shape":  # pack-quantized stores the logical shape: the shard's
                return torch.tensor(list(shard.shape), dtype=t.dtype, device=t.device)
            if k == "weight_g_idx" and shard.dim == 1:
                # checked whole (the trivial i // g) when the load was planned: the shard's columns from group 0
                return t.reshape(-1)[shard.start : shard.stop] - shard.start // g
            return t

        return local, shard_get, qc
