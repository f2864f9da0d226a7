"""Checkpoint layouts: how each ecosystem stores a quantized Linear, and its ``quantization_config``.

One :class:`Layout` per ecosystem format; each turns a ``QuantLinear`` into the producer's tensors (reusing the
bit-exact tensor converters of ``lowbit.io``) and back. See ``docs/models.md`` for the tables.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

import torch

from .. import __version__
from ..formats.nf4 import BNB_4BIT_FORMATS, NESTED_BLOCKSIZE
from ..formats.qtensor import QTensor
from ..formats.spec import FORMATS
from ..nn.modules import QTENSOR_FIELDS, QuantLinear
from ..nn.schemes import SCHEMES, Scheme
from .awq import from_autoawq, to_autoawq
from .bnb import from_bnb_state_dict, to_bnb_state_dict
from .compressed_tensors import from_compressed_tensors, to_compressed_tensors
from .deepseek import deepseek_quantization_config, from_deepseek_fp8, to_deepseek_fp8
from .gptq import V1_OFFSET, from_gptq, to_gptq, word_add
from . import lightx2v as _lx
from .modelopt import from_modelopt_nvfp4, to_modelopt_nvfp4
from .sharded import Axis, ShardInfo, Stored, unnest_absmax

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

    def unsupported(self, m: QuantLinear) -> str | None:
        """Why this layout cannot store ``m`` (None if it can)."""
        raise NotImplementedError

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


def codes_per_entry(fmt: str) -> Fraction:
    """Elements of a block-scaled format per stored entry of its codes along K (2 per FP4 byte, 4 per 3 FP6
    bytes, 1 per FP8 code)."""
    return Fraction(8, FORMATS[fmt].element.bits)


def _exact_fp32(scale: torch.Tensor, where: str) -> torch.Tensor:
    """``scale`` in fp32, checked to convert exactly. A meta tensor (the shape-only read that plans a sharded load)
    has no values: each rank checks its part when it reads it."""
    s32 = scale.float()
    if not s32.is_meta and not torch.equal(s32.to(scale.dtype), scale):
        raise ValueError(f"{where} does not convert to fp32 exactly")
    return s32


# ---------------------------------------------------------------------------------------------- compressed-tensors

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
                s32 = _exact_fp32(scale, f"{where}: weight_scale")
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


# ---------------------------------------------------------------------------------------------- bitsandbytes


class BitsAndBytesLayout(Layout):
    """bitsandbytes NF4 / FP4 (bnb_fp4) as transformers saves ``Linear4bit`` (``weight``, ``weight.absmax``, ...)."""

    name = "bitsandbytes"
    quant_method = "bitsandbytes"

    def unsupported(self, m: QuantLinear) -> str | None:
        return (
            None
            if m.scheme.weight_format in ("nf4", "bnb_fp4")
            else f"bitsandbytes stores nf4 or bnb_fp4 here, not {m.scheme.weight_format}"
        )

    def export(self, m: QuantLinear) -> dict[str, torch.Tensor]:
        return to_bnb_state_dict(m.weight_qtensor, "weight")

    def config(self, mods, ignore, dtype) -> dict:
        double = any(m._meta.get("params", {}).get("double_quant", False) for m in mods.values())
        fmts = {m.scheme.weight_format for m in mods.values()}
        if len(fmts) > 1:
            # transformers' BitsAndBytesConfig has one bnb_4bit_quant_type for the whole model
            raise ValueError(f"a bitsandbytes checkpoint holds one 4-bit type; the modules mix {sorted(fmts)}")
        compute = DTYPE_NAMES.get(dtype, "float32") if dtype is not None else "float32"
        return {
            "_load_in_4bit": True,
            "_load_in_8bit": False,
            "bnb_4bit_compute_dtype": compute,
            "bnb_4bit_quant_storage": "uint8",
            "bnb_4bit_quant_type": "fp4" if fmts == {"bnb_fp4"} else "nf4",
            "bnb_4bit_use_double_quant": double,
            "llm_int8_enable_fp32_cpu_offload": False,
            "llm_int8_has_fp16_weight": False,
            "llm_int8_skip_modules": sorted(ignore) or None,
            "llm_int8_threshold": 6.0,
            "load_in_4bit": True,
            "load_in_8bit": False,
            "quant_method": "bitsandbytes",
        }

    def is_quantized(self, local: set[str]) -> bool:
        return any(k.startswith("weight.quant_state.bitsandbytes__") for k in local)

    def read(self, name, local, get, qc, dtype) -> Loaded:
        q = from_bnb_state_dict({k: get(k) for k in local}, "weight")
        if len(q.shape) != 2:
            raise ValueError(f"module {name!r}: bitsandbytes weight shape must be 2-D, got {list(q.shape)}")
        return Loaded(find_scheme(q.fmt, None, f"module {name!r}"), q)

    _WEIGHT_TENSORS = frozenset(("weight", "weight.absmax", "weight.nested_absmax"))

    def shard_replicated(self, local: set[str]) -> set[str]:
        # quant maps and the quant_state JSON
        return set(local) - self._WEIGHT_TENSORS

    def shard_axes(self, name, local, whole, qc) -> Mapping[str, Stored]:
        # the packed codes [N*K/2, 1] and absmax [N*K/blocksize] are the row-major flattening of the weight (K a
        # multiple of the blocksize); one nested absmax per 256 absmax blocks
        k, bs = whole.shape[1], whole.params["blocksize"]
        return {"weight": Stored(n=Axis(0, Fraction(2, k)), flat=True),
                "weight.absmax": Stored(n=Axis(0, Fraction(bs, k)), flat=True),
                "weight.nested_absmax": Stored(n=Axis(0, Fraction(bs * NESTED_BLOCKSIZE, k), cover=True), flat=True)}

    def shard_parts(self, name, local, get, shard, qc):
        # row shards only (a column range of the flattened weight is no slice): the quant_state says the shard's
        # shape; double quantization stays when the shard starts a nested block, as lowbit.formats.shards keeps it
        key = next(k for k in local if k.startswith("weight.quant_state."))
        blob = get(key)
        meta = json.loads(bytes(blob.cpu().tolist()).decode("utf-8"))
        meta["shape"] = list(shard.shape)
        first = shard.start * shard.whole.shape[1] // shard.whole.params["blocksize"]
        tensors: dict[str, torch.Tensor] = {}
        if "weight.nested_absmax" in local and first % NESTED_BLOCKSIZE:
            offset = torch.tensor(float(meta["nested_offset"]), dtype=torch.float32)
            tensors["weight.absmax"] = unnest_absmax(get("weight.absmax"), get("weight.nested_absmax"), offset, first)
            for f in ("nested_blocksize", "nested_dtype", "nested_offset"):
                del meta[f]
            local = set(local) - {"weight.nested_absmax", "weight.nested_quant_map"}
        tensors[key] = torch.tensor(list(json.dumps(meta).encode("utf-8")), dtype=torch.uint8, device=blob.device)
        return local, lambda k: tensors[k] if k in tensors else get(k), qc


# ---------------------------------------------------------------------------------------------- AutoAWQ / GPTQ


class AWQLayout(Layout):
    """AutoAWQ GEMM (``qweight``/``qzeros``/``scales``, ``quant_method: awq``, ``version: gemm``)."""

    name = "awq"
    quant_method = "awq"

    def unsupported(self, m: QuantLinear) -> str | None:
        return (
            None
            if m.scheme.weight_format == "int4_awq"
            else f"AutoAWQ stores int4, not {m.scheme.weight_format}"
        )

    def export(self, m: QuantLinear) -> dict[str, torch.Tensor]:
        return to_autoawq(m.weight_qtensor)

    def config(self, mods, ignore, dtype) -> dict:
        sizes = {m.group_size for m in mods.values()}
        if len(sizes) != 1:
            raise ValueError(f"AutoAWQ checkpoints have one group size; these layers use {sorted(sizes)}")
        return {
            "bits": 4,
            "group_size": sizes.pop(),
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


class GPTQLayout(Layout):
    """GPTQ v1 (AutoGPTQ / GPTQModel ``checkpoint_format: gptq``; ``gptq_v2`` stores raw zeros)."""

    name = "gptq"
    quant_method = "gptq"

    def unsupported(self, m: QuantLinear) -> str | None:
        if m.scheme.weight_format != "int4_awq":
            return f"GPTQ stores int4, not {m.scheme.weight_format}"
        return None

    def export(self, m: QuantLinear) -> dict[str, torch.Tensor]:
        return to_gptq(m.weight_qtensor)

    def config(self, mods, ignore, dtype) -> dict:
        sizes = {m.group_size for m in mods.values()}
        if len(sizes) != 1:
            raise ValueError(f"GPTQ checkpoints have one group size; these layers use {sorted(sizes)}")
        return {
            "bits": 4,
            "checkpoint_format": "gptq",
            "desc_act": False,
            "group_size": sizes.pop(),
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


# ---------------------------------------------------------------------------------------------- FP8 block (DeepSeek)


class FP8BlockLayout(Layout):
    """DeepSeek-V3 / HF fine-grained FP8: ``weight`` float8_e4m3fn + ``weight_scale_inv`` fp32 per 128x128."""

    name = "fp8"
    quant_method = "fp8"

    def unsupported(self, m: QuantLinear) -> str | None:
        if m.scheme.weight_format != "fp8_block":
            return f"the FP8 block layout stores fp8_block weights, not {m.scheme.weight_format}"
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
            scale = _exact_fp32(scale, f"module {name!r}: weight_scale_inv")
        fmt8 = "ue8m0" if scale_fmt == "ue8m0" else None
        q = from_deepseek_fp8(get("weight"), scale.contiguous(), dtype=dtype, scale_fmt=fmt8)
        return Loaded(find_scheme("fp8_block", "fp8_block", f"module {name!r}"), q)

    def shard_axes(self, name, local, whole, qc) -> Mapping[str, Stored]:
        # weight [N, K] float8, weight_scale_inv [N/128, K/128]
        bn, bk = whole.params["block"]
        return {"weight": Stored(n=Axis(0, 1), k=Axis(1, 1)),
                "weight_scale_inv": Stored(n=Axis(0, bn), k=Axis(1, bk))}


# ---------------------------------------------------------------------------------------------- ModelOpt NVFP4


class ModelOptLayout(Layout):
    """NVIDIA ModelOpt unified HF NVFP4 (``weight``, ``weight_scale``, ``weight_scale_2``, ``input_scale``)."""

    name = "modelopt"
    quant_method = "modelopt"

    def unsupported(self, m: QuantLinear) -> str | None:
        return (
            None
            if m.scheme.weight_format == "nvfp4"
            else f"ModelOpt NVFP4 stores nvfp4, not {m.scheme.weight_format}"
        )

    def export(self, m: QuantLinear) -> dict[str, torch.Tensor]:
        return to_modelopt_nvfp4(m.weight_qtensor, m.input_global_scale)

    def _quantization(self, ignore) -> dict:
        return {
            "exclude_modules": sorted(ignore),
            "group_size": 16,
            "kv_cache_quant_algo": None,
            "quant_algo": "NVFP4",
        }

    def config(self, mods, ignore, dtype) -> dict:
        return {"quant_method": "modelopt", **self._quantization(ignore)}

    def extra_files(self, mods, ignore) -> dict[str, dict]:
        return {
            "hf_quant_config.json": {
                "producer": {"name": "lowbit", "version": __version__},
                "quantization": self._quantization(ignore),
            }
        }

    def is_quantized(self, local: set[str]) -> bool:
        return "weight_scale_2" in local

    def read(self, name, local, get, qc, dtype) -> Loaded:
        algo = str(qc.get("quant_algo", "NVFP4")).upper()
        if algo != "NVFP4":
            raise ValueError(f"quantization_config.quant_algo {algo!r}: lowbit reads ModelOpt NVFP4 only")
        q = from_modelopt_nvfp4({k: get(k) for k in local if k != "input_scale"}, dtype=dtype)
        igs = None
        if "input_scale" in local:
            from ..formats.checks import positive_fp32_scalar

            igs = (1.0 / positive_fp32_scalar(get("input_scale"), f"{name}.input_scale")).reshape(1)
        # ModelOpt NVFP4 quantizes activations to NVFP4 (W4A4)
        return Loaded(find_scheme("nvfp4", "nvfp4", f"module {name!r}"), q, igs)

    def shard_replicated(self, local: set[str]) -> set[str]:
        return {"weight_scale_2", "input_scale"}

    def shard_axes(self, name, local, whole, qc) -> Mapping[str, Stored]:
        # weight [N, K/2] (two E2M1 codes per byte), weight_scale [N, K/16] linear
        return {"weight": Stored(n=Axis(0, 1), k=Axis(1, 2)), "weight_scale": Stored(n=Axis(0, 1), k=Axis(1, 16))}


# ---------------------------------------------------------------------------------------------- lowbit native


def params_to_json(params: Mapping[str, Any]) -> dict:
    out = {}
    for k, v in params.items():
        if isinstance(v, torch.Tensor):
            out[k] = {"__fp32__": float(v.float().reshape(()).item())} if v.numel() == 1 else None
            if out[k] is None:
                raise ValueError(
                    f"param {k!r}: only scalar tensors can be stored, got shape {tuple(v.shape)}"
                )
        elif isinstance(v, tuple):
            out[k] = list(v)
        else:
            out[k] = v
    return out


def params_from_json(params: Mapping[str, Any]) -> dict:
    out = {}
    for k, v in params.items():
        if isinstance(v, dict) and set(v) == {"__fp32__"}:
            if isinstance(v["__fp32__"], bool) or not isinstance(v["__fp32__"], (int, float)):
                raise ValueError(f"params[{k!r}]: an fp32 value must be a JSON number, got {v['__fp32__']!r}")
            out[k] = torch.tensor(float(v["__fp32__"]), dtype=torch.float32)
        elif isinstance(v, list):
            out[k] = tuple(v)
        else:
            out[k] = v
    return out


class LowbitLayout(Layout):
    """lowbit-native: the ``QuantLinear`` buffers as they are (``weight_data``, ``weight_scale``, ...), with
    each module's scheme, original dtype, scale layout and format options in ``quantization_config.modules``.
    Used for schemes no ecosystem format covers (``w4a16-fp4b32``), or on request (``format="lowbit"``)."""

    name = "lowbit"
    quant_method = "lowbit"

    def unsupported(self, m: QuantLinear) -> str | None:
        return None

    def export(self, m: QuantLinear) -> dict[str, torch.Tensor]:
        out = {
            f"weight_{f}": getattr(m, f"weight_{f}")
            for f in QTENSOR_FIELDS
            if getattr(m, f"weight_{f}") is not None
        }
        if m.input_global_scale is not None:
            out["input_global_scale"] = m.input_global_scale
        return out

    def config(self, mods, ignore, dtype) -> dict:
        modules = {}
        for name, m in mods.items():
            meta = m._meta
            modules[name] = {
                "scheme": m.scheme.name,
                "shape": [m.out_features, m.in_features],
                "dtype": DTYPE_NAMES.get(meta.get("dtype"), "float32"),
                "scale_layout": meta.get("scale_layout", "linear"),
                "params": params_to_json(meta.get("params", {})),
            }
        return {
            "format": "lowbit-native",
            "ignore": sorted(ignore),
            "lowbit_version": __version__,
            "modules": modules,
            "quant_method": "lowbit",
            "schemes": sorted({m.scheme.name for m in mods.values()}),
            "version": 1,
        }

    def is_quantized(self, local: set[str]) -> bool:
        return "weight_data" in local

    def read(self, name, local, get, qc, dtype) -> Loaded:
        modules = qc.get("modules")
        if not isinstance(modules, dict) or name not in modules:
            raise ValueError(f"quantization_config.modules has no entry for quantized module {name!r}")
        meta = modules[name]
        scheme = SCHEMES.get(meta.get("scheme"))
        if scheme is None:
            raise ValueError(
                f"quantization_config.modules[{name!r}].scheme {meta.get('scheme')!r} is unknown"
            )
        if meta.get("dtype") not in NAME_DTYPES:
            raise ValueError(f"quantization_config.modules[{name!r}].dtype {meta.get('dtype')!r} is unknown")
        tensors = {f: get(f"weight_{f}") for f in QTENSOR_FIELDS if f"weight_{f}" in local}
        if "data" not in tensors or "scale" not in tensors:
            raise ValueError(f"module {name!r}: lowbit-native checkpoints need weight_data and weight_scale")
        igs = get("input_global_scale").float().reshape(1) if "input_global_scale" in local else None
        shape = meta.get("shape")
        if not (isinstance(shape, list) and len(shape) == 2 and all(isinstance(d, int) for d in shape)):
            raise ValueError(f"quantization_config.modules[{name!r}].shape must be [out, in], got {shape!r}")
        if not isinstance(meta.get("params", {}), dict):
            raise ValueError(
                f"quantization_config.modules[{name!r}].params must be an object of format options, "
                f"got {type(meta['params']).__name__}"
            )
        q = QTensor(
            fmt=scheme.weight_format,
            shape=torch.Size(shape),
            dtype=NAME_DTYPES[meta["dtype"]],
            scale_layout=meta.get("scale_layout", "linear"),
            params=params_from_json(meta.get("params", {})),
            **tensors,
        )
        return Loaded(scheme, q, igs)

    def shard_replicated(self, local: set[str]) -> set[str]:
        return {"weight_global_scale", "weight_nested_offset", "input_global_scale"}

    def shard_axes(self, name, local, whole, qc) -> Mapping[str, Stored] | None:
        # the QuantLinear buffers, as each format lays out its QTensor
        fmt = whole.fmt
        if FORMATS[fmt].kind == "blockscaled":
            # codes [N, K*bits/8]; scales [N, K/block], linear or 128x4-swizzled
            swizzled = whole.scale_layout == "swizzled"
            return {"weight_data": Stored(n=Axis(0, 1), k=Axis(1, codes_per_entry(fmt))),
                    "weight_scale": Stored(n=Axis(0, 1), k=Axis(1, FORMATS[fmt].block), swizzled=swizzled)}
        if fmt in BNB_4BIT_FORMATS:
            # bitsandbytes' flattened codes [N*K/2] and absmax [N*K/blocksize]; one nested absmax per 256 blocks
            k, bs = whole.shape[1], whole.params["blocksize"]
            return {"weight_data": Stored(n=Axis(0, Fraction(2, k)), flat=True),
                    "weight_scale": Stored(n=Axis(0, Fraction(bs, k)), flat=True),
                    "weight_nested_scale": Stored(n=Axis(0, Fraction(bs * NESTED_BLOCKSIZE, k), cover=True), flat=True)}
        if fmt == "int4_awq":
            # AutoAWQ's layout: codes [K, N/8], zeros [K/g, N/8], scales [K/g, N]
            g = whole.params["group_size"]
            return {"weight_data": Stored(n=Axis(1, 8), k=Axis(0, 1)),
                    "weight_zeros": Stored(n=Axis(1, 8), k=Axis(0, g)),
                    "weight_scale": Stored(n=Axis(1, 1), k=Axis(0, g))}
        if fmt == "fp8_block" and whole.scale_layout == "linear":
            bn, bk = whole.params["block"]
            return {"weight_data": Stored(n=Axis(0, 1), k=Axis(1, 1)),
                    "weight_scale": Stored(n=Axis(0, bn), k=Axis(1, bk))}
        return None

    def shard_parts(self, name, local, get, shard, qc):
        # quantization_config.modules[name] describes the whole weight: the shard's shape; nf4 double quantization
        # stays when a row shard starts a nested block, as lowbit.formats.shards keeps it
        meta = dict(qc["modules"][name], shape=list(shard.shape))
        qc = {**qc, "modules": {**qc["modules"], name: meta}}
        whole = shard.whole
        if whole.fmt in BNB_4BIT_FORMATS and "weight_nested_scale" in local:
            first = shard.start * whole.shape[1] // whole.params["blocksize"]
            if first % NESTED_BLOCKSIZE:
                absmax = unnest_absmax(get("weight_scale"), get("weight_nested_scale"), get("weight_nested_offset"),
                                       first)
                meta["params"] = {**meta.get("params", {}), "double_quant": False}
                local = set(local) - {"weight_nested_scale", "weight_nested_offset"}
                return local, lambda k: absmax if k == "weight_scale" else get(k), qc
        return local, get, qc


# ---------------------------------------------------------------------------------------------- LightX2V


class LightX2VLayout(Layout):
    """LightX2V's keys (``weight`` packed, swizzled ``weight_scale``, NVFP4 ``weight_global_scale`` /
    ``input_global_scale`` / ``alpha``; :mod:`lowbit.io.lightx2v`), one quantized type per checkpoint."""

    name = "lightx2v"
    quant_method = "lightx2v"

    def unsupported(self, m: QuantLinear) -> str | None:
        return _lx.unsupported(m.scheme, m._meta.get("params"))

    def export(self, m: QuantLinear) -> dict[str, torch.Tensor]:
        igs = m.input_global_scale if m.scheme.weight_format == "nvfp4" else None
        return _lx.to_lightx2v(m.weight_qtensor, igs)

    def config(self, mods, ignore, dtype) -> dict:
        kinds = {_lx.quant_scheme_of(m.scheme) for m in mods.values()}
        if len(kinds) != 1:
            # LightX2V builds every quantized layer of a model from one dit_quant_scheme
            raise ValueError(f"a LightX2V checkpoint holds one quantized type; the modules mix {sorted(kinds)}")
        return _lx.lightx2v_config(kinds.pop(), ignore)

    def is_quantized(self, local: set[str]) -> bool:
        return "weight" in local and "weight_scale" in local

    def read(self, name, local, get, qc, dtype) -> Loaded:
        kind = qc.get("quant_scheme")
        if kind not in _lx.LIGHTX2V_SCHEMES:
            raise ValueError(
                f"quantization_config.quant_scheme must be one of {_lx.QUANT_SCHEMES}, got {kind!r}"
            )
        q, igs = _lx.from_lightx2v({k: get(k) for k in local}, kind, dtype=dtype, where=f"module {name!r}")
        return Loaded(_lx.LIGHTX2V_SCHEMES[kind], q, igs)

    def shard_replicated(self, local: set[str]) -> set[str]:
        return {"weight_global_scale", "input_global_scale", "alpha", "input_absmax"}

    def shard_axes(self, name, local, whole, qc) -> Mapping[str, Stored]:
        # codes [N, K*bits/8] as bytes, scales 128x4-swizzled [round_up(N, 128), round_up(K/block, 4)]
        fmt = whole.fmt
        return {"weight": Stored(n=Axis(0, 1), k=Axis(1, codes_per_entry(fmt))),
                "weight_scale": Stored(n=Axis(0, 1), k=Axis(1, FORMATS[fmt].block), swizzled=True)}


LAYOUTS: dict[str, Layout] = {
    lay.name: lay
    for lay in (
        CompressedTensorsLayout(), BitsAndBytesLayout(), AWQLayout(), GPTQLayout(), FP8BlockLayout(), ModelOptLayout(),
        LowbitLayout(), LightX2VLayout(),
    )
}  # fmt: skip
FORMAT_ALIASES = {"ct": "compressed-tensors", "llm-compressor": "compressed-tensors", "bnb": "bitsandbytes",
                  "deepseek": "fp8", "native": "lowbit", "autoawq": "awq"}  # fmt: skip


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
