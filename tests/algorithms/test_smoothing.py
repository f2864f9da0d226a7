"""SmoothQuant-style smoothing (lowbit.algorithms.smoothing): the scale formula; the smoothed float model
computes what it computed before (pre-norm Llama folds everything into its norms and projections, post-norm
BERT only its value -> output projection pairs, the rest online on request); producers that are not safe to
fold are left alone (a residual reading the norm, a ``(1 + weight)`` norm, a layer fed two inputs); smoothing
lowers the W4A4 error of a layer behind outlier channels; combinations with GPTQ and the argument checks.
CPU, tiny models."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

import lowbit
from lowbit.algorithms import SmoothQuant, apply_smoothing
from lowbit.algorithms.rotation import input_transform_of, online_transform_layers
from lowbit.algorithms.smoothing import smooth_scale, summary
from lowbit.nn import QuantLinear, get_scheme
from lowbit.nn.quantize import linear_layers, run_calibration, transform_model
from outlier_layer import outlier_layer, rel_err  # this folder's shared fixture

W4A4 = get_scheme("w4a4-nvfp4")


def test_smooth_scale_formula():
    xa = torch.tensor([4.0, 1.0, 0.0, 9.0])
    wa = torch.tensor([1.0, 4.0, 2.0, 0.25])
    s = smooth_scale(xa, wa, 0.5)
    torch.testing.assert_close(s, torch.tensor([2.0, 0.5, 1.0, 6.0]))  # a channel never seen keeps s = 1
    torch.testing.assert_close(smooth_scale(xa, wa, 1.0)[:2], xa[:2])
    torch.testing.assert_close(smooth_scale(xa, wa, 0.0)[:2], 1 / wa[:2])


def _tiny(arch: str):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    if arch == "bert":
        cfg = transformers.BertConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                                      intermediate_size=128, vocab_size=100)
        model = transformers.BertModel(cfg)
    else:
        cfg = transformers.LlamaConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                                       num_key_value_heads=2, intermediate_size=128, vocab_size=100)
        model = transformers.LlamaModel(cfg)
    with torch.no_grad():  # norms that are not all ones, so a wrong fold shows
        for name, p in model.named_parameters():
            if "norm" in name.lower() and p.dim() == 1:
                p.add_(torch.randn_like(p) * 0.3)
    ids = [{"input_ids": torch.randint(0, 100, (2, 7))}, {"input_ids": torch.randint(0, 100, (3, 5))}]
    return model.eval(), ids


def _out(model, batch):
    with torch.no_grad():
        return model(**batch).last_hidden_state


def test_prenorm_llama_folds_everything_and_keeps_its_function():
    model, calib = _tiny("llama")
    ref = _out(model, calib[0])
    norm0 = model.layers[0].input_layernorm.weight.detach().clone()
    targets = linear_layers(model)
    report = apply_smoothing(model, targets, W4A4, lambda: run_calibration(model, calib), SmoothQuant())
    assert summary(report) == "10 folded into norms, 4 folded into Linear layers"
    assert report["layers.0.self_attn.q_proj"]["producer"] == "layers.0.input_layernorm"
    assert report["layers.1.mlp.gate_proj"]["producer"] == "layers.1.post_attention_layernorm"
    assert report["layers.0.self_attn.o_proj"]["producer"] == "layers.0.self_attn.v_proj"
    assert report["layers.0.mlp.down_proj"]["producer"] == "layers.0.mlp.up_proj"
    assert not torch.equal(model.layers[0].input_layernorm.weight, norm0)
    assert online_transform_layers(model) == []  # no runtime cost
    torch.testing.assert_close(_out(model, calib[0]), ref, rtol=1e-4, atol=1e-4)


def test_bf16_model_folds_too():
    model, calib = _tiny("llama")
    model = model.to(torch.bfloat16)
    ref = _out(model, calib[0]).float()
    report = apply_smoothing(model, linear_layers(model), W4A4, lambda: run_calibration(model, calib),
                             SmoothQuant())
    # the fold check allows the bf16 rounding of the folded weights
    assert summary(report) == "10 folded into norms, 4 folded into Linear layers"
    out = _out(model, calib[0]).float()
    assert float((out - ref).norm() / ref.norm()) < 0.02


def test_postnorm_bert_folds_only_where_safe_and_online_on_request():
    model, calib = _tiny("bert")
    ref = _out(model, calib[1])
    m = copy.deepcopy(model)
    report = apply_smoothing(m, linear_layers(m), W4A4, lambda: run_calibration(m, calib), SmoothQuant())
    # the LayerNorm output is also the residual stream: 1/s folded into it would change the model
    q = report["encoder.layer.0.attention.self.query"]
    assert q["how"] == "none" and "embeddings.LayerNorm" in q["why"] and "add" in q["why"]
    assert report["encoder.layer.1.intermediate.dense"]["how"] == "none"
    o = report["encoder.layer.1.attention.output.dense"]
    assert (o["how"], o["producer"]) == ("linear", "encoder.layer.1.attention.self.value")
    assert online_transform_layers(m) == []
    torch.testing.assert_close(_out(m, calib[1]), ref, rtol=1e-4, atol=1e-4)

    m = copy.deepcopy(model)
    report = apply_smoothing(m, linear_layers(m), W4A4, lambda: run_calibration(m, calib),
                             SmoothQuant(online=True))
    assert summary(report) == "2 folded into Linear layers, 11 online"
    online = set(online_transform_layers(m))
    assert "encoder.layer.0.attention.self.key" in online and "encoder.layer.0.output.dense" in online
    # q/k/v read one tensor: one scale
    mods = dict(m.named_modules())
    qs = [input_transform_of(mods[f"encoder.layer.0.attention.self.{n}"]).scale for n in ("query", "key", "value")]
    assert torch.equal(qs[0], qs[1]) and torch.equal(qs[0], qs[2])
    torch.testing.assert_close(_out(m, calib[1]), ref, rtol=1e-4, atol=1e-4)


class _OffsetNorm(nn.Module):
    """An RMSNorm computing ``x * (1 + weight)``: folding ``1/s`` into its weight does not scale its output."""

    def __init__(self, k: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(k) * 0.1)

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * (1 + self.weight)


class _Block(nn.Module):
    def __init__(self, norm: nn.Module, residual: bool, k: int = 64) -> None:
        super().__init__()
        self.norm, self.residual = norm, residual
        self.fc1 = nn.Linear(k, k)
        self.fc2 = nn.Linear(k, k)
        self.shared = nn.Linear(k, k)

    def forward(self, x):
        h = self.norm(x)
        y = self.fc1(h) + self.fc2(h)
        if self.residual:
            y = y + h
        # one Linear fed by two different inputs: scaling its columns cannot suit both
        return self.shared(y) + self.shared(x)


@pytest.mark.parametrize(("norm", "residual", "why"), [
    (nn.LayerNorm(64), False, None),
    (nn.LayerNorm(64), True, "also read by add"),
    (_OffsetNorm(64), False, "not a plain norm"),
])
def test_unsafe_producers_are_not_folded(norm, residual, why):
    torch.manual_seed(0)
    with torch.no_grad():
        if isinstance(norm, nn.LayerNorm):
            norm.weight.add_(torch.rand(64))
    m = _Block(norm, residual).eval()
    calib = [torch.randn(4, 6, 64)]
    ref = m(calib[0]).detach()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # nothing to smooth in the unsafe cases: that warning is tested below
        report = apply_smoothing(m, linear_layers(m), W4A4, lambda: run_calibration(m, calib), SmoothQuant())
    if why is None:
        assert report["fc1"]["how"] == report["fc2"]["how"] == "norm"
    else:
        assert report["fc1"]["how"] == "none" and why in report["fc1"]["why"]
    assert report["shared"]["how"] == "none"
    torch.testing.assert_close(m(calib[0]), ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(("scheme", "factor"), [("w4a4-nvfp4", 0.3), ("w4a4-mxfp4", 0.8)])
def test_smoothing_lowers_the_quantized_error_behind_outlier_channels(scheme, factor):
    # measured relative errors, rtn -> smoothquant: nvfp4 1.25e-2 -> 2.3e-3, mxfp4 3.3e-2 -> 2.2e-2
    rtn = rel_err(scheme, "rtn")
    sq = rel_err(scheme, "smoothquant")
    assert sq < factor * rtn
    searched = rel_err(scheme, SmoothQuant(alphas=(0.25, 0.5, 0.75)))
    assert searched < factor * rtn


def test_smoothquant_with_gptq_carries_online_scales():
    model, calib = _tiny("bert")
    ref = _out(model, calib[0])
    q = lowbit.quantize_model(copy.deepcopy(model), "w4a4-nvfp4", calibration=calib,
                              algorithm=(SmoothQuant(online=True), "gptq"))
    qs = {n: m for n, m in q.named_modules() if isinstance(m, QuantLinear)}
    assert len(qs) == 13
    assert input_transform_of(qs["encoder.layer.0.attention.self.query"]) is not None
    assert input_transform_of(qs["encoder.layer.0.attention.output.dense"]) is None  # folded
    cos = torch.nn.functional.cosine_similarity(_out(q, calib[0]).flatten(1), ref.flatten(1)).min()
    assert cos > 0.9


def test_transform_model_then_quantize_equals_quantize_model():
    model, calib = _tiny("bert")
    alg = (SmoothQuant(online=True), "rotate")
    a = lowbit.quantize_model(copy.deepcopy(model), "w4a4-mxfp4", calibration=calib, algorithm=alg)
    t = transform_model(copy.deepcopy(model), "w4a4-mxfp4", calibration=calib, algorithm=alg)
    torch.testing.assert_close(_out(t, calib[0]), _out(model, calib[0]), rtol=1e-4, atol=1e-4)
    b = lowbit.quantize_model(t, "w4a4-mxfp4", calibration=calib)
    torch.testing.assert_close(_out(a, calib[0]), _out(b, calib[0]), rtol=0, atol=0)


def test_smoothquant_argument_errors():
    m, _, calib = outlier_layer()
    with pytest.raises(ValueError, match="'smoothquant' needs a scheme that quantizes activations.*weight-only"):
        lowbit.quantize_model(copy.deepcopy(m), "w4a16-nvfp4", skip=(), calibration=calib, algorithm="smoothquant")
    with pytest.raises(ValueError, match="smoothquant.*needs calibration"):
        lowbit.quantize_model(copy.deepcopy(m), "w4a4-nvfp4", skip=(), algorithm="smoothquant")
    with pytest.raises(ValueError, match=r"alpha must be in \[0, 1\]"):
        SmoothQuant(alpha=1.5)
    with pytest.raises(TypeError, match="alpha must be a float"):
        SmoothQuant(alpha="0.5")
    with pytest.raises(ValueError, match="alphas"):
        SmoothQuant(alphas=(0.5, 2.0))
    with pytest.raises(TypeError, match="online"):
        SmoothQuant(online="yes")
    with pytest.raises(TypeError, match="config must be a lowbit.algorithms.SmoothQuant"):
        apply_smoothing(m, linear_layers(m), W4A4, lambda: None, config={"alpha": 0.5})


def test_a_model_with_nothing_to_fold_warns():
    m = nn.Sequential(nn.Linear(64, 64))
    with pytest.warns(UserWarning, match="no layer could be smoothed.*online=True"):
        lowbit.quantize_model(m, "w4a4-nvfp4", skip=(), calibration=[torch.randn(8, 64)], algorithm="smoothquant")
