"""GPTQ on lowbit's format grids (lowbit.algorithms): it lowers a layer's output error against
round-to-nearest, its result is an ordinary QTensor of the format that decodes to the loop's values bit for
bit, its grids round as the references do, and its arguments are checked. CPU, small shapes."""

from __future__ import annotations

import pytest
import torch

import lowbit
from lowbit.algorithms import GPTQ, HessianAccumulator, gptq_quantize, grid_for
from lowbit.algorithms.gptq import resolve_algorithm, stage_of
from lowbit.formats.qtensor import validate

CASES = [
    ("nvfp4", {"convention": "vllm"}),
    ("nvfp4", {"convention": "lightx2v", "scale_layout": "swizzled"}),
    ("mxfp4", {"scale_rounding": "rceil"}),
    ("mxfp4", {"scale_rounding": "floor", "scale_layout": "swizzled"}),
    ("fp4_b32", {}),
    ("nf4", {"blocksize": 64, "double_quant": False}),
    ("bnb_fp4", {"blocksize": 64, "double_quant": False}),
    ("int4_awq", {"group_size": 32}),
    ("int4_awq", {"group_size": 128}),
]
IDS = [f"{f}-{'-'.join(str(v) for v in o.values())}" for f, o in CASES]


def _layer(seed: int = 0, out: int = 32, k: int = 128, n: int = 384):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(out, k, generator=g) * 0.05
    # correlated inputs with a few strong channels, as real activations have: where GPTQ has something to do
    mix = torch.randn(k, k, generator=g) * 0.2
    x = torch.randn(n, k, generator=g) @ mix + torch.randn(n, k, generator=g)
    x[:, :4] *= 8
    acc = HessianAccumulator(k)
    acc.add(x[: n // 3])
    acc.add(x[n // 3:].reshape(2, -1, k))
    return w, x, acc.H


def _out_err(x, w, wq):
    return ((x @ (wq - w).t()) ** 2).mean().item()


def _same(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    if a is None or b is None:
        return a is None and b is None
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.dtype.itemsize == 1:
        return torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    return torch.equal(a, b)


@pytest.mark.parametrize(("fmt", "opts"), CASES, ids=IDS)
@pytest.mark.parametrize("act_order", [False, True])
def test_gptq_lowers_output_error_and_decodes_exactly(fmt, opts, act_order):
    w, x, H = _layer()
    rtn = lowbit.quantize(w, fmt, backend="torch", **opts)
    q, values = gptq_quantize(w, H, fmt, config=GPTQ(act_order=act_order), **opts)
    validate(q)  # the format's layout checks
    assert (q.fmt, q.shape, q.dtype, q.scale_layout, q.params) == (rtn.fmt, rtn.shape, rtn.dtype,
                                                                   rtn.scale_layout, rtn.params)
    assert _same(q.global_scale, rtn.global_scale)
    decoded = lowbit.dequantize(q, torch.float32, backend="torch")
    assert torch.equal(decoded, values)
    e_rtn = _out_err(x, w, lowbit.dequantize(rtn, torch.float32, backend="torch"))
    e_gptq = _out_err(x, w, decoded)
    assert e_gptq < 0.8 * e_rtn, (e_gptq, e_rtn)


@pytest.mark.parametrize(("fmt", "opts"), CASES, ids=IDS)
@pytest.mark.parametrize("act_order", [False, True])
def test_diagonal_hessian_gives_the_reference_rounding(fmt, opts, act_order):
    # no input correlation: nothing to compensate, so GPTQ is round-to-nearest and every byte of the QTensor
    # is the reference's: the grids fit scales and round exactly as lowbit.quantize does
    w, _, _ = _layer(1)
    H = torch.diag(torch.rand(w.shape[1], generator=torch.Generator().manual_seed(2)) + 0.5)
    q, _ = gptq_quantize(w, H, fmt, config=GPTQ(act_order=act_order), **opts)
    rtn = lowbit.quantize(w, fmt, backend="torch", **opts)
    for f in ("data", "scale", "global_scale", "zeros", "nested_scale", "nested_offset"):
        assert _same(getattr(q, f), getattr(rtn, f)), f


@pytest.mark.parametrize(("fmt", "opts"), CASES, ids=IDS)
def test_grid_round_matches_reference_on_scaled_blocks(fmt, opts):
    # the loop hands the grid error-updated weights, whose values can overshoot the block's original
    # absmax: fit + round of any block equals the reference quantizer run on that block alone
    w, _, _ = _layer(3)
    w = w * torch.logspace(-2, 2, w.shape[1]).unsqueeze(0)  # blocks of very different magnitudes
    grid = grid_for(w, fmt, **opts)
    G = grid.group
    codes, states = [], []
    for g in range(w.shape[1] // G):
        st = grid.fit(w[:, g * G:(g + 1) * G])
        c, _ = grid.round(w[:, g * G:(g + 1) * G], st)
        codes.append(c)
        states.append(st)
    q = grid.assemble(torch.cat(codes, dim=1), states)
    ref = lowbit.quantize(w, fmt, backend="torch", **{**opts, **_global(grid)})
    assert _same(q.data, ref.data) and _same(q.scale, ref.scale) and _same(q.zeros, ref.zeros)


def _global(grid) -> dict:
    return {"global_scale": grid.template.global_scale} if grid.fmt == "nvfp4" else {}


def test_shared_nvfp4_global_scale_is_kept():
    w, _, H = _layer()
    gs = torch.tensor(1234.5)
    q, _ = gptq_quantize(w, H, "nvfp4", global_scale=gs)
    assert q.global_scale.item() == 1234.5


def test_groups_follow_the_format_layout():
    w, _, H = _layer(k=256)
    for g in (32, 64, 128, 256):
        q, values = gptq_quantize(w, H, "int4_awq", group_size=g)
        assert q.scale.shape == (256 // g, w.shape[0]) and q.params["group_size"] == g
        assert torch.equal(lowbit.dequantize(q, torch.float32), values)


def test_act_order_uses_static_groups_of_the_original_weight():
    w, _, H = _layer(4)
    q, _ = gptq_quantize(w, H, "int4_awq", config=GPTQ(act_order=True), group_size=32)
    rtn = lowbit.quantize(w, "int4_awq", group_size=32)
    assert torch.equal(q.scale, rtn.scale) and torch.equal(q.zeros, rtn.zeros)
    assert not torch.equal(q.data, rtn.data)


def test_dead_inputs_and_bf16_weights():
    w, x, H = _layer()
    H[5, :] = 0
    H[:, 5] = 0
    q, values = gptq_quantize(w.to(torch.bfloat16), H, "nvfp4")
    assert q.dtype == torch.bfloat16
    assert torch.equal(lowbit.dequantize(q, torch.float32), values)
    assert (values[:, 5] == 0).all()


def test_hessian_accumulation_matches_direct():
    g = torch.Generator().manual_seed(5)
    xs = [torch.randn(7, 16, generator=g), torch.randn(3, 5, 16, generator=g), torch.randn(0, 16),
          torch.randn(40, 16, generator=g).to(torch.bfloat16)]
    acc = HessianAccumulator(16)
    for x in xs:
        acc.add(x)
    X = torch.cat([x.reshape(-1, 16).float() for x in xs])
    assert acc.n == X.shape[0]
    torch.testing.assert_close(acc.H, 2 * X.t() @ X / X.shape[0], rtol=1e-5, atol=1e-6)


def test_bad_arguments_name_the_argument():
    w, _, H = _layer()
    with pytest.raises(ValueError, match="damp"):
        GPTQ(damp=0)
    with pytest.raises(TypeError, match="damp"):
        GPTQ(damp="0.1")
    with pytest.raises(ValueError, match="block_size"):
        GPTQ(block_size=0)
    with pytest.raises(TypeError, match="act_order"):
        GPTQ(act_order=1)
    with pytest.raises(TypeError, match="config"):
        gptq_quantize(w, H, "nvfp4", config={"damp": 0.1})
    with pytest.raises(ValueError, match="fmt"):
        gptq_quantize(w, H, "fp8_block")
    with pytest.raises(ValueError, match="H must have shape"):
        gptq_quantize(w, H[:-1, :-1], "nvfp4")
    with pytest.raises(TypeError, match="H must"):
        gptq_quantize(w, H.to(torch.int64), "nvfp4")
    with pytest.raises(ValueError, match="H must be finite"):
        gptq_quantize(w, H * float("nan"), "nvfp4")
    with pytest.raises(ValueError, match="weight must be 2-D"):
        gptq_quantize(w[0], H, "nvfp4")
    with pytest.raises(ValueError, match="double_quant"):
        gptq_quantize(w, H, "nf4", double_quant=True)
    with pytest.raises(ValueError, match="blocksize"):
        gptq_quantize(w[:, :96], H[:96, :96], "nf4", blocksize=64)
    with pytest.raises(ValueError, match="convention"):
        gptq_quantize(w, H, "nvfp4", convention="torchao")
    with pytest.raises(ValueError, match="in_features"):
        HessianAccumulator(0)
    with pytest.raises(ValueError, match="x must have last dim"):
        HessianAccumulator(8).add(torch.zeros(2, 9))
    with pytest.raises(ValueError, match="algorithm"):
        resolve_algorithm("gptqq", None, [1])
    with pytest.raises(TypeError, match="algorithm"):
        resolve_algorithm(3, None, [1])
    with pytest.raises(ValueError, match="calibration"):
        resolve_algorithm("gptq", None, None)


def test_stage_of():
    assert stage_of("encoder.layer.3.attention.self.query") == "encoder.layer.3"
    assert stage_of("pooler.dense") == "pooler.dense"


def _assert_same_result(a, b) -> None:
    (qa, va), (qb, vb) = a, b
    assert torch.equal(va, vb)
    for field in ("data", "scale", "global_scale", "zeros"):
        assert _same(getattr(qa, field), getattr(qb, field)), field


@pytest.mark.parametrize(("fmt", "opts"), CASES, ids=IDS)
@pytest.mark.parametrize("act_order", [False, True])
def test_block_graph_buffers_give_the_eager_loop_bits(fmt, opts, act_order, monkeypatch):
    """The CUDA-graph runner's static buffers (per-column states filled per chunk, fitted or gathered; block
    weights, errors, codes), run here without capture: the eager loop's result bit for bit, with a tail
    block shorter than the lazy block left to the eager loop."""
    from lowbit.algorithms import gptq_graphs

    w, _, H = _layer(seed=3, out=24, k=384)
    config = GPTQ(act_order=act_order, block_size=128)
    eager = gptq_quantize(w, H, fmt, config=config, **opts)
    monkeypatch.setattr(gptq_graphs, "graphs_apply", lambda device, cols, bs: cols >= bs)
    made = []
    real = gptq_graphs.BlockGraphs

    def spy(*args, **kwargs):
        made.append(real(*args, **kwargs))
        return made[-1]

    monkeypatch.setattr(gptq_graphs, "BlockGraphs", spy)
    _assert_same_result(gptq_quantize(w, H, fmt, config=config, **opts), eager)
    assert len(made) == 1 and not made[0].capture and made[0].codes1 is not None
    # 384 = 3 blocks of 128 columns; with block_size 160 the last block (64 columns) runs eagerly
    config = GPTQ(act_order=act_order, block_size=160)
    if -(-160 // grid_for(w, fmt, **opts).group) * grid_for(w, fmt, **opts).group == 160:
        _assert_same_result(gptq_quantize(w, H, fmt, config=config, **opts),
                            (monkeypatch.undo() or gptq_quantize(w, H, fmt, config=config, **opts)))
