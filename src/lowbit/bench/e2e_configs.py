"""The configurations the end-to-end benchmark compares, applied to a model as a user would apply them:
``bf16``, ``lowbit:<scheme>`` (``+fused``: sibling projections fused; ``+gated``: and the gated MLP run as
one GEMV with the activation and product in its epilogue), ``torchao:int4``,
``torchao:fp8-rowwise`` and ``bnb:nf4`` (the peers where installed), and the weight bytes each leaves (:func:`weight_bytes`)."""

from __future__ import annotations

from torch import nn

from .common import fuse_or_fail, lowbit_config, weight_bytes

LOWBIT_SCHEMES = ("w4a16-nvfp4", "w4a16-int4", "w4a16-nf4", "w8a8-fp8-block", "w4a8-mxfp4", "w4a4-nvfp4")



PEERS = ("torchao:int4", "torchao:fp8-rowwise", "bnb:nf4")



FUSED_DEFAULTS = ("lowbit:w4a16-nvfp4+fused", "lowbit:w4a16-int4+fused")
"""Configs with sibling projections fused (``lowbit.nn.fuse_projections``), as serving engines run them."""

DEFAULT_CONFIGS = ("bf16", *(f"lowbit:{s}" for s in LOWBIT_SCHEMES), *FUSED_DEFAULTS, *PEERS)



def _linear_filter(module: nn.Module, fqn: str) -> bool:
    return isinstance(module, nn.Linear) and not fqn.endswith("lm_head")



def apply_config(model: nn.Module, config: str) -> nn.Module:
    """Quantize ``model`` in place as ``config`` says: ``bf16``, ``lowbit:<scheme>`` (``lowbit:<scheme>+fused``:
    then q/k/v and gate/up fused, ``lowbit.nn.fuse_projections``; ``+gated``: the same with ``gated_mlp=True``),
    ``torchao:int4``, ``torchao:fp8-rowwise`` or
    ``bnb:nf4`` (ImportError where the peer is not installed)."""
    if config == "bf16":
        return model
    kind, _, name = config.partition(":")
    if kind == "lowbit":
        import lowbit

        scheme, fused = lowbit_config(config, ("fused", "gated"),
                                      "lowbit:<scheme>, lowbit:<scheme>+fused, lowbit:<scheme>+gated")
        model = lowbit.quantize_model(model, scheme)
        if fused:
            fuse_or_fail(model, config, gated_mlp=fused == "gated")
        return model
    if kind == "torchao":
        from torchao.quantization import quantize_

        if name == "int4":
            from torchao.quantization import Int4WeightOnlyConfig

            cfg = Int4WeightOnlyConfig(group_size=128, int4_packing_format="tile_packed_to_4d")
        elif name == "fp8-rowwise":
            from torchao.quantization import Float8DynamicActivationFloat8WeightConfig, PerRow

            cfg = Float8DynamicActivationFloat8WeightConfig(granularity=PerRow())
        else:
            raise ValueError(f"unknown torchao config {name!r}")
        quantize_(model, cfg, filter_fn=_linear_filter)
        return model
    if kind == "bnb" and name == "nf4":
        import bitsandbytes as bnb

        for parent in list(model.modules()):
            for cname, child in list(parent.named_children()):
                if isinstance(child, nn.Linear) and cname != "lm_head":
                    dev = child.weight.device
                    new = bnb.nn.Linear4bit(child.in_features, child.out_features, bias=child.bias is not None,
                                            compute_dtype=child.weight.dtype, quant_type="nf4",
                                            compress_statistics=False)
                    # quantized where the weight already is (.to(dev) quantizes): no round trip through the host
                    new.weight = bnb.nn.Params4bit(child.weight.data, requires_grad=False, quant_type="nf4",
                                                   compress_statistics=False)
                    setattr(parent, cname, new.to(dev))
        return model
    raise ValueError(f"unknown config {config!r}; known: {', '.join(DEFAULT_CONFIGS)}")



__all__ = ["DEFAULT_CONFIGS", "FUSED_DEFAULTS", "LOWBIT_SCHEMES", "PEERS", "apply_config", "weight_bytes"]
