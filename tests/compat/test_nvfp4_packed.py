"""Seed 002's NVFP4PackedLinear / replace_mlp_with_nvfp4_packed on lowbit (fp4_b32 weights, fused activation)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import lowbit
from lowbit.compat.nvfp4_packed import NVFP4PackedLinear, detect_activation, replace_mlp_with_nvfp4_packed

ACTS = {
    None: lambda y: y,
    "gelu": F.gelu,
    "silu": F.silu,
    "gelu_tanh": lambda y: F.gelu(y, approximate="tanh"),
}


def _cos(a, b):
    return F.cosine_similarity(a.float().flatten(), b.float().flatten(), dim=0).item()


@pytest.mark.parametrize(
    ("activation", "name"),
    [
        (None, None),
        (0, None),
        (1, "gelu"),
        (2, "silu"),
        ("gelu", "gelu"),
        ("silu", "silu"),
        ("gelu_tanh", "gelu_tanh"),
    ],
)
def test_layer_layout_and_fused_forward(activation, name):
    torch.manual_seed(0)
    lin = nn.Linear(128, 48)
    layer = NVFP4PackedLinear.from_linear(lin, activation)
    assert layer.activation == name and layer.scheme.name == "w4a16-fp4b32" and layer.block_size == 32
    assert layer.weight_packed.dtype == torch.uint8 and layer.weight_packed.shape == (48, 64)
    assert layer.weight_scale.dtype == torch.float32 and layer.weight_scale.shape == (48, 4)
    # scale = amax / 6 per 32 weights (seed 002)
    amax = lin.weight.detach().reshape(48, 4, 32).abs().amax(-1)
    assert torch.equal(layer.weight_scale, amax / 6)
    x = torch.randn(3, 128)
    w = layer.dequantize_weight(torch.float32)
    assert torch.equal(layer(x), ACTS[name](x @ w.T + lin.bias.detach()))
    xb = x.bfloat16()
    want = lowbit.linear(xb, layer.weight_qtensor, lin.bias.detach().bfloat16(), name)
    assert torch.equal(layer(xb), want)
    assert layer.activation_type == {None: 0, "gelu": 1, "silu": 2, "gelu_tanh": 3}[name]


def test_layer_errors():
    with pytest.raises(ValueError, match="multiple of 32"):
        NVFP4PackedLinear(48, 16)
    with pytest.raises(ValueError, match="activation must be"):
        NVFP4PackedLinear(64, 16, activation="relu")
    with pytest.raises(ValueError, match="activation_type must be"):
        NVFP4PackedLinear(64, 16, activation=5)


def test_sequential_mlp_fusion():
    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 64)).eval()
    x = torch.randn(4, 64)
    ref = mlp(x)
    fused = replace_mlp_with_nvfp4_packed(copy.deepcopy(mlp))
    plain = replace_mlp_with_nvfp4_packed(copy.deepcopy(mlp), activation=None)
    assert isinstance(fused[0], NVFP4PackedLinear) and fused[0].activation == "gelu"
    assert isinstance(fused[1], nn.Identity) and isinstance(fused[2], NVFP4PackedLinear)
    assert plain[0].activation is None and isinstance(plain[1], nn.GELU)
    assert torch.equal(fused(x), plain(x))  # fp32: fusing changes nothing but the launch count
    assert _cos(fused(x), ref) > 0.98


def test_llama_gated_mlp():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=32,
    )  # fmt: skip
    model = transformers.LlamaForCausalLM(cfg).eval()
    ids = torch.arange(8).reshape(1, 8)
    with torch.no_grad():
        ref = model(ids).logits
        fused = replace_mlp_with_nvfp4_packed(copy.deepcopy(model))
        plain = replace_mlp_with_nvfp4_packed(copy.deepcopy(model), activation="none")
        mlp = fused.model.layers[0].mlp
        assert mlp.gate_proj.activation == "silu" and isinstance(mlp.act_fn, nn.Identity)
        assert mlp.up_proj.activation is None and mlp.down_proj.activation is None
        assert type(fused.model.layers[0].self_attn.q_proj) is nn.Linear  # attention untouched
        assert torch.equal(fused(ids).logits, plain(ids).logits)
        assert _cos(fused(ids).logits, ref) > 0.98


def test_bert_and_siglip_style_mlps():
    transformers = pytest.importorskip("transformers")
    from transformers.activations import ACT2FN

    torch.manual_seed(0)
    bert = transformers.BertModel(
        transformers.BertConfig(
            vocab_size=64,
            hidden_size=64,
            num_hidden_layers=1,
            num_attention_heads=4,
            intermediate_size=128,
            max_position_embeddings=32,
        )
    ).eval()
    replace_mlp_with_nvfp4_packed(bert)
    layer = bert.encoder.layer[0]
    assert layer.intermediate.dense.activation == "gelu" and isinstance(
        layer.intermediate.intermediate_act_fn, nn.Identity
    )
    assert isinstance(layer.output.dense, NVFP4PackedLinear)
    assert type(layer.attention.output.dense) is nn.Linear

    class SiglipLikeMLP(nn.Module):
        def __init__(self, act):
            super().__init__()
            self.fc1, self.fc2, self.activation_fn = nn.Linear(64, 128), nn.Linear(128, 64), ACT2FN[act]

        def forward(self, x):
            return self.fc2(self.activation_fn(self.fc1(x)))

    m = replace_mlp_with_nvfp4_packed(SiglipLikeMLP("gelu_pytorch_tanh"))
    assert m.fc1.activation == "gelu_tanh" and isinstance(m.activation_fn, nn.Identity)
    m = replace_mlp_with_nvfp4_packed(SiglipLikeMLP("gelu_new"))  # NewGELU: not fused, kept
    assert m.fc1.activation is None and not isinstance(m.activation_fn, nn.Identity)
    m = replace_mlp_with_nvfp4_packed(SiglipLikeMLP("gelu_new"), activation="gelu_tanh")  # caller's choice
    assert m.fc1.activation == "gelu_tanh" and isinstance(m.activation_fn, nn.Identity)
    assert detect_activation(ACT2FN["silu"]) == "silu" and detect_activation(ACT2FN["gelu"]) == "gelu"


def test_no_mlp_found():
    with pytest.raises(ValueError, match="found no MLP block"):
        replace_mlp_with_nvfp4_packed(nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 8)))
    with pytest.raises(ValueError, match="found no MLP block"):
        replace_mlp_with_nvfp4_packed(nn.Sequential(nn.Linear(48, 64), nn.GELU(), nn.Linear(64, 8)))
