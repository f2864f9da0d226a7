"""fp8_rowwise (per-token FP8, vLLM dynamic per-token quantization): rule, edges, non-finite input, errors."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import lowbit
from lowbit.formats.fp8_rowwise import MIN_SCALE, dequantize_fp8_rowwise, quantize_fp8_rowwise
from lowbit.formats.qtensor import QTensor

NAN_CODE = 0x7F
CANONICAL_NAN_F32 = 0x7FC00000
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def ref_per_token(x: torch.Tensor):
    """vLLM ``dynamic_per_token_scaled_fp8_quant`` as its CUDA kernel computes it, written with numpy-like steps:
    ``s = fmaxf(amax / 448, 1 / (448 * 512))`` in fp32, ``q = fp8(clamp(x / s, -448, 448))``; plus lowbit's
    non-finite rule (NaN row -> NaN scale, 0x7F codes)."""
    xf = x.float()
    amax = xf.abs().amax(dim=-1, keepdim=True) if xf.shape[-1] else xf.new_zeros(*xf.shape[:-1], 1)
    min_scale = torch.tensor(1.0, dtype=torch.float32) / torch.tensor(448.0 * 512.0, dtype=torch.float32)
    s = torch.maximum(amax / torch.tensor(448.0), min_scale)
    y = (xf / s).clamp(-448.0, 448.0)
    codes = y.to(torch.float8_e4m3fn).view(torch.uint8)
    codes = torch.where(y.isnan(), torch.full_like(codes, NAN_CODE), codes)
    s = torch.where(s.isnan(), torch.tensor(CANONICAL_NAN_F32, dtype=torch.int32).view(torch.float32), s)
    return codes, s


def _bits(s):
    return s.contiguous().view(torch.int32)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 1), (7, 100), (3, 5, 128), (4, 7168), (0, 16), (2, 0)])
def test_matches_vllm_rule(shape, dtype):
    g = torch.Generator().manual_seed(sum(shape))
    x = (torch.randn(shape, generator=g) * torch.logspace(-3, 3, shape[-1] or 1)[: shape[-1]]).to(dtype)
    q = lowbit.quantize(x, "fp8_rowwise")
    codes, s = ref_per_token(x)
    assert q.fmt == "fp8_rowwise" and q.shape == x.shape and q.dtype == dtype
    assert q.data.dtype == torch.float8_e4m3fn and q.data.shape == x.shape
    assert q.scale.dtype == torch.float32 and q.scale.shape == (*shape[:-1], 1)
    assert torch.equal(q.data.view(torch.uint8), codes)
    assert torch.equal(_bits(q.scale), _bits(s))


def test_min_scale_is_vllms_fp32_constant():
    assert MIN_SCALE == (torch.tensor(1.0) / torch.tensor(229376.0)).item()
    q = lowbit.quantize(torch.zeros(3, 64), "fp8_rowwise")
    assert torch.all(q.scale == MIN_SCALE) and torch.all(q.data.view(torch.uint8) == 0)
    # a tiny row: the floor on the scale keeps the values small instead of blowing them up to 448
    tiny = torch.full((1, 8), 1e-7)
    q = lowbit.quantize(tiny, "fp8_rowwise")
    assert q.scale.item() == MIN_SCALE
    assert torch.equal(q.data.float(), (tiny / MIN_SCALE).to(torch.float8_e4m3fn).float())


def test_division_not_reciprocal():
    # pick x, s where x / s is an exact e4m3 midpoint but x * (1/s) is not: the division form rounds to even
    s = torch.tensor(3.0 / 448.0)  # amax 3.0 in a row
    x = torch.tensor([[3.0, 0.65625 * s.item()]])
    q = quantize_fp8_rowwise(x)
    want = ref_per_token(x)[0]
    assert torch.equal(q.data.view(torch.uint8), want)


def test_amax_element_maps_to_448():
    x = torch.tensor([[-5.0, 1.0, 2.5], [0.0, 0.001, 1000.0]])
    q = quantize_fp8_rowwise(x)
    assert q.data.float().abs().amax(dim=-1).tolist() == [448.0, 448.0]
    # relative error of one E4M3 rounding, or half the smallest subnormal (2^-10) times the row scale
    torch.testing.assert_close(dequantize_fp8_rowwise(q), x, rtol=2**-4, atol=1000 / 448 * 2**-10)
    assert dequantize_fp8_rowwise(q)[1, 1] == 0  # 0.001 is below the row's smallest step


def test_non_finite_rows():
    x = torch.tensor([[1.0, float("nan"), 2.0], [1.0, float("inf"), -2.0], [1.0, 2.0, 3.0]])
    q = quantize_fp8_rowwise(x)
    assert _bits(q.scale)[0].item() == CANONICAL_NAN_F32
    assert torch.all(q.data.view(torch.uint8)[0] == NAN_CODE)
    assert q.scale[1].item() == float("inf")
    assert q.data.view(torch.uint8)[1].tolist() == [0x00, NAN_CODE, 0x80]
    d = dequantize_fp8_rowwise(q)
    assert d[0].isnan().all() and d[1].isnan().all() and torch.isfinite(d[2]).all()


def test_dequantize_dtypes_and_round_trip():
    x = torch.randn(5, 64, dtype=torch.bfloat16)
    q = lowbit.quantize(x, "fp8_rowwise")
    d32 = lowbit.dequantize(q)
    assert torch.equal(d32, q.data.float() * q.scale)
    for dt in DTYPES:
        assert torch.equal(lowbit.dequantize(q, dt), d32.to(dt))


def test_input_not_modified_and_non_contiguous():
    base = torch.randn(64, 6)
    x = base.T
    before = x.clone()
    q = lowbit.quantize(x, "fp8_rowwise")
    assert torch.equal(x, before)
    r = lowbit.quantize(x.contiguous(), "fp8_rowwise")
    assert torch.equal(q.data.view(torch.uint8), r.data.view(torch.uint8)) and torch.equal(q.scale, r.scale)


@settings(max_examples=40, deadline=None)
@given(
    rows=st.integers(0, 4),
    k=st.integers(1, 70),
    scale=st.sampled_from([1e-6, 1e-2, 1.0, 300.0, 6e4]),
    seed=st.integers(0, 2**16),
    dtype=st.sampled_from(DTYPES),
)
def test_random(rows, k, scale, seed, dtype):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(rows, k, generator=g) * scale).to(dtype)
    q = quantize_fp8_rowwise(x)
    codes, s = ref_per_token(x)
    assert torch.equal(q.data.view(torch.uint8), codes) and torch.equal(_bits(q.scale), _bits(s))


def test_errors():
    with pytest.raises(TypeError, match="float32, bfloat16 or float16"):
        lowbit.quantize(torch.zeros(2, 4, dtype=torch.float64), "fp8_rowwise")
    with pytest.raises(TypeError, match="torch.Tensor"):
        quantize_fp8_rowwise([1.0, 2.0])
    with pytest.raises(ValueError, match="at least 1 dimension"):
        lowbit.quantize(torch.tensor(1.0), "fp8_rowwise")
    with pytest.raises(ValueError, match="unknown option"):
        lowbit.quantize(torch.zeros(2, 4), "fp8_rowwise", block=(1, 128))
    q = lowbit.quantize(torch.randn(3, 16), "fp8_rowwise")
    # rejected where the QTensor is built, so dequantize never meets one
    bad = [
        ((q.data, q.scale.reshape(3)), ValueError, "one scale per row"),
        ((q.data, q.scale.double()), TypeError, "float32"),
        ((q.data.view(torch.uint8), q.scale), TypeError, "float8_e4m3fn"),
        ((q.data[:2], q.scale), ValueError, "must equal q.shape"),
    ]
    for (data, scale), exc, match in bad:
        with pytest.raises(exc, match=match):
            QTensor(data, scale, "fp8_rowwise", q.shape)
