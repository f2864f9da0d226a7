"""GPTQ on CUDA: the column loop replayed from CUDA graphs gives the eager loop's result bit for bit, for every
grid and with act-order; a model quantized with GPTQ on the GPU decodes to the values the loop used.

Run on the device machine: ``python -m pytest -q -p no:cacheprovider tests/algorithms/test_gptq_gpu.py``.
"""

from __future__ import annotations

import pytest
import torch
from test_gptq import CASES, IDS, _assert_same_result, _same  # this folder's cases
from test_gptq_refine import rounded_to_nearest

import lowbit
from lowbit.algorithms import GPTQ, HessianAccumulator, gptq_graphs, gptq_quantize

pytestmark = pytest.mark.gpu


def _layer(out=256, k=1024, n=2048, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    w = torch.randn(out, k, generator=g, device="cuda") * 0.05
    x = torch.randn(n, k, generator=g, device="cuda") @ (torch.randn(k, k, generator=g, device="cuda") * 0.1)
    x[:, :8] *= 10
    acc = HessianAccumulator(k, "cuda")
    acc.add(x)
    return w, x, acc.H


@pytest.mark.parametrize(("fmt", "opts"), CASES, ids=IDS)
@pytest.mark.parametrize("act_order", [False, True])
@pytest.mark.parametrize("scale_search", [(), (0.95, 0.9, 0.85, 0.8)], ids=["rtn-scales", "search"])
def test_graph_replay_equals_eager_loop(fmt, opts, act_order, scale_search, monkeypatch):
    w, x, H = _layer(seed=1)
    config = GPTQ(act_order=act_order, scale_search=scale_search)
    made = []
    real = gptq_graphs.BlockGraphs

    def spy(*args, **kwargs):
        made.append(real(*args, **kwargs))
        return made[-1]

    monkeypatch.setattr(gptq_graphs, "BlockGraphs", spy)
    graphed = gptq_quantize(w, H, fmt, config=config, scale_search=scale_search, **opts)
    assert len(made) == 1 and made[0].capture and len(made[0].graphs) == (1 if act_order else 128 // made[0].G)
    monkeypatch.setattr(gptq_graphs, "USE_CUDA_GRAPHS", False)
    eager = gptq_quantize(w, H, fmt, config=config, scale_search=scale_search, **opts)
    _assert_same_result(graphed, eager)
    q, values = graphed
    assert torch.equal(lowbit.dequantize(q, torch.float32), values)
    rtn = lowbit.dequantize(lowbit.quantize(w, fmt, **opts), torch.float32)
    assert ((x @ (values - w).t()) ** 2).mean() < ((x @ (rtn - w).t()) ** 2).mean()


@pytest.mark.parametrize(("fmt", "opts"), CASES, ids=IDS)
@pytest.mark.parametrize("act_order", [False, True])
def test_refinement_on_the_gpu_decodes_exactly_and_lowers_the_objective(fmt, opts, act_order):
    import dataclasses

    from lowbit.algorithms.gptq_refine import objective

    w, _, H = _layer(seed=2)
    base = GPTQ(act_order=act_order, damp=0.03, scale_search=(0.95, 0.9, 0.85, 0.8))
    q0, v0 = gptq_quantize(w, H, fmt, config=base, **opts)
    q, values = gptq_quantize(w, H, fmt, config=dataclasses.replace(base, refine_sweeps=2), **opts)
    assert torch.equal(lowbit.dequantize(q, torch.float32), values)
    for field in ("scale", "global_scale", "zeros"):
        assert _same(getattr(q, field), getattr(q0, field)), field
    Hd = H + 0.03 * H.diagonal().mean() * torch.eye(H.shape[0], device=H.device)
    assert objective(w, values, Hd) < objective(w, v0, Hd)


def _refinement_case(fmt, opts, dead: int | None = None):
    """(w, grid, states, codes, values, dampened H) of a layer rounded to nearest: several full 128-column
    blocks and a partial one; ``dead``: an input whose row and column of H are zero."""
    from lowbit.algorithms.grids import grid_for

    w, _, H = _layer(seed=4, k=1024 + 256)
    grid = grid_for(w, fmt, **opts)
    states, codes, values = rounded_to_nearest(grid, w)
    Hd = H + 0.01 * H.diagonal().mean() * torch.eye(H.shape[0], device=H.device)
    if dead is not None:
        Hd[dead, :] = 0.0
        Hd[:, dead] = 0.0
    return w, grid, states, codes, values, Hd


def _timed_refines(case, sweeps: int, modes) -> tuple[dict, dict]:
    """``refine`` of ``case`` once per ``graphs`` value in ``modes``: (results, seconds) by mode."""
    import time

    from lowbit.algorithms.gptq_refine import refine

    w, grid, states, codes, values, Hd = case
    out, times = {}, {}
    for graphs in modes:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        out[graphs] = refine(grid, w, values, codes, states, Hd, sweeps=sweeps, block_size=128, graphs=graphs)
        torch.cuda.synchronize()
        times[graphs] = time.perf_counter() - t0
    return out, times


@pytest.mark.parametrize(("fmt", "opts"), CASES, ids=IDS)
def test_refinement_from_cuda_graphs_gives_the_eager_loops_bits(fmt, opts):
    # the sweeps' full blocks replayed from one CUDA graph each against the same sweeps launched eagerly
    out, times = _timed_refines(_refinement_case(fmt, opts), 2, (False, True))
    assert torch.equal(out[False][1], out[True][1])
    assert torch.equal(out[False][0].abs(), out[True][0].abs())
    print(f"{fmt}: eager {times[False]:.3f} s, graphs {times[True]:.3f} s")


@pytest.mark.parametrize(("fmt", "opts"), CASES, ids=IDS)
def test_fused_refinement_kernel_follows_the_torch_loop(fmt, opts):
    # the default on CUDA: one Triton kernel per block. Its arithmetic is the torch loop's except the rank-1
    # update of G (one FMA), so a value may move differently only at a near-tie; the codes still decode to the
    # values bit for bit and the objective ends as low
    from lowbit.algorithms.gptq_refine import objective

    case = _refinement_case(fmt, opts, dead=5)      # the dead input keeps its values
    w, grid, states, codes, values, Hd = case
    out, times = _timed_refines(case, 3, (None, False))
    (v_fused, c_fused), (v_loop, c_loop) = out[None], out[False]
    differ = (c_fused != c_loop).float().mean().item()
    assert differ < 1e-3, differ
    assert not torch.equal(c_fused, codes)
    assert torch.equal(c_fused[:, 5], codes[:, 5])
    Hw = Hd.double()
    o_fused, o_loop, o_rtn = objective(w, v_fused, Hw), objective(w, v_loop, Hw), objective(w, values, Hw)
    assert o_fused < o_rtn and abs(o_fused - o_loop) <= 1e-4 * o_loop, (o_fused, o_loop, o_rtn)
    q = grid.assemble(c_fused, states)
    assert torch.equal(lowbit.dequantize(q, torch.float32), v_fused)
    print(f"{fmt}: fused {times[None]:.3f} s, torch loop {times[False]:.3f} s, codes differing {differ:.2e}")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_gram_sums_on_cuda_match_float64(dtype):
    # bf16/fp16 rows take the half-precision GEMM with fp32 output (exact products, the tensor cores' fp32
    # sums): on an H200 3.7e-6 (bf16) and 7.2e-6 (fp16) from the float64 sums over several batches, the fp32
    # path under 2e-6; products rounded to bf16 would be about 1e-3 off
    from lowbit.algorithms.gptq import CrossAccumulator

    g = torch.Generator(device="cuda").manual_seed(3)
    k = 384
    batches = [(torch.randn(n, k, generator=g, device="cuda") * 3).to(dtype) for n in (700, 1, 2048, 333)]
    floats = [(b.float() + 0.01 * torch.randn(b.shape, generator=g, device="cuda")).to(dtype) for b in batches]
    acc = CrossAccumulator(k, "cuda")
    for b, f in zip(batches, floats):
        acc.add_pair(b, f)
    x, xf = torch.cat(batches).double(), torch.cat(floats).double()
    n = x.shape[0]
    for got, want in ((acc.H, 2 * x.T @ x / n), (acc.C, 2 * xf.T @ x / n)):
        assert got.dtype == torch.float32
        err = ((got.double() - want).norm() / want.norm()).item()
        assert err < 2e-5, (dtype, err)
    assert acc.n == n
