"""GPTQ's asymmetric objective (``GPTQ(asymmetric=True)``): each layer fitted to the float model's output on the
float model's inputs. The cross statistics, the least-squares target, the layer-level gain, the model driver
(a float copy run on the same batches) and the errors."""

from __future__ import annotations

import argparse

import pytest
import torch
from torch import nn

import lowbit
from lowbit.algorithms import GPTQ, gptq_quantize
from lowbit.algorithms.gptq import CrossAccumulator, HessianAccumulator, _asymmetric_target
from lowbit.nn import QuantLinear

CASES = [
    ("nvfp4", {"convention": "vllm"}),
    ("mxfp4", {"scale_rounding": "rceil"}),
    ("fp4_b32", {}),
    ("nf4", {"blocksize": 64, "double_quant": False}),
    ("bnb_fp4", {"blocksize": 64, "double_quant": False}),
    ("int4_awq", {"group_size": 32}),
]


def _drifted(seed: int, out: int = 32, k: int = 128, n: int = 512):
    """A layer's weight, its float inputs and the inputs a quantized model upstream would give it (the float
    ones plus a correlated drift of about 15 %)."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(out, k, generator=g) * 0.05
    mix = torch.randn(k, k, generator=g) * 0.2
    xf = torch.randn(n, k, generator=g) @ mix + torch.randn(n, k, generator=g)
    xf[:, :4] *= 8
    drift = (torch.randn(n, k, generator=g) @ (torch.randn(k, k, generator=g) * 0.05)) * xf.std(0)
    return w, xf, xf + drift


def test_cross_accumulator_matches_direct_sums():
    _, xf, xq = _drifted(0, k=64, n=300)
    acc = CrossAccumulator(64)
    acc.add_pair(xq[:100], xf[:100])
    acc.add_pair(xq[100:].reshape(2, -1, 64), xf[100:].reshape(2, -1, 64))
    acc.add_pair(xq[:0], xf[:0])  # an empty batch changes nothing
    ref = HessianAccumulator(64)
    ref.add(xq)
    assert acc.n == 300
    torch.testing.assert_close(acc.H, ref.H, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(acc.C, 2 * xf.t() @ xq / 300, rtol=1e-4, atol=1e-4)


def test_target_is_the_ridge_least_squares_solution():
    w, xf, xq = _drifted(1, k=64)
    n = xq.shape[0]
    H, C = 2 * xq.t() @ xq / n, 2 * xf.t() @ xq / n
    damp = 0.01
    t = _asymmetric_target(w, H, C, damp)
    d = damp * torch.diag(H).mean() * torch.eye(64)
    torch.testing.assert_close(t @ (H + d), w @ (C + d), rtol=1e-4, atol=1e-4)
    # without drift (C == H) the target is the weight itself, whatever the dampening (the ridge pulls towards W)
    for damp in (1e-6, 0.1, 1.0):
        torch.testing.assert_close(_asymmetric_target(w, H, H, damp), w, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize(("fmt", "opts"), CASES, ids=[c[0] for c in CASES])
def test_asymmetric_fits_the_float_output_better(fmt, opts):
    w, xf, xq = _drifted(2)
    acc = CrossAccumulator(w.shape[1])
    acc.add_pair(xq, xf)
    target = xf @ w.t()
    errs = {}
    for asym in (False, True):
        q, values = gptq_quantize(w, acc.H, fmt, config=GPTQ(damp=0.01, asymmetric=asym),
                                  C=acc.C if asym else None, **opts)
        torch.testing.assert_close(lowbit.dequantize(q, torch.float32, backend="torch"), values, rtol=0, atol=0)
        errs[asym] = ((xq @ values.t() - target) ** 2).mean().item()
    assert errs[True] < 0.8 * errs[False], errs


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 64), nn.GELU(), nn.Linear(64, 64))


def _error(model, q, batches):
    with torch.no_grad():
        return sum(((q(x) - model(x)) ** 2).sum().item() for x in batches)


def test_quantize_model_asymmetric_runs_and_lowers_the_model_error():
    g = torch.Generator().manual_seed(3)
    # 1024 calibration rows for layers of 64 and 128 inputs: enough that the fit is not to the rows' noise
    calib = [torch.randn(64, 64, generator=g) for _ in range(16)]
    held = [torch.randn(64, 64, generator=g) for _ in range(4)]
    ref = _model()
    errs = {}
    for asym in (False, True):
        q = _model()
        lowbit.quantize_model(q, "w4a16-int4", skip=(), calibration=calib,
                              algorithm=GPTQ(damp=0.01, asymmetric=asym))
        assert all(isinstance(m, QuantLinear) for m in (q[0], q[2], q[4]))
        errs[asym] = _error(ref, q, held)
    # the end-to-end error falls on held-out inputs (the later layers absorb the earlier ones' rounding)
    assert errs[True] < errs[False], errs


def test_asymmetric_needs_sequential_and_matching_calls():
    with pytest.raises(ValueError, match="sequential"):
        GPTQ(asymmetric=True, sequential=False)
    with pytest.raises(TypeError, match="asymmetric"):
        GPTQ(asymmetric=1)
    acc = CrossAccumulator(8)
    with pytest.raises(ValueError, match="x_float"):
        acc.add_pair(torch.randn(4, 8), torch.randn(3, 8))
    m = _model()
    calls = {"n": 0}

    def calibration(model):
        # runs whatever model it is given, a batch more on every call: the float copy (run first for each
        # stage) and the quantized model see different numbers of batches
        calls["n"] += 1
        for _ in range(calls["n"]):
            model(torch.randn(8, 64))

    with pytest.raises(ValueError, match="same batches"):
        lowbit.quantize_model(m, "w4a16-int4", skip=(), calibration=calibration, algorithm=GPTQ(asymmetric=True))


def test_cli_flag():
    from lowbit.cli.algorithm_flags import algorithm_from_args, gptq_options

    def ns(**kw):
        base = {"algorithm": "gptq", "smooth_alpha": None, "smooth_online": False, "rotate_block": None,
                "gptq_act_order": None, "gptq_damp": None, "gptq_scale_search": None, "gptq_refine_sweeps": None,
                "gptq_asymmetric": None}
        return argparse.Namespace(**{**base, **kw})

    assert gptq_options(ns(gptq_asymmetric=True))["asymmetric"] is True
    (cfg,) = algorithm_from_args(ns(gptq_asymmetric=True))
    assert cfg.asymmetric
    with pytest.raises(ValueError, match="--gptq-asymmetric"):
        algorithm_from_args(ns(algorithm="rtn", gptq_asymmetric=True))
    from lowbit.cli import build_parser

    args = build_parser().parse_args(["quantize", "--scheme", "w4a16-int4", "--algorithm", "gptq", "--gptq-asymmetric"])
    assert args.gptq_asymmetric is True


class _Block(nn.Module):
    """q/k/v reading one input, an output layer reading their combination: one stage (``blocks.0``)."""

    def __init__(self) -> None:
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(64, 64) for _ in range(4))

    def forward(self, x):
        return x + self.o(torch.tanh(self.q(x)) * torch.sigmoid(self.k(x)) + self.v(x))


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(5)
        self.blocks = nn.ModuleList([_Block(), _Block()])

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x


def test_stage_layers_are_grouped_by_input_in_call_order():
    from lowbit.algorithms.gptq import _float_inputs

    net = _Net()
    calib = [torch.randn(32, 64) for _ in range(3)]
    mods = dict(net.named_modules())
    stage = ["blocks.0.o", "blocks.0.q", "blocks.0.k", "blocks.0.v"]  # o listed first: the call order decides
    kept, groups = _float_inputs(stage, mods, net, lambda m: [m(x) for x in calib])
    assert groups == [["blocks.0.q", "blocks.0.k", "blocks.0.v"], ["blocks.0.o"]]
    assert all(len(kept[n]) == 3 for n in stage)


def test_later_layers_of_a_stage_see_the_quantized_earlier_ones(monkeypatch):
    import lowbit.algorithms.gptq as G

    seen = []
    real = G._paired_statistics

    def spy(group, targets, kept, run_calibration):
        # when a group is calibrated, which of the stage's layers are quantized already
        seen.append((tuple(group), tuple(sorted(n for n in ("blocks.0.q", "blocks.0.k", "blocks.0.v", "blocks.0.o")
                                                if not isinstance(targets[n], nn.Linear) or
                                                isinstance(dict(net.named_modules())[n], QuantLinear)))))
        return real(group, targets, kept, run_calibration)

    monkeypatch.setattr(G, "_paired_statistics", spy)
    net = _Net()
    calib = [torch.randn(32, 64) for _ in range(8)]
    lowbit.quantize_model(net, "w4a16-int4", skip=(), calibration=calib, algorithm=GPTQ(asymmetric=True))
    assert seen[:2] == [(("blocks.0.q", "blocks.0.k", "blocks.0.v"), ()),
                        (("blocks.0.o",), ("blocks.0.k", "blocks.0.q", "blocks.0.v"))]
    assert len(seen) == 4 and all(isinstance(m, QuantLinear) for m in (net.blocks[1].q, net.blocks[1].o))


def test_asymmetric_damp_is_checked():
    with pytest.raises(ValueError, match="asymmetric_damp"):
        GPTQ(asymmetric=True, asymmetric_damp=0.0)
    with pytest.raises(TypeError, match="asymmetric_damp"):
        GPTQ(asymmetric_damp="1")


class _Wide(nn.Module):
    """q/k/v of 128 rows (nvfp4 and mxfp4 stack rows in tiles of 128) on one input, or on copies of it; named
    as Llama's, so that nvfp4 gives them one global scale."""

    def __init__(self, copied: bool) -> None:
        super().__init__()
        self.copied = copied
        self.q_proj, self.k_proj, self.v_proj = (nn.Linear(64, 128) for _ in range(3))
        self.o_proj = nn.Linear(128, 64)

    def forward(self, x):
        xs = [x.clone() for _ in range(3)] if self.copied else [x] * 3
        h = torch.tanh(self.q_proj(xs[0])) * torch.sigmoid(self.k_proj(xs[1])) + self.v_proj(xs[2])
        return x + self.o_proj(h)


@pytest.mark.parametrize("scheme", ["w4a16-int4", "w4a16-nvfp4", "w4a16-mxfp4", "w4a16-nf4"])
def test_siblings_on_one_input_share_statistics_and_one_column_loop(monkeypatch, scheme):
    # q/k/v on one tensor: one accumulator for the three (H and C computed once) and one GPTQ run over their
    # stacked rows (the nf4 scheme has no double quantization), with the bits of separate runs on equal copies of
    # the input (rows are independent in GPTQ; on this CPU the stacked block updates round as the separate ones do)
    import lowbit.algorithms.gptq as G

    made, runs = [], []
    real_acc, real_gptq = G.CrossAccumulator, G.gptq_quantize

    class Counting(real_acc):
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            made.append(self)

    def counting_gptq(weight, *a, **kw):
        runs.append(weight.shape[0])
        return real_gptq(weight, *a, **kw)

    monkeypatch.setattr(G, "CrossAccumulator", Counting)
    monkeypatch.setattr(G, "gptq_quantize", counting_gptq)
    calib = [torch.randn(32, 64, generator=torch.Generator().manual_seed(i)) for i in range(6)]
    nets = []
    for copied in (False, True):
        torch.manual_seed(7)
        net = nn.Sequential(_Wide(copied), _Wide(copied))
        made.clear()
        runs.clear()
        lowbit.quantize_model(net, scheme, skip=(), calibration=calib, algorithm=GPTQ(asymmetric=True))
        # per block: q/k/v, then o; copied inputs: q, k, v and o each
        assert len(made) == (8 if copied else 4), (copied, len(made))
        assert sorted(runs) == sorted([128, 128, 128, 64] * 2 if copied else [384, 64] * 2), runs
        nets.append(net)
    for a, b in zip(nets[0].modules(), nets[1].modules()):
        if isinstance(a, QuantLinear):
            qa, qb = a.weight_qtensor, b.weight_qtensor
            assert qa.shape == qb.shape and qa.fmt == qb.fmt
            for name in ("data", "scale", "global_scale", "zero", "nested_scale", "nested_offset"):
                ta, tb = getattr(qa, name, None), getattr(qb, name, None)
                assert (ta is None) == (tb is None), name
                if ta is not None:
                    assert torch.equal(ta, tb), (scheme, name)


@pytest.mark.parametrize(("fmt", "opts"), [("nf4", {"blocksize": 64}), ("nf4", {"double_quant": True}),
                                           ("nvfp4", {}), ("int4_awq", {"group_size": 32})],
                         ids=["nf4-default-dq", "nf4-dq", "nvfp4-own-global-scale", "int4-options-differ"])
def test_siblings_are_not_stacked_where_the_stack_would_quantize_differently(fmt, opts):
    from lowbit.algorithms.gptq import CrossAccumulator, _gptq_stacked_siblings

    lins = {n: nn.Linear(64, 128) for n in ("q", "k")}
    acc = CrossAccumulator(64)
    acc.add_pair(torch.randn(16, 64), torch.randn(16, 64))
    shared = {"q": acc, "k": acc}

    def options(name, lin):
        if fmt == "int4_awq" and name == "k":
            return fmt, {"group_size": 64}
        return fmt, opts

    assert _gptq_stacked_siblings(["q", "k"], shared, lins, options, GPTQ(asymmetric=True)) == {}
    if fmt == "int4_awq":  # the same options do stack
        got = _gptq_stacked_siblings(["q", "k"], shared, lins, lambda n, lin: (fmt, opts), GPTQ(asymmetric=True))
        assert sorted(got) == ["k", "q"] and got["q"].shape == (128, 64)
