"""LightX2V's checkpoint keys: bit-exact QTensor <-> keys round trips, state dicts made with
lowbit.compat.lightx2v loading into QuantLinear with the same outputs, save/convert with format="lightx2v"."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

import lowbit
from lowbit.compat import lightx2v as lx
from lowbit.eval.checkpoint_info import inspect_checkpoint as inspect_headers
from lowbit.io.lightx2v import (
    LIGHTX2V_SCHEMES,
    from_lightx2v,
    load_lightx2v_state_dict,
    quantize_weight,
    to_lightx2v,
)
from lowbit.nn import QuantLinear

KINDS = ["nvfp4", "mxfp4", "mxfp6-mxfp8", "mxfp8"]
FMT = {"nvfp4": "nvfp4", "mxfp4": "mxfp4", "mxfp6-mxfp8": "mxfp6_e3m2", "mxfp8": "mxfp8_e4m3"}


def _same_bits(a, b):
    assert a.dtype == b.dtype and a.shape == b.shape, (a.dtype, b.dtype, a.shape, b.shape)
    assert torch.equal(a.reshape(-1).contiguous().view(torch.uint8), b.reshape(-1).contiguous().view(torch.uint8))


def _same_q(a, b):
    assert a.fmt == b.fmt and a.shape == b.shape and a.scale_layout == b.scale_layout
    _same_bits(a.data, b.data)
    _same_bits(a.scale, b.scale)
    assert (a.global_scale is None) == (b.global_scale is None)
    if a.global_scale is not None:
        _same_bits(a.global_scale, b.global_scale)


def _compat_weight(kind, w):
    if kind == "nvfp4":
        gs = (2688.0 / torch.max(torch.abs(w))).to(torch.float32)
        d, s = lx.scaled_nvfp4_quant(w, gs)
        return {"weight": d, "weight_scale": s, "weight_global_scale": gs}
    fn = {"mxfp4": lx.scaled_mxfp4_quant, "mxfp6-mxfp8": lx.scaled_mxfp6_quant, "mxfp8": lx.scaled_mxfp8_quant}
    d, s = fn[kind](w)
    return {"weight": d, "weight_scale": s}


@pytest.mark.parametrize("kind", KINDS)
def test_qtensor_round_trip(kind):
    torch.manual_seed(0)
    w = torch.randn(200, 96, dtype=torch.bfloat16)  # 200 rows: swizzle padding
    opts = {"convention": "lightx2v"} if kind == "nvfp4" else {"scale_rounding": "rceil"}
    q = lowbit.quantize(w, FMT[kind], scale_layout="swizzled", **opts)
    keys = to_lightx2v(q)
    assert keys["weight"].dtype == torch.uint8
    back, igs = from_lightx2v(keys, kind)
    assert igs is None
    _same_q(back, q)
    assert back.params == q.params
    # linear scales are swizzled on the way out; they decode the same
    ql = lowbit.quantize(w, FMT[kind], scale_layout="linear", **opts)
    back_l, _ = from_lightx2v(to_lightx2v(ql), kind)
    assert torch.equal(lowbit.dequantize(back_l, torch.float32), lowbit.dequantize(ql, torch.float32))
    # the keys are what LightX2V's converter writes (quantize_weight follows it on bf16 input)
    ref = _compat_weight(kind, w)
    got = to_lightx2v(quantize_weight(w, kind))
    assert set(got) == set(ref)
    for k in ref:
        _same_bits(got[k], ref[k])


def test_nvfp4_activation_scales():
    torch.manual_seed(1)
    w = torch.randn(64, 64, dtype=torch.bfloat16)
    q = quantize_weight(w, "nvfp4")
    igs = torch.tensor([2688.0 / 5.0])
    keys = to_lightx2v(q, igs)
    wgs = keys["weight_global_scale"]
    assert torch.equal(keys["alpha"], 1.0 / (keys["input_global_scale"] * wgs))  # LightX2V's formula
    back, igs2 = from_lightx2v(keys, "nvfp4")
    _same_q(back, q)
    _same_bits(igs2, igs.float().reshape(1))
    # add_scale_to_models drops weight_global_scale: S is recovered so that alpha is reproduced exactly
    no_wgs = {k: v for k, v in keys.items() if k != "weight_global_scale"}
    back3, _ = from_lightx2v(no_wgs, "nvfp4")
    assert torch.equal(1.0 / (igs2.reshape(()) * back3.global_scale.reshape(())), keys["alpha"])
    # input_absmax: LightX2V computes input_global_scale = (2688.0 / input_absmax).to(float32)
    absmax = torch.tensor(3.7, dtype=torch.float32)
    _, igs4 = from_lightx2v({**keys, "input_absmax": absmax}, "nvfp4")
    _same_bits(igs4, (2688.0 / absmax).to(torch.float32).reshape(1))
    with pytest.raises(ValueError, match="alpha .* is not 1 / \\(input_global_scale"):
        from_lightx2v({**keys, "alpha": keys["alpha"] * 2}, "nvfp4")
    with pytest.raises(ValueError, match="quant_scheme must be one of"):
        from_lightx2v(keys, "nvfp8")
    with pytest.raises(ValueError, match="weight_scale must be 128x4-swizzled"):
        from_lightx2v({**keys, "weight_scale": keys["weight_scale"][:64]}, "nvfp4")
    with pytest.raises(ValueError, match="holds K=64, the layer has in_features=32"):
        from_lightx2v(keys, "nvfp4", in_features=32)


class _Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList()
        for _ in range(2):
            b = torch.nn.Module()
            b.q = torch.nn.Linear(128, 128)
            b.ffn = torch.nn.Linear(128, 256, bias=False)
            b.norm = torch.nn.LayerNorm(128)
            self.blocks.append(b)

    def forward(self, x):
        for b in self.blocks:
            x = b.norm(b.q(x))[..., :128] + b.ffn(x)[..., :128]
        return x


@pytest.mark.parametrize("kind", KINDS)
def test_state_dict_from_compat_loads_into_quantlinear(kind):
    torch.manual_seed(2)
    net = _Net().to(torch.bfloat16)
    state = {}
    igs = {}
    for name, t in net.state_dict().items():
        mod = name.rpartition(".")[0]
        if name.endswith(".weight") and t.dim() == 2:
            keys = _compat_weight(kind, t)
            if kind == "nvfp4":
                igs[mod] = (2688.0 / torch.tensor(4.0)).to(torch.float32)
                keys["input_global_scale"] = igs[mod]
                keys["alpha"] = 1.0 / (igs[mod] * keys["weight_global_scale"])
                del keys["weight_global_scale"]  # as add_scale_to_models leaves it
            state.update({f"{mod}.{k}": v for k, v in keys.items()})
        else:
            state[name] = t
    frozen = {k: v.clone() for k, v in state.items()}
    model = load_lightx2v_state_dict(_Net().to(torch.bfloat16), state, kind)
    for k, v in state.items():
        _same_bits(v, frozen[k])  # the state dict is not modified
    x = torch.randn(5, 128, dtype=torch.bfloat16)
    for mod in ("blocks.0.q", "blocks.1.ffn"):
        layer = model.get_submodule(mod)
        assert isinstance(layer, QuantLinear) and layer.scheme is LIGHTX2V_SCHEMES[kind]
        bias = state.get(f"{mod}.bias")
        w, s = state[f"{mod}.weight"], state[f"{mod}.weight_scale"]
        if kind == "nvfp4":
            xa, sa = lx.scaled_nvfp4_quant(x, igs[mod])
            ref = lx.cutlass_scaled_nvfp4_mm(xa, w, sa, s, state[f"{mod}.alpha"].reshape(1), bias)
        elif kind == "mxfp4":
            xa, sa = lx.scaled_mxfp4_quant(x)
            ref = lx.cutlass_scaled_mxfp4_mm(xa, w, sa, s, torch.ones(1), bias)
        elif kind == "mxfp8":
            xa, sa = lx.scaled_mxfp8_quant(x)
            ref = lx.cutlass_scaled_mxfp8_mm(xa, w, sa, s, torch.ones(1), bias)
        else:
            xa, sa = lx.scaled_mxfp8_quant(x)
            ref = lx.cutlass_scaled_mxfp6_mxfp8_mm(xa, w, sa, s, torch.ones(1), bias)
        got = layer(x)
        if kind == "nvfp4":
            # lowbit multiplies by 1/S inside each operand's decode, LightX2V by alpha after the sum: the fp32
            # products differ in the last bits at most
            torch.testing.assert_close(got.float(), ref.float(), rtol=2**-7, atol=1e-3)
        else:
            assert torch.equal(got, ref)


@pytest.mark.parametrize("scheme", ["w4a4-nvfp4", "w4a4-mxfp4", "w8a8-mxfp8", LIGHTX2V_SCHEMES["mxfp6-mxfp8"]])
def test_convert_and_save_lightx2v(tmp_path, scheme):
    torch.manual_seed(3)
    net = _Net().to(torch.bfloat16)
    src = tmp_path / "src"
    src.mkdir()
    save_file({k: v.contiguous() for k, v in net.state_dict().items()}, str(src / "model.safetensors"))
    out = lowbit.convert_checkpoint(src, tmp_path / "out", scheme, format="lightx2v", progress=False, device="cpu",
                                    exclude="*.norm")
    kind = lowbit.nn.get_scheme(scheme).weight_format
    kind = {"nvfp4": "nvfp4", "mxfp4": "mxfp4", "mxfp8_e4m3": "mxfp8", "mxfp6_e3m2": "mxfp6-mxfp8"}[kind]
    cfg = json.loads((out / "config.json").read_text())["quantization_config"]
    assert cfg["quant_method"] == "lightx2v" and cfg["quant_scheme"] == kind
    from safetensors import safe_open

    with safe_open(str(out / "model.safetensors"), "pt") as f:
        for name in ("blocks.0.q", "blocks.1.ffn"):
            ref = _compat_weight(kind, net.get_submodule(name).weight.detach())
            for k, v in ref.items():
                _same_bits(f.get_tensor(f"{name}.{k}"), v)  # what LightX2V's converter writes, bit for bit
    loaded = lowbit.load_quantized(out, model=_Net().to(torch.bfloat16))
    q = loaded.get_submodule("blocks.0.q")
    assert isinstance(q, QuantLinear) and q.scheme is LIGHTX2V_SCHEMES[kind]
    info = inspect_headers(out)
    assert info["quantized_layers"] == 4 and info["producer"].startswith("LightX2V")
    # save_quantized writes the same keys from the loaded model (bit-exact round trip through QuantLinear)
    again = lowbit.save_quantized(loaded, tmp_path / "again", format="lightx2v")
    with safe_open(str(out / "model.safetensors"), "pt") as a, safe_open(str(again / "model.safetensors"), "pt") as b:
        assert set(a.keys()) == set(b.keys())
        for k in a.keys():
            _same_bits(a.get_tensor(k), b.get_tensor(k))


def test_lightx2v_refuses_other_schemes():
    m = lowbit.quantize_model(_Net(), "w4a16-nvfp4")
    with pytest.raises(ValueError, match="format 'lightx2v' cannot store .*quantize activations to nvfp4"):
        lowbit.save_quantized(m, "/nonexistent/never-written", format="lightx2v")
