"""The NVIDIA ModelOpt unified HF NVFP4 layout (and its ``hf_quant_config.json``)."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from ... import __version__
from ...nn.modules import QuantLinear
from ..modelopt import from_modelopt_nvfp4, to_modelopt_nvfp4
from ..sharded import Axis, Stored
from .base import Layout, Loaded, find_scheme


class ModelOptLayout(Layout):
    """NVIDIA ModelOpt unified HF NVFP4 (``weight``, ``weight_scale``, ``weight_scale_2``, ``input_scale``)."""

    name = "modelopt"
    quant_method = "modelopt"
    weight_formats = ("nvfp4",)
    stores = "ModelOpt NVFP4 stores nvfp4"

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
            from ...formats.checks import positive_fp32_scalar

            igs = (1.0 / positive_fp32_scalar(get("input_scale"), f"{name}.input_scale")).reshape(1)
        # ModelOpt NVFP4 quantizes activations to NVFP4 (W4A4)
        return Loaded(find_scheme("nvfp4", "nvfp4", f"module {name!r}"), q, igs)

    def shard_replicated(self, local: set[str]) -> set[str]:
        return {"weight_scale_2", "input_scale"}

    def shard_axes(self, name, local, whole, qc) -> Mapping[str, Stored]:
        # weight [N, K/2] (two E2M1 codes per byte), weight_scale [N, K/16] linear
        return {"weight": Stored(n=Axis(0, 1), k=Axis(1, 2)), "weight_scale": Stored(n=Axis(0, 1), k=Axis(1, 16))}
