"""fp8_block (DeepSeek-V3 FP8, 1x128 / 128x128 blocks): golden bytes, producer cross-checks, edges, errors."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import lowbit
from lowbit.formats import fp8_block
from lowbit.formats.fp8_block import (
    column_major_scales,
    dequantize_fp8_block,
    pack_ue8m0_to_int32,
    quantize_fp8_block,
    ue8m0_ceil,
    unpack_ue8m0_from_int32,
)
from lowbit.formats.qtensor import QTensor

BLOCKS = [(1, 128), (128, 128)]
SCALE_FMTS = [None, "ue8m0"]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
NAN_CODE = 0x7F
CANONICAL_NAN_F32 = 0x7FC00000  # lowbit stores every NaN scale with this bit pattern


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32) if t.dtype == torch.float32 else t.view(torch.uint8)


def _codes(q: QTensor) -> torch.Tensor:
    return q.data.view(torch.uint8)


def _f32(hex_str: str) -> float:
    return float.fromhex(hex_str)


# Independent references, written from the producers' source semantics (not from lowbit's code): the
# partial edge block of a zero-padded producer is just the slice (zeros never raise an amax), the
# power-of-two rounding uses frexp instead of exponent bits, and the E4M3 cast is torch's after a clamp.
def _ref_pow2_ceil(s: torch.Tensor) -> torch.Tensor:
    mant, exp = torch.frexp(s)
    up = torch.ldexp(torch.ones_like(s), torch.where(mant == 0.5, exp - 1, exp))
    return torch.where(torch.isfinite(s), up, s)


def _ref_e4m3(y: torch.Tensor) -> torch.Tensor:
    codes = y.clamp(-448.0, 448.0).to(torch.float8_e4m3fn).view(torch.uint8)
    # GPU cvt.satfinite writes 0x7F for NaN of either sign; torch keeps the sign bit
    return torch.where(y.isnan(), torch.full_like(codes, NAN_CODE), codes)


def _ref_scale(amax: torch.Tensor, scale_fmt):
    s = torch.maximum(amax, torch.tensor(1e-4, dtype=torch.float32)) / 448.0
    s = _ref_pow2_ceil(s) if scale_fmt == "ue8m0" else s
    return torch.where(s.isnan(), torch.tensor(CANONICAL_NAN_F32, dtype=torch.int32).view(torch.float32), s)


def ref_act_quant(x: torch.Tensor, scale_fmt):
    """DeepSeek ``act_quant``: per 128 contiguous elements, ``s = max(amax, 1e-4)/448``, ``x / s``."""
    xf = x.float()
    k = xf.shape[-1]
    codes = torch.empty(xf.shape, dtype=torch.uint8)
    scales = []
    for g in range(math.ceil(k / 128)):
        blk = xf[..., g * 128:(g + 1) * 128]
        s = _ref_scale(blk.abs().amax(dim=-1, keepdim=True), scale_fmt)
        codes[..., g * 128:(g + 1) * 128] = _ref_e4m3(blk / s)
        scales.append(s)
    scale = torch.cat(scales, dim=-1) if scales else torch.empty(*xf.shape[:-1], 0)
    return codes, scale


def ref_per_block_cast(x: torch.Tensor, scale_fmt):
    """DeepGEMM ``per_block_cast_to_fp8``: per 128x128 block, ``s = max(amax, 1e-4)/448``, ``x * (1/s)``."""
    xf = x.float()
    n, k = xf.shape
    gn, gk = math.ceil(n / 128), math.ceil(k / 128)
    codes = torch.empty(xf.shape, dtype=torch.uint8)
    scale = torch.empty(gn, gk)
    for i in range(gn):
        for j in range(gk):
            blk = xf[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128]
            s = _ref_scale(blk.abs().amax(), scale_fmt)
            codes[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128] = _ref_e4m3(blk * (1.0 / s))
            scale[i, j] = s
    return codes, scale


def _reference(x, block, scale_fmt):
    return ref_act_quant(x, scale_fmt) if block == (1, 128) else ref_per_block_cast(x, scale_fmt)


def _assert_matches_reference(x, block, scale_fmt):
    q = quantize_fp8_block(x, block=block, scale_fmt=scale_fmt)
    codes, scale = _reference(x, block, scale_fmt)
    assert q.data.dtype == torch.float8_e4m3fn and q.data.shape == x.shape
    assert q.scale.dtype == torch.float32 and q.scale.shape == scale.shape
    assert torch.equal(_codes(q), codes)
    assert torch.equal(_bits(q.scale), _bits(scale))
    return q


def _varied(shape, seed, dtype=torch.float32):
    """Normal data whose rows (and 128-column groups) span magnitudes 1e-7 .. 1e4."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g)
    mag = 10 ** (torch.rand(*shape[:-1], math.ceil(shape[-1] / 128), generator=g) * 11 - 7)
    return (x * mag.repeat_interleave(128, dim=-1)[..., : shape[-1]]).to(dtype)


# ---------------------------------------------------------------- golden vectors


@pytest.mark.parametrize("block", BLOCKS)
def test_golden_scale_one_ties_subnormals_and_signed_zero(block):
    # amax exactly 448 makes the scale 448/448 = 1.0, so each code below is the plain E4M3 RNE of the value
    values_codes = [
        (448.0, 0x7E), (-448.0, 0xFE),
        (1.0625, 0x38),   # tie between 1.0 and 1.125 -> even mantissa 1.0
        (1.1875, 0x3A),   # tie between 1.125 and 1.25 -> even mantissa 1.25
        (-1.0625, 0xB8),  # same tie, negative
        (17.0, 0x58),     # tie between 16 and 18 -> 16
        (19.0, 0x5A),     # tie between 18 and 20 -> 20
        (2.0**-9, 0x01),  # smallest subnormal
        (2.0**-10, 0x00),  # tie between 0 and 2^-9 -> even (0)
        (1.5 * 2.0**-10, 0x01),
        (-(2.0**-11), 0x80),  # rounds to zero, sign kept
        (0.0, 0x00), (-0.0, 0x80),
    ]
    row = torch.zeros(128)
    row[: len(values_codes)] = torch.tensor([v for v, _ in values_codes])
    want = torch.zeros(128, dtype=torch.uint8)
    want[: len(values_codes)] = torch.tensor([c for _, c in values_codes], dtype=torch.uint8)
    x = row.expand(128, 128).clone() if block == (128, 128) else row.unsqueeze(0)
    q = quantize_fp8_block(x, block=block)
    assert torch.equal(q.scale, torch.ones_like(q.scale))
    assert torch.equal(_codes(q), want.expand_as(x))
    deq = dequantize_fp8_block(q)
    assert deq[0, 2].item() == 1.0 and deq[0, 3].item() == 1.25 and torch.signbit(deq[0, 12]).item()


@pytest.mark.parametrize("scale_fmt", SCALE_FMTS)
def test_golden_zero_block_and_tiny_block_clamp_amax_to_1e4(scale_fmt):
    x = torch.zeros(2, 384)
    x[0, 128] = -0.0
    x[0, 129] = 5e-5   # below the 1e-4 floor, so the floor decides the scale
    x[0, 256:] = torch.linspace(-3, 3, 128)  # an ordinary block in the same row
    x[1, :] = 1.0  # not all zeros
    q = quantize_fp8_block(x, scale_fmt=scale_fmt)
    # fp32(1e-4) / 448 = 0x1.df595ap-23; ue8m0 rounds it up to 2^-22
    floor_scale = _f32("0x1.df595ap-23") if scale_fmt is None else 2.0**-22
    assert q.scale[0, 0].item() == floor_scale and q.scale[0, 1].item() == floor_scale
    assert q.scale[1, 0].item() == ((torch.tensor(1.0) / 448).item() if scale_fmt is None else 2.0**-8)
    codes = _codes(q)
    assert torch.equal(codes[0, :128], torch.zeros(128, dtype=torch.uint8))
    assert codes[0, 128].item() == 0x80  # -0 keeps its sign
    # 5e-5 / (1e-4/448) = 224.0 -> 0x76; with the 2^-22 scale 5e-5 * 2^22 = 209.7 -> 208 (0x75)
    assert codes[0, 129].item() == (0x76 if scale_fmt is None else 0x75)
    assert q.scale[0, 2].item() == ((torch.tensor(3.0) / 448).item() if scale_fmt is None else 2.0**-7)


def test_golden_128x128_zero_block_and_partial_edge_blocks():
    x = torch.zeros(130, 260)
    x[:128, :128] = 0.0                      # zero block: scale from the 1e-4 floor
    x[129, 0] = 448.0                         # edge block rows 128..129: amax 448 -> scale 1
    x[5, 259] = -896.0                        # edge block cols 256..259: amax 896 -> scale 2
    x[0, 128] = 44.8                          # interior block: scale 0.1
    q = quantize_fp8_block(x, block=(128, 128))
    assert q.scale.shape == (2, 3)
    assert q.scale[0, 0].item() == _f32("0x1.df595ap-23")
    assert q.scale[1, 0].item() == 1.0
    assert q.scale[0, 2].item() == 2.0
    assert q.scale[0, 1].item() == (torch.tensor(44.8) / 448).item()
    codes = _codes(q)
    assert codes[129, 0].item() == 0x7E and codes[5, 259].item() == 0xFE
    assert torch.equal(codes[:128, :128], torch.zeros(128, 128, dtype=torch.uint8))


@pytest.mark.parametrize("block", BLOCKS)
@pytest.mark.parametrize("scale_fmt", SCALE_FMTS)
def test_nan_and_inf_blocks(block, scale_fmt):
    rows = 128 if block == (128, 128) else 1
    x = torch.linspace(-2, 2, rows * 384).reshape(rows, 384)
    # block 0: a NaN with sign and payload (0xFFC00123) -> the canonical NaN scale, every code 0x7F
    x[0, 5] = torch.tensor(0xFFC00123 - (1 << 32), dtype=torch.int32).view(torch.float32)
    x[0, 130] = float("inf")      # block 1: Inf -> scale Inf
    x[0, 131] = float("-inf")
    x[0, 132] = -1.0
    q = quantize_fp8_block(x, block=block, scale_fmt=scale_fmt)
    codes = _codes(q)
    scale = q.scale.reshape(-1)
    assert scale[0:1].view(torch.int32).item() == CANONICAL_NAN_F32
    assert scale[1].item() == math.inf
    assert math.isfinite(scale[2].item())
    assert torch.equal(codes[:, :128], torch.full((rows, 128), NAN_CODE, dtype=torch.uint8))
    assert codes[0, 130].item() == NAN_CODE and codes[0, 131].item() == NAN_CODE  # Inf/Inf
    assert codes[0, 132].item() == 0x80  # -1/Inf = -0
    assert codes[0, 133].item() in (0x00, 0x80)
    deq = dequantize_fp8_block(q)
    assert deq[:, :256].isnan().all(), "NaN and Inf blocks decode to NaN as a whole"
    assert torch.isfinite(deq[:, 256:]).all()


@pytest.mark.parametrize("scale_fmt", SCALE_FMTS)
def test_nan_scale_bit_pattern_is_canonical(scale_fmt):
    # CPU torch.amax already returns 0x7FC00000, but other kernels (CPU torch.maximum: 0xFFFFFFFF, GPUs)
    # keep signs and payloads; the stored scale must not depend on which one produced the NaN
    amax = torch.tensor([0xFFFFFFFF - (1 << 32), 0x7FC00123], dtype=torch.int32).view(torch.float32)
    s = fp8_block._block_scale(amax, scale_fmt)
    assert s.view(torch.int32).tolist() == [CANONICAL_NAN_F32] * 2


# ---------------------------------------------------------------- UE8M0 rounding


def test_ue8m0_bit_method_differs_from_log2_form_above_a_power_of_two():
    amax = torch.tensor(3.5).nextafter(torch.tensor(4.0))  # 3.5 + 2^-22
    s = amax / 448
    assert hex(s.view(torch.int32).item()) == "0x3c000001", "s is nextafter(2^-7)"
    # DeepSeek's exp2(ceil(log2(s))): fp32 log2 rounds to exactly -7.0, giving 2^-7 < s
    assert torch.log2(s).item() == -7.0
    assert torch.exp2(torch.ceil(torch.log2(s))).item() == 2.0**-7
    assert ue8m0_ceil(s.reshape(1)).item() == 2.0**-6

    x = torch.zeros(1, 128)
    x[0, 0] = amax
    x[0, 1] = -1.0
    q = quantize_fp8_block(x, scale_fmt="ue8m0")
    assert q.scale.item() == 2.0**-6
    assert _codes(q)[0, 0].item() == 0x76  # 224.00001 -> 224; the log2 form's 2^-7 would give 448 (0x7E)
    assert _codes(q)[0, 1].item() == 0xE8  # -1 / 2^-6 = -64

    x[0, 0] = 3.5  # exactly 2^-7 * 448: both forms agree
    assert quantize_fp8_block(x, scale_fmt="ue8m0").scale.item() == 2.0**-7


def test_ue8m0_ceil_values():
    s = torch.tensor([1.0, _f32("0x1.000002p+0"), 0.75, 2.0**-126, 2.0**-130, 3.0e38, 5.0, -3.0])
    want = [1.0, 2.0, 1.0, 2.0**-126, 2.0**-126, 2.0**127, 8.0, 4.0]
    # DeepGEMM's exponent clamp [1, 254]: 2^-130 (fp32 subnormal) -> smallest normal, 3e38 -> 2^127
    assert ue8m0_ceil(s).tolist() == want
    special = ue8m0_ceil(torch.tensor([float("nan"), float("inf")]))
    assert math.isnan(special[0].item()) and special[1].item() == math.inf
    with pytest.raises(TypeError, match="s must be a float32"):
        ue8m0_ceil(torch.tensor([1.0], dtype=torch.float64))


@pytest.mark.parametrize("block", BLOCKS)
def test_ue8m0_scales_are_powers_of_two_and_never_smaller(block):
    x = _varied((200, 300), seed=3) if block == (128, 128) else _varied((7, 700), seed=3)
    q = quantize_fp8_block(x, block=block, scale_fmt="ue8m0")
    plain = quantize_fp8_block(x, block=block)
    assert ((q.scale.view(torch.int32) & 0x7FFFFF) == 0).all()
    assert (q.scale >= plain.scale).all() and (q.scale < 2 * plain.scale).all()


# ---------------------------------------------------------------- divide (act_quant) vs multiply (DeepGEMM)


def test_1x128_divides_and_128x128_multiplies_by_the_reciprocal():
    amax = _f32("0x1.0c7b54p+3")  # 8.39005..
    v = _f32("0x1.92b8fep-7")     # v / (amax/448) is exactly the E4M3 midpoint 0.65625
    s = torch.tensor(amax) / 448
    assert (torch.tensor(v) / s).item() == 0.65625
    assert (torch.tensor(v) * (1.0 / s)).item() > 0.65625  # one ulp above: the tie is broken upward
    x = torch.zeros(128, 128)
    x[0, 0], x[0, 1] = amax, v
    act = quantize_fp8_block(x[:1], block=(1, 128))
    wgt = quantize_fp8_block(x, block=(128, 128))
    assert act.scale[0, 0].item() == wgt.scale[0, 0].item() == s.item()
    assert _codes(act)[0, 1].item() == 0x32  # 0.625: DeepSeek act_quant's x / s, tie to even
    assert _codes(wgt)[0, 1].item() == 0x33  # 0.6875: DeepGEMM's x * (1/s)
    # with ue8m0 the scale is a power of two and both orders are exact
    act8 = quantize_fp8_block(x[:1], block=(1, 128), scale_fmt="ue8m0")
    wgt8 = quantize_fp8_block(x, block=(128, 128), scale_fmt="ue8m0")
    assert torch.equal(_codes(act8)[0], _codes(wgt8)[0])


# ---------------------------------------------------------------- cross-check against the references


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("scale_fmt", SCALE_FMTS)
@pytest.mark.parametrize("shape", [(4, 256), (3, 5, 300), (7, 1), (2, 129), (1, 385), (384,)])
def test_1x128_matches_deepseek_act_quant(shape, scale_fmt, dtype):
    _assert_matches_reference(_varied(shape, seed=sum(shape), dtype=dtype), (1, 128), scale_fmt)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("scale_fmt", SCALE_FMTS)
@pytest.mark.parametrize("shape", [(128, 128), (256, 384), (130, 200), (1, 1), (300, 129), (5, 700)])
def test_128x128_matches_deepgemm_per_block_cast(shape, scale_fmt, dtype):
    g = torch.Generator().manual_seed(shape[0] * 1000 + shape[1])
    mag = 10 ** (torch.rand(math.ceil(shape[0] / 128), math.ceil(shape[1] / 128), generator=g) * 11 - 7)
    mag = mag.repeat_interleave(128, 0)[: shape[0]].repeat_interleave(128, 1)[:, : shape[1]]
    x = (torch.randn(shape, generator=g) * mag).to(dtype)
    _assert_matches_reference(x, (128, 128), scale_fmt)


@pytest.mark.parametrize("block", BLOCKS)
def test_matches_reference_with_specials_sprinkled(block):
    x = _varied((260, 300), seed=11)
    g = torch.Generator().manual_seed(12)
    idx = torch.randint(0, x.numel(), (12,), generator=g)
    x.view(-1)[idx] = torch.tensor([float("nan"), float("inf"), float("-inf"), -0.0, 448.0, -1e-30] * 2)
    for fmt in SCALE_FMTS:
        _assert_matches_reference(x, block, fmt)


@settings(max_examples=25, deadline=None)
@given(
    rows=st.integers(0, 140),
    k=st.integers(0, 400),
    block=st.sampled_from(BLOCKS),
    scale_fmt=st.sampled_from(SCALE_FMTS),
    dtype=st.sampled_from(DTYPES),
    seed=st.integers(0, 2**16),
)
def test_property_matches_reference(rows, k, block, scale_fmt, dtype, seed):
    x = _varied((rows, k), seed=seed, dtype=dtype) if k else torch.empty(rows, 0, dtype=dtype)
    q = _assert_matches_reference(x, block, scale_fmt)
    deq = dequantize_fp8_block(q)
    finite = torch.isfinite(x.float())
    assert deq.shape == x.shape and torch.isfinite(deq[finite]).all()


# ---------------------------------------------------------------- layout of inputs


@pytest.mark.parametrize("block", BLOCKS)
def test_non_contiguous_input(block):
    base = _varied((260, 300), seed=5)
    for x in (base.t()[:, :200], base[::2, 1::2]):
        assert not x.is_contiguous()
        want = quantize_fp8_block(x.contiguous(), block=block)
        got = quantize_fp8_block(x, block=block)
        assert torch.equal(_codes(got), _codes(want)) and torch.equal(got.scale, want.scale)


def test_leading_batch_dims_are_rows():
    x = _varied((2, 3, 300), seed=6, dtype=torch.bfloat16)
    q = quantize_fp8_block(x)
    flat = quantize_fp8_block(x.reshape(6, 300))
    assert q.data.shape == (2, 3, 300) and q.scale.shape == (2, 3, 3)
    assert torch.equal(_codes(q).reshape(6, 300), _codes(flat))
    assert torch.equal(q.scale.reshape(6, 3), flat.scale)
    assert dequantize_fp8_block(q).shape == (2, 3, 300)


@pytest.mark.parametrize("block", BLOCKS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_input_not_modified(block, dtype):
    x = _varied((130, 260), seed=7, dtype=dtype)
    x[0, 0] = float("nan")
    before = x.clone()
    quantize_fp8_block(x, block=block, scale_fmt="ue8m0")
    quantize_fp8_block(x, block=block)
    raw = torch.int32 if dtype == torch.float32 else torch.int16
    assert torch.equal(x.view(raw), before.view(raw))


@pytest.mark.parametrize(
    "shape, block, scale_shape",
    [((0, 128), (1, 128), (0, 1)), ((4, 0), (1, 128), (4, 0)), ((0,), (1, 128), (0,)),
     ((2, 0, 5), (1, 128), (2, 0, 1)), ((0, 300), (128, 128), (0, 3)), ((5, 0), (128, 128), (1, 0)),
     ((0, 0), (128, 128), (0, 0))],
)
def test_empty_inputs(shape, block, scale_shape):
    x = torch.empty(shape, dtype=torch.bfloat16)
    q = quantize_fp8_block(x, block=block)
    assert q.data.shape == shape and q.data.dtype == torch.float8_e4m3fn
    assert q.scale.shape == scale_shape and q.scale.dtype == torch.float32
    out = dequantize_fp8_block(q, torch.bfloat16)
    assert out.shape == shape and out.dtype == torch.bfloat16


# ---------------------------------------------------------------- dequantize and the public API


@pytest.mark.parametrize("block", BLOCKS)
@pytest.mark.parametrize("out_dtype", DTYPES)
def test_dequantize_is_fp8_times_block_scale(block, out_dtype):
    x = _varied((130, 300), seed=8)
    q = quantize_fp8_block(x, block=block, scale_fmt=None)
    want = torch.empty(130, 300)
    vals = q.data.float()
    for r in range(130):
        for c in range(0, 300, 128):
            s = q.scale[r, c // 128] if block == (1, 128) else q.scale[r // 128, c // 128]
            want[r, c:c + 128] = vals[r, c:c + 128] * s
    got = dequantize_fp8_block(q, out_dtype)
    assert got.dtype == out_dtype
    assert torch.equal(got, want.to(out_dtype))
    # RNE to 3 mantissa bits: error <= 2^-4 relative for normals, <= half a subnormal step (2^-10 * s) below
    err = (want - x).abs()
    scale = q.scale.repeat_interleave(128, -1)[:, :300] if block == (1, 128) else \
        q.scale.repeat_interleave(128, 0)[:130].repeat_interleave(128, 1)[:, :300]
    assert (err <= x.abs() / 16 + scale * 2.0**-10).all()


def test_public_api_dispatch_and_defaults():
    x = _varied((3, 256), seed=9, dtype=torch.float16)
    q = lowbit.quantize(x, "fp8_block")
    assert q.fmt == "fp8_block" and q.dtype == torch.float16
    assert q.params == {"block": (1, 128), "scale_fmt": None}
    w = _varied((200, 256), seed=9)
    qw = lowbit.quantize(w, "fp8_block", block=[128, 128], scale_fmt="ue8m0")
    assert qw.params == {"block": (128, 128), "scale_fmt": "ue8m0"}
    direct = quantize_fp8_block(w, block=(128, 128), scale_fmt="ue8m0")
    assert torch.equal(_codes(qw), _codes(direct)) and torch.equal(qw.scale, direct.scale)
    assert torch.equal(lowbit.dequantize(qw, torch.bfloat16), dequantize_fp8_block(direct, torch.bfloat16))
    assert lowbit.FORMATS["fp8_block"].element.name == "e4m3"


# ---------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    "kwargs, exc, match",
    [
        ({"block": (128, 1)}, ValueError, "block must be"),
        ({"block": (1, 64)}, ValueError, "block must be"),
        ({"block": "1x128"}, TypeError, "block must be a pair"),
        ({"block": (1.0, 128)}, TypeError, "block must be a pair"),
        ({"block": (1, 128, 1)}, TypeError, "block must be a pair"),
        ({"scale_fmt": "e8m0"}, ValueError, "scale_fmt must be None or 'ue8m0'"),
        ({"scale_fmt": "UE8M0"}, ValueError, "scale_fmt"),
    ],
)
def test_bad_options(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        quantize_fp8_block(torch.ones(2, 128), **kwargs)


def test_bad_inputs():
    with pytest.raises(TypeError, match="x must be a torch.Tensor"):
        quantize_fp8_block([1.0] * 128)
    with pytest.raises(TypeError, match="x must be float32, bfloat16 or float16"):
        quantize_fp8_block(torch.ones(2, 128, dtype=torch.float64))
    with pytest.raises(TypeError, match="x must be float32"):
        quantize_fp8_block(torch.ones(2, 128, dtype=torch.int32))
    with pytest.raises(ValueError, match="at least 1 dimension"):
        quantize_fp8_block(torch.tensor(1.0))
    with pytest.raises(ValueError, match=r"x must be 2-D \[N, K\] for block \(128, 128\)"):
        quantize_fp8_block(torch.ones(2, 128, 128), block=(128, 128))
    with pytest.raises(ValueError, match="unknown option"):
        lowbit.quantize(torch.ones(2, 128), "fp8_block", blocksize=128)


def test_dequantize_rejects_inconsistent_qtensors():
    q = quantize_fp8_block(torch.randn(2, 256))
    with pytest.raises(TypeError, match="q must be a QTensor"):
        dequantize_fp8_block(q.data)
    from dataclasses import replace

    # an inconsistent QTensor cannot be built (QTensor checks its layout), so the decoder never sees one
    with pytest.raises(TypeError, match=r"QTensor\(nvfp4\): data must be uint8"):
        replace(q, fmt="nvfp4")
    with pytest.raises(ValueError, match=r"q.scale must have shape \(2, 2\)"):
        replace(q, scale=q.scale[:, :1])
    with pytest.raises(TypeError, match="q.scale must be float32"):
        replace(q, scale=q.scale.half())
    with pytest.raises(TypeError, match="q.data must be float8_e4m3fn"):
        replace(q, data=q.data.view(torch.uint8))
    with pytest.raises(ValueError, match="block must be"):
        replace(q, params={"block": (1, 32), "scale_fmt": None})
    with pytest.raises(ValueError, match=r"params\['scale_fmt'\] must be None or 'ue8m0'"):
        replace(q, params={"block": (1, 128), "scale_fmt": "e8m0"})
    with pytest.raises(ValueError, match="scale_layout must be one of"):
        replace(q, scale_layout="swizzled")


# ---------------------------------------------------------------- packed UE8M0 and the MN-major layout


def test_pack_ue8m0_golden():
    packed = pack_ue8m0_to_int32(torch.tensor([1.0, 2.0, 0.5, 4.0]))
    assert packed.dtype == torch.int32 and packed.shape == (1,)
    # bytes 7f 80 7e 81, lowest K group in the lowest byte
    assert packed.item() & 0xFFFFFFFF == 0x817E807F
    assert packed.view(torch.uint8).tolist() == [0x7F, 0x80, 0x7E, 0x81]


def test_pack_ue8m0_pads_partial_words_with_zero_bytes_and_round_trips():
    s = torch.tensor([[2.0**-6, 2.0**20, 2.0**-126, 2.0**127, 1.0], [0.25, 0.25, 0.25, 0.25, 0.125]])
    packed = pack_ue8m0_to_int32(s)
    assert packed.shape == (2, 2)
    assert packed[0, 1].item() == 0x7F and packed[1, 1].item() == 0x7C  # bytes 1..3 are padding zeros
    assert packed[0, 0].item() & 0xFFFFFFFF == (0x79 | 0x93 << 8 | 0x01 << 16 | 0xFE << 24)
    assert torch.equal(unpack_ue8m0_from_int32(packed, 5), s)
    full = unpack_ue8m0_from_int32(packed)
    assert full.shape == (2, 8) and torch.equal(full[:, 5:], torch.zeros(2, 3)), "DeepGEMM: byte 0 -> 0.0"
    assert unpack_ue8m0_from_int32(torch.tensor([0xFF], dtype=torch.int32), 1).item() == math.inf


def test_pack_ue8m0_from_quantized_scales():
    q = quantize_fp8_block(_varied((3, 1000), seed=10), scale_fmt="ue8m0")
    packed = pack_ue8m0_to_int32(q.scale)
    assert packed.shape == (3, 2)
    assert torch.equal(unpack_ue8m0_from_int32(packed, q.scale.shape[-1]), q.scale)


@pytest.mark.parametrize("bad", [3.0, 0.0, -2.0, float("nan"), float("inf"), 2.0**-130])
def test_pack_ue8m0_rejects_non_powers_of_two(bad):
    with pytest.raises(ValueError, match="positive normal powers of two"):
        pack_ue8m0_to_int32(torch.tensor([1.0, bad, 2.0, 4.0]))


def test_pack_unpack_bad_arguments():
    with pytest.raises(TypeError, match="scale must be float32"):
        pack_ue8m0_to_int32(torch.ones(4, dtype=torch.float64))
    with pytest.raises(ValueError, match="scale must have at least 1 dimension"):
        pack_ue8m0_to_int32(torch.tensor(1.0))
    with pytest.raises(TypeError, match="packed must be int32"):
        unpack_ue8m0_from_int32(torch.ones(2, dtype=torch.int64))
    with pytest.raises(ValueError, match=r"groups must be an int in \[0, 8\]"):
        unpack_ue8m0_from_int32(torch.ones(2, dtype=torch.int32), 9)


@pytest.mark.parametrize("m, g, aligned", [(5, 3, 8), (8, 2, 8), (1, 4, 4), (130, 3, 132)])
def test_column_major_scales_fp32(m, g, aligned):
    s = torch.rand(m, g) + 0.5
    before = s.clone()
    c = column_major_scales(s)
    assert c.shape == (m, g) and c.stride() == (1, aligned) and c.storage_offset() == 0
    assert torch.equal(c, s) and torch.equal(s, before)
    assert c.untyped_storage().data_ptr() != s.untyped_storage().data_ptr()
    storage = c.as_strided((g, aligned), (aligned, 1))
    assert torch.equal(storage[:, :m], s.t())
    assert torch.equal(storage[:, m:], torch.zeros(g, aligned - m)), "padding rows are zero"


def test_column_major_scales_batched_and_packed():
    s = torch.rand(2, 6, 3)
    c = column_major_scales(s)
    assert c.stride() == (8 * 3, 1, 8) and torch.equal(c, s)
    q = quantize_fp8_block(_varied((6, 1024), seed=13), scale_fmt="ue8m0")
    packed = column_major_scales(pack_ue8m0_to_int32(q.scale))
    assert packed.dtype == torch.int32 and packed.shape == (6, 2) and packed.stride() == (1, 8)
    assert torch.equal(unpack_ue8m0_from_int32(packed.contiguous(), 8), q.scale)
    assert fp8_block.tma_aligned_size(6, 2) == 8 and fp8_block.tma_aligned_size(9, 1) == 16


def test_column_major_scales_bad_arguments():
    with pytest.raises(TypeError, match="scale must be float32 or int32"):
        column_major_scales(torch.ones(4, 2, dtype=torch.float16))
    with pytest.raises(ValueError, match=r"scale must be 2-D \[M, G\] or 3-D"):
        column_major_scales(torch.ones(4))


def test_column_major_scale_layout_option():
    from lowbit.formats.fp8_block import column_major_scales

    x = torch.randn(5, 300)
    lin = lowbit.quantize(x, "fp8_block")
    col = lowbit.quantize(x, "fp8_block", scale_layout="column_major")
    assert col.scale_layout == "column_major" and col.scale.stride(-2) == 1
    assert torch.equal(col.scale, lin.scale)
    assert torch.equal(col.scale, column_major_scales(lin.scale))
    assert torch.equal(lowbit.dequantize(col), lowbit.dequantize(lin))
    with pytest.raises(ValueError, match="column_major"):
        lowbit.quantize(torch.randn(256, 256), "fp8_block", block=(128, 128), scale_layout="column_major")
    with pytest.raises(ValueError, match="scale_layout"):
        lowbit.quantize(x, "fp8_block", scale_layout="row")


def test_dequantized_nan_is_canonical():
    x = torch.randn(2, 256)
    x[0, 5] = float("nan")
    out = lowbit.dequantize(lowbit.quantize(x, "fp8_block"), torch.bfloat16)
    bits = out.view(torch.int16)[0, :128]
    assert (bits == 0x7FC0).all()
