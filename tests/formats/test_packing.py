"""Literal bytes for every packing rule, and the 128x4 scale swizzle against its defining formula."""

import pytest
import torch

import lowbit
from lowbit.formats import packing


def _u8(values):
    return torch.tensor(values, dtype=torch.uint8)


def test_fp4_low_nibble_first():
    # (6.0, 0.5) = codes (7, 1): element 0 in the low nibble -> 0x17 (torchao pack_uint4, PTX cvt order)
    assert packing.pack_fp4(_u8([7, 1])).tolist() == [0x17]
    assert packing.pack_fp4(_u8([[0, 1, 2, 3], [0xF, 0x8, 0x9, 0x0]])).tolist() == [[0x10, 0x32], [0x8F, 0x09]]
    assert packing.unpack_fp4(_u8([0x17, 0xF0])).tolist() == [7, 1, 0, 15]


def test_nibbles_high_first_for_bitsandbytes():
    # bnb: x0=+1 (code 15), x1=-1 (code 0) -> 0xF0; an odd tail pads the low nibble with 0
    assert packing.pack_nibbles_high_first(_u8([15, 0, 7])).tolist() == [0xF0, 0x70]
    assert packing.unpack_nibbles_high_first(_u8([0xF0, 0x70]), 3).tolist() == [15, 0, 7]


def test_fp6_little_endian_stream():
    assert packing.pack_fp6(_u8([0x01, 0x02, 0x03, 0x3F])).tolist() == [0x81, 0x30, 0xFC]
    assert packing.unpack_fp6(_u8([0x81, 0x30, 0xFC])).tolist() == [0x01, 0x02, 0x03, 0x3F]
    # a lone code at each position lands on bit offset 6*i of the 24-bit word
    for i in range(4):
        codes = [0, 0, 0, 0]
        codes[i] = 0x3F
        word = int.from_bytes(bytes(packing.pack_fp6(_u8(codes)).tolist()), "little")
        assert word == 0x3F << (6 * i)


@pytest.mark.parametrize("shape", [(2, 8), (3, 5, 64), (1, 4)])
def test_pack_round_trips(shape):
    g = torch.Generator().manual_seed(1)
    c4 = torch.randint(0, 16, shape, generator=g, dtype=torch.int32).to(torch.uint8)
    assert torch.equal(packing.unpack_fp4(packing.pack_fp4(c4)), c4)
    c6 = torch.randint(0, 64, shape, generator=g, dtype=torch.int32).to(torch.uint8)
    assert torch.equal(packing.unpack_fp6(packing.pack_fp6(c6)), c6)
    flat = c4.reshape(-1)[:-1]
    assert torch.equal(packing.unpack_nibbles_high_first(packing.pack_nibbles_high_first(flat), flat.numel()), flat)


def test_pack_rejects_bad_shapes():
    with pytest.raises(ValueError, match="multiple of 2"):
        packing.pack_fp4(_u8([1, 2, 3]))
    with pytest.raises(ValueError, match="multiple of 4"):
        packing.pack_fp6(_u8([1, 2, 3]))
    with pytest.raises(TypeError, match="uint8"):
        packing.pack_fp4(torch.tensor([1, 2]))


def _swizzle_offset(r: int, k: int, cols: int) -> int:
    n_kt = -(-cols // 4)
    return ((r // 128) * n_kt + k // 4) * 512 + (r % 32) * 16 + ((r // 32) % 4) * 4 + (k % 4)


def test_swizzle_literal_offsets():
    rows, cols = 256, 8
    marks = {(0, 0): 0, (0, 1): 1, (0, 3): 3, (0, 4): 512, (1, 0): 16, (31, 0): 496, (32, 0): 4, (96, 3): 15,
             (128, 0): 512 * 2}
    for (r, k), off in marks.items():
        assert _swizzle_offset(r, k, cols) == off
        scale = torch.zeros(rows, cols, dtype=torch.uint8)
        scale[r, k] = 0xAB
        flat = lowbit.swizzle_scales(scale).reshape(-1)
        assert flat[off] == 0xAB and int((flat != 0).sum()) == 1


@pytest.mark.parametrize("rows, cols", [(130, 7), (1, 1), (257, 9), (128, 4), (3, 64)])
def test_swizzle_formula_every_element_and_inverse(rows, cols):
    g = torch.Generator().manual_seed(rows * 31 + cols)
    scale = torch.randint(1, 256, (rows, cols), generator=g, dtype=torch.int32).to(torch.uint8)
    sw = lowbit.swizzle_scales(scale.view(torch.float8_e4m3fn))
    assert sw.dtype == torch.float8_e4m3fn
    assert tuple(sw.shape) == packing.swizzled_scale_shape(rows, cols)
    flat = sw.view(torch.uint8).reshape(-1)
    expect = torch.zeros_like(flat)
    for r in range(rows):
        for k in range(cols):
            expect[_swizzle_offset(r, k, cols)] = scale[r, k]
    # every padding byte is zero, every real byte sits where the formula puts it
    assert torch.equal(flat, expect)
    assert torch.equal(lowbit.unswizzle_scales(sw, rows, cols).view(torch.uint8), scale)


def test_swizzle_errors():
    with pytest.raises(ValueError, match="2-D"):
        lowbit.swizzle_scales(torch.zeros(4, dtype=torch.uint8))
    with pytest.raises(TypeError, match="1-byte"):
        lowbit.swizzle_scales(torch.zeros(4, 4))
    with pytest.raises(ValueError, match="expected"):
        lowbit.unswizzle_scales(torch.zeros(100, dtype=torch.uint8), 128, 4)
