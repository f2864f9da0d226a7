"""W4A16 GEMV (``lowbit.kernels.gemv_w4``) on the GPU against the fp32 reference
``act(x.float() @ lowbit.dequantize(w).float().T + bias)``: relative Frobenius error <= 1e-2 and
max |error| / max |reference| <= 2e-2.

Run on the device machine: ``python -m pytest -q -p no:cacheprovider -m gpu tests/kernels/test_gemv_w4_gpu.py``.
The first run compiles a few hundred kernel variants (Triton caches them on disk).
"""

import pytest
import torch

import lowbit
from lowbit.kernels import gemv_w4 as G
from lowbit.kernels.gemv_prepack import prepare_w4
from lowbit.testing import linear_oracle

pytestmark = pytest.mark.gpu

# name -> (format, quantize options)
FORMATS = {
    "nvfp4": ("nvfp4", {}),
    "nvfp4-swizzled": ("nvfp4", {"scale_layout": "swizzled"}),
    "mxfp4": ("mxfp4", {}),
    "fp4_b32": ("fp4_b32", {}),
    "nf4": ("nf4", {}),
    "nf4-dq": ("nf4", {"double_quant": True}),
    "int4_awq-g32": ("int4_awq", {"group_size": 32}),
    "int4_awq-g64": ("int4_awq", {"group_size": 64}),
    "int4_awq-g128": ("int4_awq", {"group_size": 128}),
}
SHAPES = [(4096, 4096), (6144, 4096), (4096, 14336), (8192, 8192)]
MS = [1, 2, 7, 16]
DTYPES = [torch.bfloat16, torch.float16]
ACTS = [None, "gelu", "gelu_tanh", "silu"]

_WEIGHTS: dict = {}


def _weight(name: str, n: int, k: int):
    key = (name, n, k)
    if key not in _WEIGHTS:
        fmt, opts = FORMATS[name]
        g = torch.Generator(device="cuda").manual_seed(hash(key) % 2**31)
        w = torch.randn(n, k, device="cuda", generator=g) * 0.05
        if fmt == "int4_awq":
            w = w.half()
        _WEIGHTS[key] = lowbit.quantize(w, fmt, **opts)
    return _WEIGHTS[key]


_reference = linear_oracle


def _assert_close(got, ref, what):
    assert torch.isfinite(got).all(), f"{what}: non-finite output"
    err = got.float() - ref
    rel = (err.norm() / ref.norm()).item()
    mx = (err.abs().max() / ref.abs().max()).item()
    assert rel <= 1e-2 and mx <= 2e-2, f"{what}: relative Frobenius error {rel:.3e}, max error / max {mx:.3e}"


def _run(name, n, k, m, dtype, bias_dtype, act, seed=0, config=None):
    q = _weight(name, n, k)
    assert G.supports(q) is None
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(m, k, device="cuda", generator=g).to(dtype)
    bias = None if bias_dtype is None else torch.randn(n, device="cuda", generator=g).to(bias_dtype)
    got = G.gemv_w4(x, q, bias, act, config=config)
    assert got.shape == (m, n) and got.dtype == dtype
    _assert_close(got, _reference(x, q, bias, act), f"{name} {n}x{k} M={m} {dtype} bias={bias_dtype} act={act}")
    return got


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
@pytest.mark.parametrize("m", MS)
@pytest.mark.parametrize("n, k", SHAPES, ids=[f"{n}x{k}" for n, k in SHAPES])
@pytest.mark.parametrize("name", list(FORMATS))
def test_formats_shapes(name, n, k, m, dtype):
    _run(name, n, k, m, dtype, dtype if m % 2 else None, None)


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("m", [1, 16])
@pytest.mark.parametrize("name", ["nvfp4", "nf4-dq", "int4_awq-g128"])
def test_epilogue(name, m, act, bias, dtype):
    _run(name, 4096, 4096, m, dtype, dtype if bias else None, act)


@pytest.mark.parametrize("m", [1, 3, 4, 8, 16])
def test_fp32_bias_and_every_m_path(m):
    # FMA kernel with MP = 1, 4 (M = 3 re-reads the last x row), dot kernel
    _run("mxfp4", 6144, 4096, m, torch.bfloat16, torch.float32, "silu")


def test_nvfp4_conventions():
    w = torch.randn(4096, 4096, device="cuda") * 0.05
    x = torch.randn(2, 4096, device="cuda", dtype=torch.bfloat16)
    for opts in ({"convention": "torchao"}, {"convention": "torchao", "global_scale": "none"},
                 {"convention": "compressed-tensors"}, {"global_scale": torch.tensor(7.5)}):
        q = lowbit.quantize(w, "nvfp4", **opts)
        _assert_close(G.gemv_w4(x, q), _reference(x, q, None, None), f"nvfp4 {opts}")


@pytest.mark.parametrize("config", [
    {"fma": {"bn": 32, "chunks": 4, "warps": 4, "stages": 2}, "ctas_per_sm": 8},
    {"fma": {"bn": 64, "chunks": 8, "warps": 4, "stages": 3}},
    {"fma": {"bn": 32, "chunks": 32, "warps": 8, "stages": 4}, "ctas_per_sm": 2},
    {"fma": {"bn": 16, "chunks": 16, "warps": 4, "stages": 2}, "max_split": 1},
    {"fma": {"bn": 128, "chunks": 16, "warps": 8, "stages": 4}, "max_split": 1},
    {"fma_max_m": 0, "dot": {"bn": 128, "chunks": 4, "warps": 8, "stages": 3}},
    {"fma_max_m": 4, "min_iters": 1, "max_split": 64, "ws_ratio": 4.0},
])
@pytest.mark.parametrize("name", ["nvfp4", "nf4", "int4_awq-g128"])
def test_tile_variants(name, config):
    cfg = {**G.TILE, **config}
    for m in (1, 4, 16):
        _run(name, 4096, 14336, m, torch.bfloat16, None, None, config=cfg)


def test_repeated_split_k_calls_are_identical():
    # the split-K tile counters reset themselves; back-to-back launches on one stream reuse them
    q = _weight("nvfp4", 4096, 4096)
    x = torch.randn(1, 4096, device="cuda", dtype=torch.bfloat16)
    first = G.gemv_w4(x, q)
    for _ in range(20):
        assert torch.equal(G.gemv_w4(x, q), first)


def test_cuda_graph_capture():
    q1, q16 = _weight("int4_awq-g128", 4096, 4096), _weight("nvfp4", 8192, 8192)
    bias = torch.randn(8192, device="cuda", dtype=torch.bfloat16)
    x1 = torch.randn(1, 4096, device="cuda", dtype=torch.bfloat16)
    x16 = torch.randn(16, 8192, device="cuda", dtype=torch.bfloat16)
    prepare_w4(q1)
    prepare_w4(q16)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):  # warm up (compile) outside the capture
        G.gemv_w4(x1, q1, activation="gelu")
        G.gemv_w4(x16, q16, bias, "silu")
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y1 = G.gemv_w4(x1, q1, activation="gelu")
        y16 = G.gemv_w4(x16, q16, bias, "silu")
    for _ in range(3):
        x1.copy_(torch.randn_like(x1))
        x16.copy_(torch.randn_like(x16))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(y1, G.gemv_w4(x1, q1, activation="gelu"))
        assert torch.equal(y16, G.gemv_w4(x16, q16, bias, "silu"))
        _assert_close(y16, _reference(x16, q16, bias, "silu"), "graph replay")


def test_prepare_cache_and_inputs():
    q = _weight("int4_awq-g64", 4096, 4096)
    p = prepare_w4(q)
    assert prepare_w4(q) is p and prepare_w4(p) is p
    x = torch.randn(3, 4096, device="cuda", dtype=torch.float16)
    ref = G.gemv_w4(x, q)
    assert torch.equal(G.gemv_w4(x, p), ref)
    # non-contiguous and misaligned x are copied
    xt = x.t().contiguous().t()
    assert torch.equal(G.gemv_w4(xt, q), ref)
    buf = torch.empty(3 * 4096 + 1, device="cuda", dtype=torch.float16)
    xm = buf[1:].view(3, 4096)
    xm.copy_(x)
    assert torch.equal(G.gemv_w4(xm, q), ref)
    # direct launch (cached compiled kernel) and Triton's normal launch agree
    from lowbit.kernels import _launch

    _launch.DIRECT_LAUNCH = False
    try:
        assert torch.equal(G.gemv_w4(x, q), ref)
    finally:
        _launch.DIRECT_LAUNCH = True
