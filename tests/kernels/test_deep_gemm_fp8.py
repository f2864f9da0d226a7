"""The host side of lowbit.kernels.deep_gemm_fp8 on CPU: which GEMMs the DeepGEMM route takes, where the policy
sends fp8_block pairs when DeepGEMM is installed, and what happens when DeepGEMM's first call fails (the GEMM
itself runs in tests/ops/test_scaled_mm_gpu.py, with DeepGEMM carried to the GPU machine)."""

import sys
import types
import warnings

import pytest
import torch

import lowbit
from lowbit.kernels import deep_gemm_fp8 as dg
from lowbit.kernels import scaled_mm_routes as routes
from lowbit.ops import policy

CPU = torch.device("cpu")


def _why(m=256, n=7168, k=2048, contiguous=True, fp32=True, bias=None, out_dtype=torch.bfloat16, device=CPU):
    return dg.unsupported(m, n, k, device, contiguous, fp32, bias, out_dtype)


@pytest.mark.parametrize(
    "kwargs, reason",
    [
        ({"k": 2048 + 64}, "K a multiple of 128"),
        ({"n": 7168 + 32}, "N of 64"),
        ({"contiguous": False}, "contiguous K-major"),
        ({"fp32": False}, "fp32 scales"),
        ({"out_dtype": torch.float16}, "bfloat16 output"),
        ({"out_dtype": torch.float32}, "bfloat16 output"),
        ({"bias": torch.zeros(7168, dtype=torch.float16)}, "bfloat16 bias"),
        ({"bias": torch.zeros(7168, dtype=torch.float32)}, "bfloat16 bias"),
        ({"bias": torch.zeros(1, 7168, dtype=torch.bfloat16)}, "of N = 7168 values"),
        ({"m": 0}, "at least 1"),
        ({}, "not on CUDA"),
    ],
)
def test_reasons(kwargs, reason):
    assert reason in _why(**kwargs)


def test_a_bfloat16_bias_of_n_values_is_taken():
    assert _why(bias=torch.zeros(7168, dtype=torch.bfloat16)) == "not on CUDA"  # every other check passed


def test_switched_off_by_env(monkeypatch):
    monkeypatch.setenv(dg.ENV, "0")
    assert _why() == f"${dg.ENV}=0"


def test_import_failure_and_missing_entry_point_are_reasons(monkeypatch):
    dg._unavailable.cache_clear()
    try:
        monkeypatch.setitem(sys.modules, "deep_gemm", None)  # import raises ImportError
        assert "deep_gemm does not import" in dg._unavailable(0)
        dg._unavailable.cache_clear()
        monkeypatch.setitem(sys.modules, "deep_gemm", types.ModuleType("deep_gemm"))
        assert "no fp8_gemm_nt" in dg._unavailable(0)
    finally:
        dg._unavailable.cache_clear()


def _pair(m=256, n=256, k=512, wblock=(128, 128)):
    a = lowbit.quantize(torch.randn(m, k), "fp8_block")
    b = lowbit.quantize(torch.randn(n, k), "fp8_block", block=wblock)
    return a, b


def test_pair_reasons():
    a, b = _pair()
    assert routes.deepgemm_unsupported(a, b, None, torch.bfloat16) == "not on CUDA"
    _, b1 = _pair(wblock=(1, 128))
    assert "128x128-block" in routes.deepgemm_unsupported(a, b1, None, torch.bfloat16)
    a2, b2 = _pair(n=200, k=512)
    assert "N of 64" in routes.deepgemm_unsupported(a2, b2, None, torch.bfloat16)


def _capable(deepgemm=None, cublas=None, fold="no", fold_deepgemm=None):
    """A kernel module that can run every route but the GEMV and dequant ones, and the fold routes as ``fold``
    and ``fold_deepgemm`` say (reasons or None; False: the module has no such check)."""
    attrs = {"gemv_unsupported": lambda *x: "no", "fold_unsupported": lambda *x: fold,
             "cublas_unsupported": lambda *x: cublas}
    if deepgemm is not False:
        attrs["deepgemm_unsupported"] = lambda *x: deepgemm
    if fold_deepgemm is not False:
        attrs["fold_deepgemm_unsupported"] = lambda *x: fold_deepgemm
    return type("M", (), attrs)


@pytest.mark.parametrize(
    "m, k, module, route",
    [
        (64, 512, _capable(), "kernel"),           # decode: lowbit's split-K kernel
        (68, 512, _capable(), "deepgemm"),
        (4096, 512, _capable(), "deepgemm"),
        (256, 16384, _capable(), "cublas"),        # long K at M <= 1024: cuBLASLt measured faster
        (1024, 16384, _capable(), "cublas"),
        (1028, 16384, _capable(), "deepgemm"),
        (256, 512, _capable(deepgemm="not installed"), "cublas"),
        (256, 512, _capable(deepgemm=False), "cublas"),   # a kernel module without the route
        (256, 512, _capable(deepgemm="no", cublas="no"), "kernel"),
    ],
)
def test_policy(m, k, module, route):
    a = lowbit.quantize(torch.randn(m, k), "fp8_block")
    b = lowbit.quantize(torch.randn(128, k), "fp8_block", block=(128, 128))
    assert policy.deepgemm_preferred(m, k) == (not (k >= 16384 and m <= 1024))
    assert policy.scaled_route(a, b, None, torch.bfloat16, module) == route


@pytest.mark.parametrize(
    "m, k, module, route",
    [
        (1024, 512, _capable(fold=None), "fold_deepgemm"),
        (8190, 5120, _capable(fold=None), "fold_deepgemm"),
        (1020, 512, _capable(fold=None), "deepgemm"),       # below FOLD_MIN_M the module's other routes
        (1024, 16384, _capable(fold=None), "fold"),         # long K at M <= 1024: cuBLASLt behind the re-encoding
        (2048, 16384, _capable(fold=None), "fold_deepgemm"),
        (4096, 512, _capable(fold=None, fold_deepgemm="not installed"), "fold"),
        (4096, 512, _capable(fold=None, fold_deepgemm=False), "fold"),
    ],
)
def test_fold_policy(m, k, module, route):
    """mxfp4 weights from FOLD_MIN_M rows: DeepGEMM behind the E4M3 re-encoding where it can run and
    ``deepgemm_preferred`` says so, else the fold route's cuBLASLt / TMA GEMM."""
    a = lowbit.quantize(torch.randn(m, k), "mxfp4")
    b = lowbit.quantize(torch.randn(128, k), "mxfp4")
    assert policy.FOLD_MIN_M == 1024
    assert policy.scaled_route(a, b, None, torch.bfloat16, module) == route


def test_fold_route_reasons_on_cpu():
    """The fold routes are for the GPU (the re-encoding feeds a GPU GEMM), and a pair the re-encoding does not
    take says so first."""
    a = lowbit.quantize(torch.randn(64, 256), "mxfp4")
    b = lowbit.quantize(torch.randn(128, 256), "mxfp4")
    # the re-encoding's own reason where it has one (under the interpreter), else DeepGEMM's: CPU operands
    assert routes.fold_deepgemm_unsupported(a, b, None, torch.bfloat16) == (routes.fold_unsupported(a, b)
                                                                           or "not on CUDA")
    nv = lowbit.quantize(torch.randn(128, 256), "nvfp4")
    assert "mxfp4 weights" in routes.fold_deepgemm_unsupported(a, nv, None, torch.bfloat16)


@pytest.fixture
def fake_deep_gemm(monkeypatch):
    """A ``deep_gemm`` whose fp8_gemm_nt records its arguments and writes the fp32 block-scaled product, or
    raises when ``fail`` is set; the route's failure state is restored afterwards."""
    calls: list = []
    state = {"fail": None}

    def fp8_gemm_nt(a, b, d):
        if state["fail"]:
            raise RuntimeError(state["fail"])
        calls.append((a, b, d))
        (ad, asc), (bd, bsc) = a, b
        x = ad.float() * asc.repeat_interleave(128, 1)[:, : ad.shape[1]]
        w = bd.float() * bsc.repeat_interleave(128, 0).repeat_interleave(128, 1)[: bd.shape[0], : bd.shape[1]]
        d.copy_(x @ w.T)

    mod = types.ModuleType("deep_gemm")
    mod.fp8_gemm_nt = fp8_gemm_nt
    monkeypatch.setitem(sys.modules, "deep_gemm", mod)
    saved = list(dg._FAILED)
    dg._FAILED.clear()
    yield calls, state
    dg._FAILED[:] = saved


def test_mm_hands_the_operands_over_untouched(fake_deep_gemm):
    calls, _ = fake_deep_gemm
    a, b = _pair(m=8, n=128, k=256)
    before = [t.clone() for t in (a.data, a.scale, b.data, b.scale)]
    out = dg.mm(a.data, a.scale, b.data, b.scale)
    assert out.dtype == torch.bfloat16 and out.shape == (8, 128)
    (ad, asc), (bd, bsc), d = calls[0]
    assert ad is a.data and asc is a.scale and bd is b.data and bsc is b.scale and d is out
    assert all(torch.equal(x, y) for x, y in zip(before, (a.data, a.scale, b.data, b.scale)))
    ref = lowbit.ops.scaled_mm_reference(a, b, out_dtype=torch.float32)
    assert torch.allclose(out.float(), ref, rtol=1e-2, atol=1e-2 * ref.abs().max().item())


def test_route_folds_alpha_into_m_major_activation_scales(fake_deep_gemm):
    calls, _ = fake_deep_gemm
    a, b = _pair(m=8, n=128, k=256)
    routes.deepgemm_mm(a, b, torch.tensor([0.5]), None, torch.bfloat16)
    (_, asc), _, _ = calls[0]
    assert asc.stride() == (1, 8) and torch.equal(asc, a.scale * 0.5)
    assert a.scale.stride() == (2, 1)  # the caller's scales untouched


def test_route_adds_a_bfloat16_bias_after_the_product(fake_deep_gemm):
    """No bias epilogue in DeepGEMM's SM90 GEMM: the route adds it to the bf16 product (torch's add, one
    rounding of the fp32 sum), and the bias is not modified."""
    calls, _ = fake_deep_gemm
    a, b = _pair(m=8, n=128, k=256)
    bias = torch.randn(128).to(torch.bfloat16)
    keep = bias.clone()
    out = routes.deepgemm_mm(a, b, None, bias, torch.bfloat16)
    plain = routes.deepgemm_mm(a, b, None, None, torch.bfloat16)
    assert len(calls) == 2 and torch.equal(bias, keep)
    assert torch.equal(out, (plain.float() + bias.float()).to(torch.bfloat16))
    prepared = dg.PreparedMM(b.data, b.scale, lambda *args: None)
    assert torch.equal(prepared(a.data, a.scale.t().contiguous().t(), bias), out)


def test_a_failing_first_call_falls_back_once_with_a_warning(fake_deep_gemm):
    calls, state = fake_deep_gemm
    a, b = _pair(m=8, n=128, k=256)
    state["fail"] = "nvcc not found"
    fallback_calls = []

    def fallback():
        fallback_calls.append(1)
        return torch.zeros(8, 128, dtype=torch.bfloat16)

    with pytest.warns(RuntimeWarning, match="nvcc not found"):
        out = dg.mm(a.data, a.scale, b.data, b.scale, fallback)
    assert fallback_calls == [1] and out.shape == (8, 128)
    assert "first call failed" in _why()
    state["fail"] = None
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no second warning, and DeepGEMM is not asked again
        dg.mm(a.data, a.scale, b.data, b.scale, fallback)
    assert fallback_calls == [1, 1] and not calls
    with pytest.raises(RuntimeError, match="boom"):  # no fallback given: the error itself
        dg._FAILED.clear()
        state["fail"] = "boom"
        dg.mm(a.data, a.scale, b.data, b.scale)


def test_prepared_mm_falls_back_to_the_same_operands(fake_deep_gemm):
    calls, state = fake_deep_gemm
    a, b = _pair(m=8, n=128, k=256)
    seen = []
    prepared = dg.PreparedMM(b.data, b.scale, lambda *args: seen.append(args) or torch.ones(8, 128))
    prepared(a.data, a.scale, None)
    assert len(calls) == 1 and not seen
    state["fail"] = "jit"
    with pytest.warns(RuntimeWarning):
        prepared(a.data, a.scale, None)
    assert seen[0][0] is a.data and seen[0][1] is a.scale and seen[0][2] is None
