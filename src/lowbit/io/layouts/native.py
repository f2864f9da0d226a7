"""lowbit's native layout: the ``QuantLinear`` buffers as they are, each module's scheme and format options
in ``quantization_config.modules`` (format options as JSON: :func:`params_to_json` / :func:`params_from_json`)."""

from __future__ import annotations

from collections.abc import Mapping
from fractions import Fraction
from typing import Any

import torch

from ... import __version__
from ...formats.nf4 import BNB_4BIT_FORMATS, NESTED_BLOCKSIZE
from ...formats.qtensor import QTensor
from ...formats.spec import FORMATS
from ...nn.modules import QTENSOR_FIELDS, QuantLinear
from ...nn.schemes import SCHEMES
from ..sharded import Axis, Stored, unnest_absmax
from .base import DTYPE_NAMES, NAME_DTYPES, Layout, Loaded, codes_per_entry


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


def _input_transform(name: str, meta: Mapping[str, Any], local: set[str], get, k: int):
    """The online InputTransform ``quantization_config.modules[name].input_transform`` describes, or None."""
    spec = meta.get("input_transform")
    if spec is None:
        return None
    where = f"quantization_config.modules[{name!r}].input_transform"
    if not isinstance(spec, dict) or set(spec) != {"scale", "hadamard_block"} or not isinstance(spec["scale"], bool):
        raise ValueError(f"{where} must be {{'scale': bool, 'hadamard_block': int or null}}, got {spec!r}")
    block = spec["hadamard_block"]
    if block is not None and (isinstance(block, bool) or not isinstance(block, int)):
        raise ValueError(f"{where}.hadamard_block must be an int or null, got {block!r}")
    if not spec["scale"] and block is None:
        raise ValueError(f"{where} holds neither a scale nor a rotation")
    scale = None
    if spec["scale"]:
        if "input_transform.scale" not in local:
            raise ValueError(f"module {name!r}: {where} has a scale but the checkpoint has no "
                             f"{name}.input_transform.scale tensor")
        scale = get("input_transform.scale")
        if not scale.is_floating_point():
            raise ValueError(f"module {name!r}: input_transform.scale must be floating point, got {scale.dtype}")
    from ...algorithms.rotation import InputTransform

    try:
        return InputTransform(k, scale, block)
    except ValueError as e:
        raise ValueError(f"module {name!r}: {where}: {e}") from None


class LowbitLayout(Layout):
    """lowbit-native: the ``QuantLinear`` buffers as they are (``weight_data``, ``weight_scale``, ...), with
    each module's scheme, original dtype, scale layout and format options in ``quantization_config.modules``.
    Used for schemes no ecosystem format covers (``w4a16-fp4b32``), or on request (``format="lowbit"``)."""

    name = "lowbit"
    quant_method = "lowbit"
    stores = "lowbit-native stores every registered format"

    @property
    def weight_formats(self) -> tuple[str, ...]:  # a format registered later is stored too
        return tuple(FORMATS)

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
        from ...algorithms.rotation import input_transform_of

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
            t = input_transform_of(m)
            if t is not None:
                # the scale vector is the tensor <name>.input_transform.scale of the state dict
                modules[name]["input_transform"] = {"scale": t.scale is not None, "hadamard_block": t.block}
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
        return Loaded(scheme, q, igs, _input_transform(name, meta, local, get, shape[1]))

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
