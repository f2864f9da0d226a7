"""GPTQ's scale refit (``GPTQ(scale_refits=...)``, lowbit.algorithms.gptq_refine.refit_scales): for the grids
whose group scale is a free fp32 multiplier it never increases ``tr((W - Q) H (W - Q)^T)``, it solves the
weighted least-squares problem of the scales exactly, the QTensor decodes to the values bit for bit, and the
other grids ignore it. CPU, small shapes."""

from __future__ import annotations

import pytest
import torch
from test_gptq import CASES, IDS, _layer

import lowbit
from lowbit.algorithms import GPTQ, gptq_quantize, grid_for
from lowbit.algorithms.gptq_refine import objective, refit_scales
from lowbit.formats.qtensor import validate

SEARCH = (0.95, 0.9, 0.85, 0.8)
FREE = {"fp4_b32", "nf4", "bnb_fp4"}


def _damped(H: torch.Tensor, d: float) -> torch.Tensor:
    return H + d * H.diagonal().mean() * torch.eye(H.shape[0])


@pytest.mark.parametrize(("fmt", "opts"), CASES, ids=IDS)
@pytest.mark.parametrize("act_order", [False, True])
def test_refits_never_increase_the_objective_and_decode_exactly(fmt, opts, act_order):
    w, _, H = _layer()
    Hobj = _damped(H, 0.1)
    base = GPTQ(act_order=act_order, scale_search=SEARCH, damp=0.1, refine_sweeps=2)
    q0, v0 = gptq_quantize(w, H, fmt, config=base, **opts)
    prev = objective(w, v0, Hobj)
    for refits in (1, 2):
        q, values = gptq_quantize(w, H, fmt, config=GPTQ(act_order=act_order, scale_search=SEARCH, damp=0.1,
                                                         refine_sweeps=2, scale_refits=refits), **opts)
        validate(q)
        assert (q.fmt, q.shape, q.dtype, q.scale_layout, q.params) == (q0.fmt, q0.shape, q0.dtype,
                                                                       q0.scale_layout, q0.params)
        assert torch.equal(lowbit.dequantize(q, torch.float32, backend="torch"), values)
        obj = objective(w, values, Hobj)
        if fmt not in FREE:  # ignored: the very same result
            assert torch.equal(values, v0) and torch.equal(q.data, q0.data)
            continue
        assert obj <= prev * (1 + 1e-9), (refits, obj, prev)
        assert bool((q.scale > 0).all())
        prev = obj
    if fmt in FREE:  # these correlated inputs leave room: the refit moves the objective down
        assert prev < objective(w, v0, Hobj) * 0.99


@pytest.mark.parametrize("fmt", ["fp4_b32", "nf4", "bnb_fp4"])
def test_the_refit_solves_the_scales_least_squares(fmt):
    # each row's group scales minimize the objective with the codes fixed: the gradient in the scales vanishes
    w, _, H = _layer(seed=1)
    Hobj = _damped(H, 0.1)
    opts = {} if fmt == "fp4_b32" else {"blocksize": 64, "double_quant": False}
    grid = grid_for(w, fmt, **opts)
    G = grid.group
    states = [grid.fit(w[:, g * G:(g + 1) * G]) for g in range(w.shape[1] // G)]
    parts = [grid.round(w[:, g * G:(g + 1) * G], st) for g, st in enumerate(states)]
    codes = torch.cat([c for c, _ in parts], dim=1)
    Q = torch.cat([v for _, v in parts], dim=1)
    new_states, Qn = refit_scales(grid, w, Q, codes, states, Hobj)
    assert objective(w, Qn, Hobj) < objective(w, Q, Hobj)
    for g, st in enumerate(new_states):  # the grid's own decode under the new scales
        assert torch.equal(Qn[:, g * G:(g + 1) * G], grid.decode(codes[:, g * G:(g + 1) * G], st))
    U = grid.unit_values(codes).double()
    E = w.double() - Qn.double()
    grad = ((E @ Hobj.double()) * U).reshape(w.shape[0], -1, G).sum(-1)  # d obj / d s, up to the factor -2
    moved = torch.stack([st[0] for st in new_states], 1) != torch.stack([st[0] for st in states], 1)
    assert bool(moved.any())
    scale = (U.abs() * (E @ Hobj.double()).abs()).reshape(w.shape[0], -1, G).sum(-1)
    assert float((grad.abs() / scale.clamp_min(1e-30))[moved].max()) < 1e-4


def test_grids_without_free_scales_are_not_refit():
    w, _, H = _layer()
    for fmt, opts in (("nvfp4", {}), ("mxfp4", {}), ("int4_awq", {"group_size": 32})):
        grid = grid_for(w, fmt, **opts)
        assert not grid.free_scale and refit_scales(grid, w, w, None, [], H) is None
    assert grid_for(w, "fp4_b32", scale_search=SEARCH).free_scale


def test_scale_refits_option_is_checked():
    with pytest.raises(TypeError, match="scale_refits"):
        GPTQ(scale_refits=1.5)
    with pytest.raises(TypeError, match="scale_refits"):
        GPTQ(scale_refits=True)
    with pytest.raises(ValueError, match="scale_refits"):
        GPTQ(scale_refits=-1)


def test_label_and_cli_flag():
    from lowbit import cli
    from lowbit.algorithms.pipeline import label

    assert label(GPTQ(act_order=True, refine_sweeps=4, scale_refits=2)) == "gptq-act-cd4-refit2"
    args = cli.build_parser().parse_args(["quantize", "--scheme", "w4a16-fp4b32", "--algorithm", "gptq",
                                          "--gptq-scale-refits", "3"])
    (g,) = cli.algorithm_from_args(args)
    assert g.scale_refits == 3
    with pytest.raises(ValueError, match="--gptq-scale-refits"):
        cli.algorithm_from_args(cli.build_parser().parse_args(
            ["quantize", "--scheme", "w4a16-fp4b32", "--algorithm", "gptq", "--gptq-scale-refits", "-1"]))
    with pytest.raises(ValueError, match="--gptq-scale-refits"):
        cli.algorithm_from_args(cli.build_parser().parse_args(
            ["quantize", "--scheme", "w4a16-fp4b32", "--algorithm", "rtn", "--gptq-scale-refits", "1"]))
