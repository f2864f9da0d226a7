"""lowbit.scaled_mm on CUDA (issue 5): the Triton block-scaled GEMMs against ``scaled_mm_reference``, the compat
entry points on the device, CUDA-graph capture and torch.compile.

Accuracy rule: the operands are already quantized, so every pair is exact up to fp32 accumulation order:
relative Frobenius error <= 1e-3 and max |error| / max |ref| <= 1e-2 against the fp32 reference (each operand
dequantized by the torch reference, fp32 matmul, alpha, bias), for float32 and bfloat16 outputs (a bfloat16
result is compared with the reference rounded once to bfloat16).

Tests of the real kernel skip while ``lowbit.kernels.scaled_mm`` does not exist; once it exists, a pair it
declines fails (the issue needs all of them on the H100). ``test_plumbing_*`` run a stand-in kernel
(dequantize + matmul) and need no real kernel: they check the custom ops, the dispatch, graph capture and
compile on a real device.

Run on the device machine: ``python3 -m pytest -q -p no:cacheprovider -m gpu tests/ops/test_scaled_mm_gpu.py``
(kept under a minute on an H100: a few shapes per pair).
"""

from __future__ import annotations

import functools
import sys
from types import SimpleNamespace

import pytest
import torch

import lowbit
from lowbit.compat import deepseek as D
from lowbit.compat import lightx2v as L
from lowbit.ops import scaled_linear, scaled_mm_reference

pytestmark = pytest.mark.gpu
smm = sys.modules["lowbit.ops.scaled_mm"]
smm_dispatch = sys.modules["lowbit.ops.scaled_mm_dispatch"]
policy = sys.modules["lowbit.ops.policy"]

REL_FRO, REL_MAX = 1e-3, 1e-2
# (name, activation format, options, weight format, options)
PAIRS = [
    ("fp8_block", "fp8_block", (), "fp8_block", (("block", (128, 128)),)),
    (
        "fp8_block-ue8m0",
        "fp8_block",
        (("scale_fmt", "ue8m0"),),
        "fp8_block",
        (("block", (128, 128)), ("scale_fmt", "ue8m0")),
    ),
    (
        "fp8_block-colmajor",
        "fp8_block",
        (("scale_layout", "column_major"),),
        "fp8_block",
        (("block", (128, 128)),),
    ),
    ("nvfp4", "nvfp4", (), "nvfp4", ()),
    ("nvfp4-swizzled", "nvfp4", (("scale_layout", "swizzled"),), "nvfp4", (("scale_layout", "swizzled"),)),
    ("mxfp4", "mxfp4", (), "mxfp4", ()),
    ("mxfp4-swizzled", "mxfp4", (("scale_layout", "swizzled"),), "mxfp4", (("scale_layout", "swizzled"),)),
    ("mxfp8", "mxfp8_e4m3", (), "mxfp8_e4m3", ()),
    ("mxfp8-e5m2", "mxfp8_e5m2", (), "mxfp8_e4m3", ()),
    ("mxfp6xmxfp8", "mxfp6_e2m3", (), "mxfp8_e4m3", ()),
    ("mxfp8xmxfp6", "mxfp8_e4m3", (), "mxfp6_e3m2", ()),
    ("w4a8-rowwise-nvfp4", "fp8_rowwise", (), "nvfp4", ()),
    ("w4a8-rowwise-mxfp4", "fp8_rowwise", (), "mxfp4", ()),
    ("w4a8-block-mxfp4", "fp8_block", (), "mxfp4", ()),
    ("w4a8-block-nvfp4", "fp8_block", (), "nvfp4", ()),
]
PAIR = {p[0]: p[1:] for p in PAIRS}
IDS = [p[0] for p in PAIRS]
MS = [1, 16, 33, 128, 1000, 4096]
# N x K from DeepSeek-V3 and Llama: (7168, 2048), (2112, 7168), (4096, 4096), (6144, 4096)
SHAPES = [(7168, 2048), (2112, 7168), (4096, 4096), (6144, 4096)]


def _quantize(x, fmt, opts):
    # fp8_rowwise has no Triton quantize kernel: its torch reference runs on the device
    return lowbit.quantize(x, fmt, backend="torch" if fmt == "fp8_rowwise" else None, **dict(opts))


@functools.cache
def _weight(fmt, opts, n, k):
    g = torch.Generator(device="cuda").manual_seed(n * 7 + k)
    w = (torch.randn(n, k, device="cuda", generator=g) * 0.02).to(torch.bfloat16)
    return _quantize(w, fmt, opts)


def _act(fmt, opts, m, k, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed * 1000 + m)
    x = torch.randn(m, k, device="cuda", generator=g).to(torch.bfloat16)
    return x, _quantize(x, fmt, opts)


def _bias(n, dtype=torch.bfloat16):
    g = torch.Generator(device="cuda").manual_seed(n)
    return torch.randn(n, device="cuda", generator=g).to(dtype)


def _assert_close(out, ref, what=""):
    assert out.shape == ref.shape, (what, out.shape, ref.shape)
    assert torch.isfinite(out).all(), f"{what}: non-finite output"
    want = ref if out.dtype == torch.float32 else ref.to(out.dtype).float()
    err = out.float() - want
    fro = (err.norm() / want.norm()).item()
    mx = (err.abs().max() / want.abs().max()).item()
    assert fro <= REL_FRO and mx <= REL_MAX, (
        f"{what}: rel Frobenius {fro:.2e} (<= {REL_FRO}), max {mx:.2e} (<= {REL_MAX})"
    )


def _need_kernel():
    if policy.kernel_module(smm.KERNEL_MODULE) is None:
        pytest.skip("no lowbit.kernels.scaled_mm yet")


def _check(name, m, n, k, alpha=None, with_bias=False, out_dtype=torch.bfloat16):
    _need_kernel()
    af, ao, wf, wo = PAIR[name]
    w = _weight(wf, wo, n, k)
    _, a = _act(af, ao, m, k)
    bias = _bias(n) if with_bias else None
    plan = smm_dispatch.plan_scaled_mm(a, w)
    assert plan.path == "scaled_mm", str(plan)
    before = {key: t.clone() for key, t in a.tensors().items()}
    out = lowbit.scaled_mm(a, w, alpha, bias, out_dtype)
    assert out.dtype == out_dtype and out.shape == (m, n)
    assert all(torch.equal(t, before[key]) for key, t in a.tensors().items())
    ref = scaled_mm_reference(a, w, alpha, bias, torch.float32, dequant_backend="torch")
    _assert_close(out, ref, f"{plan}, alpha={alpha}, bias={with_bias}, out={out_dtype}")
    return out


# ------------------------------------------------------------------------------------------ accuracy


@pytest.mark.parametrize("m", MS)
@pytest.mark.parametrize("name", IDS)
def test_m_sweep(name, m):
    i = MS.index(m)
    n, k = SHAPES[i % len(SHAPES)]
    alpha = torch.tensor([0.5], device="cuda") if i % 2 else None
    _check(
        name, m, n, k, alpha=alpha, with_bias=i % 3 == 0, out_dtype=torch.float32 if i % 2 else torch.bfloat16
    )


@pytest.mark.parametrize("out_dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("name", ["fp8_block", "nvfp4", "mxfp4", "w4a8-rowwise-mxfp4"])
def test_out_dtypes_and_bias_dtypes(name, out_dtype):
    _need_kernel()
    af, ao, wf, wo = PAIR[name]
    w = _weight(wf, wo, 4096, 4096)
    _, a = _act(af, ao, 77, 4096, seed=1)
    for bias_dtype in (torch.bfloat16, torch.float32):
        bias = _bias(4096, bias_dtype)
        out = lowbit.scaled_mm(a, w, 2.0, bias, out_dtype)
        ref = scaled_mm_reference(a, w, 2.0, bias, torch.float32, dequant_backend="torch")
        _assert_close(out, ref, f"{name} out={out_dtype} bias={bias_dtype}")


def test_empty_and_dispatch():
    w = _weight("nvfp4", (), 4096, 4096)
    a = lowbit.quantize(torch.empty(0, 4096, device="cuda", dtype=torch.bfloat16), "nvfp4", backend="torch")
    assert smm_dispatch.plan_scaled_mm(a, w).path == "empty"
    assert lowbit.scaled_mm(a, w).shape == (0, 4096)
    _, a = _act("nvfp4", (), 4, 4096)
    assert smm_dispatch.plan_scaled_mm(a, w, backend="torch").path == "reference"
    plan = smm_dispatch.plan_scaled_mm(a, w)
    module = policy.kernel_module(smm.KERNEL_MODULE)
    if module is None:
        assert plan.path == "unavailable" and plan.error is RuntimeError
        with pytest.raises(RuntimeError, match="no triton kernel runs lowbit.scaled_mm"):
            lowbit.scaled_mm(a, w)
    assert lowbit.scaled_mm(a, w, backend="torch").shape == (4, 4096)
    with pytest.raises(ValueError, match="devices differ"):
        lowbit.scaled_mm(a, w.to("cpu"))
    with pytest.raises(ValueError, match="devices differ"):
        lowbit.scaled_mm(a, w, torch.tensor(1.0))


@pytest.mark.parametrize("name", ["fp8_block", "nvfp4", "w4a8-block-mxfp4", "mxfp8"])
def test_scaled_linear(name):
    _need_kernel()
    af, ao, wf, wo = PAIR[name]
    w = _weight(wf, wo, 6144, 4096)
    g = torch.Generator(device="cuda").manual_seed(5)
    x = torch.randn(2, 9, 4096, device="cuda", generator=g, dtype=torch.bfloat16)
    bias = _bias(6144)
    out = scaled_linear(x, w, af, act_options=dict(ao), bias=bias)
    a = _quantize(x.reshape(18, 4096), af, ao)
    ref = scaled_mm_reference(a, w, None, bias, torch.float32, dequant_backend="torch")
    _assert_close(out.reshape(18, 6144), ref, f"scaled_linear {name}")


# ------------------------------------------------------------------------------------------ compat


@pytest.mark.parametrize("m", [1, 128, 1000])
def test_lightx2v_nvfp4(m):
    g = torch.Generator(device="cuda").manual_seed(m)
    x = torch.randn(m, 4096, device="cuda", generator=g, dtype=torch.bfloat16)
    w = torch.randn(4096, 4096, device="cuda", generator=g, dtype=torch.bfloat16) * 0.02
    gs_w = (2688.0 / w.abs().max()).float()
    gs_x = (2688.0 / torch.tensor(5.0, device="cuda")).float()
    wq, ws = L.scaled_nvfp4_quant(w, gs_w)
    xq, xs = L.scaled_nvfp4_quant(x, gs_x)
    # the quantize kernels on the device are bit-identical to the CPU reference
    cq, cs = L.scaled_nvfp4_quant(x.cpu(), gs_x.cpu())
    assert torch.equal(xq.cpu(), cq) and torch.equal(xs.view(torch.uint8).cpu(), cs.view(torch.uint8))
    assert xs.shape == (-(-m // 128) * 128, 256) and xs.dtype == torch.float8_e4m3fn
    bias = _bias(4096).reshape(1, 4096)
    alpha = 1.0 / (gs_x * gs_w)
    _need_kernel()
    out = L.cutlass_scaled_nvfp4_mm(xq, wq, xs, ws, alpha, bias)
    assert out.dtype == torch.bfloat16 and out.shape == (m, 4096)
    qa = lowbit.QTensor(xq, xs, "nvfp4", (m, 4096), torch.bfloat16, scale_layout="swizzled")
    qw = lowbit.QTensor(wq, ws, "nvfp4", (4096, 4096), torch.bfloat16, scale_layout="swizzled")
    ref = scaled_mm_reference(qa, qw, alpha, bias.reshape(4096), torch.float32, dequant_backend="torch")
    _assert_close(out, ref, f"lightx2v nvfp4 M={m}")


@pytest.mark.parametrize("kind", ["mxfp4", "mxfp8", "mxfp6_mxfp8"])
def test_lightx2v_mx(kind):
    g = torch.Generator(device="cuda").manual_seed(7)
    x = torch.randn(300, 4096, device="cuda", generator=g, dtype=torch.bfloat16)
    w = torch.randn(2048, 4096, device="cuda", generator=g, dtype=torch.bfloat16) * 0.02
    quant_a = L.scaled_mxfp4_quant if kind == "mxfp4" else L.scaled_mxfp8_quant
    quant_b = {
        "mxfp4": L.scaled_mxfp4_quant,
        "mxfp8": L.scaled_mxfp8_quant,
        "mxfp6_mxfp8": L.scaled_mxfp6_quant,
    }[kind]
    mm = {
        "mxfp4": L.cutlass_scaled_mxfp4_mm,
        "mxfp8": L.cutlass_scaled_mxfp8_mm,
        "mxfp6_mxfp8": L.cutlass_scaled_mxfp6_mxfp8_mm,
    }[kind]
    (a, sa), (b, sb) = quant_a(x), quant_b(w)
    ca, csa = quant_a(x.cpu())
    assert torch.equal(a.cpu(), ca) and torch.equal(sa.view(torch.uint8).cpu(), csa.view(torch.uint8))
    _need_kernel()
    alpha = torch.ones(1, device="cuda")
    out = mm(a, b, sa, sb, alpha)
    fa = "mxfp4" if kind == "mxfp4" else "mxfp8_e4m3"
    fb = {"mxfp4": "mxfp4", "mxfp8": "mxfp8_e4m3", "mxfp6_mxfp8": "mxfp6_e3m2"}[kind]
    qa = L._operand(a, sa, fa, 300, 4096)
    qb = L._operand(b, sb, fb, 2048, 4096)
    _assert_close(out, scaled_mm_reference(qa, qb, alpha, None, torch.float32, dequant_backend="torch"), kind)


@pytest.mark.parametrize("m", [1, 16, 4096])
def test_deepseek(m):
    g = torch.Generator(device="cuda").manual_seed(m)
    x = torch.randn(m, 7168, device="cuda", generator=g, dtype=torch.bfloat16)
    wq = _weight("fp8_block", (("block", (128, 128)),), 2112, 7168)
    y, s = D.act_quant(x, 128, "ue8m0")
    cy, cs = D.act_quant(x.cpu(), 128, "ue8m0")
    assert torch.equal(y.view(torch.uint8).cpu(), cy.view(torch.uint8)) and torch.equal(s.cpu(), cs)
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        deq = D.weight_dequant(wq.data, wq.scale)
        assert deq.dtype == torch.bfloat16
        _need_kernel()
        c = D.fp8_gemm(y, s, wq.data, wq.scale)
    finally:
        torch.set_default_dtype(old)
    assert c.dtype == torch.bfloat16 and c.shape == (m, 2112)
    qa = lowbit.quantize(x, "fp8_block", scale_fmt="ue8m0")
    _assert_close(
        c, scaled_mm_reference(qa, wq, None, None, torch.float32, dequant_backend="torch"), f"deepseek M={m}"
    )


# ------------------------------------------------------------------------------------------ graphs / compile


def _assert_bias_pass(out, plain, bias, ref_plain, what=""):
    """DeepGEMM has no bias epilogue: its routes add a bias to the bf16 product in one more pass. ``out`` must be
    that sum rounded once, and the product without the bias (``plain``) within the usual tolerance of the
    reference (a bias added after the product's rounding differs from cuBLASLt's epilogue by up to one bf16 ulp
    of the product, which the reference comparison of the sum would count twice)."""
    assert torch.equal(out, (plain.float() + bias.float()).to(torch.bfloat16)), f"{what}: not product + bias"
    _assert_close(plain, ref_plain, f"{what} (product)")


def _capture(fn, x):
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            fn(x)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn(x)
    return graph, out


@pytest.mark.parametrize("name", ["fp8_block", "mxfp8", "w4a8-block-mxfp4"])
def test_cuda_graph(name):
    """scaled_linear with dynamic activation quantization, captured and replayed on new inputs."""
    _need_kernel()
    af, ao, wf, wo = PAIR[name]
    w = _weight(wf, wo, 4096, 4096)
    bias = _bias(4096)
    x, _ = _act(af, ao, 64, 4096)
    graph, out = _capture(lambda t: scaled_linear(t, w, af, act_options=dict(ao), bias=bias), x)
    for seed in (1, 2):
        x.copy_(_act(af, ao, 64, 4096, seed=seed)[0])
        graph.replay()
        torch.cuda.synchronize()
        a = _quantize(x, af, ao)
        _assert_close(
            out,
            scaled_mm_reference(a, w, None, bias, torch.float32, dequant_backend="torch"),
            f"graph replay {name}",
        )


@pytest.mark.parametrize("name", ["fp8_block", "nvfp4"])
def test_torch_compile(name):
    _need_kernel()
    torch._dynamo.reset()
    af, ao, wf, wo = PAIR[name]
    w = _weight(wf, wo, 4096, 4096)
    bias = _bias(4096)

    @torch.compile(fullgraph=True)
    def f(x):
        return scaled_linear(x, w, af, act_options=dict(ao), bias=bias, out_dtype=torch.float32) * 0.5

    for m in (1, 16, 300):
        x, a = _act(af, ao, m, 4096, seed=3)
        ref = scaled_mm_reference(a, w, None, bias, torch.float32, dequant_backend="torch")
        _assert_close(f(x), 0.5 * ref, f"compiled {name} M={m}")


# ------------------------------------------------------------------------------------------ plumbing


@pytest.fixture
def stand_in_kernel(monkeypatch):
    """lowbit.kernels.scaled_mm replaced by dequantize (torch on the device, capturable) + matmul."""
    calls = []

    def kernel(a, b, alpha, bias, out_dtype, route):
        assert a.data.is_cuda and (alpha is None or (alpha.shape == (1,) and alpha.dtype == torch.float32))
        assert bias is None or bias.is_contiguous()
        calls.append((a.fmt, b.fmt, a.shape[0]))
        return scaled_mm_reference(a, b, alpha, bias, out_dtype, dequant_backend="torch")

    cannot = lambda *args: "stand-in"  # noqa: E731 - only the "kernel" route
    module = SimpleNamespace(supports=lambda a, b: None, scaled_mm=kernel, gemv_unsupported=cannot,
                             fold_unsupported=cannot, cublas_unsupported=cannot)
    monkeypatch.setattr(policy, "kernel_module", lambda name: module)
    return calls


def test_plumbing_eager_graph_compile(stand_in_kernel):
    calls = stand_in_kernel
    af, ao, wf, wo = PAIR["fp8_block"]
    w = _weight(wf, wo, 2112, 7168)
    bias = _bias(2112)
    for m in (1, 33):
        x, a = _act(af, ao, m, 7168)
        out = lowbit.scaled_mm(a, w, 0.5, bias)
        _assert_close(
            out, scaled_mm_reference(a, w, 0.5, bias, torch.float32, dequant_backend="torch"), f"M={m}"
        )
    assert [c[2] for c in calls] == [1, 33]

    x, _ = _act(af, ao, 8, 7168)
    graph, out = _capture(lambda t: scaled_linear(t, w, af, bias=bias), x)
    x.copy_(_act(af, ao, 8, 7168, seed=5)[0])
    graph.replay()
    torch.cuda.synchronize()
    a = _quantize(x, af, ao)
    _assert_close(
        out, scaled_mm_reference(a, w, None, bias, torch.float32, dequant_backend="torch"), "graph replay"
    )

    torch._dynamo.reset()
    calls.clear()
    f = torch.compile(
        lambda t: scaled_linear(t, w, af, bias=bias, out_dtype=torch.float32), fullgraph=True, dynamic=True
    )
    for m in (3, 40):
        x, a = _act(af, ao, m, 7168, seed=6)
        _assert_close(
            f(x),
            scaled_mm_reference(a, w, None, bias, torch.float32, dequant_backend="torch"),
            f"compiled M={m}",
        )
    assert [c[2] for c in calls] == [3, 40]


# ------------------------------------------------------------------------------------- fp8_block TMA path


@pytest.mark.parametrize("m", [1, 33, 1000, 4096])
@pytest.mark.parametrize("n, k", [(2112, 7168), (384, 1600)])
def test_fp8_block_tma_and_pointer_kernels_agree(m, n, k):
    """The TMA kernel (aligned operands, every shipped config) and the pointer kernel it falls back to (a
    base that is not 16-byte aligned) both match the reference, including N and K that are not multiples of
    the 128 tile (TMA zero-fills past the edges) and with bias and alpha."""
    _need_kernel()
    from dataclasses import replace

    from lowbit.kernels import scaled_mm as ks

    af, ao, wf, wo = PAIR["fp8_block"]
    w = _weight(wf, wo, n, k)
    _, a = _act(af, ao, m, k, seed=3)
    bias = _bias(n)
    alpha = torch.full((1,), 0.75, device="cuda")
    ref = scaled_mm_reference(a, w, alpha, bias, torch.float32, dequant_backend="torch")
    for limit, cfg in ks.FP8_CONFIGS:
        out = ks.scaled_mm(a, w, alpha, bias, torch.float32, config=cfg)
        _assert_close(out, ref, f"config {cfg} (for M <= {limit})")
    # a copy of a.data one byte into a buffer: same values, base not 16-byte aligned -> pointer kernel
    buf = torch.empty(m * k + 16, dtype=torch.uint8, device="cuda")
    shifted = buf[1 : 1 + m * k].view(torch.float8_e4m3fn).view(m, k)
    shifted.copy_(a.data)
    assert shifted.data_ptr() % 16 == 1
    a_shifted = replace(a, data=shifted)
    out = ks.scaled_mm(a_shifted, w, alpha, bias, torch.float32, config=ks.ONE_PARTITION_CONFIG)
    _assert_close(out, ref, "unaligned a.data (pointer kernel)")


@pytest.mark.parametrize("m, c", [(1, 1), (37, 300), (1000, 512), (2049, 1280)])
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("extras", ["scales", "scales+alpha", "b-only+bias-bf16", "all+bias-fp32"])
def test_dequant_epilogue_equals_the_torch_steps(m, c, out_dtype, extras):
    """The dequant route's one-pass epilogue gives the bits of the torch ops it replaced (mul by 1 / global
    scale of a, of b, alpha, add the bias in fp32, one rounding), on values that round to ties in the output
    dtype, fp32 subnormals, +-Inf and NaN, into the columns of a wider output (row stride > C)."""
    _need_kernel()
    from lowbit.kernels.scaled_mm_routes import dequant_epilogue

    g = torch.Generator(device="cuda").manual_seed(m * 7 + c)
    acc = torch.randn(m, c, device="cuda", generator=g) * 1000
    flat = acc.view(-1)
    flat[::7] = flat[::7].to(torch.bfloat16).float() * (1 + 2 ** -9)  # ties of bf16 after scaling by 1
    flat[3::11] = 1e-40
    if flat.numel() > 20:
        flat[5], flat[6], flat[7] = float("inf"), float("-inf"), float("nan")
    inv_a = torch.tensor([1.0 / 3.0], device="cuda")
    inv_b = torch.tensor([0.7], device="cuda")
    alpha = torch.tensor([1.25], device="cuda")
    bias = torch.randn(c, device="cuda", generator=g)
    args = {"scales": (inv_a, inv_b, None, None), "scales+alpha": (inv_a, inv_b, alpha, None),
            "b-only+bias-bf16": (None, inv_b, None, bias.to(torch.bfloat16)),
            "all+bias-fp32": (inv_a, inv_b, alpha, bias)}[extras]
    ia, ib, al, bi = args
    want = acc.clone()
    for f in (ia, ib, al):
        if f is not None:
            want.mul_(f)
    if bi is not None:
        want.add_(bi.to(torch.float32))
    wide = torch.full((m, c + 40), 7.0, device="cuda", dtype=out_dtype)
    expected = wide.clone()
    expected[:, 3:3 + c] = want
    dequant_epilogue(acc, wide[:, 3:3 + c], ia, ib, al, bi)
    same = (wide == expected) | (wide.isnan() & expected.isnan())
    assert same.all(), (wide[~same][:5], expected[~same][:5])


WS_CONFIG = {"BM": 128, "BN": 128, "BK": 128, "GROUP_M": 8, "num_warps": 4, "num_stages": 4, "tma": True,
             "ws": True}  # also the shipped config for M > 1024 (scaled_mm.WS_CONFIG)


@pytest.mark.parametrize("m", [1, 33, 1000, 4096])
@pytest.mark.parametrize("n, k", [(2112, 7168), (384, 1600), (7168, 2048), (1004, 1664)])
@pytest.mark.parametrize("name", ["fp8_block", "fp8_block-ue8m0", "fp8_block-colmajor"])
def test_fp8_block_warp_specialized_kernel(name, m, n, k):
    """The Gluon warp-specialized kernel matches the reference (tiles past M, N and K zero-filled by TMA, bias,
    alpha, both output dtypes, BN 64 and 128, 4 and 6 stages; the output through TMA stores, and through plain
    stores where a bf16 row is not a multiple of 16 bytes: N = 1004) and, for fp32 output, equals the
    one-partition TMA kernel with 64-row tiles bit for bit: both promote the same four m64n128k32 wgmmas per K
    tile the same way."""
    _need_kernel()
    from lowbit.kernels import scaled_mm as ks

    af, ao, wf, wo = PAIR[name]
    w = _weight(wf, wo, n, k)
    _, a = _act(af, ao, m, k, seed=5)
    bias = _bias(n)
    alpha = torch.full((1,), 0.75, device="cuda")
    for extras in (False, True):
        al, bi = (alpha, bias) if extras else (None, None)
        ref = scaled_mm_reference(a, w, al, bi, torch.float32, dequant_backend="torch")
        one_partition = ks.scaled_mm(a, w, al, bi, torch.float32, config=ks.ONE_PARTITION_CONFIG)
        for cfg in (WS_CONFIG, {**WS_CONFIG, "BN": 64, "num_stages": 6}):
            out = ks.scaled_mm(a, w, al, bi, torch.float32, config=cfg)
            _assert_close(out, ref, f"ws {cfg} extras={extras}")
            if cfg["BN"] == 128:
                assert torch.equal(out, one_partition), (out - one_partition).abs().max()
            out16 = ks.scaled_mm(a, w, al, bi, torch.bfloat16, config=cfg)
            _assert_close(out16, ref, f"ws bf16 {cfg} extras={extras}")


def test_fp8_block_warp_specialized_per_row_weight_scales():
    """Weight scales per row (block (1, 128); the op layer takes 128 x 128 weights, the kernel layer both): a
    ws config falls back to the one-partition kernel, which takes a vector of weight scales per K tile."""
    _need_kernel()
    from lowbit.kernels import scaled_mm as ks
    from lowbit.kernels.scaled_mm_launch import launch_fp8_block_tma

    m, n, k = 1000, 2112, 1600
    g = torch.Generator(device="cuda").manual_seed(21)
    w = lowbit.quantize((torch.randn(n, k, device="cuda", generator=g) * 0.02).to(torch.bfloat16), "fp8_block")
    _, a = _act("fp8_block", (), m, k, seed=6)
    ref = lowbit.dequantize(a, torch.float32) @ lowbit.dequantize(w, torch.float32).T
    outs = []
    for cfg in (WS_CONFIG, ks.ONE_PARTITION_CONFIG):
        out = torch.empty(m, n, device="cuda", dtype=torch.float32)
        launch_fp8_block_tma([a.data, a.scale, None, None, *a.scale.stride()],
                             [w.data, w.scale, None, None, *w.scale.stride()],
                             {"ROWS_PER_SCALE": 1}, m, n, k, None, None, out, cfg)
        _assert_close(out, ref, f"per-row weight scales {cfg}")
        outs.append(out)
    assert torch.equal(outs[0], outs[1])


# ----------------------------------------------------------------------------- decode through the GEMV


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("m", [1, 2, 7, 16])
@pytest.mark.parametrize(
    "name", ["nvfp4", "nvfp4-swizzled", "mxfp4", "mxfp4-swizzled", "w4a8-rowwise-nvfp4", "w4a8-rowwise-mxfp4"]
)
def test_decode_gemv_route(name, m, out_dtype):
    """M <= 16 with a 4-bit weight runs the W4A16 GEMV on the exactly decoded activation; with alpha and bias
    (applied after the activation's leftover scales) it matches the reference like the GEMM."""
    _need_kernel()
    from lowbit.kernels import scaled_mm as ks

    af, ao, wf, wo = PAIR[name]
    w = _weight(wf, wo, 6144, 4096)
    _, a = _act(af, ao, m, 4096, seed=11)
    assert policy.scaled_route(a, w, None, out_dtype) == "gemv"
    plan = smm_dispatch.plan_scaled_mm(a, w)
    assert plan.path == "scaled_mm" and "GEMV" in plan.reason, str(plan)
    bias = _bias(6144)
    for alpha in (None, 0.375):
        out = lowbit.scaled_mm(a, w, alpha, bias, out_dtype)
        assert out.dtype == out_dtype
        ref = scaled_mm_reference(a, w, alpha, bias, torch.float32, dequant_backend="torch")
        _assert_close(out, ref, f"{plan}, alpha={alpha}")
    # the GEMM on the same operands (an explicit config skips the route) agrees too
    gemm = ks.scaled_mm(a, w, None, None, torch.float32, config=ks.CONFIGS[0][1])
    _assert_close(gemm, scaled_mm_reference(a, w, None, None, torch.float32, dequant_backend="torch"), "GEMM")


def test_decode_gemv_route_nvfp4_activation_global_scale_and_graph():
    """The activation's global scale (nvfp4 two-level) is applied in the GEMV epilogue; the route captures in a
    CUDA graph (no host copies) and replays with new activation values."""
    _need_kernel()
    af, ao, wf, wo = PAIR["nvfp4"]
    w = _weight(wf, wo, 2112, 7168)
    _, a = _act(af, ao, 4, 7168, seed=12)
    assert a.global_scale is not None
    ref = scaled_mm_reference(a, w, None, None, torch.float32, dequant_backend="torch")
    _assert_close(lowbit.scaled_mm(a, w, out_dtype=torch.float32), ref, "eager")
    x, _ = _act(af, ao, 4, 7168, seed=13)
    graph, out = _capture(lambda t: scaled_linear(t, w, af, out_dtype=torch.float32), x)
    x.copy_(_act(af, ao, 4, 7168, seed=14)[0])
    graph.replay()
    torch.cuda.synchronize()
    a2 = _quantize(x, af, ao)
    _assert_close(out, scaled_mm_reference(a2, w, None, None, torch.float32, dequant_backend="torch"), "replay")


@pytest.mark.parametrize("name", ["fp8_block", "mxfp8", "w4a8-block-mxfp4", "mxfp6xmxfp8"])
@pytest.mark.parametrize("m", [1, 5, 64])
def test_decode_split_k(name, m):
    """Small M splits K over programs (the last program of a tile reduces the partials); repeated calls reuse
    the arrival counters, so a second call must give the same result."""
    _need_kernel()
    from lowbit.kernels.scaled_mm_launch import config_for, split_k

    af, ao, wf, wo = PAIR[name]
    n, k = 2112, 7168
    w = _weight(wf, wo, n, k)
    _, a = _act(af, ao, m, k, seed=21)
    cfg = config_for(m, name == "fp8_block")
    split, _ = split_k(-(-m // cfg["BM"]) * -(-n // cfg["BN"]), k // 128, 128, cfg, a.data.device)
    assert split > 1
    bias = _bias(n)
    ref = scaled_mm_reference(a, w, 0.5, bias, torch.float32, dequant_backend="torch")
    first = lowbit.scaled_mm(a, w, 0.5, bias, torch.float32)
    _assert_close(first, ref, f"{name} M={m} split={split}")
    assert torch.equal(lowbit.scaled_mm(a, w, 0.5, bias, torch.float32), first)


@pytest.mark.parametrize("name", ["mxfp4", "nvfp4-swizzled"])
def test_decode_gemv_route_captured_cold(name):
    """A weight whose GEMV layouts were never made (no eager call first) can be captured: the capture does not
    build or cache them (the MXFP4 layout check would read the scales on the host), it runs the FMA/dot GEMV."""
    _need_kernel()
    af, ao, wf, wo = PAIR[name]
    g = torch.Generator(device="cuda").manual_seed(77)
    w = _quantize((torch.randn(1024, 2048, device="cuda", generator=g) * 0.02).to(torch.bfloat16), wf, wo)
    _, a = _act(af, ao, 8, 2048, seed=31)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = lowbit.scaled_mm(a, w, None, None, torch.float32)
    graph.replay()
    torch.cuda.synchronize()
    _assert_close(out, scaled_mm_reference(a, w, None, None, torch.float32, dequant_backend="torch"), "replay")


# --------------------------------------------------------------- cuBLASLt block-scaled FP8 (cublas route)

CUBLAS_CASES = [  # (name, M, N, K, alpha, bias dtype, out dtype, cuBLAS expected)
    ("fp8_block", 128, 7168, 2048, None, None, torch.bfloat16, True),
    ("fp8_block-ue8m0", 1000, 2112, 7168, 0.75, torch.bfloat16, torch.bfloat16, True),
    ("fp8_block-colmajor", 4096, 4096, 4096, 2.0, torch.float16, torch.float16, True),
    ("fp8_block", 256, 1024, 1408, None, None, torch.float32, True),          # K/128 = 11: padded weight scales
    ("fp8_block", 1000, 2112, 7168, None, torch.float32, torch.bfloat16, False),  # fp32 bias: Triton
    ("fp8_block", 1000, 2112, 7168, 0.5, torch.bfloat16, torch.float32, False),   # fp32 out + bias: Triton
    ("fp8_block", 1030, 2112, 7168, None, None, torch.bfloat16, True),        # M % 4: padded for cuBLAS
    ("fp8_block", 64, 7168, 2048, None, None, torch.bfloat16, False),         # decode: split-K kernel
]


@pytest.mark.parametrize("case", CUBLAS_CASES, ids=lambda c: f"{c[0]}-M{c[1]}-{c[2]}x{c[3]}-{c[5]}-{c[6]}")
def test_cublas_route(case, monkeypatch):
    """fp8_block pairs run cuBLASLt's block-scaled GEMM where it can, lowbit's kernels where it cannot; both
    are the block-scaled product, and each agrees with the reference and with the other (DeepGEMM's route,
    where installed, is switched off here and tested below)."""
    monkeypatch.setenv("LOWBIT_DEEP_GEMM", "0")
    km = _km()
    name, m, n, k, alpha, bias_dtype, out_dtype, expected = case
    af, ao, wf, wo = PAIR[name]
    w = _weight(wf, wo, n, k)
    _, a = _act(af, ao, m, k, seed=5)
    bias = None if bias_dtype is None else _bias(n, bias_dtype)
    alpha_t = None if alpha is None else torch.tensor([alpha], device="cuda")
    route = policy.scaled_route(a, w, bias, out_dtype, km)
    assert (route == "cublas") == expected, (route, km.cublas_unsupported(a, w, bias, out_dtype))
    ref = scaled_mm_reference(a, w, alpha_t, bias, torch.float32, dequant_backend="torch")
    before = {key: t.clone() for key, t in a.tensors().items()}
    out = lowbit.scaled_mm(a, w, alpha_t, bias, out_dtype)
    assert all(torch.equal(t, before[key]) for key, t in a.tensors().items())
    _assert_close(out, ref, f"default {case}")
    triton_out = km.scaled_mm(a, w, alpha_t, bias, out_dtype, "kernel")
    _assert_close(triton_out, ref, f"lowbit's kernel {case}")
    if km.cublas_unsupported(a, w, bias, out_dtype) is None:
        _assert_close(km.scaled_mm(a, w, alpha_t, bias, out_dtype, "cublas"), ref, f"route cublas {case}")
    if expected:
        assert "cuBLASLt" in str(smm_dispatch.plan_scaled_mm(a, w))  # the plan's wording assumes no bias, a bf16 output
    elif km.cublas_unsupported(a, w, bias, out_dtype) is not None:
        with pytest.raises(ValueError, match="route 'cublas'"):
            km.scaled_mm(a, w, alpha_t, bias, out_dtype, "cublas")


@pytest.mark.parametrize("route", ["cublas", "fold"])
def test_cublas_pads_m_to_a_multiple_of_4(route, monkeypatch):
    """cuBLASLt takes M a multiple of 4: at M = 8190 mm pads two zero rows, and the output's rows are the bits of
    the same rows of an M = 8192 input whose last two rows are zero (the GEMM that runs), for fp8_block pairs and
    for the FP8 GEMM behind the mxfp4 re-encoding."""
    monkeypatch.setenv("LOWBIT_DEEP_GEMM", "0")
    km = _km()
    fmt, wopts = ("fp8_block", (("block", (128, 128)),)) if route == "cublas" else ("mxfp4", ())
    afmt = "fp8_block" if route == "cublas" else "mxfp4"
    w = _weight(fmt, wopts, 2112, 1024)
    x, _ = _act(afmt, (), 8190, 1024, seed=7)
    a = _quantize(x, afmt, ())
    a8 = _quantize(torch.cat([x, torch.zeros(2, 1024, device="cuda", dtype=x.dtype)]), afmt, ())
    assert policy.scaled_route(a, w, None, torch.bfloat16, km) == route
    out = lowbit.scaled_mm(a, w, None, None, torch.bfloat16)
    assert out.shape == (8190, 2112) and out.is_contiguous()
    assert torch.equal(out, lowbit.scaled_mm(a8, w, None, None, torch.bfloat16)[:8190])
    _assert_close(out, scaled_mm_reference(a, w, None, None, torch.float32, dequant_backend="torch"), route)


def _library_route_in_a_cuda_graph(km, route):
    w = _weight("fp8_block", (("block", (128, 128)),), 4096, 4096)
    x, a = _act("fp8_block", (), 256, 4096)
    assert policy.scaled_route(a, w, None, torch.bfloat16, km) == route
    graph, out = _capture(lambda t: scaled_linear(t, w, "fp8_block"), x)
    for seed in (1, 2):
        x.copy_(_act("fp8_block", (), 256, 4096, seed=seed)[0])
        graph.replay()
        torch.cuda.synchronize()
        ref = scaled_mm_reference(_quantize(x, "fp8_block", ()), w, None, None, torch.float32,
                                  dequant_backend="torch")
        _assert_close(out, ref, f"{route} route, graph replay")
    return w, a


def test_cublas_route_in_a_cuda_graph_and_off_by_env(monkeypatch):
    monkeypatch.setenv("LOWBIT_DEEP_GEMM", "0")
    km = _km()
    w, a = _library_route_in_a_cuda_graph(km, "cublas")
    monkeypatch.setenv("LOWBIT_CUBLAS_FP8_BLOCK", "0")
    assert "LOWBIT_CUBLAS_FP8_BLOCK=0" in km.cublas_unsupported(a, w, None, torch.bfloat16)
    assert policy.scaled_route(a, w, None, torch.bfloat16, km) == "kernel"
    assert "cuBLASLt" not in str(smm_dispatch.plan_scaled_mm(a, w))


# ------------------------------------------------------------------------ DeepGEMM (deepgemm route)

def _check_deepgemm_call(km, a, w, alpha, bias, route, what):
    """A pair the policy sends to ``route`` (``"deepgemm"`` or ``"fold_deepgemm"``): the plan names DeepGEMM;
    ``lowbit.scaled_mm`` leaves the operands as they were and gives the bits of the route called directly (and of
    a second call); the product is within tolerance of the fp32 reference, and with a bias the output is the bf16
    product plus the bias rounded once (:func:`_assert_bias_pass`). Returns the reference with the bias."""
    assert policy.scaled_route(a, w, bias, torch.bfloat16, km) == route
    assert "DeepGEMM" in str(smm_dispatch.plan_scaled_mm(a, w))
    ref = scaled_mm_reference(a, w, alpha, bias, torch.float32, dequant_backend="torch")
    before = [t.clone() for t in (*a.tensors().values(), *w.tensors().values())]
    out = lowbit.scaled_mm(a, w, alpha, bias, torch.bfloat16)
    assert all(torch.equal(t, b) for t, b in zip((*a.tensors().values(), *w.tensors().values()), before))
    assert torch.equal(lowbit.scaled_mm(a, w, alpha, bias, torch.bfloat16), out)
    assert torch.equal(km.scaled_mm(a, w, alpha, bias, torch.bfloat16, route), out)
    if bias is None:
        _assert_close(out, ref, what)
    else:
        ref_plain = scaled_mm_reference(a, w, alpha, None, torch.float32, dequant_backend="torch")
        _assert_bias_pass(out, km.scaled_mm(a, w, alpha, None, torch.bfloat16, route), bias, ref_plain, what)
    return ref


DEEPGEMM_CASES = [
    # (m, n, k, alpha, seed): DeepSeek-V3 shapes, M not a multiple of 4, N not a multiple of 128, alpha
    (256, 7168, 2048, None, 0),
    (68, 2112, 7168, None, 1),
    (1030, 2112, 7168, None, 2),
    (1000, 24576, 1536, 0.75, 3),
    (4096, 4096, 7168, None, 4),
    (300, 1024, 1408, 2.0, 5),      # K/128 = 11
]


def _need_deep_gemm():
    pytest.importorskip("deep_gemm")
    from lowbit.kernels import deep_gemm_fp8

    why = deep_gemm_fp8._unavailable(torch.cuda.current_device())
    if why is not None:
        pytest.skip(why)


@pytest.mark.parametrize("case", DEEPGEMM_CASES, ids=lambda c: f"M{c[0]}-{c[1]}x{c[2]}-a{c[3]}")
def test_deepgemm_route(case):
    """Where DeepGEMM is installed, the policy's fp8_block prefill pairs run its FP8 GEMM: the block-scaled
    product against the fp32 reference, against cuBLASLt's route and lowbit's kernel, alpha folded into the
    activation scales; the operands are not modified, and the same call twice gives the same bits."""
    km = _km()
    _need_deep_gemm()
    m, n, k, alpha, seed = case
    w = _weight("fp8_block", (("block", (128, 128)),), n, k)
    x, a = _act("fp8_block", (), m, k, seed=seed)
    if seed == 3:  # adversarial blocks: a zero block and a block at E4M3's largest finite value
        x = x.clone()
        x[:5, :128] = 0
        x[5:9, 128:256] = 448.0
        a = _quantize(x, "fp8_block", ())
    alpha_t = None if alpha is None else torch.tensor([alpha], device="cuda")
    bias = _bias(n) if seed % 2 else None  # no bias epilogue in DeepGEMM: the route adds it to the bf16 product
    ref = _check_deepgemm_call(km, a, w, alpha_t, bias, "deepgemm", f"deepgemm {case}")
    _assert_close(km.scaled_mm(a, w, alpha_t, bias, torch.bfloat16, "kernel"), ref, f"kernel {case}")
    _assert_close(km.scaled_mm(a, w, alpha_t, bias, torch.bfloat16, "cublas"), ref, f"cublas {case}")


@pytest.mark.parametrize("m, n", [(1, 64), (300, 1000), (8190, 5120)])
def test_deepgemm_bias_pass_is_torchs_add(m, n):
    """The DeepGEMM routes' bias pass equals torch's bf16 ``add_`` bit for bit: random values, exponents far
    apart, ties, subnormals, signed zeros, Inf and NaN, a ragged last tile."""
    _need_kernel()
    from lowbit.kernels import deep_gemm_fp8

    g = torch.Generator(device="cuda").manual_seed(m + n)
    out = (torch.randn(m, n, device="cuda", generator=g) * 2.0 ** torch.randint(-20, 20, (m, n), device="cuda",
                                                                               generator=g)).to(torch.bfloat16)
    bias = (torch.randn(n, device="cuda", generator=g) * 2.0 ** torch.randint(-20, 20, (n,), device="cuda",
                                                                             generator=g)).to(torch.bfloat16)
    special = torch.tensor([float("inf"), -float("inf"), float("nan"), 0.0, -0.0, 1e-40, -1e-39, 1.0],
                           device="cuda").to(torch.bfloat16)
    out.view(-1)[: special.numel()] = special
    bias[: min(n, special.numel())] = special.flip(0)[: min(n, special.numel())]
    want = out.clone().add_(bias)
    keep = bias.clone()
    deep_gemm_fp8.add_bias_(out, bias)
    nan = torch.isnan(want)
    assert torch.equal(torch.isnan(out), nan) and nan.any()  # NaN payloads may differ (PTX's canonical NaN)
    assert torch.equal(out.view(torch.int16)[~nan], want.view(torch.int16)[~nan])
    assert torch.equal(bias.view(torch.int16), keep.view(torch.int16))  # bits: the bias holds a NaN


@pytest.mark.parametrize("m, k, bias, out_dtype, route", [
    (256, 16384, False, torch.bfloat16, "cublas"),   # long K at M <= 1024: cuBLASLt
    (2048, 16384, False, torch.bfloat16, "deepgemm"),
    (256, 2048, True, torch.bfloat16, "deepgemm"),   # a bf16 bias: added to DeepGEMM's bf16 product
    (256, 2048, False, torch.float16, "cublas"),     # DeepGEMM writes bf16 only
    (256, 2048, True, torch.float16, "cublas"),      # and takes a bf16 bias only
    (64, 2048, False, torch.bfloat16, "kernel"),     # decode
])
def test_deepgemm_policy_on_the_gpu(m, k, bias, out_dtype, route, monkeypatch):
    km = _km()
    _need_deep_gemm()
    w = _weight("fp8_block", (("block", (128, 128)),), 7168, k)
    _, a = _act("fp8_block", (), m, k)
    b = _bias(7168, out_dtype) if bias else None
    assert policy.scaled_route(a, w, b, out_dtype, km) == route
    monkeypatch.setenv("LOWBIT_DEEP_GEMM", "0")
    assert policy.scaled_route(a, w, b, out_dtype, km) == ("kernel" if route == "kernel" else "cublas")


def test_deepgemm_route_in_a_cuda_graph():
    km = _km()
    _need_deep_gemm()
    _library_route_in_a_cuda_graph(km, "deepgemm")


def test_deepgemm_in_a_prepared_layer_and_its_fallback(monkeypatch):
    """A w8a8-fp8-block QuantLinear at a prefill M runs the quantize kernel (M-major scales) and DeepGEMM, the
    same bits as the public ops; if DeepGEMM's call fails, a warning and cuBLASLt's result."""
    km = _km()
    _need_deep_gemm()
    import deep_gemm

    from lowbit.kernels import deep_gemm_fp8
    from lowbit.nn import QuantLinear

    lin = torch.nn.Linear(2048, 7168, bias=False, device="cuda", dtype=torch.bfloat16)
    layer = QuantLinear.from_linear(lin, "w8a8-fp8-block")
    x = torch.randn(512, 2048, device="cuda", dtype=torch.bfloat16)
    wq = layer.weight_qtensor
    want = scaled_linear(x, wq, "fp8_block")
    for _ in range(2):
        assert torch.equal(layer(x), want)
    run = layer._prepared.scaled_runners.get((512, torch.bfloat16, True))
    assert type(run).__name__ == "Fp8BlockLibraryGemm" and type(run.mm).__name__ == "PreparedMM"
    assert run.mm.__class__.__module__ == deep_gemm_fp8.__name__
    # with a bias (a DiT's layers have one): the same runner kind, the bits of the public op's route
    lin_b = torch.nn.Linear(2048, 7168, bias=True, device="cuda", dtype=torch.bfloat16)
    layer_b = QuantLinear.from_linear(lin_b, "w8a8-fp8-block")
    want_b = lowbit.scaled_mm(_quantize(x, "fp8_block", ()), layer_b.weight_qtensor, None, lin_b.bias.detach(),
                              torch.bfloat16)
    for _ in range(2):
        assert torch.equal(layer_b(x), want_b)
    run_b = layer_b._prepared.scaled_runners.get((512, torch.bfloat16, False))
    assert type(run_b).__name__ == "Fp8BlockLibraryGemm" and run_b.mm.__class__.__module__ == deep_gemm_fp8.__name__
    a = _quantize(x, "fp8_block", ())
    cublas_out = km.scaled_mm(a, wq, None, None, torch.bfloat16, "cublas")

    def broken(*args, **kwargs):
        raise RuntimeError("JIT failed (test)")

    monkeypatch.setattr(deep_gemm, "fp8_gemm_nt", broken)
    saved = list(deep_gemm_fp8._FAILED)
    deep_gemm_fp8._FAILED.clear()
    try:
        with pytest.warns(RuntimeWarning, match="JIT failed"):
            got = layer(x)
        assert torch.equal(got, cublas_out)
        assert policy.scaled_route(a, wq, None, torch.bfloat16, km) == "cublas"
    finally:
        deep_gemm_fp8._FAILED[:] = saved


# ------------------------------------------------------------------------ FP8 re-encoding (fold route)

FOLD_PAIRS = ["mxfp4", "mxfp4-swizzled", "w4a8-rowwise-mxfp4", "w4a8-block-mxfp4"]


def _km():
    _need_kernel()
    return policy.kernel_module(smm.KERNEL_MODULE)


@pytest.mark.parametrize("m", [300, 1000, 1024, 4096])
@pytest.mark.parametrize("name", FOLD_PAIRS)
def test_fold_route_matches_reference_and_decoding_kernel(name, m):
    km = _km()
    af, ao, wf, wo = PAIR[name]
    i = [300, 1000, 1024, 4096].index(m)
    n, k = [(7168, 2048), (2112, 7168), (384, 1600), (4096, 4096)][i]
    w = _weight(wf, wo, n, k)
    _, a = _act(af, ao, m, k, seed=3)
    routed = m >= policy.FOLD_MIN_M
    fold_routes = ("fold", "fold_deepgemm")  # DeepGEMM behind the re-encoding where it is installed and can run
    assert (policy.scaled_route(a, w, None, torch.bfloat16, km) in fold_routes) == routed
    assert ("E4M3" in str(smm_dispatch.plan_scaled_mm(a, w))) == routed
    alpha = torch.tensor([0.75], device="cuda") if i % 2 else None
    bias = _bias(n) if i != 1 else None
    ref = scaled_mm_reference(a, w, alpha, bias, torch.float32, dequant_backend="torch")
    default = lowbit.scaled_mm(a, w, alpha, bias, torch.bfloat16)
    if bias is not None and policy.scaled_route(a, w, bias, torch.bfloat16, km) == "fold_deepgemm":
        ref_plain = scaled_mm_reference(a, w, alpha, None, torch.float32, dequant_backend="torch")
        _assert_bias_pass(default, lowbit.scaled_mm(a, w, alpha, None, torch.bfloat16), bias, ref_plain,
                          f"default {name} M={m}")
    else:
        _assert_close(default, ref, f"default {name} M={m}")
    for out_dtype in (torch.bfloat16, torch.float32):
        _assert_close(km.scaled_mm(a, w, alpha, bias, out_dtype, "fold"), ref, f"fold {out_dtype} {name} M={m}")
        _assert_close(km.scaled_mm(a, w, alpha, bias, out_dtype, "fold", cublas=False), ref,
                      f"fold on the TMA kernel {out_dtype} {name} M={m}")
    if routed and m % 4 == 0:  # the GEMM behind the re-encoding is cuBLASLt's
        _assert_close(km.scaled_mm(a, w, alpha, bias, torch.bfloat16, "fold", cublas=True), ref,
                      f"fold cuBLAS {name} M={m}")
    _assert_close(km.scaled_mm(a, w, alpha, bias, torch.float32, "kernel"), ref, f"decoding {name} M={m}")


@pytest.mark.parametrize("m, cublas", [(1030, True), (1032, True), (1032, False)])  # 1030: rows padded for cuBLAS
@pytest.mark.parametrize("case", ["weight-window", "activation-window", "activation-nan", "weight-nan"])
def test_fold_route_exact_fallback(case, m, cublas, monkeypatch):
    """Blocks the E4M3 re-encoding cannot hold arm the guarded decoding kernel, which recomputes the output:
    the result is still the block-scaled product (dropping those blocks would be far off: they are the
    largest values of their rows)."""
    from lowbit.kernels import blockscaled as kb

    km = _km()
    n, k = 512, 1024
    g = torch.Generator(device="cuda").manual_seed(11)
    w = torch.randn(n, k, device="cuda", generator=g) * 0.02
    x = torch.randn(m, k, device="cuda", generator=g)
    if case == "weight-window":
        w[7, 160:192] *= 1e6   # the other blocks of that tile fall 20 binades below it
    elif case == "activation-window":
        x[3, 128:160] *= 1e6
    elif case == "activation-nan":
        x[5, 40] = float("nan")
    else:
        w[9, 70] = float("nan")
    wq = lowbit.quantize(w.to(torch.bfloat16), "mxfp4")
    a = lowbit.quantize(x.to(torch.bfloat16), "mxfp4")
    odd, block = (wq, (128, 128)) if case.startswith("weight") else (a, (1, 128))
    assert not bool(kb.mxfp4_as_fp8_block(odd, block)[1])
    assert policy.scaled_route(a, wq, None, torch.float32, km) == "fold"
    if not cublas:  # the TMA kernel behind the re-encoding
        monkeypatch.setenv("LOWBIT_CUBLAS_FP8_BLOCK", "0")
    assert (km.cb.unsupported(m, n, k, a.data.device, True, None, torch.float32) is None) == cublas
    out = lowbit.scaled_mm(a, wq, None, None, torch.float32)
    ref = scaled_mm_reference(a, wq, None, None, torch.float32, dequant_backend="torch")
    if case.endswith("nan"):
        assert torch.equal(torch.isnan(out), torch.isnan(ref)) and torch.isnan(ref).any()
        # a NaN activation block makes its output row NaN, a NaN weight block its column
        rows = ~torch.isnan(ref).all(1)
        cols = ~torch.isnan(ref).all(0)
        _assert_close(out[rows][:, cols], ref[rows][:, cols], case)
    else:
        _assert_close(out, ref, case)


def test_fold_route_in_a_cuda_graph():
    """Captured once; replays follow the inputs, including one that needs the exact fallback."""
    km = _km()
    m, n, k = 1024, 1024, 2048
    g = torch.Generator(device="cuda").manual_seed(12)
    wq = lowbit.quantize((torch.randn(n, k, device="cuda", generator=g) * 0.02).to(torch.bfloat16), "mxfp4")
    x = torch.randn(m, k, device="cuda", generator=g).to(torch.bfloat16)
    a = lowbit.quantize(x, "mxfp4")
    static = lowbit.QTensor(a.data.clone(), a.scale.clone(), "mxfp4", a.shape, a.dtype)
    assert policy.scaled_route(static, wq, None, torch.float32, km) == "fold"
    graph, out = _capture(lambda q: lowbit.scaled_mm(q, wq, None, None, torch.float32), static)
    for scale_row in (None, 4):
        y = torch.randn(m, k, device="cuda", generator=g)
        if scale_row is not None:
            y[scale_row, :32] *= 1e6
        new = lowbit.quantize(y.to(torch.bfloat16), "mxfp4")
        static.data.copy_(new.data)
        static.scale.copy_(new.scale)
        graph.replay()
        torch.cuda.synchronize()
        ref = scaled_mm_reference(new, wq, None, None, torch.float32, dequant_backend="torch")
        _assert_close(out, ref, f"graph replay, wide row {scale_row}")


FOLD_DEEPGEMM_CASES = [  # (pair, M, N, K, alpha, bias): the DiT's 8190 tokens (M % 4 != 0), W4A8 activations
    ("mxfp4", 8190, 5120, 5120, None, True),
    ("mxfp4-swizzled", 1024, 7168, 2048, 0.75, False),
    ("w4a8-rowwise-mxfp4", 2048, 2112, 7168, None, True),
    ("w4a8-block-mxfp4", 1500, 4096, 4096, 2.0, True),
]


@pytest.mark.parametrize("case", FOLD_DEEPGEMM_CASES, ids=lambda c: f"{c[0]}-M{c[1]}-{c[2]}x{c[3]}")
def test_fold_deepgemm_route(case):
    """Where DeepGEMM is installed, mxfp4 weights from FOLD_MIN_M rows run the exact E4M3 re-encoding, then
    DeepGEMM's FP8 GEMM: against the fp32 reference, the fold route's cuBLASLt GEMM and the decoding kernel;
    the operands are not modified, the same call twice gives the same bits, a bias is the bf16 product plus
    the bias rounded once."""
    km = _km()
    _need_deep_gemm()
    name, m, n, k, alpha, with_bias = case
    af, ao, wf, wo = PAIR[name]
    w = _weight(wf, wo, n, k)
    _, a = _act(af, ao, m, k, seed=9)
    alpha_t = None if alpha is None else torch.tensor([alpha], device="cuda")
    bias = _bias(n) if with_bias else None
    ref = _check_deepgemm_call(km, a, w, alpha_t, bias, "fold_deepgemm", f"fold_deepgemm {case}")
    _assert_close(km.scaled_mm(a, w, alpha_t, bias, torch.bfloat16, "fold"), ref, f"fold {case}")
    _assert_close(km.scaled_mm(a, w, alpha_t, bias, torch.float32, "kernel"), ref, f"decoding {case}")
    with pytest.raises(ValueError, match="route 'fold_deepgemm'"):
        km.scaled_mm(a, w, alpha_t, bias, torch.float16, "fold_deepgemm")  # DeepGEMM writes bf16 only


@pytest.mark.parametrize("case", ["weight-window", "activation-nan"])
def test_fold_deepgemm_exact_fallback(case):
    """A block the re-encoding cannot hold arms the guarded decoding kernel behind DeepGEMM's GEMM too."""
    km = _km()
    _need_deep_gemm()
    m, n, k = 1030, 512, 1024
    g = torch.Generator(device="cuda").manual_seed(13)
    w = torch.randn(n, k, device="cuda", generator=g) * 0.02
    x = torch.randn(m, k, device="cuda", generator=g)
    if case == "weight-window":
        w[7, 160:192] *= 1e6
    else:
        x[5, 40] = float("nan")
    wq = lowbit.quantize(w.to(torch.bfloat16), "mxfp4")
    a = lowbit.quantize(x.to(torch.bfloat16), "mxfp4")
    assert policy.scaled_route(a, wq, None, torch.bfloat16, km) == "fold_deepgemm"
    out = lowbit.scaled_mm(a, wq, None, None, torch.bfloat16)
    ref = scaled_mm_reference(a, wq, None, None, torch.float32, dequant_backend="torch")
    if case.endswith("nan"):
        assert torch.equal(torch.isnan(out), torch.isnan(ref)) and torch.isnan(ref).any()
        rows = ~torch.isnan(ref).all(1)
        _assert_close(out[rows], ref[rows], case)
    else:
        _assert_close(out, ref, case)


def test_fold_deepgemm_in_a_cuda_graph_and_a_prepared_layer():
    """Captured once, replays follow the input; a w4a4-mxfp4 QuantLinear at M = 8190 takes the route, with
    the bits of the public ops."""
    km = _km()
    _need_deep_gemm()
    from lowbit.nn import QuantLinear

    m, n, k = 2048, 1024, 2048
    g = torch.Generator(device="cuda").manual_seed(14)
    wq = lowbit.quantize((torch.randn(n, k, device="cuda", generator=g) * 0.02).to(torch.bfloat16), "mxfp4")
    a = lowbit.quantize(torch.randn(m, k, device="cuda", generator=g).to(torch.bfloat16), "mxfp4")
    static = lowbit.QTensor(a.data.clone(), a.scale.clone(), "mxfp4", a.shape, a.dtype)
    assert policy.scaled_route(static, wq, None, torch.bfloat16, km) == "fold_deepgemm"
    graph, out = _capture(lambda q: lowbit.scaled_mm(q, wq, None, None, torch.bfloat16), static)
    for _ in range(2):
        new = lowbit.quantize(torch.randn(m, k, device="cuda", generator=g).to(torch.bfloat16), "mxfp4")
        static.data.copy_(new.data)
        static.scale.copy_(new.scale)
        graph.replay()
        torch.cuda.synchronize()
        _assert_close(out, scaled_mm_reference(new, wq, None, None, torch.float32, dequant_backend="torch"),
                      "fold_deepgemm graph replay")
    lin = torch.nn.Linear(5120, 5120, bias=True, device="cuda", dtype=torch.bfloat16)
    layer = QuantLinear.from_linear(lin, "w4a4-mxfp4")
    x = torch.randn(8190, 5120, device="cuda", dtype=torch.bfloat16)
    want = lowbit.scaled_mm(lowbit.quantize(x, "mxfp4"), layer.weight_qtensor, None, lin.bias.detach(),
                            torch.bfloat16)
    assert torch.equal(layer(x), want) and torch.equal(layer(x), want)


# ----------------------------------------------------------- nvfp4 x nvfp4 decoded to bf16 (dequant route)


@pytest.mark.parametrize("m", [policy.DEQUANT_MM_MIN_M, 1000, 2048])
@pytest.mark.parametrize("convention", ["vllm", "torchao"])
def test_dequant_route_matches_reference_and_decoding_kernel(m, convention):
    km = _km()
    n, k = 1536, 1024
    g = torch.Generator(device="cuda").manual_seed(21)
    x = torch.randn(m, k, device="cuda", generator=g).to(torch.bfloat16)
    w = (torch.randn(n, k, device="cuda", generator=g) * 0.05).to(torch.bfloat16)
    a = lowbit.quantize(x, "nvfp4", convention=convention)
    b = lowbit.quantize(w, "nvfp4", convention=convention, scale_layout="swizzled")
    assert policy.scaled_route(a, b, None, torch.bfloat16, km) == "dequant"
    alpha = torch.tensor([0.5], device="cuda")
    bias = torch.randn(n, device="cuda").to(torch.bfloat16)
    for args, out_dtype in (((None, None), torch.float32), ((alpha, bias), torch.bfloat16)):
        ref = scaled_mm_reference(a, b, *args, torch.float32, dequant_backend="torch")
        _assert_close(lowbit.scaled_mm(a, b, *args, out_dtype), ref, f"dequant route M={m} {convention}")
        _assert_close(km.scaled_mm(a, b, *args, out_dtype, "kernel"), ref, f"decoding kernel M={m}")


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
def test_nvfp4_dequant_route_in_chunks_of_weight_rows(out_dtype, monkeypatch):
    """Weight rows in several chunks (the fp32 partial product of each through the one-pass epilogue into its
    columns of the output, 128 rows and a ragged last chunk) and in one: both match the reference."""
    km = _km()
    from lowbit.kernels import scaled_mm_routes

    m, n, k = 600, 1000, 512
    g = torch.Generator(device="cuda").manual_seed(25)
    a = lowbit.quantize(torch.randn(m, k, device="cuda", generator=g).to(torch.bfloat16), "nvfp4")
    b = lowbit.quantize((torch.randn(n, k, device="cuda", generator=g) * 0.05).to(torch.bfloat16), "nvfp4")
    alpha = torch.tensor([0.5], device="cuda")
    bias = torch.randn(n, device="cuda").to(torch.bfloat16)
    ref = scaled_mm_reference(a, b, alpha, bias, torch.float32, dequant_backend="torch")
    _assert_close(km.scaled_mm(a, b, alpha, bias, out_dtype, "dequant"), ref, "dequant route, one chunk")
    monkeypatch.setattr(scaled_mm_routes, "DEQUANT_CHUNK_BYTES", 128 * 4 * m)
    _assert_close(km.scaled_mm(a, b, alpha, bias, out_dtype, "dequant"), ref, "dequant route, 8 chunks")


# ------------------------------------------------- 6/8-bit MX pairs decoded to bf16 (dequant route)


@pytest.mark.parametrize("m", [policy.DEQUANT_MM_MIN_M, 2048])
@pytest.mark.parametrize("fa,fb", [("mxfp8_e4m3", "mxfp8_e4m3"), ("mxfp8_e5m2", "mxfp8_e4m3"),
                                   ("mxfp6_e2m3", "mxfp8_e4m3")])
def test_mx_dequant_route_matches_reference_and_decoding_kernel(fa, fb, m):
    km = _km()
    n, k = 1536, 1024
    g = torch.Generator(device="cuda").manual_seed(23)
    x = torch.randn(m, k, device="cuda", generator=g).to(torch.bfloat16)
    w = (torch.randn(n, k, device="cuda", generator=g) * 0.05).to(torch.bfloat16)
    a, b = lowbit.quantize(x, fa), lowbit.quantize(w, fb)
    assert policy.scaled_route(a, b, None, torch.bfloat16, km) == "dequant"
    alpha = torch.tensor([0.5], device="cuda")
    bias = torch.randn(n, device="cuda").to(torch.bfloat16)
    for args, out_dtype in (((None, None), torch.float32), ((None, bias), torch.bfloat16),
                            ((alpha, bias), torch.bfloat16)):
        ref = scaled_mm_reference(a, b, *args, torch.float32, dequant_backend="torch")
        _assert_close(lowbit.scaled_mm(a, b, *args, out_dtype), ref, f"dequant route {fa} x {fb} M={m}")
        _assert_close(km.scaled_mm(a, b, *args, out_dtype, "kernel"), ref, f"decoding kernel M={m}")


def test_mx_dequant_route_falls_back_exactly_on_an_extreme_scale():
    # one activation block scaled by 2^-120: its bf16 decoding would round, so the guarded decoding kernel
    # recomputes the output, which then equals the decoding kernel's bit for bit
    km = _km()
    m, n, k = 1024, 512, 512
    g = torch.Generator(device="cuda").manual_seed(24)
    a = lowbit.quantize(torch.randn(m, k, device="cuda", generator=g).to(torch.bfloat16), "mxfp8_e4m3")
    b = lowbit.quantize((torch.randn(n, k, device="cuda", generator=g) * 0.05).to(torch.bfloat16), "mxfp8_e4m3")
    a.scale.view(torch.uint8)[5, 3] = 7
    got = km.scaled_mm(a, b, None, None, torch.bfloat16, "dequant")
    want = km.scaled_mm(a, b, None, None, torch.bfloat16, "kernel")
    torch.cuda.synchronize()
    assert torch.equal(got, want)
