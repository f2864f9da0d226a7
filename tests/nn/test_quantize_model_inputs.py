"""quantize_model: argument errors name the argument, and a meta model becomes a shape-only skeleton."""

import warnings

import pytest
import torch
from torch import nn

import lowbit
from lowbit.nn import QuantLinear


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        # q/k/v share one nvfp4 global scale (fused siblings): that path must work on meta as well
        self.q_proj, self.k_proj, self.v_proj = nn.Linear(256, 256), nn.Linear(256, 256), nn.Linear(256, 256)
        self.gate_proj = nn.Linear(256, 512, bias=False)

    def forward(self, x):
        return self.gate_proj(self.q_proj(x) + self.k_proj(x) + self.v_proj(x))


def _model():
    torch.manual_seed(0)
    return nn.Sequential(Block())


@pytest.mark.parametrize("scheme", sorted(lowbit.SCHEMES))
def test_meta_model_becomes_a_skeleton_that_loads(scheme):
    with torch.device("meta"):
        skeleton = _model()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        lowbit.quantize_model(skeleton, scheme, skip=None)
        real = lowbit.quantize_model(_model(), scheme, skip=None)
    layers = [m for m in skeleton.modules() if isinstance(m, QuantLinear)]
    assert len(layers) == 4
    want = {k: (v.dtype, v.shape) for k, v in real.state_dict().items()}
    got = skeleton.state_dict()
    assert set(got) == set(want)
    for k, t in got.items():
        assert t.is_meta and (t.dtype, t.shape) == want[k], k
    # the use of a skeleton: allocate, then load quantized weights; it computes what the real model does
    skeleton.to_empty(device="cpu")
    skeleton.load_state_dict(real.state_dict())
    x = torch.randn(3, 256)
    assert torch.equal(skeleton(x), real(x))


def test_meta_model_refuses_calibration():
    with torch.device("meta"):
        model = _model()
    with pytest.raises(ValueError, match="calibration needs a model with real weights.*meta device"):
        lowbit.quantize_model(model, "w4a4-nvfp4", skip=None, calibration=[torch.randn(2, 256)])


@pytest.mark.parametrize(
    ("kwargs", "exc", "match"),
    [
        ({"skip": 5}, TypeError, "skip must be None, a module-name pattern"),
        ({"skip": [5]}, TypeError, r"skip must hold module-name patterns \(str\)"),
        ({"calibration": "abc"}, TypeError, "calibration must be None, a tensor, a dict or an iterable"),
        ({"calibration": b"abc"}, TypeError, "calibration must be None"),
        ({"calibration": 3}, TypeError, "calibration must be None"),
        ({"calibration": []}, ValueError, "calibration is empty"),
        ({"awq": "yes"}, TypeError, "awq must be None, True or False"),
        ({"backend": "cuda"}, ValueError, "backend must be one of"),
    ],
)
def test_bad_arguments_name_the_argument(kwargs, exc, match):
    model = _model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(exc, match=match):
        lowbit.quantize_model(model, "w4a4-nvfp4", **kwargs)
    after = model.state_dict()
    assert set(after) == set(before) and all(torch.equal(after[k], before[k]) for k in before)


def test_run_calibration_checks_its_argument():
    from lowbit.nn.quantize import run_calibration

    with pytest.raises(TypeError, match="calibration must be None"):
        run_calibration(_model(), "abc")
