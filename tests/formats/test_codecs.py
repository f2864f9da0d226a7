"""Element codecs over every code, with the edge behaviour documented in lowbit.formats.codecs."""

import math
import struct

import pytest
import torch

from lowbit.formats import codecs
from lowbit.formats.spec import BNB_FP4, E2M1, E2M3, E3M2, E4M3, E5M2, INT4, NF4, UINT4, ScaleRounding

E2M1_VALUES = [0, 0.5, 1, 1.5, 2, 3, 4, 6]
E2M3_VALUES = [i / 8 for i in range(8)] + [1 + i / 8 for i in range(8)] + [2 + i / 4 for i in range(8)] + [
    4 + i / 2 for i in range(8)
]
E3M2_VALUES = [0, 0.0625, 0.125, 0.1875, 0.25, 0.3125, 0.375, 0.4375, 0.5, 0.625, 0.75, 0.875, 1, 1.25, 1.5,
               1.75, 2, 2.5, 3, 3.5, 4, 5, 6, 7, 8, 10, 12, 14, 16, 20, 24, 28]


@pytest.mark.parametrize(
    "spec, positives", [(E2M1, E2M1_VALUES), (E2M3, E2M3_VALUES), (E3M2, E3M2_VALUES)], ids=lambda v: getattr(v, "name", "")
)
def test_fp4_fp6_tables_and_round_trip_every_code(spec, positives):
    table = codecs.minifloat_table(spec)
    assert table.tolist() == positives + [-v for v in positives]
    codes = torch.arange(1 << spec.bits, dtype=torch.uint8)
    values = codecs.decode_minifloat(codes, spec)
    # -0.0 decodes with its sign bit, so every code (0x8 / 0x20 included) encodes back to itself
    assert torch.equal(codecs.encode_minifloat(values, spec), codes)
    assert torch.signbit(values[spec.sign_mask]).item()


@pytest.mark.parametrize("spec", [E4M3, E5M2], ids=["e4m3", "e5m2"])
def test_fp8_every_code(spec):
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    values = codecs.decode_minifloat(codes, spec)
    ref = codes.view(spec.torch_dtype).float()
    assert torch.equal(values.isnan(), ref.isnan())
    finite = ~ref.isnan()
    assert torch.equal(values[finite], ref[finite])
    back = codecs.encode_minifloat(values, spec)
    for c in range(256):
        v = values[c].item()
        if math.isnan(v):
            assert back[c] == 0x7F, "NaN of either sign encodes to the canonical 0x7F"
        elif math.isinf(v):
            assert back[c] == (0x7B if v > 0 else 0xFB), "E5M2 Inf saturates to +-57344"
        else:
            assert back[c] == c


def _nearest_even_reference(x: float, positives: list[float]) -> int:
    """Independent float64 round-to-nearest-even with saturation: index of the nearest magnitude."""
    a = min(abs(x), positives[-1])
    best = min(range(len(positives)), key=lambda i: (abs(positives[i] - a), i % 2))
    return best | ((len(positives)) if math.copysign(1.0, x) < 0 else 0)


@pytest.mark.parametrize("spec, positives", [(E2M1, E2M1_VALUES), (E2M3, E2M3_VALUES), (E3M2, E3M2_VALUES)])
def test_encode_matches_bruteforce_nearest_even(spec, positives):
    g = torch.Generator().manual_seed(0)
    top = positives[-1]
    x = torch.cat([
        (torch.rand(4000, generator=g) * 2 - 1) * top * 1.2,
        torch.randn(2000, generator=g) * top / 8,
        # every midpoint, and one fp32 ulp either side of it
        torch.tensor([(a + b) / 2 for a, b in zip(positives, positives[1:])]),
    ])
    mids = torch.tensor([(a + b) / 2 for a, b in zip(positives, positives[1:])])
    x = torch.cat([x, torch.nextafter(mids, torch.full_like(mids, 1e9)), torch.nextafter(mids, torch.zeros_like(mids))])
    x = torch.cat([x, -x])
    got = codecs.encode_minifloat(x, spec)
    want = torch.tensor([_nearest_even_reference(v, positives) for v in x.tolist()], dtype=torch.uint8)
    assert torch.equal(got, want)


def test_e2m1_ties_round_to_even():
    cases = {
        0.25: 0x0,  # halfway 0 / 0.5: even mantissa is 0
        0.75: 0x2,  # halfway 0.5 / 1.0 -> 1.0
        1.25: 0x2,  # halfway 1.0 / 1.5 -> 1.0
        1.75: 0x4,  # halfway 1.5 / 2.0 -> 2.0
        2.5: 0x4,  # halfway 2 / 3 -> 2
        3.5: 0x6,  # halfway 3 / 4 -> 4
        5.0: 0x6,  # halfway 4 / 6 -> 4
        -0.25: 0x8,  # rounds to zero but keeps the sign code (torchao, compressed-tensors)
        -2.5: 0xC,
    }
    got = codecs.encode_minifloat(torch.tensor(list(cases)), E2M1).tolist()
    assert got == list(cases.values())


def test_minifloat_edges():
    x = torch.tensor([6.1, 1e30, float("inf"), -float("inf"), float("nan"), -0.0, -1e-30, 0.0])
    assert codecs.encode_minifloat(x, E2M1).tolist() == [0x7, 0x7, 0x7, 0xF, 0x7, 0x8, 0x8, 0x0]
    # 6.1 is an in-range value for FP6: 6.0 is code 0x1C (E2M3) and 0x16 (E3M2)
    assert codecs.encode_minifloat(x, E2M3).tolist() == [0x1C, 0x1F, 0x1F, 0x3F, 0x1F, 0x20, 0x20, 0x00]
    assert codecs.encode_minifloat(x, E3M2).tolist() == [0x16, 0x1F, 0x1F, 0x3F, 0x1F, 0x20, 0x20, 0x00]
    y = torch.tensor([448.0, 464.0, 1e9, float("inf"), -float("inf"), float("nan"), -float("nan"), -0.0])
    assert codecs.encode_minifloat(y, E4M3).tolist() == [0x7E, 0x7E, 0x7E, 0x7E, 0xFE, 0x7F, 0x7F, 0x80]
    z = torch.tensor([57344.0, 61440.0, float("inf"), -float("inf"), float("nan"), 2.0**-16, 2.0**-17])
    # 2^-17 is exactly half the smallest subnormal: ties to even -> 0
    assert codecs.encode_minifloat(z, E5M2).tolist() == [0x7B, 0x7B, 0x7B, 0xFB, 0x7F, 0x01, 0x00]


def test_e4m3_ties_and_subnormals():
    x = torch.tensor([1.0625, 1.1875, 17.0, 19.0, 2.0**-9, 2.0**-10, 1.5 * 2.0**-10])
    # 1.0625 is between 1.0 and 1.125 -> even 1.0; 1.1875 -> 1.25; 17 -> 16; 19 -> 20; 2^-10 ties to 0
    assert codecs.encode_minifloat(x, E4M3).view(torch.float8_e4m3fn).float().tolist() == [
        1.0, 1.25, 16.0, 20.0, 2.0**-9, 0.0, 2.0**-9,
    ]


def test_encoders_accept_all_float_dtypes_and_reject_ints():
    v = torch.tensor([0.75, -3.5, 6.0])
    for dt in (torch.float32, torch.bfloat16, torch.float16):
        assert codecs.encode_minifloat(v.to(dt), E2M1).tolist() == [0x2, 0xE, 0x7]
    with pytest.raises(TypeError, match="floating-point"):
        codecs.encode_minifloat(torch.tensor([1, 2]), E2M1)


def _f32(bits: int) -> float:
    return struct.unpack("<f", struct.pack("<I", bits))[0]


def test_e8m0_decode_every_code():
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    v = codecs.decode_e8m0(codes)
    assert v[0].item() == 2.0**-127 and v[0].view(torch.int32).item() == 0x00400000
    assert math.isnan(v[255].item())
    for c in range(1, 255):
        assert v[c].item() == 2.0 ** (c - 127)
    # torch's own float8_e8m0fnu agrees on decoding
    ref = codes.view(torch.float8_e8m0fnu).float()
    assert torch.equal(v[:255], ref[:255])


def test_e8m0_floor_and_rceil():
    x = torch.tensor([
        1.0, 1.5, _f32(0x3F800001), 0.75, 3.0, 2.0**-127, _f32(0x00400001), _f32(0x00000001), 0.0,
        2.0**127 * 1.5, float("inf"), float("nan"), -4.0,
    ])
    floor = codecs.encode_e8m0(x, ScaleRounding.FLOOR).tolist()
    rceil = codecs.encode_e8m0(x, "rceil").tolist()
    assert floor == [127, 127, 127, 126, 128, 0, 0, 0, 0, 254, 255, 255, 129]
    # RCEIL: exponent bits + 1 if any mantissa bit is set; subnormals round up only above 2^-127;
    # above 2^127 it saturates at 0xFE (satfinite), Inf/NaN -> 0xFF, the sign is dropped
    assert rceil == [127, 128, 128, 127, 129, 0, 1, 0, 0, 254, 255, 255, 129]


def test_e8m0_rceil_bit_method_differs_from_float_log2():
    s = torch.nextafter(torch.tensor(2.0**-7), torch.tensor(1.0))
    # float log2 rounds to -7.0 here, so exp2(ceil(log2 s)) = 2^-7 < s; the bit method gives 2^-6 >= s
    assert math.ceil(math.log2(s.item())) == -7 or torch.log2(s).ceil().item() == -7
    code = codecs.encode_e8m0(s, "rceil")
    assert codecs.decode_e8m0(code).item() == 2.0**-6


def test_e8m0_rounding_rejects_unknown_mode():
    with pytest.raises(ValueError):
        codecs.encode_e8m0(torch.tensor([1.0]), "nearest")


def test_int4_codecs():
    x = torch.tensor([0.5, 1.5, 2.5, -0.5, -1.5, 7.6, -9.0, 100.0])
    # torch.round is half-to-even: 0.5 -> 0, 1.5 -> 2, 2.5 -> 2, -0.5 -> -0, -1.5 -> -2
    assert codecs.encode_int(x, INT4).tolist() == [0, 2, 2, 0, -2, 7, -8, 7]
    assert codecs.encode_int(x, UINT4).tolist() == [0, 2, 2, 0, 0, 8, 0, 15]
    q = torch.arange(-8, 8, dtype=torch.int32)
    nib = codecs.int_to_nibble(q, INT4)
    assert nib.tolist() == [8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7]
    assert torch.equal(codecs.nibble_to_int(nib, INT4), q)
    u = torch.arange(16, dtype=torch.int32)
    assert torch.equal(codecs.nibble_to_int(codecs.int_to_nibble(u, UINT4), UINT4), u)
    with pytest.raises(ValueError, match="NaN"):
        codecs.encode_int(torch.tensor([float("nan")]), INT4)


def test_nf4_and_bnb_fp4_tables():
    nf4 = codecs.codebook_table(NF4)
    assert nf4[0] == -1.0 and nf4[7] == 0.0 and nf4[15] == 1.0 and torch.all(nf4[1:] > nf4[:-1])
    fp4 = codecs.codebook_table(BNB_FP4)
    # bnb FP4 is not E2M1: code 0b011 is the maximum (12/12) and 0b010 is 8/12
    assert fp4[3] == 1.0 and fp4[2] == pytest.approx(8 / 12) and fp4[1] == pytest.approx(0.0625 / 12)
    codes = torch.arange(16, dtype=torch.uint8)
    assert torch.equal(codecs.encode_codebook(codecs.decode_codebook(codes, NF4), NF4), codes)


def test_nf4_midpoint_ties_go_to_lower_code():
    nf4 = codecs.codebook_table(NF4)
    mid = (nf4[7] + nf4[8]) / 2  # 0.0397901...
    up = torch.nextafter(mid, torch.tensor(1.0))
    assert codecs.encode_codebook(torch.stack([mid, up]), NF4).tolist() == [7, 8]
    assert codecs.encode_codebook(torch.tensor([2.0, -2.0]), NF4).tolist() == [15, 0]
