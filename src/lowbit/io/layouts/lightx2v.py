"""The LightX2V layout (:mod:`lowbit.io.lightx2v` holds its tensor converters and ``quantization_config``)."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from ...formats.spec import FORMATS
from ...nn.modules import QuantLinear
from .. import lightx2v as _lx
from ..sharded import Axis, Stored
from .base import Layout, Loaded, codes_per_entry


class LightX2VLayout(Layout):
    """LightX2V's keys (``weight`` packed, swizzled ``weight_scale``, NVFP4 ``weight_global_scale`` /
    ``input_global_scale`` / ``alpha``; :mod:`lowbit.io.lightx2v`), one quantized type per checkpoint."""

    name = "lightx2v"
    quant_method = "lightx2v"
    weight_formats = _lx.WEIGHT_FORMATS
    stores = "LightX2V stores " + ", ".join(_lx.WEIGHT_FORMATS)

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
