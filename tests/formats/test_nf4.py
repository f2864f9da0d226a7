"""NF4 (bitsandbytes layout): golden vectors, tie rules, edge blocks, double quantization, errors, and
bit-exact agreement with bitsandbytes 0.50.2 on CPU (tests marked ``interop``)."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import lowbit
from lowbit.formats import nf4
from lowbit.formats.codecs import codebook_table
from lowbit.formats.packing import unpack_nibbles_high_first
from lowbit.formats.qtensor import QTensor
from lowbit.formats.spec import NF4
from lowbit.testing import assert_bitexact

LEVELS = codebook_table(NF4)
MIDS = (LEVELS[:-1] + LEVELS[1:]) / 2
INT_VIEW = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}


def _bytes(t):
    return t.contiguous().view(torch.uint8).reshape(-1).tolist()


def _bits(t):
    return t.contiguous().view(INT_VIEW[t.dtype]).reshape(-1)


def _codes(q):
    return unpack_nibbles_high_first(q.data, q.shape.numel()).tolist()


def _next_up(x):
    return torch.nextafter(x, torch.tensor(float("inf")))


def _same_qtensor(a, b):
    assert a.fmt == b.fmt and a.shape == b.shape and a.dtype == b.dtype and a.params == b.params
    assert torch.equal(a.data, b.data) and a.data.dtype == b.data.dtype
    assert torch.equal(
        _bits(a.scale) if a.scale.is_floating_point() else a.scale,
        _bits(b.scale) if b.scale.is_floating_point() else b.scale,
    )
    assert (a.nested_scale is None) == (b.nested_scale is None)
    if a.nested_scale is not None:
        assert torch.equal(_bits(a.nested_scale), _bits(b.nested_scale))
        assert torch.equal(_bits(a.nested_offset), _bits(b.nested_offset))


def test_formats_md_golden_vectors():
    # element 0 in the high nibble: +1 -> code 15, -1 -> code 0
    q = nf4.quantize_nf4(torch.tensor([1.0, -1.0]))
    assert _bytes(q.data) == [0xF0] and q.scale.tolist() == [1.0]
    # all-zero block: absmax 0, every code 7 (0.0), bnb CPU; CUDA would write 0x00
    q = nf4.quantize_nf4(torch.zeros(64))
    assert _bytes(q.data) == [0x77] * 32 and _bytes(q.scale) == [0, 0, 0, 0]
    # the exact 7/8 midpoint 0.0397901... is a tie and goes to the lower code; one ulp above goes up
    mid = MIDS[7]
    assert mid.item() == pytest.approx(0.03979014977812767, abs=0)
    q = nf4.quantize_nf4(torch.stack([torch.tensor(1.0), mid]))
    assert _bytes(q.data) == [0xF7]
    q = nf4.quantize_nf4(torch.stack([torch.tensor(1.0), _next_up(mid)]))
    assert _bytes(q.data) == [0xF8]


@pytest.mark.parametrize("k", range(15))
def test_every_midpoint_tie_goes_to_the_lower_code(k):
    # absmax 2 (a power of two) keeps 2*mid exact and x * (1/2) == mid, so each value is an exact tie
    ties = torch.stack([torch.tensor(2.0), 2 * MIDS[k], 2 * _next_up(MIDS[k])])
    assert _codes(nf4.quantize_nf4(ties)) == [15, k, k + 1]


def test_full_blocks_multiply_by_the_reciprocal_tail_divides():
    # 0.11937045 * (1/3) lands above the 7/8 midpoint, 0.11937045 / 3 below it: bitsandbytes scales full
    # blocks with x * (1/absmax) but the tail block with x / absmax
    x = torch.tensor([3.0, 0.11937045305967331])
    full = torch.cat([x, torch.zeros(62)])
    assert _codes(nf4.quantize_nf4(full))[:2] == [15, 8]
    assert _codes(nf4.quantize_nf4(x)) == [15, 7]


def test_tail_block_absmax_is_clamped_full_block_is_not():
    q = nf4.quantize_nf4(torch.zeros(65))
    assert q.scale[0].item() == 0.0
    assert _bits(q.scale[1:]).tolist() == [_bits(torch.tensor([1e-38])).item()]
    assert _codes(q) == [7] * 65


def test_odd_numel_pads_with_code_7_and_scalar_input():
    assert _bytes(nf4.quantize_nf4(torch.tensor([3.0, -3.0, 3.0])).data) == [0xF0, 0xF7]
    q = nf4.quantize_nf4(torch.tensor(-2.5))
    assert q.shape == torch.Size([]) and _bytes(q.data) == [0x07]
    assert nf4.dequantize_nf4(q).item() == -2.5 and nf4.dequantize_nf4(q).shape == torch.Size([])


def test_blocks_run_over_the_flattened_tensor():
    # 2 rows of 48: block 0 straddles the rows, block 1 is a 32-element tail with its own absmax
    x = torch.zeros(2, 48)
    x[0, 0] = 8.0
    x[1, 40] = 0.5
    x[1, 0] = 4.0
    q = nf4.quantize_nf4(x)
    assert q.scale.tolist() == [8.0, 0.5]
    codes = _codes(q)
    assert codes[0] == 15 and codes[48] == 12 and codes[88] == 15  # 4/8 = 0.5 is below the 12/13 midpoint
    assert sum(c != 7 for c in codes) == 3


def test_tiny_and_huge_values():
    # subnormal absmax: bnb clamps only the divisor to 1e-38, so 1e-40 * 1e38 = 0.01 encodes as code 7
    q = nf4.quantize_nf4(torch.full((64,), 1e-40))
    assert q.scale[0].item() == pytest.approx(1e-40, rel=1e-3) and set(_codes(q)) == {7}
    big = torch.finfo(torch.float32).max
    q = nf4.quantize_nf4(torch.tensor([big, -big, big / 2, 0.0]))
    assert _codes(q) == [15, 0, 12, 7] and q.scale.item() == big  # 0.5 is below the 12/13 midpoint 0.5017
    deq = nf4.dequantize_nf4(q)
    assert deq[0].item() == big and deq[1].item() == -big


def test_nan_and_inf_follow_bitsandbytes_cpu():
    x = torch.linspace(-1, 1, 192)
    x[5] = float("nan")
    x[70] = float("inf")
    q = nf4.quantize_nf4(x)
    assert q.scale[0].isnan() and q.scale[1].isinf() and q.scale[2].item() == 1.0
    codes = _codes(q)
    assert set(codes[:64]) == {15}  # NaN absmax -> every scaled value NaN -> bucketize puts it last
    assert codes[70] == 15 and set(codes[64:70] + codes[71:128]) == {7}  # x * (1/inf) = 0
    deq = nf4.dequantize_nf4(q, torch.bfloat16)
    assert deq[70].isinf() and set(_bits(deq[128:]).tolist()) == set(
        _bits(nf4.dequantize_nf4(q)[128:].bfloat16()).tolist()
    )
    # bitsandbytes' C++ bf16 conversion keeps the NaN's sign: +NaN * level -> 0x7FC0, 0 * inf = -NaN -> 0xFFC0
    # (torch's vectorised cast would write 0xFFFF for both)
    assert set(_bits(deq[:64]).tolist()) == {0x7FC0} and _bits(deq[64:65]).tolist() == [-64]


def test_dequantize_values_and_dtypes():
    x = torch.tensor([1.0, -1.0, 0.5, -0.25] * 16 + [6.0, 3.0])
    q = nf4.quantize_nf4(x)
    ref = LEVELS[torch.tensor(_codes(q))] * torch.cat([torch.ones(64), torch.full((2,), 6.0)])
    for dt in (torch.float32, torch.bfloat16, torch.float16):
        out = nf4.dequantize_nf4(q, dt)
        assert out.dtype == dt and out.shape == x.shape
        assert torch.equal(_bits(out), _bits(ref.to(dt)))
    assert torch.equal(lowbit.dequantize(q, torch.float16), nf4.dequantize_nf4(q, torch.float16))


def test_double_quant_layout_and_single_block():
    x = torch.randn(3, 1000, generator=torch.Generator().manual_seed(3))
    q = nf4.quantize_nf4(x, double_quant=True)
    nblocks = -(-3000 // 64)
    assert q.scale.dtype == torch.uint8 and q.scale.shape == (nblocks,)
    assert q.nested_scale.dtype == torch.float32 and q.nested_scale.shape == (1,)
    assert q.nested_offset.shape == () and q.params == {"blocksize": 64, "double_quant": True}
    plain = nf4.quantize_nf4(x)
    assert torch.equal(q.data, plain.data)
    assert q.nested_offset.item() == plain.scale.mean().item()
    codes, nested = nf4.quantize_blockwise_8bit(plain.scale - plain.scale.mean())
    assert torch.equal(codes, q.scale) and torch.equal(nested, q.nested_scale)
    err = (nf4.nf4_absmax(q) - plain.scale).abs().max().item()
    assert 0 < err < 0.02 * plain.scale.max().item()
    # one block: absmax - mean == 0 is a zero 8-bit block (code 0, nested absmax 0); it decodes to the offset
    one = nf4.quantize_nf4(torch.tensor([1.5, -0.75]), double_quant=True)
    assert _bytes(one.scale) == [0] and one.nested_scale.tolist() == [0.0] and one.nested_offset.item() == 1.5
    assert nf4.dequantize_nf4(one).tolist() == [1.5, LEVELS[2].item() * 1.5]  # -0.5 is nearest to code 2


def test_dynamic_map_values():
    m = nf4.create_dynamic_map()
    assert m.shape == (256,) and m.dtype == torch.float32 and bool((m[1:] >= m[:-1]).all())
    assert m[0].item() == pytest.approx(-0.992968738079071, abs=0) and m[255].item() == 1.0
    assert m[127].item() == 0.0 and int((m == 0).sum()) == 1
    assert m[254].item() == -m[0].item() and m[131].item() == pytest.approx(2.1249998098937795e-05, abs=0)
    u = nf4.create_dynamic_map(signed=False)
    assert u[0].item() == 0.0 and u[255].item() == 1.0 and bool((u >= 0).all())
    assert torch.equal(nf4.dynamic_map(), m) and nf4.dynamic_map() is not nf4.dynamic_map()


def test_blockwise_8bit_golden():
    # bnb's CPU quantizer bins v into 65536 steps: 0.0 falls in a bin whose nearest code is 131, not 127
    codes, absmax = nf4.quantize_blockwise_8bit(torch.tensor([1.0, 0.0, -1.0, 0.5, float("nan"), -0.0]))
    assert codes.tolist() == [255, 131, 0, 219, 0, 131] and absmax.tolist() == [1.0]
    # zero block -> codes 0 and absmax 0; NaN does not enter the absmax
    codes, absmax = nf4.quantize_blockwise_8bit(
        torch.tensor([0.0, 0.0, 0.0, 0.0, float("nan"), 2.0, 1.0]), blocksize=4
    )
    assert codes.tolist() == [0, 0, 0, 0, 0, 255, 219] and absmax.tolist() == [0.0, 2.0]
    m = nf4.dynamic_map()
    deq = nf4.dequantize_blockwise_8bit(codes, absmax, blocksize=4)
    assert torch.equal(deq, torch.cat([m[codes[:4].long()] * 0.0, m[codes[4:].long()] * 2.0]))
    codes2d, _ = nf4.quantize_blockwise_8bit(torch.ones(3, 5, dtype=torch.bfloat16), blocksize=4)
    assert codes2d.shape == (3, 5) and set(codes2d.reshape(-1).tolist()) == {255}


def test_empty_tensors():
    for shape in [(0,), (0, 64), (3, 0)]:
        for dq in (False, True):
            q = nf4.quantize_nf4(torch.empty(shape, dtype=torch.bfloat16), double_quant=dq)
            assert q.data.shape == (0,) and q.scale.numel() == 0 and q.shape == shape
            if dq:
                assert q.nested_scale.shape == (0,) and q.nested_offset.isnan()  # mean of nothing, as bnb
            out = nf4.dequantize_nf4(q, torch.bfloat16)
            assert out.shape == shape and out.dtype == torch.bfloat16
    codes, absmax = nf4.quantize_blockwise_8bit(torch.empty(0))
    assert codes.shape == (0,) and absmax.shape == (0,)


def test_non_contiguous_batch_dims_and_no_mutation():
    g = torch.Generator().manual_seed(7)
    base = torch.randn(6, 50, 4, generator=g).to(torch.bfloat16)
    x = base.transpose(0, 1)[:, ::2]  # non-contiguous view
    before = x.clone()
    for dq in (False, True):
        q = nf4.quantize_nf4(x, blocksize=128, double_quant=dq)
        _same_qtensor(q, nf4.quantize_nf4(x.contiguous(), blocksize=128, double_quant=dq))
        # the flattened order is all that matters: any shape with the same elements gives the same bytes
        flat = nf4.quantize_nf4(x.reshape(-1), blocksize=128, double_quant=dq)
        assert torch.equal(flat.data, q.data) and torch.equal(flat.scale, q.scale)
        assert nf4.dequantize_nf4(q).shape == x.shape
    assert torch.equal(_bits(x), _bits(before))
    y = torch.full((64,), float("nan"))
    nf4.quantize_nf4(y)
    assert y.isnan().all()


def test_api_dispatch_and_defaults():
    x = torch.randn(4, 96, generator=torch.Generator().manual_seed(1))
    q = lowbit.quantize(x, "nf4")
    assert q.params == {"blocksize": 64, "double_quant": False}
    _same_qtensor(q, nf4.quantize_nf4(x))
    q = lowbit.quantize(x, "nf4", blocksize=128, double_quant=True)
    _same_qtensor(q, nf4.quantize_nf4(x, 128, True))
    assert torch.equal(lowbit.dequantize(q), nf4.dequantize_nf4(q))
    with pytest.raises(ValueError, match="unknown option"):
        lowbit.quantize(x, "nf4", group_size=64)


@pytest.mark.parametrize(
    "call, exc, match",
    [
        (lambda: nf4.quantize_nf4([1.0, 2.0]), TypeError, "x must be a torch.Tensor"),
        (
            lambda: nf4.quantize_nf4(torch.ones(4, dtype=torch.float64)),
            TypeError,
            "float32, bfloat16 or float16",
        ),
        (
            lambda: nf4.quantize_nf4(torch.ones(4, dtype=torch.int32)),
            TypeError,
            "float32, bfloat16 or float16",
        ),
        (lambda: nf4.quantize_nf4(torch.ones(4), blocksize=48), ValueError, "blocksize must be one of"),
        (lambda: nf4.quantize_nf4(torch.ones(4), blocksize=8192), ValueError, "blocksize must be one of"),
        (lambda: nf4.quantize_nf4(torch.ones(4), blocksize=64.0), TypeError, "blocksize must be an int"),
        (lambda: nf4.quantize_nf4(torch.ones(4), blocksize=True), TypeError, "blocksize must be an int"),
        (lambda: nf4.quantize_nf4(torch.ones(4), double_quant=1), TypeError, "double_quant must be a bool"),
        (lambda: nf4.create_dynamic_map(total_bits=9), ValueError, "total_bits"),
        (lambda: nf4.create_dynamic_map(max_exponent_bits=8), ValueError, "max_exponent_bits"),
        (lambda: nf4.create_dynamic_map(signed=False, max_exponent_bits=5), ValueError, "unsigned"),
        (lambda: nf4.create_dynamic_map(signed=1), TypeError, "signed must be a bool"),
        (lambda: nf4.quantize_blockwise_8bit(torch.ones(4), code=torch.ones(16)), ValueError, "code must be"),
        (lambda: nf4.quantize_blockwise_8bit(torch.ones(4), code=-nf4.dynamic_map()), ValueError, "sorted"),
        (
            lambda: nf4.quantize_blockwise_8bit(torch.ones(4), blocksize=0),
            ValueError,
            "blocksize must be positive",
        ),
        (
            lambda: nf4.quantize_blockwise_8bit(torch.ones(4, dtype=torch.int8)),
            TypeError,
            "x must be float32",
        ),
        (
            lambda: nf4.dequantize_blockwise_8bit(torch.zeros(4, dtype=torch.uint8), torch.ones(2)),
            ValueError,
            r"absmax must have ceil\(4/256\) = 1",
        ),
        (
            lambda: nf4.dequantize_blockwise_8bit(torch.zeros(4), torch.ones(1)),
            TypeError,
            "codes must be a uint8",
        ),
        (lambda: nf4.dequantize_nf4(nf4.quantize_nf4(torch.ones(4)), torch.int8), TypeError, "dtype must be"),
        (lambda: nf4.dequantize_nf4("q"), TypeError, "q must be a QTensor"),
    ],
)
def test_bad_input(call, exc, match):
    with pytest.raises(exc, match=match):
        call()


def test_corrupt_qtensor_is_rejected():
    q = nf4.quantize_nf4(torch.ones(130), double_quant=True)
    fields = {
        "data": q.data,
        "scale": q.scale,
        "fmt": "nf4",
        "shape": q.shape,
        "dtype": q.dtype,
        "params": q.params,
        "nested_scale": q.nested_scale,
        "nested_offset": q.nested_offset,
    }
    cases = [
        ({"fmt": "mxfp4"}, r"QTensor\(mxfp4\): nested_scale must be None"),
        ({"data": q.data[:-1]}, "q.data must be uint8 with ceil"),
        ({"scale": q.scale[:2]}, "q.scale must be torch.uint8 with 3"),
        ({"scale": q.scale.float()}, "q.scale must be torch.uint8"),
        ({"nested_scale": None}, "must agree"),
        ({"nested_scale": torch.ones(2)}, "q.nested_scale must be float32 with 1"),
        ({"nested_offset": torch.ones(2)}, "q.nested_offset must be a float32 scalar"),
        ({"params": {"blocksize": 48, "double_quant": True}}, r"q.params\['blocksize'\]"),
    ]
    # rejected where the QTensor is built, so dequantize never meets one
    for change, match in cases:
        with pytest.raises(ValueError, match=match):
            QTensor(**{**fields, **change})


@settings(max_examples=40, deadline=None)
@given(
    n=st.integers(1, 700),
    blocksize=st.sampled_from([32, 64, 128]),
    dq=st.booleans(),
    scale=st.floats(1e-3, 1e3),
    seed=st.integers(0, 2**16),
)
def test_property_error_bound_and_idempotence(n, blocksize, dq, scale, seed):
    x = torch.randn(n, generator=torch.Generator().manual_seed(seed)) * scale
    q = nf4.quantize_nf4(x, blocksize, dq)
    absmax = nf4.nf4_absmax(q)
    per_elem = absmax.repeat_interleave(blocksize)[:n]
    deq = nf4.dequantize_nf4(q)
    # half the widest NF4 gap (between -1 and -0.696) bounds the error, plus the 8-bit absmax error
    slack = (per_elem - nf4.quantize_nf4(x, blocksize).scale.repeat_interleave(blocksize)[:n]).abs()
    assert bool(((deq - x).abs() <= 0.1520 * per_elem.abs() + 1.2 * slack + 1e-6 * scale).all())
    if not dq:
        again = nf4.quantize_nf4(deq, blocksize)
        assert torch.equal(again.data, q.data)


# ---------------------------------------------------------------- bitsandbytes cross-checks


@pytest.fixture
def bnbf():
    return pytest.importorskip("bitsandbytes.functional")


@pytest.fixture
def bnb(bnbf, bnb_dequantize_4bit):
    """bitsandbytes' quantize_4bit and its host-independent decode (tests/conftest.py says why not its CPU op)."""
    return bnbf.quantize_4bit, bnb_dequantize_4bit


def _check_against_bnb(bnb, x, blocksize, dq, compare_dequant=True):
    quantize_4bit, dequantize_4bit = bnb
    packed, state = quantize_4bit(x, blocksize=blocksize, compress_statistics=dq, quant_type="nf4")
    q = nf4.quantize_nf4(x, blocksize, dq)
    assert packed.shape == (q.data.numel(), 1)
    assert torch.equal(packed.reshape(-1), q.data)
    if dq:
        assert torch.equal(state.absmax, q.scale)
        assert torch.equal(_bits(state.state2.absmax), _bits(q.nested_scale))
        assert torch.equal(_bits(state.offset), _bits(q.nested_offset))
        assert torch.equal(state.state2.code, nf4.dynamic_map())
    else:
        assert torch.equal(_bits(state.absmax), _bits(q.scale))
    if compare_dequant:
        # NaN bits are pinned by test_nan_and_inf_follow_bitsandbytes_cpu; finite bits and NaN places here
        ref = dequantize_4bit(packed, state)
        ours = nf4.dequantize_nf4(q, x.dtype)
        assert_bitexact(ours.reshape(-1), ref.reshape(-1), "dequantize_nf4", any_nan=True)
    return q


@pytest.mark.interop
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("blocksize", [64, 128, 256])
@pytest.mark.parametrize("dq", [False, True])
def test_random_matches_bitsandbytes(bnb, dtype, blocksize, dq):
    g = torch.Generator().manual_seed(blocksize + 7 * dq + list(INT_VIEW).index(dtype))
    for shape in [(64, 256), (5, 130), (3, 7, 66), (1000,), (257, 2), (64 * 300 + 3,)]:
        x = (torch.randn(shape, generator=g) * torch.rand(1, generator=g) * 50).to(dtype)
        _check_against_bnb(bnb, x, blocksize, dq)


@pytest.mark.interop
def test_odd_shapes_match_bitsandbytes(bnb):
    g = torch.Generator().manual_seed(11)
    for shape, dtype in [
        ((7, 33), torch.bfloat16),
        ((1,), torch.float16),
        ((5, 3, 13), torch.float32),
        ((129,), torch.float32),
    ]:
        _check_against_bnb(bnb, torch.randn(shape, generator=g).to(dtype), 64, True)


@pytest.mark.interop
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_adversarial_matches_bitsandbytes(bnb, dtype):
    info = torch.finfo(dtype)
    g = torch.Generator().manual_seed(5)
    rows = [
        torch.zeros(64),  # zero block: code 7
        torch.cat([torch.tensor([2.0]), 2 * MIDS, 2 * torch.nextafter(MIDS, torch.tensor(9.0))]).repeat(3)[
            :64
        ],  # ties
        torch.full((64,), info.max) * torch.sign(torch.randn(64, generator=g)),  # +-max
        torch.full((64,), info.tiny) * torch.randn(64, generator=g),  # tiny and subnormal
        torch.cat([torch.tensor([3.0, 0.11937045305967331]), torch.randn(62, generator=g)]),
        torch.randn(64, generator=g) * 1e-3,
    ]
    x = torch.cat(rows).to(dtype)
    for dq in (False, True):
        _check_against_bnb(bnb, x.reshape(6, 64), 64, dq)
        _check_against_bnb(bnb, x[:-3], 64, dq)  # tail block of 61, division path
        _check_against_bnb(bnb, torch.cat([x[:128], torch.zeros(7, dtype=dtype)]), 64, dq)


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
def test_non_contiguous_batch_matches_bitsandbytes(bnb):
    base = torch.randn(8, 100, 6, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    x = base.permute(2, 0, 1)[:, 1::2]
    for dq in (False, True):
        _check_against_bnb(bnb, x, 128, dq)


@pytest.mark.interop
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_bnb_cpu_op_matches_where_host_independent(bnbf, dtype):
    # bnb's CPU dequantize_4bit itself, on the inputs where its AVX-512 and scalar branches agree (blocks
    # inside rows, no subnormal or NaN results; tests/conftest.py lists where they part)
    g = torch.Generator().manual_seed(12)
    for shape, blocksize in [((8, 256), 64), ((3, 128), 128), ((2, 5, 64), 64), ((512,), 256), ((4, 96), 32)]:
        x = (torch.randn(shape, generator=g) * 4).to(dtype)
        for dq in (False, True):
            packed, state = bnbf.quantize_4bit(x, blocksize=blocksize, compress_statistics=dq, quant_type="nf4")
            ours = nf4.dequantize_nf4(nf4.quantize_nf4(x, blocksize, dq), dtype)
            ref = bnbf.dequantize_4bit(packed, state, quant_type="nf4")
            assert_bitexact(ours.reshape(-1), ref.reshape(-1), f"{shape} blocksize {blocksize} dq {dq}")


@pytest.mark.interop
def test_dynamic_map_matches_bitsandbytes(bnbf):
    for args in [
        (True, 7, 8),
        (True, 5, 8),
        (True, 1, 8),
        (True, 3, 4),
        (True, 6, 7),
        (False, 7, 8),
        (False, 3, 4),
    ]:
        assert torch.equal(
            nf4.create_dynamic_map(*args).view(torch.int32), bnbf.create_dynamic_map(*args).view(torch.int32)
        )


def _lut_edge_values():
    # values near every place where bnb's 65536-bin table switches code, where an off-by-one bin shows
    m = nf4.dynamic_map()
    table = nf4._bin_table(m.numpy().tobytes())
    edges = torch.nonzero(table[1:] != table[:-1]).flatten().float()
    v0 = ((edges + 0.5) / 65535) * 2 - 1
    offs = torch.arange(-40, 41, 4, dtype=torch.int32)
    v = (v0.view(torch.int32)[:, None] + offs).reshape(-1).view(torch.float32)
    return v[v.isfinite()].clamp(-1, 1)


@pytest.mark.interop
def test_blockwise_8bit_matches_bitsandbytes(bnbf):
    code = bnbf.create_dynamic_map()
    g = torch.Generator().manual_seed(9)
    v = _lut_edge_values()
    cases = []
    for bs in (2, 7, 16):  # bs 2 and 7: bnb's scalar loop; 16: its AVX2 loop
        cases.append(
            (torch.cat([torch.ones(v.numel(), 1), v[:, None].expand(-1, bs - 1)], 1).reshape(-1), bs)
        )
    x = torch.randn(5000, generator=g) * 3
    x[17] = 0.0
    x[300:556] = 0.0  # zero block
    x[600] = float("nan")
    x[900] = float("inf")
    cases += [(x, 256), (x, 64), (x[:4099], 4096), (x.to(torch.bfloat16), 256), (x.to(torch.float16), 100)]
    for xin, bs in cases:
        ref_q, state = bnbf.quantize_blockwise(xin, code=code, blocksize=bs)
        q, absmax = nf4.quantize_blockwise_8bit(xin, code, bs)
        assert torch.equal(q, ref_q), bs
        assert torch.equal(_bits(absmax), _bits(state.absmax))
        ref = bnbf.dequantize_blockwise(ref_q, absmax=state.absmax, code=code, blocksize=bs)
        assert torch.equal(_bits(nf4.dequantize_blockwise_8bit(q, absmax, code, bs)), _bits(ref))


@pytest.mark.interop
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_blockwise_8bit_dequant_nan_payloads_match_bitsandbytes(bnbf, dtype):
    # NaN payloads whose bf16 rounding differs from torch's cast: 0x7FFFFFFF even carries into the sign bit
    pats = [0x7F800001, 0x7FFFFFFF, -0x400000, 0x7FC12345, 0x7FC00000, 0x3F800000, 0x3F7FFFFF]
    absmax = torch.tensor(pats, dtype=torch.int32).view(torch.float32)
    code = bnbf.create_dynamic_map()
    for bs in (8, 7):  # bnb's AVX2 loop and its scalar loop
        codes = torch.randint(
            0, 256, (bs * len(pats),), dtype=torch.uint8, generator=torch.Generator().manual_seed(bs)
        )
        state = bnbf.QuantState(absmax=absmax, code=code, blocksize=bs, dtype=dtype)
        ref = bnbf.dequantize_blockwise(codes, state)
        assert torch.equal(_bits(nf4.dequantize_blockwise_8bit(codes, absmax, code, bs, dtype)), _bits(ref))
