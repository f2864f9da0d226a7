"""``set_compute``: switch the ``w4a4-nvfp4`` layers of a model between the exact product and the opt-in FP8
compute mode (``lowbit.ops.fp8_compute``). A runtime choice: the weights, state dict and checkpoints stay the
same, and ``set_compute(model, "exact")`` gives the exact layers back."""

from __future__ import annotations

from torch import nn

from ..ops.fp8_compute import COMPUTE_MODES, fp8_compute_unsupported
from .modules import QuantLinear


def set_compute(model: nn.Module, compute: str, *, keep_weight: bool = False) -> list[str]:
    """Set how the ``w4a4-nvfp4`` ``QuantLinear`` layers of ``model`` compute; returns the qualified names of the
    layers set (other schemes are left as they are: the mode only exists for NVFP4 x NVFP4).

    Args:
        model: a module (or one ``QuantLinear``).
        compute: ``"exact"`` (the default of every layer: the block-scaled product up to fp32 accumulation
            order) or ``"fp8_block"`` (from ``lowbit.ops.policy.FP8_COMPUTE_MIN_M`` rows on, the weight re-encoded
            as fp8_block 128x128 and the activation quantized to fp8_block 1x128, on the FP8 tensor cores; the
            extra error is in ``docs/quality.md``).
        keep_weight: with ``"fp8_block"``, keep each layer's FP8 copy of its weight (one more byte per weight
            on the device) instead of re-encoding it on every call.

    Raises:
        TypeError: ``model`` is not an ``nn.Module``.
        ValueError: ``compute`` is not one of ``"exact"``, ``"fp8_block"``.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if compute not in COMPUTE_MODES:
        raise ValueError(f"compute must be one of {COMPUTE_MODES}, got {compute!r}")
    done = []
    for name, m in model.named_modules():
        if not isinstance(m, QuantLinear) or fp8_compute_unsupported(m.scheme) is not None:
            continue
        m.compute = compute
        m.keep_fp8_weight = bool(keep_weight) and compute == "fp8_block"
        m._prepare_if_ready()
        done.append(name)
    return done


__all__ = ["set_compute"]
