"""shard: equal row or column ranges of a quantized weight decode to exactly that range of the whole weight."""

import pytest
import torch

import lowbit
from lowbit.formats.shards import SHARDABLE, shard, shard_align, shard_range, shard_reason

CASES = [
    ("nvfp4", {}), ("nvfp4", {"scale_layout": "swizzled"}), ("nvfp4", {"convention": "torchao"}),
    ("mxfp4", {}), ("mxfp4", {"scale_layout": "swizzled"}), ("mxfp6_e2m3", {}), ("mxfp6_e3m2", {}),
    ("mxfp8_e4m3", {}), ("mxfp8_e5m2", {"scale_layout": "swizzled"}), ("fp4_b32", {}),
    ("nf4", {}), ("nf4", {"double_quant": True}), ("bnb_fp4", {"double_quant": True}),
    ("int4_awq", {"group_size": 64}), ("int4_awq", {"group_size": 128}),
    ("fp8_block", {"block": (128, 128)}), ("fp8_block", {"block": (128, 128), "scale_fmt": "ue8m0"}),
]
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA"))]


def _adversarial(n: int, k: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=gen) * torch.logspace(-4, 2, n)[:, None]
    w[3] = 0.0                                   # a zero row (zero blocks)
    w[7, :40] = 448.0 * 6                        # +-max of the element grids
    w[8, 16:48] = -1e-30                         # subnormal scales
    w[9, ::5] = 0.25                             # ties
    return w


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fmt, opts", CASES, ids=[f"{f}-{o}" for f, o in CASES])
@pytest.mark.parametrize("count", [2, 4])
def test_shards_decode_to_the_same_ranges(fmt, opts, count, device):
    n, k = 512, 1024
    w = _adversarial(n, k, seed=count)
    if fmt != "int4_awq":
        w[11, 100] = float("nan")                # NaN keeps its block's decode
        w[12, 200] = float("inf")
    q = lowbit.quantize((w.half() if fmt == "int4_awq" else w).to(device), fmt, **opts)
    full = lowbit.dequantize(q, torch.float32, backend="torch")
    for dim in (0, 1):
        parts = [shard(q, dim, i, count) for i in range(count)]
        for i, p in enumerate(parts):
            a, b = shard_range(q.shape[dim], i, count)
            want = full[a:b] if dim == 0 else full[:, a:b]
            got = lowbit.dequantize(p, torch.float32, backend="torch")
            assert got.shape == want.shape
            assert torch.equal(_bits(got), _bits(want)), (dim, i)
            assert p.fmt == q.fmt and p.scale_layout == q.scale_layout and p.dtype == q.dtype
            for name, t in p.tensors().items():
                assert t.is_contiguous(), name
                # owned: no shard keeps the whole weight's storage alive
                whole = getattr(q, name)
                assert t.untyped_storage().data_ptr() != whole.untyped_storage().data_ptr(), name
            if q.global_scale is not None:
                assert torch.equal(p.global_scale, q.global_scale)


def test_every_shardable_format_is_covered():
    assert {f for f, _ in CASES} == set(SHARDABLE)


def test_nf4_row_shards_keep_whole_nested_blocks_double_quantized():
    w = torch.randn(512, 256)
    q = lowbit.quantize(w, "nf4", double_quant=True)
    # 256 rows x 4 blocks per row = 4 nested blocks of 256: kept
    assert shard(q, 0, 1, 2).nested_scale is not None
    # a column range cuts every nested block: decoded to its fp32 absmax (the same decode)
    assert shard(q, 1, 1, 2).nested_scale is None


def test_alignment_rules():
    q = lowbit.quantize(torch.randn(256, 512).half(), "int4_awq", group_size=128)
    assert shard_align(q, 0) == 8 and shard_align(q, 1) == 128
    assert shard_reason(q, 1, 2) is None
    assert "multiple of 128" in shard_reason(q, 1, 8)           # 64 columns: half a group
    with pytest.raises(ValueError, match="multiple of 128"):
        shard(q, 1, 0, 8)
    assert "multiple of 8" in shard_reason(q, 0, 64)            # 4 rows: half a packed word
    f8 = lowbit.quantize(torch.randn(384, 256), "fp8_block", block=(128, 128))
    assert shard_reason(f8, 0, 3) is None
    assert "multiple of 128" in shard_reason(f8, 0, 6)
    nv = lowbit.quantize(torch.randn(6, 48), "nvfp4")
    assert "multiple of 16" in shard_reason(nv, 1, 2)            # 24 columns: 1.5 blocks
    assert "divisible" in shard_reason(nv, 0, 4)


def test_bad_arguments():
    q = lowbit.quantize(torch.randn(64, 64), "nvfp4")
    with pytest.raises(ValueError, match="dim must be 0"):
        shard(q, 2, 0, 2)
    with pytest.raises(ValueError, match="count must be a positive int"):
        shard(q, 0, 0, 0)
    with pytest.raises(ValueError, match=r"index must be an int in \[0, 2\)"):
        shard(q, 0, 2, 2)
    rowwise = lowbit.quantize(torch.randn(64, 64), "fp8_rowwise")
    with pytest.raises(ValueError, match="no sharding for format 'fp8_rowwise'"):
        shard(rowwise, 0, 0, 2)
    with pytest.raises(ValueError, match="2-D"):
        shard(lowbit.quantize(torch.randn(2, 64, 64), "nvfp4"), 0, 0, 2)
    assert "QTensor" in shard_reason(torch.randn(4, 4), 0, 2)
