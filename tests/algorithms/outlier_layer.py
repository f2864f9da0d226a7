"""A LayerNorm -> Linear layer with outlier activation channels, and the relative error of quantizing it: the
shared fixture of the smoothing and rotation tests."""

from __future__ import annotations

import copy
import warnings

import torch
from torch import nn

import lowbit


def outlier_layer(seed: int = 0):
    """(model, input, calibration batches): a LayerNorm whose weight has four outlier channels feeding a Linear,
    the activations a W4A4 format struggles with."""
    g = torch.Generator().manual_seed(seed)
    m = nn.Sequential()
    m.add_module("norm", nn.LayerNorm(128))
    m.add_module("fc", nn.Linear(128, 64))
    with torch.no_grad():
        m.fc.weight.copy_(torch.randn(64, 128, generator=g) * 0.05)
        w = torch.ones(128)
        w[[3, 40, 77, 100]] = 40.0  # four outlier channels in the activations
        m.norm.weight.copy_(w)
    return m, torch.randn(512, 128, generator=g), [torch.randn(256, 128, generator=g)]


def rel_err(scheme, algorithm) -> float:
    """Mean squared error of the quantized outlier layer's output over the float layer's mean square."""
    m, x, calib = outlier_layer()
    with torch.no_grad():
        ref = m(x)
    q = copy.deepcopy(m)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        lowbit.quantize_model(q, scheme, skip=(), calibration=calib, algorithm=algorithm)
    with torch.no_grad():
        y = q(x)
    return float((y - ref).pow(2).mean() / ref.pow(2).mean())
