"""lowbit.io.sharded's reads on their own (one process, no mesh): the tile reads of 128x4-swizzled scales and the
decode of nf4 absmax inside nested blocks give exactly what lowbit.formats.shards.shard gives, for shapes whose
shards cut tiles and 4-column groups; the declarations' ranges and header checks."""

from fractions import Fraction

import pytest
import torch
from safetensors.torch import save_file

import lowbit
from lowbit.formats.nf4 import nf4_absmax
from lowbit.formats.shards import shard, shard_range, shard_reason
from lowbit.formats.spec import FORMATS
from lowbit.io.files import TensorSource
from lowbit.io.sharded import Axis, ShardInfo, Stored, read_part, unnest_absmax


class _Counting(TensorSource):
    """A TensorSource that counts the bytes its reads return."""

    read = 0

    def read_slice(self, key, index):
        t = super().read_slice(key, index)
        self.read += t.numel() * t.element_size()
        return t

    def get(self, key):
        t = super().get(key)
        self.read += t.numel() * t.element_size()
        return t


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp8_e4m3"])
@pytest.mark.parametrize("shape", [(300, 480), (256, 512), (130, 1344)])
def test_swizzled_scale_parts_equal_shards(tmp_path, fmt, shape):
    w = torch.randn(*shape, generator=torch.Generator().manual_seed(0))
    q = lowbit.quantize(w, fmt, scale_layout="swizzled")
    save_file({"s": q.scale.contiguous()}, str(tmp_path / "model.safetensors"))
    block = FORMATS[fmt].block
    stored = Stored(n=Axis(0, 1), k=Axis(1, block), swizzled=True)
    assert stored.header_reason(list(q.scale.shape), *shape) is None
    prow, pcol = q.scale.shape
    checked = 0
    for dim in (0, 1):
        for count in (2, 3, 4, 5):
            if shard_reason(q, dim, count) is not None:
                continue
            for i in range(count):
                a, b = shard_range(shape[dim], i, count)
                source = _Counting(tmp_path)
                got = read_part(source, "s", stored, ShardInfo(q, dim, a, b, i, count))
                want = shard(q, dim, i, count).scale
                assert got.dtype == want.dtype and got.shape == want.shape, (dim, count, i)
                assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), (dim, count, i)
                if dim == 0:  # the 128-row tiles holding the rows
                    bound = (-(-b // 128) - a // 128) * 128 * pcol
                else:  # per tile: the 4-column groups of the scale columns, and the rows the run starts/ends in
                    groups = -(-(b // block) // 4) - (a // block) // 4
                    bound = prow // 128 * (groups * 512 + 2 * pcol)
                assert source.read <= bound, (dim, count, i, source.read, bound)
                checked += 1
    assert checked >= 8


@pytest.mark.parametrize("rows", [(0, 64), (32, 64), (48, 112), (96, 192), (100, 101)])
def test_nested_absmax_parts_decode_as_the_whole(rows):
    n, k = 192, 256  # 4 absmax blocks a row, 3 nested blocks of 256
    q = lowbit.quantize(torch.randn(n, k, generator=torch.Generator().manual_seed(1)), "nf4", double_quant=True)
    n0, n1 = rows
    b0, b1 = n0 * k // 64, n1 * k // 64
    axis = Axis(0, Fraction(64 * 256, k), cover=True)
    lo, hi = axis.stored_range(n0, n1, n)
    assert (lo, hi) == (b0 // 256, -(-b1 // 256))
    got = unnest_absmax(q.scale[b0:b1], q.nested_scale[lo:hi], q.nested_offset, b0)
    want = nf4_absmax(q)[b0:b1]
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))


def test_axis_ranges_and_header_checks():
    awq_n = Axis(1, 8)  # eight output columns per int32
    assert awq_n.stored_range(8, 24, 64) == (1, 3)
    assert awq_n.stored_range(4, 12, 64) is None          # half a packed word
    assert Axis(1, 8).stored_range(96, 100, 100) == (12, 13)  # a padded last entry
    assert Axis(0, Fraction(2, 256)).stored_range(3, 5, 10) == (384, 640)  # flattened rows of K/2 bytes
    assert Axis(1, Fraction(4, 3)).size(256) == 192         # FP6: 4 codes in 3 bytes
    plain = Stored(n=Axis(0, 1), k=Axis(1, 16))
    assert plain.header_reason([64, 8], 64, 128) is None
    assert "dim 1 holds one entry per 16" in plain.header_reason([64, 16], 64, 128)
    flat = Stored(n=Axis(0, Fraction(2, 128)), flat=True)
    assert flat.header_reason([64 * 64, 1], 64, 128) is None
    assert "flattened" in flat.header_reason([64 * 64, 2], 64, 128)
    swz = Stored(n=Axis(0, 1), k=Axis(1, 16), swizzled=True)
    assert swz.header_reason([128, 8], 100, 128) is None
    assert "swizzled" in swz.header_reason([100, 8], 100, 128)
