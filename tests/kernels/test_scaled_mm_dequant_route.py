"""The ``"dequant"`` route of ``lowbit.kernels.scaled_mm`` (nvfp4 x nvfp4 decoded exactly to bf16, then a bf16
GEMM with fp32 accumulation) on CPU, with the Triton decode replaced by the format reference it matches bit for
bit: chunking over weight rows (linear and swizzled scales), both global-scale conventions, alpha and bias, and
the policy choosing it from DEQUANT_MM_MIN_M. The GPU runs are in tests/ops/test_scaled_mm_gpu.py."""

import pytest
import torch

import lowbit
from lowbit.formats import blockscaled as ref
from lowbit.ops import policy
from lowbit.ops import scaled_mm_reference

triton = pytest.importorskip("triton")


@pytest.fixture
def km(monkeypatch):
    from lowbit.kernels import blockscaled, scaled_mm

    monkeypatch.setattr(blockscaled, "dequantize_nvfp4", ref.dequantize_nvfp4)  # the kernel's bits, on CPU
    return scaled_mm


def _pair(m, n, k, convention, layout, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g) * 3
    w = torch.randn(n, k, generator=g) * torch.logspace(-3, 1, n)[:, None]
    a = lowbit.quantize(x, "nvfp4", convention=convention)
    b = lowbit.quantize(w, "nvfp4", convention=convention, scale_layout=layout)
    return a, b


def _rel(got, want):
    return ((got.float() - want.float()).norm() / want.float().norm()).item()


@pytest.mark.parametrize("convention", ["vllm", "torchao"])
@pytest.mark.parametrize("layout", ["linear", "swizzled"])
@pytest.mark.parametrize("chunk_rows", [None, 128])
def test_dequant_route_matches_the_reference(km, monkeypatch, convention, layout, chunk_rows):
    from lowbit.kernels import scaled_mm_routes

    m, n, k = 40, 384, 256
    a, b = _pair(m, n, k, convention, layout)
    if chunk_rows is not None:  # several chunks of 128 weight rows
        monkeypatch.setattr(scaled_mm_routes, "DEQUANT_CHUNK_BYTES", chunk_rows * 2 * k)
    alpha = torch.tensor([0.75])
    bias = torch.randn(n).to(torch.bfloat16)
    for args in ((None, None), (alpha, bias)):
        for out_dtype in (torch.bfloat16, torch.float32):
            got = km.scaled_mm(a, b, *args, out_dtype, route="dequant")
            want = scaled_mm_reference(a, b, *args, out_dtype)
            assert got.shape == (m, n) and got.dtype == out_dtype
            # CPU has no bf16 mm with an fp32 output: one extra bf16 rounding of the product here
            assert _rel(got, want) < 8e-3, (args[0] is None, out_dtype)


def test_dequant_route_products_are_exact_in_bf16(km):
    """Each decoded element (E2M1 x E4M3) is a bf16 value: decoding to bf16 loses nothing."""
    from lowbit.kernels import scaled_mm_routes

    a, b = _pair(8, 128, 128, "vllm", "linear")
    for q in (a, b):
        plain, _, _ = scaled_mm_routes._without_global(q)
        d32 = ref.dequantize_nvfp4(plain, torch.float32)
        assert torch.equal(d32.to(torch.bfloat16).float(), d32)


def test_policy_picks_the_dequant_route_from_its_threshold(km):
    n, k = 256, 128
    for m, want in ((policy.DEQUANT_MM_MIN_M, "dequant"), (policy.DEQUANT_MM_MIN_M - 1, "kernel"), (8, "gemv")):
        a, b = _pair(m, n, k, "vllm", "swizzled")
        assert policy.scaled_route(a, b, None, torch.bfloat16, km) == want, m
    a, b = _pair(600, n, k, "vllm", "swizzled")
    a_mx = lowbit.quantize(torch.randn(600, k), "mxfp8_e4m3")
    assert km.dequant_unsupported(a_mx, b) is not None
    assert policy.scaled_route(a_mx, b, None, torch.bfloat16, km) == "kernel"
    with pytest.raises(ValueError, match="route 'dequant'"):
        km.scaled_mm(a_mx, b, None, None, torch.bfloat16, route="dequant")
