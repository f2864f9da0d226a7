"""QTensor: a quantized tensor as plain data (packed payload, scales, and what is needed to decode them)."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import torch

from .spec import FORMATS, FormatSpec


@dataclass(frozen=True, eq=False)
class QTensor:
    """A quantized tensor.

    Attributes:
        data: packed payload, dtype as the producers store it (uint8 for FP4/FP6/NF4, float8 for
            MXFP8/fp8_block, int32 ``qweight`` for int4_awq).
        scale: block scales; linear layout ``[..., K/block]`` unless ``scale_layout == "swizzled"``
            (then 2-D ``[round_up(rows,128), round_up(K/block,4)]``). For nf4 with double quantization
            these are the uint8 codes of the absmax.
        fmt: format name (a key of ``lowbit.formats.FORMATS``).
        shape: logical (unquantized) shape.
        dtype: dtype of the tensor that was quantized.
        global_scale: fp32 per-tensor multiplier (dequant = value * block scale / global_scale), or None.
        zeros: packed zero points (int4_awq ``qzeros``), or None.
        scale_layout: ``"linear"`` or ``"swizzled"``.
        params: the format options this tensor was made with (convention, rounding, block, ...).
        nested_scale: nf4 double quantization: fp32 absmax of each 256-block of absmax values.
        nested_offset: nf4 double quantization: fp32 scalar mean subtracted from absmax before coding.
    """

    data: torch.Tensor
    scale: torch.Tensor
    fmt: str
    shape: torch.Size
    dtype: torch.dtype = torch.float32
    global_scale: torch.Tensor | None = None
    zeros: torch.Tensor | None = None
    scale_layout: str = "linear"
    params: dict[str, Any] = field(default_factory=dict)
    nested_scale: torch.Tensor | None = None
    nested_offset: torch.Tensor | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "shape", torch.Size(self.shape))

    @property
    def spec(self) -> FormatSpec:
        return FORMATS[self.fmt]

    @property
    def device(self) -> torch.device:
        return self.data.device

    def tensors(self) -> dict[str, torch.Tensor]:
        """Every tensor this QTensor holds, by attribute name (None entries left out)."""
        names = ("data", "scale", "global_scale", "zeros", "nested_scale", "nested_offset")
        return {n: getattr(self, n) for n in names if getattr(self, n) is not None}

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors().values())

    def to(self, device: torch.device | str) -> QTensor:
        return replace(self, **{n: t.to(device) for n, t in self.tensors().items()})

    def __repr__(self) -> str:
        extra = f", global_scale={self.global_scale.item():.6g}" if self.global_scale is not None else ""
        opts = ", ".join(f"{k}={v}" for k, v in self.params.items())
        return (
            f"QTensor(fmt={self.fmt}, shape={tuple(self.shape)}, dtype={self.dtype}, "
            f"data={self.data.dtype}{tuple(self.data.shape)}, scale={self.scale.dtype}{tuple(self.scale.shape)}"
            f"{extra}, scale_layout={self.scale_layout}{', ' + opts if opts else ''})"
        )
