"""The opt-in FP8 compute mode of ``w4a4-nvfp4`` layers (``lowbit.nn.set_compute(model, "fp8_block")``).

Hopper has no FP4 tensor cores, so the exact W4A4 product runs on bf16 ones (both operands decoded exactly) at
0.6-0.8x bf16 in a Wan2.1-sized DiT block. In this mode a layer from ``policy.FP8_COMPUTE_MIN_M`` rows on
computes ``act(fp8_block(x) @ fp8_block(dequant(W)).T + bias)`` on the FP8 tensor cores (the ``w8a8-fp8-block``
pipeline: cuBLASLt's block-scaled GEMM where it runs):

- the weight: its NVFP4 value (E2M1 x E4M3 / global scale, in fp32) re-encoded as fp8_block with 128x128 blocks
  (:func:`reencode_fp8_block`, the fp8_block quantizer applied to the exact decoding); by default on every
  call, a memory-bound pass small against the GEMM at these M, so the layer keeps only its 4-bit weight;
  ``keep_weight=True`` keeps the FP8 copy instead (8 bits a weight more, no per-call pass);
- the activation: quantized from x to fp8_block 1x128 (E4M3, one fp32 scale per 128), not to NVFP4.

What changes against the exact path: the weight's re-encoding rounds (an NVFP4 value has up to 6 significant
bits, E4M3 holds 4), and the activation is rounded to E4M3 in 128-blocks instead of E2M1 in 16-blocks, which
is finer. ``docs/quality.md`` gives the measured error against the exact path and against bf16. Below
``FP8_COMPUTE_MIN_M`` rows (decode) the exact path runs: its kernels are faster there.
"""

from __future__ import annotations

from typing import Any

import torch

from ..formats.qtensor import QTensor
from . import policy
from .linear import apply_activation

COMPUTE_MODES = ("exact", "fp8_block")
"""``QuantLinear.compute`` values: ``"exact"`` (the scheme's own product) and ``"fp8_block"`` (this module)."""

# the options of the w8a8-fp8-block scheme (lowbit.nn.schemes sits above ops; a test keeps the two equal)
WEIGHT_BLOCK = (128, 128)
ACT_OPTIONS = {"block": (1, 128)}


def fp8_compute_unsupported(scheme: Any) -> str | None:
    """None when layers of ``scheme`` (a ``lowbit.nn.Scheme``) can take the FP8 compute mode, else why not."""
    if scheme.weight_format != "nvfp4" or scheme.act_format != "nvfp4":
        return f"the FP8 compute mode is for w4a4-nvfp4 layers (nvfp4 weights and activations), not {scheme.name}"
    return None


def reencode_fp8_block(w: QTensor, backend: str | None = None) -> QTensor:
    """``w`` (nvfp4 ``[N, K]``) re-encoded as fp8_block with 128x128 blocks: its exact fp32 decoding quantized by
    the fp8_block quantizer (the reference of this operation on every device; the GPU kernels of both steps are
    bit-identical to their references)."""
    from ..api import dequantize, quantize

    if w.fmt != "nvfp4" or len(w.shape) != 2:
        raise ValueError(f"w must be a 2-D nvfp4 QTensor, got {w.fmt} of shape {tuple(w.shape)}")
    return quantize(dequantize(w, torch.float32, backend=backend), "fp8_block", block=WEIGHT_BLOCK, backend=backend)


class Fp8BlockCompute:
    """A prepared ``w4a4-nvfp4`` layer in the FP8 compute mode (module docstring): calls with at least
    ``policy.FP8_COMPUTE_MIN_M`` rows run the fp8_block product, the others the exact prepared weight ``exact``
    (a ``lowbit.ops.prepared.PreparedWeight``), whose attributes the layer checks (activation, backend, stale)."""

    def __init__(self, exact: Any, keep_weight: bool = False) -> None:
        self.exact = exact
        self.w = exact.w
        self.n, self.k = exact.n, exact.k
        self.activation = exact.activation
        self.backend = exact.backend
        self.versions = exact.versions
        self.keep_weight = bool(keep_weight)
        self._w8: QTensor | None = None

    def stale(self) -> bool:
        return self.exact.stale()

    def weight_fp8(self) -> QTensor:
        """The weight as fp8_block (kept when ``keep_weight``, else encoded for this call)."""
        if self._w8 is not None:
            return self._w8
        w8 = reencode_fp8_block(self.w, self.backend)
        if self.keep_weight:
            self._w8 = w8
        return w8

    def _fp8(self, x: torch.Tensor) -> bool:
        return x.shape[-1] == self.k and x.dtype in (torch.bfloat16, torch.float16) and (
            x.numel() // self.k >= policy.FP8_COMPUTE_MIN_M)

    def _fp8_call(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        from .scaled_mm import scaled_linear

        y = scaled_linear(x, self.weight_fp8(), "fp8_block", act_options=ACT_OPTIONS, bias=bias, out_dtype=x.dtype,
                          backend=self.backend)
        return apply_activation(y, self.activation)

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None,
                 act_global_scale: torch.Tensor | None = None) -> torch.Tensor:
        if self._fp8(x):
            return self._fp8_call(x, bias)
        return self.exact(x, bias, act_global_scale)

    def traced_call(self, x: torch.Tensor, bias: torch.Tensor | None,
                    act_global_scale: torch.Tensor | None = None) -> torch.Tensor:
        if self._fp8(x):
            return self._fp8_call(x, bias)
        return self.exact.traced_call(x, bias, act_global_scale)


__all__ = ["ACT_OPTIONS", "COMPUTE_MODES", "Fp8BlockCompute", "WEIGHT_BLOCK", "fp8_compute_unsupported",
           "reencode_fp8_block"]
