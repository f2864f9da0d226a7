"""lowbit.linear on CUDA (issue 4): the Triton GEMV/GEMM paths against the fp32 reference
``act(x.float() @ dequant(w).float().T + bias)``, CUDA-graph capture and torch.compile.

Accuracy rule (the issue's): relative Frobenius error <= 1e-2 and max |error| / max |ref| <= 2e-2.

Tests of the real kernels skip while ``lowbit.kernels.gemv_w4`` / ``gemm_w4`` do not exist; a kernel module
that exists but declines one of the five formats in their default options fails them (the issue needs all
five). ``test_plumbing_*`` run stand-in kernels (dequantize + matmul) and need no real kernel: they check the
custom op, the dispatch and capture/compile on a real device.

Run on the device machine: ``python3 -m pytest -q -p no:cacheprovider -m gpu tests/ops/test_linear_gpu.py``.
"""

from __future__ import annotations

import dataclasses
import functools
import sys
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

import lowbit

pytestmark = pytest.mark.gpu
lin = sys.modules["lowbit.ops.linear"]  # the package's `linear` attribute is the function
policy = sys.modules["lowbit.ops.policy"]

FORMATS = {
    "nvfp4": {},
    "mxfp4": {},
    "nf4": {"double_quant": True},
    "int4_awq": {"group_size": 128},
    "fp4_b32": {},
}
FMTS = list(FORMATS)
ACTS = [None, "gelu", "gelu_tanh", "silu"]
MS = [1, 2, 7, 16, 33, 128, 1000, 4096]
REL_FRO, REL_MAX = 1e-2, 2e-2


@functools.cache
def _weight(fmt: str, n: int, k: int, variant: tuple = ()) -> lowbit.QTensor:
    g = torch.Generator(device="cuda").manual_seed(n * 7 + k)
    w = (torch.randn(n, k, device="cuda", generator=g) * 0.02).to(torch.bfloat16)
    opts = dict(FORMATS[fmt]) | dict(variant)
    if fmt == "int4_awq":
        w = w.half()
    return lowbit.quantize(w, fmt, **opts)


@functools.cache
def _dequant(fmt: str, n: int, k: int, variant: tuple = ()) -> torch.Tensor:
    return lowbit.dequantize(_weight(fmt, n, k, variant), torch.float32, backend="torch")


def _inputs(m, k, n, dtype=torch.bfloat16, with_bias=False, lead=None, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed * 1000 + m)
    x = torch.randn(*(lead or (m,)), k, device="cuda", generator=g).to(dtype)
    bias = torch.randn(n, device="cuda", generator=g).to(dtype) if with_bias else None
    return x, bias


def _ref32(x, wd, bias, activation):
    """The issue's fp32 reference, written out (TF32 stays off: torch's default)."""
    y = x.float() @ wd.T
    if bias is not None:
        y = y + bias.float()
    if activation == "gelu":
        y = F.gelu(y)
    elif activation == "gelu_tanh":
        y = F.gelu(y, approximate="tanh")
    elif activation == "silu":
        y = F.silu(y)
    return y


def _assert_close(out, ref, what=""):
    assert out.shape == ref.shape, (what, out.shape, ref.shape)
    assert torch.isfinite(out).all(), f"{what}: non-finite output"
    err = out.float() - ref
    fro = (err.norm() / ref.norm()).item()
    mx = (err.abs().max() / ref.abs().max()).item()
    assert fro <= REL_FRO and mx <= REL_MAX, f"{what}: rel Frobenius {fro:.2e} (<= {REL_FRO}), max {mx:.2e} (<= {REL_MAX})"


def _need_kernels(m: int) -> None:
    gemv, gemm = policy.kernel_module("gemv_w4"), policy.kernel_module("gemm_w4")
    if gemm is None and (m > policy.GEMV_MAX_M or gemv is None):
        pytest.skip(f"no W4A16 kernel module for M={m} yet (lowbit.kernels.gemv_w4 / gemm_w4)")


def _check(fmt, m, n, k, dtype=torch.bfloat16, with_bias=False, activation=None, lead=None, variant=()):
    _need_kernels(m)
    w = _weight(fmt, n, k, variant)
    x, bias = _inputs(m, k, n, dtype, with_bias, lead)
    x_before = x.clone()
    out = lowbit.linear(x, w, bias, activation, backend="triton")
    assert out.dtype == dtype and torch.equal(x, x_before)
    ref = _ref32(x, _dequant(fmt, n, k, variant), bias, activation)
    _assert_close(out, ref, f"{lowbit.explain(x, w, backend='triton')}, bias={with_bias}, act={activation}")
    return out


# ------------------------------------------------------------------------------------------ accuracy


@pytest.mark.parametrize("m", MS)
@pytest.mark.parametrize("fmt", FMTS)
def test_m_sweep(fmt, m):
    i = MS.index(m)
    _check(fmt, m, 4096, 4096, with_bias=bool(i % 2), activation=ACTS[i % 4])


@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("activation", ACTS)
@pytest.mark.parametrize("m", [1, 16, 128])
@pytest.mark.parametrize("fmt", FMTS)
def test_bias_activation(fmt, m, activation, with_bias):
    # non-power-of-two N
    _check(fmt, m, 6144, 4096, with_bias=with_bias, activation=activation)


@pytest.mark.parametrize("m", [1, 7, 33, 1000])
@pytest.mark.parametrize("nk", [(14336, 4096), (4096, 14336)])
@pytest.mark.parametrize("fmt", FMTS)
def test_shapes(fmt, nk, m):
    _check(fmt, m, *nk, with_bias=m % 2 == 1, activation="silu" if m < 100 else "gelu")


@pytest.mark.parametrize("m", [1, 16, 4096])
@pytest.mark.parametrize("fmt", FMTS)
def test_fp16(fmt, m):
    _check(fmt, m, 4096, 4096, dtype=torch.float16, with_bias=True, activation="gelu_tanh")


@pytest.mark.parametrize("fmt", FMTS)
def test_leading_dims(fmt):
    for lead in [(2, 3), (4, 1, 64)]:
        _need_kernels(lead[0] * lead[-1])
        w = _weight(fmt, 4096, 4096)
        x, bias = _inputs(0, 4096, 4096, with_bias=True, lead=lead)
        out = lowbit.linear(x, w, bias, "silu")
        assert out.shape == (*lead, 4096)
        _assert_close(out, _ref32(x, _dequant(fmt, 4096, 4096), bias, "silu"), f"{fmt} lead={lead}")
        flat = lowbit.linear(x.reshape(-1, 4096), w, bias, "silu")
        _assert_close(out.reshape(-1, 4096), flat.float(), "leading dims vs flat")


VARIANTS = [
    ("nvfp4", (("scale_layout", "swizzled"),)),
    ("nvfp4", (("convention", "torchao"),)),
    ("mxfp4", (("scale_rounding", "floor"),)),
    ("mxfp4", (("scale_layout", "swizzled"),)),
    ("nf4", (("double_quant", False),)),
    ("nf4", (("blocksize", 128),)),
    ("int4_awq", (("group_size", 64),)),
    ("int4_awq", (("group_size", 4096),)),
]


@pytest.mark.parametrize("m", [1, 128])
@pytest.mark.parametrize("fmt,variant", VARIANTS, ids=[f"{f}-{v[0][0]}={v[0][1]}" for f, v in VARIANTS])
def test_format_variants(fmt, variant, m):
    """Other options of the five formats: the kernel runs them accurately, or linear says it cannot."""
    _need_kernels(m)
    w = _weight(fmt, 4096, 4096, variant)
    plan = lin.plan_linear((m, 4096), w, backend="triton")
    if plan.path == "unavailable":
        x, _ = _inputs(m, 4096, 4096)
        with pytest.raises(RuntimeError, match="no triton kernel runs"):
            lowbit.linear(x, w)
        assert lowbit.linear(x, w, backend="torch").shape == (m, 4096)
        pytest.xfail(f"not covered by the kernels: {plan.reason}")
    _check(fmt, m, 4096, 4096, with_bias=True, activation="gelu", variant=variant)


# ------------------------------------------------------------------------------------------ dispatch


@pytest.mark.parametrize("fmt", FMTS)
def test_dispatch(fmt):
    w = _weight(fmt, 4096, 4096)
    gemv, gemm = policy.kernel_module("gemv_w4"), policy.kernel_module("gemm_w4")
    for m in (1, policy.GEMV_MAX_M, policy.GEMV_MAX_M + 1, 4096):
        plan = lin.plan_linear((m, 4096), w)
        if m <= policy.GEMV_MAX_M and gemv is not None and gemv.supports(w) is None:
            assert plan.path == "gemv_w4", str(plan)
        elif policy.DEQUANT_GEMM_MIN_M is not None and m >= policy.dequant_gemm_min_m(w.fmt):
            assert plan.path == "dequant_gemm", str(plan)
        elif gemm is not None and gemm.supports(w) is None:
            assert plan.path == "gemm_w4", str(plan)
        else:
            assert plan.path == "unavailable" and plan.error is RuntimeError, str(plan)
        assert lin.plan_linear((m, 4096), w, backend="torch").path == "reference"
    assert lin.plan_linear((0, 4096), w).path == "empty"
    assert lowbit.linear(torch.empty(0, 4096, device="cuda", dtype=torch.bfloat16), w).shape == (0, 4096)


def test_errors_on_cuda():
    w = _weight("nvfp4", 4096, 4096)
    x = torch.randn(2, 4096, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="devices differ"):
        lowbit.linear(x, w)
    with pytest.raises(ValueError, match="devices differ"):
        lowbit.linear(x.cuda(), w, torch.zeros(4096, dtype=torch.bfloat16))


# ------------------------------------------------------------------------------------------ graphs / compile


def _capture(fn, x):
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            fn(x)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = fn(x)
    return g, out


@pytest.mark.parametrize("m", [1, 128])
@pytest.mark.parametrize("fmt", FMTS)
def test_cuda_graph(fmt, m):
    _need_kernels(m)
    w = _weight(fmt, 4096, 4096)
    x, bias = _inputs(m, 4096, 4096, with_bias=True)
    g, out = _capture(lambda t: lowbit.linear(t, w, bias, "gelu"), x)
    for seed in (1, 2):
        x.copy_(_inputs(m, 4096, 4096, seed=seed)[0])
        g.replay()
        torch.cuda.synchronize()
        _assert_close(out, _ref32(x, _dequant(fmt, 4096, 4096), bias, "gelu"), f"graph replay {fmt} M={m}")


@pytest.mark.parametrize("fmt", FMTS)
def test_torch_compile(fmt):
    _need_kernels(4096)
    torch._dynamo.reset()
    w = _weight(fmt, 4096, 4096)
    _, bias = _inputs(1, 4096, 4096, with_bias=True)

    @torch.compile(fullgraph=True)
    def f(x):
        return lowbit.linear(x, w, bias, "silu") * 0.5

    for m in (1, 16, 300):
        x, _ = _inputs(m, 4096, 4096, seed=3)
        _assert_close(f(x), 0.5 * _ref32(x, _dequant(fmt, 4096, 4096), bias, "silu"), f"compiled {fmt} M={m}")


@pytest.mark.parametrize("fmt", ["nvfp4", "int4_awq"])
def test_torch_compile_reduce_overhead(fmt):
    """torch.compile's CUDA graphs (cudagraph trees) around the custom op. Needs kernels whose per-weight
    caches key on ``w.data``: the op hands them a QTensor rebuilt on every call, and a cache keyed on the
    QTensor object re-lays the weight out inside the capture (host copies there fail)."""
    _need_kernels(1)
    torch._dynamo.reset()
    w = _weight(fmt, 4096, 4096)
    f = torch.compile(lambda x: lowbit.linear(x, w, None, "gelu_tanh"), mode="reduce-overhead", fullgraph=True)
    x, _ = _inputs(1, 4096, 4096, seed=4)
    for _ in range(3):
        out = f(x).clone()
    _assert_close(out, _ref32(x, _dequant(fmt, 4096, 4096), None, "gelu_tanh"), f"reduce-overhead {fmt}")


# ------------------------------------------------------------------------------------------ plumbing


@pytest.fixture
def stand_in_kernels(monkeypatch):
    """gemv_w4 / gemm_w4 replaced by dequantize (Triton, capturable) + matmul; records the calls."""
    calls = []

    def make(name):
        def kernel(x, w, bias, activation):
            assert x.dim() == 2 and x.is_contiguous() and x.is_cuda
            calls.append((name, x.shape[0]))
            y = x.float() @ lowbit.dequantize(w, torch.float32, backend="triton").T
            if bias is not None:
                y = y + bias.float()
            return lin.apply_activation(y, activation).to(x.dtype)

        return SimpleNamespace(supports=lambda w: None, **{name: kernel})

    modules = {"gemv_w4": make("gemv_w4"), "gemm_w4": make("gemm_w4")}
    monkeypatch.setattr(policy, "kernel_module", lambda name: modules[name])
    return calls


def test_plumbing_eager_graph_compile(stand_in_kernels):
    calls = stand_in_kernels
    w = _weight("mxfp4", 6144, 4096)
    wd = _dequant("mxfp4", 6144, 4096)
    _, bias = _inputs(1, 4096, 6144, with_bias=True)
    for m in (1, 16, 17, 256):
        x, _ = _inputs(m, 4096, 6144)
        _assert_close(lowbit.linear(x, w, bias, "gelu"), _ref32(x, wd, bias, "gelu"), f"eager M={m}")
    assert [c[0] for c in calls] == ["gemv_w4", "gemv_w4", "gemm_w4", "gemm_w4"]

    calls.clear()
    x, _ = _inputs(8, 4096, 6144)
    g, out = _capture(lambda t: lowbit.linear(t, w, bias, "silu"), x)
    x.copy_(_inputs(8, 4096, 6144, seed=5)[0])
    g.replay()
    torch.cuda.synchronize()
    _assert_close(out, _ref32(x, wd, bias, "silu"), "graph replay")

    torch._dynamo.reset()
    calls.clear()
    f = torch.compile(lambda t: lowbit.linear(t, w, bias, "gelu_tanh"), fullgraph=True, dynamic=True)
    for m in (3, 40):
        x, _ = _inputs(m, 4096, 6144)
        _assert_close(f(x), _ref32(x, wd, bias, "gelu_tanh"), f"compiled M={m}")
    # the dynamic graph chose GEMV or GEMM at run time
    assert ("gemv_w4", 3) in calls and ("gemm_w4", 40) in calls


@pytest.mark.parametrize("fmt", FMTS)
def test_kept_dequant_chunks_give_the_same_bits(fmt):
    # lowbit.linear at M >= the dequantize threshold keeps its chunk launches per weight (kept_chunks): the
    # kept calls give exactly what fresh dequantize calls give, before and after an in-place weight update
    w = _weight(fmt, 6144, 4096)
    w = dataclasses.replace(w, **{f.name: getattr(w, f.name).clone() for f in dataclasses.fields(w)
                                  if isinstance(getattr(w, f.name), torch.Tensor)})  # a weight of its own
    x, _ = _inputs(600, 4096, 6144)
    fresh = lin.linear_dequant_gemm(x, w, None, "silu", dequant_backend="triton")
    kept = [lin.linear_dequant_gemm(x, w, None, "silu") for _ in range(2)]
    assert lin.kept_chunks(w, torch.bfloat16) is lin.kept_chunks(w, torch.bfloat16)
    assert torch.equal(fresh, kept[0]) and torch.equal(fresh, kept[1])
    w.data.view(torch.uint8)[:3] ^= 0x11          # an in-place update: the kept chunks are made again
    fresh = lin.linear_dequant_gemm(x, w, None, None, dequant_backend="triton")
    assert torch.equal(fresh, lin.linear_dequant_gemm(x, w, None, None))
