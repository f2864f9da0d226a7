"""bnb_fp4 (bitsandbytes' ``fp4`` 4-bit type): table, encode rule (ties, zero signs, NaN), layout, errors, and
bit-exact agreement with bitsandbytes 0.50.2 on CPU (tests marked ``interop``)."""

import pytest
import torch

import lowbit
from lowbit.formats import bnb_fp4, nf4
from lowbit.formats.codecs import codebook_table
from lowbit.formats.packing import unpack_nibbles_high_first
from lowbit.formats.spec import BNB_FP4, FORMATS
from lowbit.testing import assert_bitexact

LEVELS = codebook_table(BNB_FP4)
ORDER = torch.argsort(LEVELS, stable=True)
SORTED = LEVELS[ORDER]
MIDS = (SORTED[:-1] + SORTED[1:]) / 2
INT_VIEW = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}


def _bits(t):
    return t.contiguous().view(INT_VIEW[t.dtype]).reshape(-1)


def _codes(q):
    return unpack_nibbles_high_first(q.data, q.shape.numel()).tolist()


def test_table_and_registration():
    # not E2M1: code 3 is the max, code 2 is 8/12; code 8 is +0.0 (bitsandbytes' table), not -0.0
    assert LEVELS[3] == 1.0 and LEVELS[2] == pytest.approx(8 / 12) and LEVELS[11] == -1.0
    assert LEVELS[8].item() == 0.0 and not torch.signbit(LEVELS[8])
    assert ORDER.tolist() == [11, 10, 13, 12, 15, 14, 9, 0, 8, 1, 6, 7, 4, 5, 2, 3]
    assert FORMATS["bnb_fp4"].element is BNB_FP4 and FORMATS["bnb_fp4"].options == {
        "blocksize": 64, "double_quant": False}
    assert "bnb_fp4" in nf4.BNB_4BIT_FORMATS and FORMATS["fp4_b32"].element is not BNB_FP4


def test_golden_bytes():
    # element 0 in the high nibble: +1 -> code 3, -1 -> code 11; 0.5 -> 5, -0.25 -> 15
    q = bnb_fp4.quantize_bnb_fp4(torch.tensor([1.0, -1.0, 0.5, -0.25]))
    assert q.data.tolist() == [0x3B, 0x5F] and q.scale.tolist() == [1.0]
    # zero block: absmax 0 and code 0 (bnb CPU); odd numel pads with code 0
    q = bnb_fp4.quantize_bnb_fp4(torch.zeros(64))
    assert q.data.tolist() == [0] * 32 and q.scale.tolist() == [0.0]
    q = bnb_fp4.quantize_bnb_fp4(torch.tensor([1.0, 2.0 / 3, 1.0 / 3]))
    assert _codes(q) == [3, 2, 4] and q.data.tolist() == [0x32, 0x40]


@pytest.mark.parametrize("k", range(15))
def test_every_midpoint_tie_goes_to_the_lower_level(k):
    mid = MIDS[k]
    up = torch.nextafter(mid, torch.tensor(2.0))
    codes = bnb_fp4.encode_bnb_fp4(torch.stack([mid, up])).tolist()
    assert codes == [ORDER[k].item(), ORDER[k + 1].item()]


def test_zero_codes_follow_the_cpu_bucket_order():
    # tiny positive -> code 8 (the sign-bit code), tiny negative and both zeros -> code 0
    t = torch.tensor([1e-30, -1e-30, 0.0, -0.0, MIDS[8].item(), torch.nextafter(MIDS[8], torch.tensor(1.0)).item()])
    assert bnb_fp4.encode_bnb_fp4(t).tolist() == [8, 0, 0, 0, 8, 1]
    assert bnb_fp4.encode_bnb_fp4(torch.tensor([float("nan")])).tolist() == [3]
    # both zero codes decode to +0.0
    q = bnb_fp4.quantize_bnb_fp4(torch.tensor([1.0, 1e-30, -1e-30, 0.0]))
    assert _codes(q) == [3, 8, 0, 0]
    out = bnb_fp4.dequantize_bnb_fp4(q)
    assert not torch.signbit(out[1:]).any()


def test_nan_and_inf():
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(1))
    x[0, 5] = float("nan")
    x[1, 7] = float("inf")
    x[2, 9] = -float("inf")
    q = bnb_fp4.quantize_bnb_fp4(x)
    codes = torch.tensor(_codes(q)).reshape(3, 64)
    assert torch.isnan(q.scale[0]) and (codes[0] == 3).all()  # NaN block: NaN absmax, every code 3
    assert q.scale[1:].tolist() == [float("inf")] * 2
    # finite / inf = +-0 -> code 0; inf / inf = NaN -> code 3
    assert codes[1, 7] == 3 and codes[2, 9] == 3 and (codes[1, :7] == 0).all()


def test_double_quant_and_dequant_dtypes():
    x = torch.randn(33, 256, generator=torch.Generator().manual_seed(3)) * 7
    for dq in (False, True):
        q = lowbit.quantize(x, "bnb_fp4", blocksize=128, double_quant=dq)
        assert q.fmt == "bnb_fp4" and q.params == {"blocksize": 128, "double_quant": dq}
        assert (q.nested_scale is not None) == dq and q.scale.dtype == (torch.uint8 if dq else torch.float32)
        absmax = nf4.nf4_absmax(q)
        levels = LEVELS[torch.tensor(_codes(q))].view(-1, 128)
        expect = (levels * absmax[:, None]).reshape(x.shape)
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            out = lowbit.dequantize(q, dtype)
            assert out.dtype == dtype and out.shape == x.shape
            assert torch.equal(out, expect.to(dtype))
    # default options come from the FormatSpec
    q = lowbit.quantize(x, "bnb_fp4")
    assert q.params == {"blocksize": 64, "double_quant": False}


def test_error_bound_against_the_nearest_level():
    x = torch.randn(4096, generator=torch.Generator().manual_seed(9))
    q = bnb_fp4.quantize_bnb_fp4(x, 64)
    absmax = q.scale.repeat_interleave(64)
    nearest = (x[:, None] / absmax[:, None] - LEVELS[None, :]).abs().min(dim=1).values
    got = (bnb_fp4.dequantize_bnb_fp4(q) - x).abs() / absmax
    assert torch.allclose(got, nearest, atol=1e-6)


@pytest.mark.parametrize(
    ("call", "exc", "match"),
    [
        (lambda: bnb_fp4.quantize_bnb_fp4([1.0]), TypeError, "x must be a torch.Tensor"),
        (lambda: bnb_fp4.quantize_bnb_fp4(torch.ones(4, dtype=torch.int32)), TypeError, "bnb_fp4: x must be"),
        (lambda: bnb_fp4.quantize_bnb_fp4(torch.ones(4), 48), ValueError, "bnb_fp4: blocksize must be one of"),
        (lambda: bnb_fp4.quantize_bnb_fp4(torch.ones(4), True), TypeError, "blocksize must be an int"),
        (lambda: bnb_fp4.quantize_bnb_fp4(torch.ones(4), 64, 1), TypeError, "double_quant must be a bool"),
        (lambda: bnb_fp4.encode_bnb_fp4(torch.ones(4, dtype=torch.float16)), TypeError, "scaled must be a float32"),
        (lambda: bnb_fp4.dequantize_bnb_fp4(nf4.quantize_nf4(torch.ones(4))), ValueError, "bnb_fp4 QTensor"),
        (lambda: nf4.dequantize_nf4(bnb_fp4.quantize_bnb_fp4(torch.ones(4))), ValueError, "nf4 QTensor"),
        (lambda: bnb_fp4.dequantize_bnb_fp4(bnb_fp4.quantize_bnb_fp4(torch.ones(4)), torch.int8), TypeError,
         "dtype must be"),
    ],
)
def test_bad_input(call, exc, match):
    with pytest.raises(exc, match=match):
        call()


# ---------------------------------------------------------------- bitsandbytes cross-checks


@pytest.fixture
def bnbf():
    return pytest.importorskip("bitsandbytes.functional")


@pytest.fixture
def bnb(bnbf, bnb_dequantize_4bit):
    """bitsandbytes' quantize_4bit and its host-independent decode (tests/conftest.py says why not its CPU op)."""
    return bnbf.quantize_4bit, bnb_dequantize_4bit


def _check_against_bnb(bnb, x, blocksize, dq):
    quantize_4bit, dequantize_4bit = bnb
    packed, state = quantize_4bit(x, blocksize=blocksize, compress_statistics=dq, quant_type="fp4")
    q = bnb_fp4.quantize_bnb_fp4(x, blocksize, dq)
    assert state.quant_type == "fp4" and packed.shape == (q.data.numel(), 1)
    assert torch.equal(packed.reshape(-1), q.data)
    if dq:
        assert torch.equal(state.absmax, q.scale)
        assert torch.equal(_bits(state.state2.absmax), _bits(q.nested_scale))
        assert torch.equal(_bits(state.offset), _bits(q.nested_offset))
    else:
        assert torch.equal(_bits(state.absmax), _bits(q.scale))
    ref = dequantize_4bit(packed, state)
    ours = bnb_fp4.dequantize_bnb_fp4(q, x.dtype)
    # NaN bits: torch's cast in bitsandbytes' PyTorch kernel against its C++ one (see dequantize_nf4)
    assert_bitexact(ours.reshape(-1), ref.reshape(-1), "dequantize_bnb_fp4", any_nan=True)
    return q


@pytest.mark.interop
def test_table_and_bounds_match_bitsandbytes():
    from bitsandbytes.backends.default.ops import _get_4bit_quantize_bounds
    from bitsandbytes.backends.utils import _get_4bit_code

    cpu = torch.device("cpu")
    assert torch.equal(_get_4bit_code("fp4", cpu).view(torch.int32), LEVELS.view(torch.int32))
    mids, order = _get_4bit_quantize_bounds("fp4", cpu)
    assert torch.equal(mids.view(torch.int32), MIDS.view(torch.int32)) and torch.equal(order, ORDER)


@pytest.mark.interop
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("blocksize", [32, 64, 256, 4096])
@pytest.mark.parametrize("dq", [False, True])
def test_random_matches_bitsandbytes(bnb, dtype, blocksize, dq):
    g = torch.Generator().manual_seed(blocksize + 7 * dq + list(INT_VIEW).index(dtype))
    for shape in [(64, 256), (5, 130), (3, 7, 66), (1000,), (257, 2), (64 * 300 + 3,), (1,), (7, 33)]:
        x = (torch.randn(shape, generator=g) * torch.rand(1, generator=g) * 50).to(dtype)
        _check_against_bnb(bnb, x, blocksize, dq)


@pytest.mark.interop
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_adversarial_matches_bitsandbytes(bnb, dtype):
    info = torch.finfo(dtype)
    g = torch.Generator().manual_seed(5)
    sign = torch.sign(torch.randn(64, generator=g))
    ties = torch.cat([torch.tensor([1.0]), MIDS, torch.nextafter(MIDS, torch.tensor(9.0)),
                      torch.nextafter(MIDS, torch.tensor(-9.0))])
    rows = [
        torch.zeros(64),  # zero block: code 0
        ties.repeat(2)[:64],  # every tie, one ulp either side (scaled by absmax 1)
        torch.full((64,), info.max) * sign,  # +-max
        torch.full((64,), info.tiny) * torch.randn(64, generator=g),  # tiny and subnormal
        torch.cat([torch.tensor([3.0]), torch.randn(63, generator=g) * 1e-3]),  # +-zero buckets
        torch.cat([torch.tensor([-12.0, 0.0625, -0.0625, 1.03125]), torch.tensor([-0.0] * 60)]),
    ]
    x = torch.cat(rows).to(dtype)
    for dq in (False, True):
        _check_against_bnb(bnb, x.reshape(6, 64), 64, dq)
        _check_against_bnb(bnb, x[:-3], 64, dq)  # tail block of 61, division path
        _check_against_bnb(bnb, torch.cat([x[:128], torch.zeros(7, dtype=dtype)]), 64, dq)
        _check_against_bnb(bnb, x, 32, dq)


@pytest.mark.interop
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_nan_inf_match_bitsandbytes(bnb, dtype):
    x = torch.randn(4, 128, generator=torch.Generator().manual_seed(2)).to(dtype)
    x[0, 3] = float("nan")
    x[1, 100] = float("inf")
    x[3, 127] = -float("inf")
    for dq in (False, True):
        _check_against_bnb(bnb, x, 64, dq)


@pytest.mark.interop
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_bnb_cpu_op_matches_where_host_independent(bnbf, dtype):
    # bnb's CPU dequantize_4bit (native fp4 decode) on the inputs where its AVX-512 and scalar branches agree,
    # save the sign of code 8's zero: its scalar branch (and CUDA) decode code 8 as -0.0, its AVX-512 / NEON
    # branches and PyTorch kernel as +0.0, the value of bitsandbytes' table, which lowbit follows
    g = torch.Generator().manual_seed(12)
    for shape, blocksize in [((8, 256), 64), ((3, 128), 128), ((2, 5, 64), 64), ((512,), 256), ((4, 96), 32)]:
        x = (torch.randn(shape, generator=g) * 4).to(dtype)
        x.view(-1)[1] = 1e-6 * x.view(-1)[0].abs().float().clamp(min=1).to(dtype)  # a zero code (0 or 8)
        for dq in (False, True):
            packed, state = bnbf.quantize_4bit(x, blocksize=blocksize, compress_statistics=dq, quant_type="fp4")
            ours = bnb_fp4.dequantize_bnb_fp4(bnb_fp4.quantize_bnb_fp4(x, blocksize, dq), dtype)
            ref = bnbf.dequantize_4bit(packed, state, quant_type="fp4").reshape(-1)
            code8 = unpack_nibbles_high_first(packed.reshape(-1), x.numel()) == 8
            assert code8.any()
            assert (ours.reshape(-1)[code8] == 0).all() and not torch.signbit(ours.reshape(-1)[code8]).any()
            ref = torch.where(code8, torch.zeros_like(ref), ref)
            assert_bitexact(ours.reshape(-1), ref, f"{shape} blocksize {blocksize} dq {dq}")
