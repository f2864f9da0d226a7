"""The FP8 compute mode of w4a4-nvfp4 layers on CUDA: from FP8_COMPUTE_MIN_M rows the layer's output equals the
fp8_block pipeline of its re-encoded weight (the same public ops, cuBLASLt's block-scaled GEMM where it runs) and
stays close to the exact W4A4 output; the weight re-encoding on the GPU equals the CPU reference bit for bit;
below the bound the exact path runs; CUDA graphs capture it.

Run on the device machine: ``python -m pytest -q -p no:cacheprovider tests/nn/test_fp8_compute_gpu.py``.
"""

import pytest
import torch
from torch import nn

import lowbit
from lowbit.nn import set_compute
from lowbit.ops import policy
from lowbit.ops.fp8_compute import ACT_OPTIONS, reencode_fp8_block

pytestmark = pytest.mark.gpu


def _layer(n=1536, k=1024, seed=0):
    torch.manual_seed(seed)
    lin = nn.Linear(k, n, bias=True, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        lin.weight.normal_(0.0, 0.02)
    return lowbit.quantize_model(nn.Sequential(lin), "w4a4-nvfp4")


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def test_reencoding_on_the_gpu_equals_the_cpu_reference():
    q = _layer()[0].weight_qtensor
    got = reencode_fp8_block(q)
    want = reencode_fp8_block(q.to("cpu"))
    assert torch.equal(got.data.view(torch.uint8).cpu(), want.data.view(torch.uint8))
    assert torch.equal(got.scale.cpu(), want.scale)


@pytest.mark.parametrize("m", [policy.FP8_COMPUTE_MIN_M, 4096])
@pytest.mark.parametrize("keep_weight", [False, True])
def test_fp8_mode_output(m, keep_weight):
    layer = _layer()
    x = torch.randn(m, 1024, device="cuda").to(torch.bfloat16)
    with torch.inference_mode():
        exact = layer(x)
        set_compute(layer, "fp8_block", keep_weight=keep_weight)
        got = layer(x)
        lin = layer[0]
        a = lowbit.quantize(x, "fp8_block", **ACT_OPTIONS)
        want = lowbit.scaled_mm(a, reencode_fp8_block(lin.weight_qtensor), bias=lin.bias, out_dtype=torch.bfloat16)
    torch.cuda.synchronize()
    assert torch.equal(got, want)
    assert _rel(got, exact) < 0.15


def test_small_m_runs_the_exact_path_and_graphs_capture_the_fp8_mode():
    layer = _layer()
    small = torch.randn(8, 1024, device="cuda").to(torch.bfloat16)
    big = torch.randn(1024, 1024, device="cuda").to(torch.bfloat16)
    with torch.inference_mode():
        want_small = layer(small)
        set_compute(layer, "fp8_block", keep_weight=True)
        assert torch.equal(layer(small), want_small)
        want = layer(big).clone()
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            layer(big)
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            out = layer(big)
        g.replay()
        torch.cuda.synchronize()
    assert torch.equal(out, want)
