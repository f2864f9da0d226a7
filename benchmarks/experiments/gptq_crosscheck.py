"""Cross-check of lowbit's GPTQ on int4 (the grid of ``w4a16-int4``) against llm-compressor's GPTQ, layer by
layer, on the bundled model with the 64 calibration sentences.

Both GPTQ implementations get the SAME Hessian for every Linear: lowbit's ``HessianAccumulator`` over the
inputs recorded from the float model on the calibration sentences (non-sequential calibration: every
layer's Hessian comes from the float model, none from already quantized layers), so the comparison isolates
the per-layer algorithm. lowbit runs ``gptq_quantize(weight, H, "int4_awq", group_size=g)`` (``g`` as
``w4a16-int4`` picks it per layer); llm-compressor runs its per-layer ``quantize_weight`` with the
``W4A16_ASYM`` preset's weight arguments (4-bit asymmetric int, group 128), act-order off, and the scales and
zero points of its default weight observer (``memoryless_minmax``) on the original weight, as its
``GPTQModifier`` computes them. Both use lazy blocks of 128 columns; the dampening fraction is the same
for both in each run (``--damp``).

For each Linear it prints the relative output error ``||X W^T - X Q^T||_F / ||X W^T||_F`` on the recorded
calibration inputs (every row that went into the Hessian, padding positions included, as lowbit's
calibration records them) and on held-out inputs (the real, non-padding tokens of the 330 evaluation
sentences, recorded from the float model), for round-to-nearest (lowbit's ``int4_awq``), lowbit GPTQ and
llm-compressor GPTQ; then the whole-model embedding cosine against the float model with every Linear's
weight replaced by the fp32 values each method chose (activations stay fp32). The errors are computed in
float64 from the inputs' Gram matrices: ``||X D^T||_F^2 = sum((D X^T X) * D)``.

``--diag`` adds llm-compressor's ``quantize_weight`` run with lowbit's round-to-nearest scales and zero
points (AutoAWQ's formulas, fp16), fixed before the loop as llm-compressor fixes its own: same algorithm,
lowbit's grid, to tell the effect of the grid from the effect of refitting scales during the loop; and a
plain GPTQ loop written here (one rank-1 update per column) on lowbit's grid, with scales refitted at each
group's first column or fixed from the original weight. ``--act-order`` runs both implementations with
act-order instead (llm-compressor's default): columns by decreasing ``diag(H)``, static groups in both.

llm-compressor is a benchmark tool here, not a lowbit dependency: install it next to lowbit with
``pip install --no-deps llmcompressor`` (plus, with ``--no-deps`` too, compressed-tensors and loguru where
missing; lowbit's ``interop`` extra already pins compressed-tensors). Its top-level package imports the whole
oneshot stack, datasets and accelerate included; this script imports only the per-layer GPTQ function and the
observer, from their modules, without running ``llmcompressor/__init__.py``.

Run from the repository root: ``PYTHONPATH=src python benchmarks/experiments/gptq_crosscheck.py``.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import math
import pathlib
import sys
import time
import types
import warnings

import torch

import lowbit
from lowbit.algorithms.gptq import GPTQ, HessianAccumulator, gptq_quantize
from lowbit.eval import SentenceEncoder, bundled_model_dir, load_sentences
from lowbit.eval.metrics import cosine_stats
from lowbit.nn.quantize import linear_layers, recording_inputs
from lowbit.nn.schemes import get_scheme

SCHEME = "w4a16-int4"


def llmcompressor_gptq(act_order: bool = False):
    """(``quantize_weight``, the memoryless min-max weight observer class, the W4A16_ASYM weight args with
    act-order off, or ``"weight"`` with ``act_order``), imported from their modules without
    ``llmcompressor/__init__.py``."""
    spec = importlib.util.find_spec("llmcompressor")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("llmcompressor is not installed (pip install --no-deps llmcompressor ...)")
    root = pathlib.Path(list(spec.submodule_search_locations)[0])
    for name, sub in (("llmcompressor", ""), ("llmcompressor.modifiers", "modifiers"),
                      ("llmcompressor.modifiers.gptq", "modifiers/gptq"),
                      ("llmcompressor.observers", "observers")):
        if name not in sys.modules:
            pkg = types.ModuleType(name)
            pkg.__path__ = [str(root / sub)]
            sys.modules[name] = pkg
    from compressed_tensors.quantization.quant_scheme import W4A16_ASYM
    from llmcompressor.modifiers.gptq.gptq_quantize import quantize_weight
    from llmcompressor.observers.min_max import MemorylessMinMaxObserver

    args = W4A16_ASYM["weights"].model_copy(update={"actorder": "weight" if act_order else None})
    return quantize_weight, MemorylessMinMaxObserver, args


class Gram:
    """float64 ``X^T X`` and row count of every input given to :meth:`add`."""

    def __init__(self, k: int) -> None:
        self.G = torch.zeros(k, k, dtype=torch.float64)
        self.n = 0

    def add(self, x: torch.Tensor) -> None:
        x = x.detach().reshape(-1, x.shape[-1]).double()
        self.G.addmm_(x.t(), x)
        self.n += x.shape[0]


def rel_error(W: torch.Tensor, Q: torch.Tensor, G: torch.Tensor) -> float:
    """``||X (W - Q)^T||_F / ||X W^T||_F`` from ``G = X^T X``."""
    W, D = W.double(), (W.double() - Q.double())
    return math.sqrt(float(((D @ G) * D).sum()) / float(((W @ G) * W).sum()))


def record(model, layers, batches, hessians: dict | None, grams: dict, real_tokens_only: bool) -> None:
    """Runs ``model`` over ``batches`` and adds each layer's inputs to ``hessians`` (lowbit's accumulators,
    every row) and ``grams`` (every row, or the non-padding tokens with ``real_tokens_only``)."""
    mask: dict[str, torch.Tensor] = {}

    def add(name: str, x: torch.Tensor) -> None:
        if hessians is not None:
            hessians[name].add(x)
        m = mask["m"]
        if real_tokens_only and x.dim() == 3 and tuple(x.shape[:2]) == tuple(m.shape):
            x = x[m]
        grams[name].add(x)

    with torch.inference_mode(), recording_inputs(layers, add):
        for _, enc in batches:
            mask["m"] = enc["attention_mask"].bool()
            model(**enc)


def llmc_quantize(quantize_weight, args, W, H, scale, zero_point, damp):
    Q, _, fallback = quantize_weight(W.clone()[None], H.clone()[None], scale[None], zero_point[None], None,
                                     args, blocksize=128, percdamp=damp)
    if bool(fallback[0]):
        raise RuntimeError("llm-compressor fell back to round-to-nearest (H not positive definite)")
    return Q[0].float()


def lowbit_static_qparams(W: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """lowbit's round-to-nearest int4_awq scales and zero points of ``W`` ([out, groups], fp32 scales, int8
    zero points shifted to compressed-tensors' [-8, 7] codes)."""
    from lowbit.algorithms.grids import grid_for

    grid = grid_for(W, "int4_awq", group_size=group)
    states = [grid.fit(W[:, g * group:(g + 1) * group].float()) for g in range(W.shape[1] // group)]
    scale = torch.stack([s for s, _ in states], dim=1).float()
    zero = torch.stack([z for _, z in states], dim=1).float() - 8
    return scale, zero.to(torch.int8)


def plain_gptq(W: torch.Tensor, H: torch.Tensor, g: int, damp: float, refit: bool) -> tuple[torch.Tensor, dict]:
    """A plain GPTQ loop (one rank-1 update per column, no lazy blocks) on lowbit's int4_awq grid: group
    scales refitted from the updated weights at each group's first column (``refit``, as lowbit does) or
    fitted once from the original weight (as llm-compressor does). Returns the chosen fp32 weights and
    (refit) the mean and max over groups 2.. of the refitted scale over the original one, (static) the
    fraction of values that fell outside the group's grid and were clamped."""
    from lowbit.algorithms.grids import grid_for

    grid = grid_for(W, "int4_awq", group_size=g)
    W = W.detach().float().clone()
    rows, cols = W.shape
    Hd = H.float().clone()
    Hd.diagonal().add_(damp * Hd.diagonal().mean())
    U = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(Hd)), upper=True)
    static = [grid.fit(W[:, i * g:(i + 1) * g]) for i in range(cols // g)]
    states = list(static)
    Q = torch.zeros_like(W)
    clamped = 0
    for j in range(cols):
        if refit and j % g == 0:
            states[j // g] = grid.fit(W[:, j:j + g])
        s, z = states[j // g]
        w = W[:, j]
        if not refit:
            raw = torch.round(w.to(torch.float16) / s) + z
            clamped += int(((raw < 0) | (raw > 15)).sum())
        _, q = grid.round(w, states[j // g])
        Q[:, j] = q
        W[:, j:].addr_((w - q) / U[j, j], U[j, j:], alpha=-1)
    info: dict = {}
    if refit and cols > g:
        r = torch.cat([(states[i][0].float() / static[i][0].float()) for i in range(1, cols // g)])
        info = {"scale_growth_mean": float(r.mean()), "scale_growth_max": float(r.max())}
    if not refit:
        info = {"clamped": clamped / W.numel()}
    return Q, info


def embed_with(enc, weights: dict[str, torch.Tensor], batches) -> torch.Tensor:
    model = enc.load_fp32()
    lin = linear_layers(model)
    with torch.no_grad():
        for n, Q in weights.items():
            lin[n].weight.copy_(Q)
    return enc.embed(model, batches)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--damp", type=float, nargs="+", default=[0.1, 0.01],
                   help="dampening fractions, each run for both implementations (default 0.1 0.01)")
    p.add_argument("--calib", type=int, default=64, help="calibration sentences (default 64)")
    p.add_argument("--diag", action="store_true",
                   help="also run llm-compressor's loop with lowbit's round-to-nearest scales")
    p.add_argument("--act-order", action="store_true",
                   help="both with act-order (lowbit GPTQ(act_order=True), llm-compressor actorder='weight', "
                        "its default): columns by decreasing diag(H), static groups")
    p.add_argument("--no-cosine", action="store_true", help="skip the whole-model embedding cosines")
    p.add_argument("--json", type=pathlib.Path, help="write every number here")
    a = p.parse_args()
    warnings.filterwarnings("ignore")
    torch.manual_seed(0)

    if a.diag and a.act_order:
        p.error("--diag compares loops in column order: run it without --act-order")
    quantize_weight, Observer, qargs = llmcompressor_gptq(a.act_order)
    versions = {k: importlib.metadata.version(k) for k in ("llmcompressor", "compressed-tensors", "torch")}
    print(f"versions: {versions}; torch threads {torch.get_num_threads()}; act-order {a.act_order}")

    enc = SentenceEncoder(bundled_model_dir())
    sents = load_sentences()
    calib = enc.batches(sents.calibration_sentences(a.calib))
    evalb = enc.batches(sents.sentences)
    model = enc.load_fp32()
    scheme = get_scheme(SCHEME)
    layers = {n: m for n, m in linear_layers(model).items()
              if scheme.unsupported(m.out_features, m.in_features) is None}
    hess = {n: HessianAccumulator(m.in_features) for n, m in layers.items()}
    gcal = {n: Gram(m.in_features) for n, m in layers.items()}
    geval = {n: Gram(m.in_features) for n, m in layers.items()}
    record(model, layers, calib, hess, gcal, real_tokens_only=False)
    record(model, layers, evalb, None, geval, real_tokens_only=True)
    real = sum(int(e["attention_mask"].sum()) for _, e in calib)
    print(f"{len(layers)} Linear layers; calibration rows (the Hessian's) per token layer: "
          f"{gcal[next(iter(layers))].n} ({real} real tokens), evaluation rows: {geval[next(iter(layers))].n}")

    rows: list[dict] = []
    qw: dict[str, dict[str, torch.Tensor]] = {}
    times: dict[str, float] = {}

    def put(method: str, name: str, Q: torch.Tensor) -> None:
        qw.setdefault(method, {})[name] = Q

    for n, lin in layers.items():
        W = lin.weight.detach().float()
        g = scheme.group_size(lin.in_features)
        assert g == qargs.group_size, f"{n}: lowbit uses group {g}, llm-compressor's args {qargs.group_size}"
        H = hess[n].H
        row = {"layer": n, "shape": list(W.shape), "group": g}
        Qr = lowbit.dequantize(lowbit.quantize(W, "int4_awq", group_size=g), torch.float32)
        put("rtn", n, Qr)
        obs = Observer("weight", qargs.model_copy())
        obs(W)
        qp = obs.get_qparams()
        static = lowbit_static_qparams(W, g) if a.diag else None
        for d in a.damp:
            t0 = time.perf_counter()
            _, Ql = gptq_quantize(W, H, "int4_awq", config=GPTQ(damp=d, block_size=128, act_order=a.act_order), group_size=g)
            t1 = time.perf_counter()
            Qc = llmc_quantize(quantize_weight, qargs, W, H, qp["scale"], qp["zero_point"], d)
            t2 = time.perf_counter()
            times[f"lowbit@{d:g}"] = times.get(f"lowbit@{d:g}", 0.0) + t1 - t0
            times[f"llmc@{d:g}"] = times.get(f"llmc@{d:g}", 0.0) + t2 - t1
            put(f"lowbit@{d:g}", n, Ql)
            put(f"llmc@{d:g}", n, Qc)
            if static is not None:
                put(f"llmc-awqscales@{d:g}", n, llmc_quantize(quantize_weight, qargs, W, H, *static, d))
                Qp, info_r = plain_gptq(W, H, g, d, refit=True)
                put(f"loop-refit@{d:g}", n, Qp)
                Qp, info_s = plain_gptq(W, H, g, d, refit=False)
                put(f"loop-static@{d:g}", n, Qp)
                row[f"loop@{d:g}"] = {**info_r, **info_s}
        for method, by_layer in qw.items():
            row[method] = {"cal": rel_error(W, by_layer[n], gcal[n].G), "eval": rel_error(W, by_layer[n], geval[n].G)}
        rows.append(row)

    methods = list(qw)
    cos = {}
    if not a.no_cosine:
        ref = enc.embed(enc.load_fp32(), evalb)
        for method in methods:
            cos[method] = cosine_stats(ref, embed_with(enc, qw[method], evalb))

    # ------------------------------------------------------------------ report
    short = {n: n.replace("encoder.layer.", "L").replace("attention.self.", "").replace("attention.output.", "ao.")
             for n in layers}
    for d in a.damp:
        lb, lc = f"lowbit@{d:g}", f"llmc@{d:g}"
        print(f"\n### damp {d:g} (both)\n")
        hdr = ["layer", "[out, in]", "g", "rtn cal", "lowbit cal", "llmc cal", "ratio cal",
               "rtn eval", "lowbit eval", "llmc eval", "ratio eval"]
        print("| " + " | ".join(hdr) + " |")
        print("|" + "---|" * len(hdr))
        for r in rows:
            cells = [short[r["layer"]], f"{r['shape'][0]}x{r['shape'][1]}", str(r["group"]),
                     f"{r['rtn']['cal']:.4f}", f"{r[lb]['cal']:.4f}", f"{r[lc]['cal']:.4f}",
                     f"{r[lb]['cal'] / r[lc]['cal']:.3f}",
                     f"{r['rtn']['eval']:.4f}", f"{r[lb]['eval']:.4f}", f"{r[lc]['eval']:.4f}",
                     f"{r[lb]['eval'] / r[lc]['eval']:.3f}"]
            print("| " + " | ".join(cells) + " |")
        for split in ("cal", "eval"):
            ratios = [r[lb][split] / r[lc][split] for r in rows]
            wins = sum(x <= 1 for x in ratios)
            worst = max(range(len(rows)), key=lambda i: ratios[i])
            gm = math.exp(sum(math.log(x) for x in ratios) / len(ratios))
            print(f"{split}: lowbit <= llmc on {wins}/{len(rows)} layers; lowbit/llmc ratio geomean {gm:.3f}, "
                  f"min {min(ratios):.3f}, max {ratios[worst]:.3f} ({short[rows[worst]['layer']]})")
    for d in a.damp:
        if f"loop-refit@{d:g}" not in methods:
            continue
        print(f"\n### damp {d:g}: where the difference comes from (calibration rows / held-out rows)\n")
        cols = [f"lowbit@{d:g}", f"loop-refit@{d:g}", f"llmc@{d:g}", f"llmc-awqscales@{d:g}",
                f"loop-static@{d:g}"]
        print("| layer | lowbit | plain loop, refit | llmc | llmc, lowbit's RTN scales | plain loop, static "
              "| refit scale / static (mean, max) | clamped (static) |")
        print("|---|---|---|---|---|---|---|---|")
        for r in rows:
            info = r[f"loop@{d:g}"]
            growth = (f"{info['scale_growth_mean']:.3f}, {info['scale_growth_max']:.2f}"
                      if "scale_growth_mean" in info else "-")
            print(f"| {short[r['layer']]} | " + " | ".join(f"{r[c]['cal']:.4f} / {r[c]['eval']:.4f}" for c in cols)
                  + f" | {growth} | {100 * info['clamped']:.3f} % |")
    if cos:
        print("\n| method | cos mean | cos min |\n|---|---|---|")
        for method, c in cos.items():
            print(f"| {method} | {c['mean']:.4f} | {c['min']:.4f} |")
    print(f"\nGPTQ seconds over all layers: { {k: round(v, 1) for k, v in times.items()} }")
    if a.json:
        a.json.write_text(json.dumps({"versions": versions, "damp": a.damp, "act_order": a.act_order, "layers": rows, "cosine": cos,
                                      "seconds": times}, indent=1))


if __name__ == "__main__":
    main()
