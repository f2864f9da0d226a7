"""Fused sibling projections on CUDA: a fused decoder computes what the unfused one computes (each member's
columns through the GEMV or GEMM of the stacked weight, within the rounding of another split of the sums) in
eager mode, captured in a CUDA graph and under torch.compile (Inductor, fullgraph, default and
reduce-overhead); the fused GEMV reads the stacked weight in one launch per group.

Run on the device machine: ``python -m pytest -q -p no:cacheprovider tests/nn/test_fuse_gpu.py``.
"""

import pytest
import torch

import lowbit
from lowbit.bench.decoder import Decoder, DecoderShape, clear_cache
from lowbit.nn import FusedProjection, fuse_projections

pytestmark = pytest.mark.gpu

SHAPE = DecoderShape(hidden=512, intermediate=1024, heads=4, kv_heads=1, head_dim=128, vocab=1024, layers=2)
MAX_LEN = 320  # the cache holds the longest prompt of the tests (300 tokens)
SCHEMES = ["w4a16-nvfp4", "w4a16-mxfp4", "w4a16-int4", "w4a16-nf4", "w4a16-fp4b32", "w4a4-nvfp4", "w4a8-mxfp4"]


def _pair(scheme):
    models = []
    for _ in range(2):
        torch.manual_seed(0)
        m = Decoder(SHAPE, max_len=MAX_LEN, device="cuda")
        with torch.no_grad():
            for p in m.parameters():
                if p.dim() >= 2:
                    p.normal_(0.0, 0.05)
        models.append(lowbit.quantize_model(m.eval(), scheme))
    assert fuse_projections(models[1])
    return models


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("tokens", [1, 5, 300], ids=["decode", "m5", "prefill"])
def test_fused_equals_unfused_eager(scheme, tokens):
    plain, fused = _pair(scheme)
    ids = torch.randint(0, SHAPE.vocab, (1, tokens), device="cuda")
    pos = torch.arange(tokens, device="cuda")
    with torch.inference_mode():
        clear_cache(plain)
        clear_cache(fused)
        want, got = plain(ids, pos), fused(ids, pos)
    assert _rel(got, want) < 2e-2, _rel(got, want)


def test_fused_members_give_the_unfused_layers_columns():
    plain, fused = _pair("w4a16-nvfp4")
    x = torch.randn(1, 1, SHAPE.hidden, device="cuda", dtype=torch.bfloat16)
    with torch.inference_mode():
        for name in ("q_proj", "k_proj", "v_proj", "mlp.gate_proj", "mlp.up_proj"):
            want = plain.layers[0].get_submodule(name)(x)
            got = fused.layers[0].get_submodule(name)(x)
            assert got.shape == want.shape and _rel(got, want) < 1e-2, name


def test_one_launch_per_group_in_a_decode_step():
    _, fused = _pair("w4a16-nvfp4")
    ids, pos = torch.zeros(1, 1, dtype=torch.long, device="cuda"), torch.tensor([3], device="cuda")
    with torch.inference_mode():
        fused(ids, pos)                      # prepare the runners
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            fused(ids, pos)
            torch.cuda.synchronize()
    gemv = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA and "gemv" in e.name]
    # per layer: q/k/v fused, o, gate/up fused, down
    assert len(gemv) == 4 * SHAPE.layers, [e.name for e in gemv]


def test_cuda_graph_replay_equals_eager():
    _, fused = _pair("w4a16-int4")
    ids, pos = torch.zeros(1, 1, dtype=torch.long, device="cuda"), torch.tensor([3], device="cuda")
    with torch.inference_mode():
        clear_cache(fused)
        want = fused(ids, pos).clone()
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            fused(ids, pos)
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            out = fused(ids, pos)
        clear_cache(fused)
        g.replay()
        torch.cuda.synchronize()
    assert torch.equal(out, want)
    assert all(m._out.x is None for m in fused.modules() if isinstance(m, FusedProjection))


def _compiled_logits(model, mode, ids, pos):
    torch._dynamo.reset()
    fn = torch.compile(lambda i, p: model(i, p), fullgraph=True, mode=mode)
    with torch.inference_mode():
        for _ in range(3):
            clear_cache(model)
            if mode:
                torch.compiler.cudagraph_mark_step_begin()
            got = fn(ids, pos).clone()
    return got


@pytest.mark.parametrize("mode", [None, "reduce-overhead"])
def test_compiled_fused_step_equals_compiled_unfused(mode):
    # both compiled: Inductor's fused norms and RoPE round differently from eager bf16 (the compiled fused
    # step measured 1.02 % from eager on these logits, with and without the static launcher), so the fused
    # model is held to the unfused one under the same compiler, and to eager more loosely
    plain, fused = _pair("w4a16-nvfp4")
    ids, pos = torch.zeros(1, 1, dtype=torch.long, device="cuda"), torch.tensor([3], device="cuda")
    with torch.inference_mode():
        clear_cache(fused)
        eager = fused(ids, pos).clone()
    want = _compiled_logits(plain, mode, ids, pos)
    got = _compiled_logits(fused, mode, ids, pos)
    assert _rel(got, want) < 1e-2
    assert _rel(got, eager) < 3e-2
