"""Sequential GPTQ's calibration passes end each batch's forward after the stage they calibrate
(``lowbit.algorithms.gptq._stopping_after``): the statistics, and so every quantized weight, are bit for bit
those of passes through the whole model, while the blocks after the stage run only for the first batch. A
block that runs twice in one forward (shared weights) keeps whole passes; a callable calibration never
stops early. CPU, small models."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import lowbit
from lowbit.algorithms import GPTQ
from lowbit.algorithms import gptq as gptq_mod


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(64, 64) for _ in range(4))
        self.up, self.down = nn.Linear(64, 128), nn.Linear(128, 64)

    def forward(self, x):
        x = x + self.o(torch.tanh(self.q(x)) * torch.sigmoid(self.k(x)) + self.v(x))
        return x + self.down(torch.nn.functional.gelu(self.up(x)))


class _Net(nn.Module):
    def __init__(self, blocks: int = 3, shared: bool = False) -> None:
        super().__init__()
        torch.manual_seed(11)
        self.blocks = nn.ModuleList([_Block() for _ in range(blocks)])
        self.head = nn.Linear(64, 32)
        self.shared = shared

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        if self.shared:  # the first block once more: shared weights, two calls per forward
            x = self.blocks[0](x)
        return self.head(x)


def _calls(net):
    counts = {}
    for name, m in net.named_modules():
        if name.startswith("blocks.") and name.count(".") == 1 or name == "head":
            counts[name] = 0
            m.register_forward_hook(lambda mod, a, o, name=name: counts.__setitem__(name, counts[name] + 1))
    return counts


def _state(net):
    return {k: v.clone() for k, v in net.state_dict().items()}


def _same_state(a, b):
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k].view(torch.uint8) if a[k].element_size() == 1
                                                        else a[k], b[k].view(torch.uint8)
                                                        if b[k].element_size() == 1 else b[k]), k


@pytest.mark.parametrize("asymmetric", [False, True])
@pytest.mark.parametrize("scheme", ["w4a16-int4", "w4a16-nvfp4"])
def test_early_stop_gives_the_same_weights_and_skips_the_later_blocks(scheme, asymmetric, monkeypatch):
    g = torch.Generator().manual_seed(4)
    calib = [torch.randn(16, 64, generator=g) for _ in range(5)]
    config = GPTQ(damp=0.01, act_order=True, asymmetric=asymmetric)
    runs = {}
    for stop in (False, True):
        monkeypatch.setattr(gptq_mod, "STOP_EARLY", stop)
        net = _Net()
        calls = _calls(net)
        lowbit.quantize_model(net, scheme, skip=(), calibration=calib, algorithm=config)
        runs[stop] = (_state(net), dict(calls))
    _same_state(runs[False][0], runs[True][0])
    full, early = runs[False][1], runs[True][1]
    # every pass runs block 0; a pass calibrating block i runs the later blocks for batch 0 only
    assert early["blocks.0"] == full["blocks.0"]
    assert early["blocks.1"] < full["blocks.1"] and early["blocks.2"] < full["blocks.2"], (early, full)


def test_a_block_run_twice_per_forward_keeps_whole_passes(monkeypatch):
    g = torch.Generator().manual_seed(5)
    calib = [torch.randn(16, 64, generator=g) for _ in range(4)]
    runs = {}
    for stop in (False, True):
        monkeypatch.setattr(gptq_mod, "STOP_EARLY", stop)
        net = _Net(blocks=1, shared=True)
        calls = _calls(net)
        lowbit.quantize_model(net, "w4a16-int4", skip=(), calibration=calib, algorithm=GPTQ(damp=0.01))
        runs[stop] = (_state(net), dict(calls))
    _same_state(runs[False][0], runs[True][0])
    # block 0's pass runs whole (its first call is not the end of it): twice per forward in both runs
    early, full = runs[True][1], runs[False][1]
    assert early["blocks.0"] == full["blocks.0"] == 2 * 2 * len(calib), (early, full)


def test_a_callable_calibration_is_never_stopped(monkeypatch):
    g = torch.Generator().manual_seed(6)
    batches = [torch.randn(16, 64, generator=g) for _ in range(3)]
    seen = []

    def calibration(model):
        for x in batches:
            seen.append(model(x).shape)  # a StopForward would end this loop on its first batch

    net = _Net(blocks=2)
    calls = _calls(net)
    lowbit.quantize_model(net, "w4a16-int4", skip=(), calibration=calibration, algorithm=GPTQ(damp=0.01))
    # one pass per stage (the head, two blocks), each through every batch and the whole model
    assert len(seen) == 3 * len(batches)
    assert calls["blocks.0"] == calls["blocks.1"] == 3 * len(batches)
