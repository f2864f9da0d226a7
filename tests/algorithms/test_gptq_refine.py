"""GPTQ's coordinate-descent refinement (``GPTQ(refine_sweeps=...)``, lowbit.algorithms.gptq_refine): with the
group scales fixed it never increases ``tr((W - Q) H (W - Q)^T)``, a converged result is a fixed point of
every single-value move, the QTensor keeps GPTQ's scales and decodes to the refined values bit for bit, and
its options are checked. CPU, small shapes."""

from __future__ import annotations

import pytest
import torch
from test_gptq import CASES, IDS, _layer, _out_err, _same  # this folder's GPTQ cases and layer

import lowbit
from lowbit import cli
from lowbit.algorithms import GPTQ, gptq_quantize, grid_for
from lowbit.algorithms.gptq_refine import objective, refine
from lowbit.formats.qtensor import validate

SEARCH = (0.95, 0.9, 0.85, 0.8)


def _damped(H: torch.Tensor, d: float) -> torch.Tensor:
    return H + d * H.diagonal().mean() * torch.eye(H.shape[0])


@pytest.mark.parametrize(("fmt", "opts"), CASES, ids=IDS)
@pytest.mark.parametrize("act_order", [False, True])
@pytest.mark.parametrize("refine_damp", [0.0, None], ids=["undamped", "gptq-damp"])
def test_sweeps_never_increase_the_objective_and_decode_exactly(fmt, opts, act_order, refine_damp):
    w, _, H = _layer()
    base = GPTQ(act_order=act_order, scale_search=SEARCH, damp=0.1)
    Hobj = _damped(H, base.damp if refine_damp is None else refine_damp)
    q0, v0 = gptq_quantize(w, H, fmt, config=base, **opts)
    prev = objective(w, v0, Hobj)
    first = None
    for sweeps in (1, 2, 3):
        cfg = GPTQ(act_order=act_order, scale_search=SEARCH, damp=0.1, refine_sweeps=sweeps,
                   refine_damp=refine_damp)
        q, values = gptq_quantize(w, H, fmt, config=cfg, **opts)
        validate(q)
        assert (q.fmt, q.shape, q.dtype, q.scale_layout, q.params) == (q0.fmt, q0.shape, q0.dtype,
                                                                       q0.scale_layout, q0.params)
        # only codes move: every scale is the loop's
        for field in ("scale", "global_scale", "zeros"):
            assert _same(getattr(q, field), getattr(q0, field)), field
        assert torch.equal(lowbit.dequantize(q, torch.float32, backend="torch"), values)
        obj = objective(w, values, Hobj)
        assert obj <= prev * (1 + 1e-6), (sweeps, obj, prev)
        prev = obj
        first = obj if first is None else first
    # one sweep already moves something on these correlated inputs
    assert first < objective(w, v0, Hobj) * 0.995


def rounded_to_nearest(grid, w):
    """(group states, codes, values) of ``w`` rounded to nearest on ``grid``, group by group: a start for
    :func:`refine` without GPTQ."""
    G = grid.group
    states = [grid.fit(w[:, g * G:(g + 1) * G]) for g in range(w.shape[1] // G)]
    parts = [grid.round(w[:, g * G:(g + 1) * G], states[g]) for g in range(len(states))]
    return states, torch.cat([c for c, _ in parts], dim=1), torch.cat([v for _, v in parts], dim=1)


@pytest.mark.parametrize(("fmt", "opts"), CASES, ids=IDS)
def test_converged_values_are_the_nearest_grid_value_of_each_coordinate(fmt, opts):
    # a fixed point: for every value, given all the others, no other value of its group's grid is nearer
    # to the coordinate's unconstrained minimizer (checked in float64 against all 16 values)
    w, _, H = _layer(2, out=8, k=128)
    grid = grid_for(w, fmt, scale_search=SEARCH, **opts)
    G = grid.group
    states, codes, values = rounded_to_nearest(grid, w)
    q, c = refine(grid, w, values, codes, states, H, sweeps=30, block_size=32)
    E = (w - q).double()
    Hd = H.double()
    for j in range(w.shape[1]):
        target = w[:, j].double() + (E @ Hd[:, j] - Hd[j, j] * E[:, j]) / Hd[j, j]
        _, lv = grid.levels(states[j // G])
        best = (lv.double() - target[:, None]).abs().min(dim=1).values
        assert ((q[:, j].double() - target).abs() <= best + 1e-7 * target.abs().clamp(min=1e-3)).all(), j
    assert torch.equal(lowbit.dequantize(grid.assemble(c, states), torch.float32, backend="torch"), q)


def test_refinement_lowers_the_output_error_of_plain_gptq():
    w, x, H = _layer(5)
    _, plain = gptq_quantize(w, H, "int4_awq", config=GPTQ(damp=0.01), group_size=32)
    _, refined = gptq_quantize(w, H, "int4_awq", config=GPTQ(damp=0.01, refine_sweeps=2), group_size=32)
    assert _out_err(x, w, refined) < 0.97 * _out_err(x, w, plain)


def test_levels_hold_what_round_returns():
    # every value the grid rounds to is one of its 16 levels, bit for bit, at its code's index
    for fmt, opts in CASES:
        w, _, _ = _layer(6)
        grid = grid_for(w, fmt, **opts)
        st = grid.fit(w[:, :grid.group])
        c, v = grid.round(w[:, :grid.group] * 1.3, st)
        codes, lv = grid.levels(st)
        assert torch.equal(codes.long(), torch.arange(16)) and codes.dtype == c.dtype
        assert torch.equal(lv.gather(1, c.long()), v), fmt


def test_dead_inputs_stay_zero_and_sweeps_zero_is_gptq():
    w, _, H = _layer()
    H[5, :] = 0
    H[:, 5] = 0
    q, values = gptq_quantize(w, H, "nvfp4", config=GPTQ(refine_sweeps=2, refine_damp=0.0))
    assert torch.equal(lowbit.dequantize(q, torch.float32), values)
    assert (values[:, 5] == 0).all()
    a = gptq_quantize(w, H, "nvfp4", config=GPTQ())
    b = gptq_quantize(w, H, "nvfp4", config=GPTQ(refine_sweeps=0, refine_damp=0.5))
    assert torch.equal(a[1], b[1]) and torch.equal(a[0].data, b[0].data)


def test_bad_options_name_the_argument():
    for kwargs, exc, name in (({"refine_sweeps": -1}, ValueError, "refine_sweeps"),
                              ({"refine_sweeps": 1.0}, TypeError, "refine_sweeps"),
                              ({"refine_sweeps": True}, TypeError, "refine_sweeps"),
                              ({"refine_damp": -0.1}, ValueError, "refine_damp"),
                              ({"refine_damp": float("nan")}, ValueError, "refine_damp"),
                              ({"refine_damp": float("inf")}, ValueError, "refine_damp"),
                              ({"refine_damp": "0.1"}, TypeError, "refine_damp")):
        with pytest.raises(exc, match=name):
            GPTQ(**kwargs)
    assert GPTQ(refine_sweeps=3, refine_damp=0).refine_damp == 0


def test_cli_flag_and_label():
    from lowbit.algorithms.pipeline import describe, label

    assert label(GPTQ(act_order=True, scale_search=(0.9,), refine_sweeps=4)) == "gptq-act-clip-cd4"
    assert describe(GPTQ(refine_sweeps=2)) == "gptq(refine_sweeps=2)"

    def algorithm(*extra):
        return cli.algorithm_from_args(cli.build_parser().parse_args(["quantize", "--scheme", "w4a16-nvfp4", *extra]))

    assert algorithm("--algorithm", "gptq")[0].refine_sweeps == cli.GPTQ_DEFAULTS.get("refine_sweeps", 0)
    assert algorithm("--algorithm", "gptq", "--gptq-refine-sweeps", "3")[0].refine_sweeps == 3
    assert algorithm("--algorithm", "gptq", "--gptq-refine-sweeps", "0")[0].refine_sweeps == 0
    with pytest.raises(ValueError, match="--gptq-refine-sweeps must be"):
        algorithm("--algorithm", "gptq", "--gptq-refine-sweeps", "-1")
    with pytest.raises(ValueError, match="--gptq-refine-sweeps applies to --algorithm gptq"):
        algorithm("--algorithm", "rtn", "--gptq-refine-sweeps", "1")


@pytest.mark.parametrize(("fmt", "opts"), CASES, ids=IDS)
def test_block_graph_buffers_give_the_eager_loops_bits(fmt, opts):
    # the CUDA-graph path of the refinement (full blocks on static buffers, columns with H_jj <= 0 masked
    # instead of skipped, no test for unchanged columns) run directly on the CPU: the eager loop's values and
    # codes, with a partial last block, a zero H_jj and several sweeps
    w, _, H = _layer(3, out=8, k=384)
    H = H.clone()
    H[5, :] = 0.0
    H[:, 5] = 0.0
    grid = grid_for(w, fmt, scale_search=SEARCH, **opts)
    states, codes, values = rounded_to_nearest(grid, w)
    q0, c0 = refine(grid, w, values, codes, states, H, sweeps=3, block_size=256, graphs=False)
    q1, c1 = refine(grid, w, values, codes, states, H, sweeps=3, block_size=256, graphs=True)
    assert torch.equal(c0, c1)
    assert torch.equal(q0.abs(), q1.abs())          # equal up to the sign of a zero
    assert not torch.equal(q0, values)              # something moved
    assert torch.equal(q1[:, 5], values[:, 5])      # H_jj = 0: kept
