"""The bitsandbytes layout: NF4 / FP4 ``Linear4bit`` state as transformers saves it."""

from __future__ import annotations

import json
from collections.abc import Mapping
from fractions import Fraction

import torch

from ...formats.nf4 import NESTED_BLOCKSIZE
from ...nn.modules import QuantLinear
from ..bnb import from_bnb_state_dict, to_bnb_state_dict
from ..sharded import Axis, Stored, unnest_absmax
from .base import DTYPE_NAMES, Layout, Loaded, find_scheme


class BitsAndBytesLayout(Layout):
    """bitsandbytes NF4 / FP4 (bnb_fp4) as transformers saves ``Linear4bit`` (``weight``, ``weight.absmax``, ...)."""

    name = "bitsandbytes"
    quant_method = "bitsandbytes"
    weight_formats = ("nf4", "bnb_fp4")
    stores = "bitsandbytes stores nf4 or bnb_fp4 here"

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
