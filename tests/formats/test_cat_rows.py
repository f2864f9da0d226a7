"""cat_rows: weights stacked along their rows decode to exactly the stacked rows of their members (the fused
weight of sibling projections), and members that do not agree are refused with the rule they break."""

import pytest
import torch

import lowbit
from lowbit.formats.rows import cat_rows, slice_rows

CASES = [
    ("nvfp4", {}), ("nvfp4", {"scale_layout": "swizzled"}), ("mxfp4", {}), ("mxfp4", {"scale_layout": "swizzled"}),
    ("fp4_b32", {}), ("nf4", {}), ("nf4", {"double_quant": True}), ("bnb_fp4", {}), ("int4_awq", {"group_size": 64}),
    ("int4_awq", {"group_size": 128}),
]


def _weights(rows, k=256, seed=0):
    gen = torch.Generator().manual_seed(seed)
    ws = [torch.randn(n, k, generator=gen) * torch.logspace(-3, 1, n)[:, None] for n in rows]
    ws[0][3] = 0.0                                   # a zero row: zero blocks, zero scales
    ws[-1][1, :16] = torch.tensor([448.0 * 6, -448.0 * 6] * 8)  # ±max of the block scale's range
    ws[-1][2, 16:32] = 1e-30                         # subnormal-scale blocks
    return ws


def _quantize_siblings(ws, fmt, opts):
    if fmt == "int4_awq":
        return [lowbit.quantize(w.half(), fmt, **opts) for w in ws]
    if fmt == "nvfp4":
        # siblings share one global scale, as quantize_model gives q/k/v and gate/up
        shared = lowbit.quantize(torch.cat(ws), fmt, **opts).global_scale
        return [lowbit.quantize(w, fmt, global_scale=shared, **opts) for w in ws]
    return [lowbit.quantize(w, fmt, **opts) for w in ws]


@pytest.mark.parametrize("fmt, opts", CASES, ids=[f"{f}-{o}" for f, o in CASES])
@pytest.mark.parametrize("rows", [(256, 128, 72), (128, 128), (384,)], ids=["qkv-like", "gate-up-like", "one"])
def test_stacked_weight_decodes_to_the_stacked_rows(fmt, opts, rows):
    qs = _quantize_siblings(_weights(rows), fmt, opts)
    fused = cat_rows(qs)
    want = torch.cat([lowbit.dequantize(q, torch.float32) for q in qs])
    got = lowbit.dequantize(fused, torch.float32)
    assert fused.shape == (sum(rows), 256) and fused.fmt == fmt
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))
    n0 = 0
    for q, n in zip(qs, rows):   # and each member's rows come back out of the stack
        if n0 % 128 == 0:
            part = lowbit.dequantize(slice_rows(fused, n0, n0 + n), torch.float32)
            assert torch.equal(part.view(torch.int32), lowbit.dequantize(q, torch.float32).view(torch.int32))
        n0 += n


def test_members_are_not_modified():
    qs = _quantize_siblings(_weights((128, 128)), "mxfp4", {})
    before = [(q.data.clone(), q.scale.clone()) for q in qs]
    cat_rows(qs)
    for q, (d, s) in zip(qs, before):
        assert torch.equal(q.data, d) and torch.equal(q.scale, s)


def test_disagreeing_members_are_refused():
    w = _weights((128, 128))
    with pytest.raises(ValueError, match="global scale"):
        cat_rows([lowbit.quantize(x, "nvfp4") for x in w])        # each its own global scale
    with pytest.raises(ValueError, match="format"):
        cat_rows([lowbit.quantize(w[0], "mxfp4"), lowbit.quantize(w[1], "fp4_b32")])
    with pytest.raises(ValueError, match="in_features"):
        cat_rows([lowbit.quantize(w[0], "mxfp4"), lowbit.quantize(w[1][:, :128], "mxfp4")])
    with pytest.raises(ValueError, match="scale layout"):
        cat_rows([lowbit.quantize(w[0], "mxfp4"), lowbit.quantize(w[1], "mxfp4", scale_layout="swizzled")])
    with pytest.raises(ValueError, match="params"):
        cat_rows([lowbit.quantize(w[0].half(), "int4_awq", group_size=64),
                  lowbit.quantize(w[1].half(), "int4_awq", group_size=128)])
    with pytest.raises(ValueError, match="multiple of 128"):
        cat_rows([lowbit.quantize(torch.randn(72, 256), "mxfp4", scale_layout="swizzled"),
                  lowbit.quantize(w[1], "mxfp4", scale_layout="swizzled")])
    with pytest.raises(ValueError, match="multiple of 8"):
        cat_rows([lowbit.quantize(torch.randn(12, 256).half(), "int4_awq", group_size=64),
                  lowbit.quantize(w[1].half(), "int4_awq", group_size=64)])
    with pytest.raises(ValueError, match="at least one"):
        cat_rows([])
    with pytest.raises(TypeError, match="QTensor"):
        cat_rows([torch.zeros(2, 2)])
