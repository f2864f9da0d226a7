"""Argument checks shared by the format references and the interop converters."""

from __future__ import annotations

import torch


def positive_fp32_scalar(t: torch.Tensor | float, name: str) -> torch.Tensor:
    """A 0-d fp32 copy of ``t`` after checking it is one finite value > 0 (a float is accepted too)."""
    if isinstance(t, (int, float)) and not isinstance(t, bool):
        t = torch.tensor(float(t), dtype=torch.float32)
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype != torch.float32:
        raise TypeError(f"{name} must be float32, got {t.dtype}")
    if t.numel() != 1:
        raise ValueError(f"{name} must hold one value, got shape {tuple(t.shape)}")
    if t.is_meta:  # a shape-only quantize (meta device): there is no value to check
        return t.detach().reshape(()).clone()
    v = t.detach().reshape(()).cpu()
    if not torch.isfinite(v) or v <= 0:
        raise ValueError(f"{name} must be finite and > 0, got {v.item()}")
    return t.detach().reshape(()).clone()


def check_2d(t: torch.Tensor, name: str, dtype: torch.dtype) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype != dtype:
        raise TypeError(f"{name} must be {dtype}, got {t.dtype}")
    if t.dim() != 2:
        raise ValueError(f"{name} must be 2-D, got shape {tuple(t.shape)}")
