"""``quantize_model(..., algorithm="gptq")``: every 4-bit weight-only scheme, stage by stage on a small model;
layers that never ran fall back to round-to-nearest with a warning; the algorithm arguments are checked."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

import lowbit
from lowbit.algorithms import GPTQ
from lowbit.formats.qtensor import validate


class _Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(6)
        self.layers = nn.ModuleList(
            nn.Sequential(nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 64)) for _ in range(2)
        )
        self.head = nn.Linear(64, 64)
        self.unused = nn.Linear(64, 64)
        for p in self.parameters():
            p.data = torch.randn(p.shape, generator=g) * 0.1

    def forward(self, x):
        for layer in self.layers:
            x = x + layer(x)
        return self.head(x)


@pytest.mark.parametrize("scheme", ["w4a16-nvfp4", "w4a16-mxfp4", "w4a16-nf4", "w4a16-int4", "w4a16-fp4b32",
                                    "w4a16-bnb-fp4"])
def test_quantize_model_gptq_beats_rtn(scheme):
    g = torch.Generator().manual_seed(7)
    mix = torch.randn(64, 64, generator=g) * 0.3
    calib = [torch.randn(32, 64, generator=g) @ mix for _ in range(4)]
    test = torch.randn(64, 64, generator=g) @ mix
    ref = _Tiny()
    want = ref(test)
    rtn = lowbit.quantize_model(_Tiny(), scheme, skip=("unused",))
    with pytest.warns(UserWarning, match="never ran"):
        gptq = lowbit.quantize_model(_Tiny(), scheme, skip=(), calibration=calib, algorithm="gptq")
    assert isinstance(gptq.unused, lowbit.nn.QuantLinear)  # rounded to nearest: no inputs seen
    e_rtn = ((rtn(test) - want) ** 2).mean()
    e_gptq = ((gptq(test) - want) ** 2).mean()
    assert e_gptq < e_rtn
    for m in gptq.modules():
        if isinstance(m, lowbit.nn.QuantLinear):
            validate(m.weight_qtensor)


def test_quantize_model_algorithm_arguments():
    with pytest.raises(ValueError, match="calibration"):
        lowbit.quantize_model(_Tiny(), "w4a16-nvfp4", algorithm="gptq")
    with pytest.raises(ValueError, match="algorithm"):
        lowbit.quantize_model(_Tiny(), "w4a16-nvfp4", algorithm="best")
    cfg = GPTQ(act_order=True, damp=0.05, sequential=False)
    m = lowbit.quantize_model(_Tiny(), "w4a16-nvfp4", calibration=[torch.randn(8, 64)], algorithm=cfg,
                              skip=("unused",))
    assert isinstance(m.head, lowbit.nn.QuantLinear)
    assert dataclasses.replace(cfg) == cfg
