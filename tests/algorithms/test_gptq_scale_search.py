"""GPTQ's scale search (``GPTQ(scale_search=...)``, ``grid_for(..., scale_search=...)``): every group's scales
are chosen among the format's own fits of the weights times each factor; the result is still an ordinary
QTensor of the format decoding to the loop's values bit for bit, a group's rounding error never grows, and
quantize_model and the CLI pass the options through. CPU, small shapes."""

from __future__ import annotations

import pytest
import torch
from test_gptq import CASES, IDS, _layer, _out_err, _same  # this folder's GPTQ cases and layer
from torch import nn

import lowbit
from lowbit import cli
from lowbit.algorithms import GPTQ, gptq_quantize, grid_for
from lowbit.algorithms.pipeline import describe, label
from lowbit.formats.qtensor import validate

FACTORS = (0.95, 0.9, 0.85, 0.8, 0.5)


def _weight(seed: int = 0, out: int = 32, k: int = 128) -> torch.Tensor:
    # Gaussian groups: their largest values are rare, so a slightly clipped range rounds the group better
    return torch.randn(out, k, generator=torch.Generator().manual_seed(seed)) * 0.02


def _rtn_through(grid, w):
    """Fit and round every group of ``w`` (no error feedback): (QTensor, values, per-group per-row errors)."""
    G = grid.group
    codes, states, values, errs = [], [], [], []
    for g in range(w.shape[1] // G):
        block = w[:, g * G:(g + 1) * G]
        st = grid.fit(block)
        c, v = grid.round(block, st)
        codes.append(c)
        states.append(st)
        values.append(v)
        errs.append((block - v).square().sum(dim=-1))
    return grid.assemble(torch.cat(codes, dim=1), states), torch.cat(values, dim=1), torch.stack(errs)


@pytest.mark.parametrize(("fmt", "opts"), CASES, ids=IDS)
def test_searched_groups_round_no_worse_and_decode_exactly(fmt, opts):
    w = _weight()
    plain = grid_for(w, fmt, **opts)
    searched = grid_for(w, fmt, scale_search=FACTORS, **opts)
    assert (searched.fmt, searched.group, searched.round_reads) == (plain.fmt, plain.group, plain.round_reads)
    _, _, e_plain = _rtn_through(plain, w)
    q, values, e_search = _rtn_through(searched, w)
    validate(q)
    assert torch.equal(lowbit.dequantize(q, torch.float32, backend="torch"), values)
    # each row of each group keeps the best of its candidates, the format's own fit among them
    assert (e_search <= e_plain).all()
    if opts.get("scale_rounding") == "floor":
        # FLOOR's power-of-two scale already clips (the block max may exceed 6 steps): a smaller one never wins
        assert torch.equal(e_search, e_plain)
    else:
        assert e_search.sum() < 0.95 * e_plain.sum(), (e_search.sum(), e_plain.sum())


@pytest.mark.parametrize(("fmt", "opts"), CASES, ids=IDS)
def test_factor_one_is_the_reference(fmt, opts):
    # the candidate 1 is the reference fit itself, and ties keep it: the reference's bytes
    w = _weight(1)
    q, _, _ = _rtn_through(grid_for(w, fmt, scale_search=(1.0,), **opts), w)
    rtn = lowbit.quantize(w, fmt, backend="torch", **opts)
    for f in ("data", "scale", "global_scale", "zeros"):
        assert _same(getattr(q, f), getattr(rtn, f)), f


@pytest.mark.parametrize(("fmt", "opts"), CASES, ids=IDS)
@pytest.mark.parametrize("act_order", [False, True])
def test_gptq_with_scale_search_is_an_ordinary_qtensor(fmt, opts, act_order):
    w, x, H = _layer()
    rtn = lowbit.quantize(w, fmt, backend="torch", **opts)
    q, values = gptq_quantize(w, H, fmt, config=GPTQ(act_order=act_order), scale_search=FACTORS, **opts)
    validate(q)
    assert (q.fmt, q.shape, q.dtype, q.scale_layout, q.params) == (rtn.fmt, rtn.shape, rtn.dtype,
                                                                   rtn.scale_layout, rtn.params)
    assert _same(q.global_scale, rtn.global_scale)
    decoded = lowbit.dequantize(q, torch.float32, backend="torch")
    assert torch.equal(decoded, values)
    assert _out_err(x, w, decoded) < 0.8 * _out_err(x, w, lowbit.dequantize(rtn, torch.float32, backend="torch"))


def test_the_configs_search_is_the_direct_calls_default():
    w, _, H = _layer()
    by_config = gptq_quantize(w, H, "nvfp4", config=GPTQ(scale_search=FACTORS))
    by_option = gptq_quantize(w, H, "nvfp4", config=GPTQ(), scale_search=FACTORS)
    plain = gptq_quantize(w, H, "nvfp4", config=GPTQ(scale_search=FACTORS), scale_search=())
    assert torch.equal(by_config[1], by_option[1])
    assert torch.equal(plain[1], gptq_quantize(w, H, "nvfp4", config=GPTQ())[1])
    assert not torch.equal(plain[1], by_config[1])


def test_options_are_checked_and_kept_as_a_tuple():
    assert GPTQ(scale_search=[0.9, 1]).scale_search == (0.9, 1.0)
    assert GPTQ(scale_search=[0.9]) == GPTQ(scale_search=(0.9,)) and hash(GPTQ(scale_search=[0.9]))
    for bad, exc in (("0.9", TypeError), (0.9, TypeError), ((True,), TypeError), (("a",), TypeError),
                     ((0.0,), ValueError), ((1.5,), ValueError), ((float("nan"),), ValueError)):
        with pytest.raises(exc, match="scale_search"):
            GPTQ(scale_search=bad)
    w, _, _ = _layer()
    with pytest.raises(ValueError, match="scale_search"):
        grid_for(w, "nvfp4", scale_search=(2.0,))


def test_quantize_model_passes_the_search_to_every_layer(monkeypatch):
    from lowbit.algorithms import gptq

    seen = []
    real = gptq.gptq_quantize

    def spy(weight, H, fmt, *, config=None, **options):
        seen.append(options.get("scale_search", config.scale_search))
        return real(weight, H, fmt, config=config, **options)

    monkeypatch.setattr(gptq, "gptq_quantize", spy)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 32))
    cal = [torch.randn(16, 64) for _ in range(2)]
    lowbit.quantize_model(model, "w4a16-nvfp4", skip=(), calibration=cal,
                          algorithm=GPTQ(act_order=True, scale_search=(0.9, 0.8)))
    assert seen == [(0.9, 0.8), (0.9, 0.8)]
    seen.clear()
    lowbit.quantize_model(nn.Sequential(nn.Linear(64, 64)), "w4a16-nvfp4", skip=(), calibration=cal,
                          algorithm="gptq")
    assert seen == [()]  # GPTQ()'s own default: the format's scales


def test_labels_and_cli_flags():
    assert label(GPTQ(act_order=True, scale_search=(0.9,))) == "gptq-act-clip"
    assert describe(GPTQ(scale_search=(0.9,))) == "gptq(scale_search=(0.9,))"

    def algorithm(*extra):
        return cli.algorithm_from_args(cli.build_parser().parse_args(["quantize", "--scheme", "w4a16-nvfp4", *extra]))

    assert algorithm("--algorithm", "gptq") == (GPTQ(**cli.GPTQ_DEFAULTS),)
    assert algorithm("--algorithm", "gptq", "--no-gptq-act-order", "--gptq-damp", "0.1",
                     "--gptq-scale-search", "none", "--gptq-refine-sweeps", "0", "--no-gptq-asymmetric") == (GPTQ(),)
    assert label(GPTQ(act_order=True, scale_search=(0.9,), refine_sweeps=4, asymmetric=True)) == (
        "gptq-act-clip-cd4-asym")
    assert algorithm("--algorithm", "gptq", "--gptq-scale-search", "0.9,0.8")[0].scale_search == (0.9, 0.8)
    assert algorithm("--algorithm", "gptq", "--gptq-act-order")[0].act_order
    for extra, words in ((("--gptq-damp", "0.1"), "--gptq-damp applies to --algorithm gptq"),
                         (("--algorithm", "rtn", "--gptq-act-order", "--gptq-damp", "0.1"),
                          "--gptq-act-order, --gptq-damp apply to --algorithm gptq"),
                         (("--algorithm", "gptq", "--gptq-damp", "0"), "--gptq-damp must be a positive"),
                         (("--algorithm", "gptq", "--gptq-scale-search", "x"), "not 'none' or comma-separated"),
                         (("--algorithm", "gptq", "--gptq-scale-search", "1.2"), r"--gptq-scale-search: .*\(0, 1\]")):
        with pytest.raises(ValueError, match=words):
            algorithm(*extra)


def _adversarial_weight(k: int = 256) -> torch.Tensor:
    """Gaussian rows with the groups that make fits differ: a zero group, ties at the largest value, huge and
    tiny groups."""
    w = _weight(seed=3, out=24, k=k)
    w[0, :64] = 0.0
    w[1, :128] = 0.01
    w[2, 64:128] = torch.tensor([-0.5, 0.5]).repeat(32)
    w[3, 128:] *= 1e4
    w[4] *= 1e-6
    return w


@pytest.mark.parametrize("factors", [(), FACTORS], ids=["plain", "searched"])
@pytest.mark.parametrize(("fmt", "opts"), CASES, ids=IDS)
def test_fit_groups_is_one_fit_per_group(fmt, opts, factors, monkeypatch):
    """Fitting many groups in one call (act-order's static groups) gives each group the bits of its own fit,
    also when the groups are split over several calls."""
    from lowbit.algorithms import grids

    w = _adversarial_weight()
    grid = grid_for(w, fmt, scale_search=factors, **opts)
    G = grid.group
    one_by_one = [grid.fit(w[:, g * G:(g + 1) * G]) for g in range(w.shape[1] // G)]
    for limit in (grids.FIT_ELEMENTS, 3 * w.shape[0] * G, 1):
        monkeypatch.setattr(grids, "FIT_ELEMENTS", limit)
        together = grid.fit_groups(w)
        assert len(together) == len(one_by_one)
        for a, b in zip(together, one_by_one, strict=True):
            assert len(a) == len(b)
            for x, y in zip(a, b, strict=True):
                assert x.dtype == y.dtype and x.shape == y.shape
                bits = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[x.dtype.itemsize]
                assert torch.equal(x.view(bits), y.view(bits))
