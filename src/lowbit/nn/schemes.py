"""Quantization schemes: which weight format, which activation format, and the shape rules of each.

A scheme is data (:class:`Scheme`); :data:`SCHEMES` is the one registry every part of lowbit reads
(``QuantLinear``, ``quantize_model``, checkpoints, the CLI). Nothing else branches on scheme names.

=================  ===========  ==========================================  =================  ===============
scheme             weight       weight options                              activations        shape rule
=================  ===========  ==========================================  =================  ===============
w4a16-nvfp4        nvfp4        convention vllm, shared fused global scale  bf16/fp16          K % 16
w4a16-mxfp4        mxfp4        RCEIL scales                                bf16/fp16          K % 32
w4a16-nf4          nf4          blocksize 64, no double quant               bf16/fp16          any
w4a16-bnb-fp4      bnb_fp4      blocksize 64, no double quant               bf16/fp16          any
w4a16-int4         int4_awq     group 128, else 64 or 32 (largest dividing  bf16/fp16          K % 32, N % 8
                                K), AutoAWQ zero-point
w4a16-fp4b32       fp4_b32      fp32 amax/6 scale per 32                    bf16/fp16          K % 32
w8a8-fp8-block     fp8_block    128x128 blocks                              fp8_block 1x128    any
w4a4-nvfp4         nvfp4        as w4a16-nvfp4                              nvfp4 (global      K % 16
                                                                            scale static when
                                                                            calibrated)
w4a4-mxfp4         mxfp4        RCEIL                                       mxfp4 (dynamic)    K % 32
w4a8-mxfp4         mxfp4        RCEIL                                       fp8_block 1x128    K % 32
w8a8-mxfp8         mxfp8_e4m3   RCEIL                                       mxfp8_e4m3         K % 32
=================  ===========  ==========================================  =================  ===============
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any


@dataclass(frozen=True)
class Scheme:
    """One quantization scheme for ``nn.Linear`` layers.

    Attributes:
        name: registry key (``"w4a16-nvfp4"``).
        weight_format: lowbit format of the weight (a key of ``lowbit.FORMATS``).
        weight_options: options passed to ``lowbit.quantize`` for the weight.
        act_format: lowbit format the activations are quantized to before the GEMM (``lowbit.ops.scaled_linear``),
            or None for weight-only schemes (``lowbit.linear``).
        act_options: options passed when quantizing activations.
        k_multiple: in_features must be a multiple of this.
        n_multiple: out_features must be a multiple of this.
        group_sizes: int4 only: the group sizes to try, largest first (the first that divides K is used).
        shared_global_scale: nvfp4 weights: fused siblings (q/k/v, gate/up) share one global scale.
        static_act_scale: nvfp4 activations: calibration gives a static activation global scale.
        checkpoint: the checkpoint layout ``save_quantized(format="auto")`` writes.
        ct_preset: the compressed-tensors preset with the same meaning (None if CT has none).
        description: one line for ``extra_repr`` and reports.
    """

    name: str
    weight_format: str
    weight_options: Mapping[str, Any] = field(default_factory=dict)
    act_format: str | None = None
    act_options: Mapping[str, Any] = field(default_factory=dict)
    k_multiple: int = 1
    n_multiple: int = 1
    group_sizes: tuple[int, ...] = ()
    shared_global_scale: bool = False
    static_act_scale: bool = False
    checkpoint: str = "lowbit"
    ct_preset: str | None = None
    description: str = ""

    def __post_init__(self) -> None:
        object.__setattr__(self, "weight_options", MappingProxyType(dict(self.weight_options)))
        object.__setattr__(self, "act_options", MappingProxyType(dict(self.act_options)))

    def __copy__(self) -> Scheme:
        return self  # immutable

    def __deepcopy__(self, memo: dict) -> Scheme:
        return self

    def __reduce__(self):
        fields = {f: getattr(self, f) for f in self.__dataclass_fields__}
        fields["weight_options"] = dict(self.weight_options)
        fields["act_options"] = dict(self.act_options)
        return (_rebuild, (fields,))

    @property
    def weight_only(self) -> bool:
        return self.act_format is None

    def group_size(self, in_features: int) -> int | None:
        """int4: the group size used for a layer with ``in_features`` inputs (None: no size fits)."""
        for g in self.group_sizes:
            if in_features % g == 0:
                return g
        return None

    def unsupported(self, out_features: int, in_features: int) -> str | None:
        """Why a ``[out_features, in_features]`` weight cannot take this scheme, or None if it can."""
        if out_features <= 0 or in_features <= 0:
            return "empty weight"
        if in_features % self.k_multiple:
            return f"in_features={in_features} is not a multiple of {self.k_multiple}"
        if out_features % self.n_multiple:
            return f"out_features={out_features} is not a multiple of {self.n_multiple}"
        if self.group_sizes and self.group_size(in_features) is None:
            return (
                f"in_features={in_features} is divisible by none of the group sizes {list(self.group_sizes)}"
            )
        return None

    def weight_quantize_options(self, in_features: int) -> dict[str, Any]:
        """The ``lowbit.quantize`` options for a weight with ``in_features`` inputs."""
        opts = dict(self.weight_options)
        if self.group_sizes:
            opts["group_size"] = self.group_size(in_features)
        return opts

    def __str__(self) -> str:
        return self.name


def _rebuild(fields: dict) -> Scheme:
    scheme = Scheme(**fields)
    return SCHEMES.get(scheme.name, scheme) if SCHEMES.get(scheme.name) == scheme else scheme


_RCEIL = {"scale_rounding": "rceil"}
_FP8_ACT = {"block": (1, 128)}

_ALL = (
    Scheme(
        "w4a16-nvfp4",
        "nvfp4",
        {"convention": "vllm"},
        k_multiple=16,
        shared_global_scale=True,
        checkpoint="compressed-tensors",
        ct_preset="NVFP4A16",
        description="NVFP4 weights (E2M1, 16-blocks, E4M3 scales, fp32 global scale), 16-bit activations",
    ),
    Scheme(
        "w4a16-mxfp4",
        "mxfp4",
        _RCEIL,
        k_multiple=32,
        checkpoint="compressed-tensors",
        ct_preset="MXFP4A16",
        description="MXFP4 weights (E2M1, 32-blocks, E8M0 scales), 16-bit activations",
    ),
    Scheme(
        "w4a16-nf4",
        "nf4",
        {"blocksize": 64, "double_quant": False},
        checkpoint="bitsandbytes",
        description="bitsandbytes NF4 weights (64-blocks over the flattened weight), 16-bit activations",
    ),
    Scheme(
        "w4a16-bnb-fp4",
        "bnb_fp4",
        {"blocksize": 64, "double_quant": False},
        checkpoint="bitsandbytes",
        description="bitsandbytes FP4 weights (quant_type fp4, not E2M1; 64-blocks over the flattened weight), "
        "16-bit activations",
    ),
    Scheme(
        "w4a16-int4",
        "int4_awq",
        {},
        k_multiple=32,
        n_multiple=8,
        group_sizes=(128, 64, 32),
        checkpoint="compressed-tensors",
        ct_preset="W4A16_ASYM",
        description="INT4 asymmetric weights, AutoAWQ layout, group 128 (64/32 where K needs), 16-bit activations",
    ),
    Scheme(
        "w4a16-fp4b32",
        "fp4_b32",
        {},
        k_multiple=32,
        checkpoint="lowbit",
        description="FP4 E2M1 weights with an fp32 amax/6 scale per 32 (the nvfp4_packed plugin's format), "
        "16-bit activations",
    ),
    Scheme(
        "w8a8-fp8-block",
        "fp8_block",
        {"block": (128, 128)},
        act_format="fp8_block",
        act_options=_FP8_ACT,
        checkpoint="fp8",
        ct_preset="FP8_BLOCK",
        description="FP8 E4M3 weights in 128x128 blocks, FP8 activations in 1x128 blocks (DeepSeek-V3)",
    ),
    Scheme(
        "w4a4-nvfp4",
        "nvfp4",
        {"convention": "vllm"},
        act_format="nvfp4",
        k_multiple=16,
        shared_global_scale=True,
        static_act_scale=True,
        checkpoint="compressed-tensors",
        ct_preset="NVFP4",
        description="NVFP4 weights and NVFP4 activations (static global scale when calibrated)",
    ),
    Scheme(
        "w4a4-mxfp4",
        "mxfp4",
        _RCEIL,
        act_format="mxfp4",
        act_options=_RCEIL,
        k_multiple=32,
        checkpoint="compressed-tensors",
        ct_preset="MXFP4",
        description="MXFP4 weights and dynamic MXFP4 activations",
    ),
    Scheme(
        "w4a8-mxfp4",
        "mxfp4",
        _RCEIL,
        act_format="fp8_block",
        act_options=_FP8_ACT,
        k_multiple=32,
        checkpoint="compressed-tensors",
        ct_preset="MXFP4XFP8",
        description="MXFP4 weights, dynamic FP8 E4M3 activations in 1x128 blocks",
    ),
    Scheme(
        "w8a8-mxfp8",
        "mxfp8_e4m3",
        _RCEIL,
        act_format="mxfp8_e4m3",
        act_options=_RCEIL,
        k_multiple=32,
        checkpoint="compressed-tensors",
        ct_preset="MXFP8",
        description="MXFP8 E4M3 weights and dynamic MXFP8 E4M3 activations",
    ),
)

SCHEMES: Mapping[str, Scheme] = MappingProxyType({s.name: s for s in _ALL})
"""Every scheme by name (read-only)."""


def get_scheme(scheme: str | Scheme) -> Scheme:
    """The :class:`Scheme` for a name (or the scheme itself); ValueError listing the known names otherwise."""
    if isinstance(scheme, Scheme):
        return scheme
    if not isinstance(scheme, str):
        raise TypeError(f"scheme must be a scheme name or a lowbit.nn.Scheme, got {type(scheme).__name__}")
    try:
        return SCHEMES[scheme]
    except KeyError:
        raise ValueError(f"unknown scheme {scheme!r}; known schemes: {', '.join(SCHEMES)}") from None


__all__ = ["SCHEMES", "Scheme", "get_scheme"]
