"""The opt-in FP8 compute mode of w4a4-nvfp4 layers (``lowbit.nn.set_compute``) on CPU, where every op runs its
reference: from FP8_COMPUTE_MIN_M rows the layer computes exactly the fp8_block pipeline of its re-encoded weight,
below it the exact W4A4 path; only w4a4-nvfp4 layers switch; the state dict is untouched; "exact" gives the exact
layer back; its extra error against the exact path is bounded. The GPU runs are in test_fp8_compute_gpu.py."""

import pytest
import torch
from torch import nn

import lowbit
from lowbit.nn import QuantLinear, set_compute
from lowbit.ops import policy, scaled_mm_reference
from lowbit.ops.fp8_compute import ACT_OPTIONS, reencode_fp8_block


def _model(seed=0, k=256, n=384):
    torch.manual_seed(seed)
    m = nn.Sequential(nn.Linear(k, n, bias=True), nn.GELU(), nn.Linear(n, k, bias=False)).to(torch.bfloat16)
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0.0, 0.05)
    return m


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def test_only_w4a4_nvfp4_layers_switch_and_the_state_dict_stays():
    m = lowbit.quantize_model(_model(), "w4a4-nvfp4")
    before = {k: v.clone() for k, v in m.state_dict().items()}
    assert set_compute(m, "fp8_block") == ["0", "2"]
    assert all(q.compute == "fp8_block" for q in m.modules() if isinstance(q, QuantLinear))
    after = m.state_dict()
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    other = lowbit.quantize_model(_model(), "w8a8-fp8-block")
    assert set_compute(other, "fp8_block") == []
    assert all(q.compute == "exact" for q in other.modules() if isinstance(q, QuantLinear))


def test_bad_arguments_are_refused():
    m = lowbit.quantize_model(_model(), "w4a4-nvfp4")
    with pytest.raises(ValueError, match="compute must be one of"):
        set_compute(m, "fp4")
    with pytest.raises(TypeError, match="torch.nn.Module"):
        set_compute("model", "exact")
    with pytest.raises(ValueError, match="nvfp4"):
        reencode_fp8_block(lowbit.quantize(torch.randn(128, 128), "mxfp4"))


@pytest.mark.parametrize("keep_weight", [False, True])
def test_large_m_computes_the_fp8_block_pipeline_small_m_the_exact_path(keep_weight):
    exact = lowbit.quantize_model(_model(), "w4a4-nvfp4")
    fast = lowbit.quantize_model(_model(), "w4a4-nvfp4")
    set_compute(fast, "fp8_block", keep_weight=keep_weight)
    layer = fast[0]
    big = torch.randn(2, policy.FP8_COMPUTE_MIN_M // 2, 256).to(torch.bfloat16)
    small = torch.randn(3, 256).to(torch.bfloat16)
    with torch.inference_mode():
        got = layer(big)
        w8 = reencode_fp8_block(layer.weight_qtensor)
        a = lowbit.quantize(big.reshape(-1, 256), "fp8_block", **ACT_OPTIONS)
        want = scaled_mm_reference(a, w8, None, layer.bias, torch.bfloat16).reshape(2, -1, 384)
        assert torch.equal(got, want)
        assert torch.equal(fast(small), exact(small))
    assert (layer._prepared._w8 is not None) == keep_weight


def test_exact_gives_the_exact_layers_back():
    m = lowbit.quantize_model(_model(), "w4a4-nvfp4")
    x = torch.randn(policy.FP8_COMPUTE_MIN_M, 256).to(torch.bfloat16)
    with torch.inference_mode():
        want = m(x)
        set_compute(m, "fp8_block")
        assert not torch.equal(m(x), want)
        set_compute(m, "exact")
        assert torch.equal(m(x), want)


def test_the_reencoded_weight_is_the_fp8_block_quantization_of_the_exact_decoding():
    w = torch.randn(256, 384) * torch.logspace(-2, 1, 256)[:, None]
    q = lowbit.quantize(w, "nvfp4")
    w8 = reencode_fp8_block(q)
    ref = lowbit.quantize(lowbit.dequantize(q, torch.float32), "fp8_block", block=(128, 128))
    assert w8.fmt == "fp8_block" and torch.equal(w8.data.view(torch.uint8), ref.data.view(torch.uint8))
    assert torch.equal(w8.scale, ref.scale)


def test_the_extra_error_against_the_exact_path_is_small():
    # a DiT-like layer (K = 5120 split into 40 blocks of 128), M = 512: the fp8 mode's product against the
    # exact W4A4 product and against the fp32 product of the unquantized weight and input
    torch.manual_seed(3)
    k, n, m = 1024, 512, policy.FP8_COMPUTE_MIN_M
    lin = nn.Linear(k, n, bias=False).to(torch.bfloat16)
    with torch.no_grad():
        lin.weight.normal_(0.0, 0.02)
    x = torch.randn(m, k).to(torch.bfloat16)
    dense = x.float() @ lin.weight.float().T
    layer = lowbit.quantize_model(nn.Sequential(lin), "w4a4-nvfp4")
    with torch.inference_mode():
        exact = layer(x)
        set_compute(layer, "fp8_block")
        fast = layer(x)
    e_exact, e_fast, e_between = _rel(exact, dense), _rel(fast, dense), _rel(fast, exact)
    # NVFP4 activations dominate the exact path's error; the FP8 mode's activations are finer, its weight
    # re-encoding adds a little: the fast product is no further from the dense one than the exact path
    assert e_fast <= e_exact * 1.05, (e_fast, e_exact)
    assert e_between < 0.15, e_between


def test_the_fp8_options_are_the_w8a8_fp8_block_schemes():
    from lowbit.nn import get_scheme
    from lowbit.ops.fp8_compute import WEIGHT_BLOCK

    s = get_scheme("w8a8-fp8-block")
    assert s.weight_options == {"block": WEIGHT_BLOCK} and s.act_options == ACT_OPTIONS
