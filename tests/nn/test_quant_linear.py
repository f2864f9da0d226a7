"""QuantLinear and quantize_model: module swap accuracy per scheme, buffers, dtype safety, skip rules, fused global
scales, calibration and errors."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import lowbit
from lowbit.formats.blockscaled import finite_amax, nvfp4_default_global_scale
from lowbit.nn import SCHEMES, QuantLinear, Scheme, fused_groups, get_scheme, quantize_model

# minimum cosine similarity of a 3-layer MLP's output to fp32 (measured ~0.976 for the W4A4 schemes, ~0.986-0.995
# for W4A16, ~0.998 for 8-bit; set a little below the measurements so a broken quantizer fails)
MIN_COSINE = {
    "w4a16-nvfp4": 0.98, "w4a16-mxfp4": 0.98, "w4a16-nf4": 0.98, "w4a16-int4": 0.985, "w4a16-fp4b32": 0.98,
    "w4a16-bnb-fp4": 0.97,
    "w8a8-fp8-block": 0.996, "w4a4-nvfp4": 0.965, "w4a4-mxfp4": 0.965, "w4a8-mxfp4": 0.978, "w8a8-mxfp8": 0.996,
}  # fmt: skip


def _mlp(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(256, 128), nn.GELU(), nn.Linear(128, 64), nn.SiLU(), nn.Linear(64, 40)
    ).eval()


def _x(seed: int = 1, rows: int = 16) -> torch.Tensor:
    return torch.randn(rows, 256, generator=torch.Generator().manual_seed(seed))


def _cos(a: torch.Tensor, b: torch.Tensor) -> float:
    return F.cosine_similarity(a.float().flatten(), b.float().flatten(), dim=0).item()


def test_registry_lists_the_issue_schemes():
    assert set(SCHEMES) == set(MIN_COSINE)
    assert lowbit.SCHEMES is SCHEMES
    for s in SCHEMES.values():
        assert s.weight_format in lowbit.FORMATS
        assert s.act_format is None or s.act_format in lowbit.FORMATS
        assert s.weight_only == s.name.startswith("w4a16")


@pytest.mark.parametrize("scheme", list(MIN_COSINE))
def test_module_swap_close_to_fp32(scheme):
    model = _mlp()
    x = _x()
    ref = model(x)
    q = quantize_model(copy.deepcopy(model), scheme)
    assert all(isinstance(q[i], QuantLinear) for i in (0, 2, 4))
    with torch.no_grad():
        y = q(x)
        yb = copy.deepcopy(q).to(torch.bfloat16)(x.bfloat16())
    assert y.dtype == torch.float32 and yb.dtype == torch.bfloat16
    assert _cos(y, ref) >= MIN_COSINE[scheme], _cos(y, ref)
    assert _cos(yb, ref) >= MIN_COSINE[scheme] - 0.002, _cos(yb, ref)


def _swap_check(scheme: str) -> float:
    model = _mlp()
    x = _x()
    q = quantize_model(copy.deepcopy(model), scheme)
    with torch.no_grad():
        return _cos(q(x), model(x))


def test_broken_quantizer_fails_the_threshold(monkeypatch):
    """A quantizer that puts the two FP4 codes of each byte in the wrong nibbles falls far below the threshold."""
    import lowbit.nn.modules as mod

    real = mod.quantize

    def broken(x, fmt, **kw):
        from dataclasses import replace

        q = real(x, fmt, **kw)
        return replace(q, data=((q.data << 4) | (q.data >> 4)).to(torch.uint8))

    assert _swap_check("w4a16-fp4b32") >= MIN_COSINE["w4a16-fp4b32"]
    monkeypatch.setattr(mod, "quantize", broken)
    assert _swap_check("w4a16-fp4b32") < MIN_COSINE["w4a16-fp4b32"] - 0.1


def test_fp32_input_runs_the_fp32_reference():
    lin = nn.Linear(64, 32)
    q = QuantLinear.from_linear(lin, "w4a16-nvfp4")
    x = torch.randn(3, 5, 64)
    want = F.linear(x, q.dequantize_weight(torch.float32), lin.bias)
    assert torch.equal(q(x), want)
    xb = x.bfloat16()
    assert torch.equal(q(xb), lowbit.linear(xb, q.weight_qtensor, q.bias.bfloat16()))


def test_buffers_state_dict_and_weight_qtensor():
    lin = nn.Linear(64, 16)
    q = QuantLinear.from_linear(lin, "w4a16-int4")
    names = {n for n, _ in q.named_buffers()}
    assert names == {"weight_data", "weight_scale", "weight_zeros", "bias"}
    assert q.group_size == 64  # K = 64: group 128 does not divide it, 64 does
    w = q.weight_qtensor
    assert w.fmt == "int4_awq" and tuple(w.shape) == (16, 64) and w.data is q.weight_data
    direct = lowbit.quantize(lin.weight.detach(), "int4_awq", group_size=64)
    assert torch.equal(w.data, direct.data) and torch.equal(w.zeros, direct.zeros)
    fresh = QuantLinear(64, 16, True, scheme="w4a16-int4", weight=direct)
    fresh.load_state_dict(q.state_dict())
    x = torch.randn(2, 64)
    assert torch.equal(fresh(x), q(x))
    assert "scheme=w4a16-int4" in repr(q) and "group=64" in repr(q)


def test_dtype_casts_keep_the_bits():
    q = QuantLinear.from_linear(nn.Linear(64, 32), "w8a8-fp8-block")
    before = {n: b.clone() for n, b in q.named_buffers()}
    q.half()
    q.to(torch.bfloat16)
    q.float()
    for n, b in q.named_buffers():
        if n == "bias":
            assert b.dtype == torch.float32
            continue
        assert b.dtype == before[n].dtype, n
        assert torch.equal(b.view(torch.uint8), before[n].view(torch.uint8)), n


def test_extra_repr_and_dequantize():
    q = QuantLinear.from_linear(nn.Linear(64, 32, bias=False), "w4a4-nvfp4", activation="silu")
    r = repr(q)
    for part in (
        "scheme=w4a4-nvfp4",
        "weight=nvfp4",
        "group=16",
        "act=nvfp4 dynamic",
        "activation=silu",
        "bias=False",
    ):
        assert part in r
    assert q.dequantize_weight(torch.bfloat16).shape == (32, 64)


def test_unknown_scheme_and_bad_shapes():
    with pytest.raises(ValueError, match="unknown scheme 'w3a16'.*w4a16-nvfp4"):
        quantize_model(_mlp(), "w3a16")
    with pytest.raises(ValueError, match="unknown scheme"):
        get_scheme("nvfp4")
    with pytest.raises(ValueError, match="not a multiple of 32"):
        QuantLinear.from_linear(nn.Linear(48, 16), "w4a16-mxfp4")
    with pytest.raises(ValueError, match="no nn.Linear layer can take scheme w4a16-mxfp4"):
        quantize_model(nn.Sequential(nn.Linear(48, 16)), "w4a16-mxfp4")
    with pytest.raises(ValueError, match="no nn.Linear layer"):
        quantize_model(nn.Sequential(nn.ReLU()), "w4a16-nf4")


def test_unsupported_shapes_skipped_with_one_warning():
    model = nn.Sequential(nn.Linear(64, 32), nn.Linear(32, 24), nn.Linear(24, 16), nn.Linear(16, 8))
    with pytest.warns(UserWarning) as rec:
        quantize_model(model, "w4a16-mxfp4")
    msgs = [str(w.message) for w in rec if "left unquantized" in str(w.message)]
    assert len(msgs) == 1
    assert "2 layer(s)" in msgs[0] and "2 [16, 24]" in msgs[0] and "3 [8, 16]" in msgs[0]
    assert isinstance(model[0], QuantLinear) and isinstance(model[1], QuantLinear)
    assert type(model[2]) is nn.Linear and type(model[3]) is nn.Linear


def test_skip_patterns():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.body = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64))
            self.lm_head = nn.Linear(64, 32)

        def forward(self, x):
            return self.lm_head(self.body(x))

    m = quantize_model(M(), "w4a16-nvfp4")
    assert type(m.lm_head) is nn.Linear and isinstance(m.body[0], QuantLinear)
    m = quantize_model(M(), "w4a16-nvfp4", skip=None)
    assert isinstance(m.lm_head, QuantLinear)
    m = quantize_model(M(), "w4a16-nvfp4", skip=["body.1", "lm_*"])
    assert (
        isinstance(m.body[0], QuantLinear) and type(m.body[1]) is nn.Linear and type(m.lm_head) is nn.Linear
    )


def test_multihead_attention_out_proj_left_alone():
    m = nn.Sequential(nn.MultiheadAttention(64, 4, batch_first=True))
    with pytest.raises(ValueError, match="no nn.Linear"):
        quantize_model(m, "w4a16-nvfp4")


class _Attn(nn.Module):
    def __init__(self, names, d=64):
        super().__init__()
        for i, n in enumerate(names):
            lin = nn.Linear(d, d)
            with torch.no_grad():
                lin.weight.mul_(1 + i)  # different amax per sibling
            setattr(self, n, lin)


def test_fused_siblings_share_the_nvfp4_global_scale():
    torch.manual_seed(0)
    model = nn.Module()
    model.attn = _Attn(["q_proj", "k_proj", "v_proj", "o_proj"])
    model.mlp = _Attn(["gate_proj", "up_proj", "down_proj"])
    model.bert = _Attn(["query", "key", "value", "dense"])
    assert fused_groups(n for n, _ in model.named_modules() if "." in n) == [
        ("attn.q_proj", "attn.k_proj", "attn.v_proj"),
        ("bert.query", "bert.key", "bert.value"),
        ("mlp.gate_proj", "mlp.up_proj"),
    ]
    ref = copy.deepcopy(model)
    quantize_model(model, "w4a16-nvfp4")
    for parent, group in (("attn", "qkv"), ("mlp", "gu"), ("bert", "qkv")):
        names = {"qkv": ["q_proj", "k_proj", "v_proj"], "gu": ["gate_proj", "up_proj"]}[group]
        if parent == "bert":
            names = ["query", "key", "value"]
        scales = [getattr(getattr(model, parent), n).weight_global_scale for n in names]
        want = nvfp4_default_global_scale(
            torch.stack([finite_amax(getattr(getattr(ref, parent), n).weight) for n in names])
        )
        for s in scales:
            assert torch.equal(s, want.reshape(1))
    # unfused layers keep their own default
    own = nvfp4_default_global_scale(ref.attn.o_proj.weight.detach())
    assert torch.equal(model.attn.o_proj.weight_global_scale, own.reshape(1))
    # other formats have no global scale to share
    m2 = nn.Module()
    m2.attn = _Attn(["q_proj", "k_proj"])
    quantize_model(m2, "w4a16-mxfp4")
    assert m2.attn.q_proj.weight_global_scale is None


def test_calibration_static_nvfp4_activation_scale():
    model = _mlp()
    batches = [_x(s, rows=4) * (s + 1) for s in range(3)]
    seen = {}
    hooks = [
        model[i].register_forward_pre_hook(lambda m, a, i=i: seen.setdefault(i, []).append(a[0].abs().amax()))
        for i in (0, 2, 4)
    ]
    with torch.no_grad():
        for b in batches:
            model(b)
    for h in hooks:
        h.remove()
    q = quantize_model(copy.deepcopy(model), "w4a4-nvfp4", calibration=batches)
    for i in (0, 2, 4):
        absmax = torch.stack(seen[i]).amax()
        assert torch.equal(q[i].input_global_scale, (2688.0 / absmax).reshape(1)), i
        assert "act=nvfp4 static" in repr(q[i])
    x = _x()
    assert _cos(q(x), model(x)) > MIN_COSINE["w4a4-nvfp4"]
    # without calibration: dynamic
    assert quantize_model(copy.deepcopy(model), "w4a4-nvfp4")[0].input_global_scale is None
    # weight-only schemes ignore calibration data
    assert (
        quantize_model(copy.deepcopy(model), "w4a16-nvfp4", calibration=batches)[0].input_global_scale is None
    )


def test_calibration_dict_batches_and_empty():
    class Kw(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(64, 32)

        def forward(self, input_ids=None, scale=1.0):
            return self.proj(input_ids * scale)

    m = quantize_model(Kw(), "w4a4-nvfp4", calibration=[{"input_ids": torch.ones(2, 64), "scale": 3.0}])
    assert torch.equal(m.proj.input_global_scale, torch.tensor([2688.0 / 3.0]))
    with pytest.raises(ValueError, match="calibration is empty"):
        quantize_model(Kw(), "w4a4-nvfp4", calibration=[])


def test_custom_scheme_object():
    s = Scheme("w4a16-nf4-dq", "nf4", {"blocksize": 64, "double_quant": True})
    m = quantize_model(nn.Sequential(nn.Linear(64, 32)), s)
    assert m[0].weight_nested_scale is not None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        m(torch.randn(2, 64))


@pytest.mark.parametrize(
    "scheme", [*SCHEMES, Scheme("nf4-dq", "nf4", {"blocksize": 64, "double_quant": True})]
)
def test_load_state_dict_into_an_empty_layer(scheme):
    lin = nn.Linear(256, 128)
    q = QuantLinear.from_linear(lin, scheme)
    empty = QuantLinear(256, 128, True, scheme=scheme)
    empty.load_state_dict(q.state_dict())
    x = torch.randn(2, 256)
    assert torch.equal(empty(x), q(x))
