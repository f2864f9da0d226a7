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
        plain, _, _ = scaled_mm_routes.without_global(q)
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


# ----------------------------------------------------------------- MX pairs of 6/8-bit elements

MX_PAIRS = [("mxfp8_e4m3", "mxfp8_e4m3"), ("mxfp8_e5m2", "mxfp8_e4m3"), ("mxfp6_e2m3", "mxfp8_e4m3"),
            ("mxfp8_e4m3", "mxfp6_e3m2")]


@pytest.fixture
def km_mx(monkeypatch):
    """The MX decode replaced by the format reference it matches bit for bit, and the guarded decoding kernel
    by a recorder that, when its guard is set, writes the reference product (what the kernel computes)."""
    from lowbit.kernels import blockscaled, scaled_mm, scaled_mm_routes

    monkeypatch.setattr(blockscaled, "dequantize_mx", ref.dequantize_mx)
    calls = []

    def fake_decoding(a_args, ac, b_args, bc, m, n, k_dim, alpha, bias, out, cfg, guard=None, plan_n=0):
        calls.append(int(guard.item()))
        if calls[-1]:
            out.copy_(calls_pair[0](alpha, bias, out.dtype))

    calls_pair = []
    monkeypatch.setattr(scaled_mm_routes, "launch_decoding", fake_decoding)
    scaled_mm.mx_calls, scaled_mm.mx_pair = calls, calls_pair
    yield scaled_mm
    del scaled_mm.mx_calls, scaled_mm.mx_pair


def _mx_pair(fa, fb, m, n, k, seed=0, layout="linear"):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g) * 3
    w = torch.randn(n, k, generator=g) * torch.logspace(-3, 1, n)[:, None]
    return lowbit.quantize(x, fa), lowbit.quantize(w, fb, scale_layout=layout)


@pytest.mark.parametrize("fa,fb", MX_PAIRS)
@pytest.mark.parametrize("chunk_rows", [None, 128])
def test_mx_dequant_route_matches_the_reference(km_mx, monkeypatch, fa, fb, chunk_rows):
    from lowbit.kernels import scaled_mm_routes

    m, n, k = 40, 384, 256
    a, b = _mx_pair(fa, fb, m, n, k, layout="swizzled" if chunk_rows else "linear")
    if chunk_rows is not None:
        monkeypatch.setattr(scaled_mm_routes, "DEQUANT_CHUNK_BYTES", chunk_rows * 2 * k)
    km_mx.mx_pair.append(lambda al, bi, dt: scaled_mm_reference(a, b, al, bi, dt))
    alpha = torch.tensor([0.75])
    bias = torch.randn(n).to(torch.bfloat16)
    for args in ((None, None), (None, bias), (alpha, bias)):
        for out_dtype in (torch.bfloat16, torch.float32):
            got = km_mx.scaled_mm(a, b, *args, out_dtype, route="dequant")
            want = scaled_mm_reference(a, b, *args, out_dtype)
            assert got.shape == (m, n) and got.dtype == out_dtype
            assert _rel(got, want) < 8e-3, (args[0] is None, args[1] is None, out_dtype)
    # every call ended with the guarded decoding kernel, its guard clear: these scales decode exactly
    assert km_mx.mx_calls == [0] * 6


@pytest.mark.parametrize("bad_scale", [0, 9, 240, 255], ids=["tiny", "below", "above", "nan"])
@pytest.mark.parametrize("operand", ["a", "b"])
def test_mx_scale_outside_the_exact_range_runs_the_decoding_kernel(km_mx, bad_scale, operand):
    a, b = _mx_pair("mxfp8_e4m3", "mxfp8_e4m3", 16, 128, 128)
    q = a if operand == "a" else b
    q.scale.view(torch.uint8)[1, 2] = bad_scale
    want = scaled_mm_reference(a, b, None, None, torch.float32)
    km_mx.mx_pair.append(lambda al, bi, dt: scaled_mm_reference(a, b, al, bi, dt))
    got = km_mx.scaled_mm(a, b, None, None, torch.float32, route="dequant")
    assert km_mx.mx_calls == [1]
    assert torch.equal(got.isnan(), want.isnan())
    fin = ~want.isnan()
    assert torch.equal(got[fin], want[fin])


def test_mx_guard_bounds():
    from lowbit.kernels.scaled_mm_routes import MX_BF16_EXACT_SCALES, mx_scales_outside_bf16

    lo, hi = MX_BF16_EXACT_SCALES
    q = lowbit.quantize(torch.randn(4, 64), "mxfp8_e5m2")
    for s, flagged in ((lo, 0), (hi, 0), (127, 0), (lo - 1, 1), (hi + 1, 1), (255, 1)):
        q.scale.view(torch.uint8).fill_(127)
        q.scale.view(torch.uint8)[3, 1] = s
        assert mx_scales_outside_bf16(q).tolist() == [flagged], s


def _scaled_elements(fmt, s):
    """Every finite element of MX format ``fmt`` times 2^(s - 127), in float64."""
    from lowbit.formats import FORMATS
    from lowbit.formats.codecs import decode_minifloat

    elem = FORMATS[fmt].element
    codes = torch.arange(1 << (1 + elem.ebits + elem.mbits), dtype=torch.int32)
    values = decode_minifloat(codes, elem).double()
    return torch.ldexp(values[values.isfinite()], torch.tensor(s - 127, dtype=torch.float64))


@pytest.mark.parametrize("fmt", ["mxfp8_e4m3", "mxfp8_e5m2", "mxfp6_e2m3", "mxfp6_e3m2"])
def test_mx_elements_times_exact_range_scales_are_bf16_values(fmt):
    """Every finite element of the format times 2^(s - 127) at both ends of MX_BF16_EXACT_SCALES survives a
    round trip through bf16: the route's decoding loses nothing there."""
    from lowbit.kernels.scaled_mm_routes import MX_BF16_EXACT_SCALES

    for s in MX_BF16_EXACT_SCALES:
        v = _scaled_elements(fmt, s)
        assert torch.equal(v.to(torch.bfloat16).double(), v), (fmt, s)


def test_the_exact_range_is_tight_for_the_widest_format():
    """One step outside the range at either end, some E5M2 element (the widest format) is not a finite bf16
    value or rounds: the bounds are not looser than the formats allow."""
    from lowbit.kernels.scaled_mm_routes import MX_BF16_EXACT_SCALES

    lo, hi = MX_BF16_EXACT_SCALES
    for s in (lo - 1, hi + 1):
        v = _scaled_elements("mxfp8_e5m2", s)
        assert not torch.equal(v.to(torch.bfloat16).double(), v), s


def test_policy_routes_mx_pairs_to_dequant_from_its_threshold(km_mx):
    n, k = 256, 128
    for m, want in ((policy.DEQUANT_MM_MIN_M, "dequant"), (policy.DEQUANT_MM_MIN_M - 1, "kernel")):
        a, b = _mx_pair("mxfp8_e4m3", "mxfp8_e4m3", m, n, k)
        assert policy.scaled_route(a, b, None, torch.bfloat16, km_mx) == want, m
    a, _ = _mx_pair("mxfp8_e4m3", "mxfp8_e4m3", 600, n, k)
    b4 = lowbit.quantize(torch.randn(n, k), "mxfp4")
    assert km_mx.dequant_unsupported(a, b4) is not None  # mxfp4 weights take the fold route
