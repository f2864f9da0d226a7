"""Cross-check of lowbit's GPTQ on int4 (the grid of ``w4a16-int4``) against llm-compressor's GPTQ, layer by
layer, on the bundled model with the first ``--calib`` sentences of its calibration set (64 by default).

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

``--shipped`` compares each tool as a user gets it instead of with the same settings: lowbit with
``GPTQ(**GPTQ_DEFAULTS)`` (what ``lowbit quantize --algorithm gptq`` runs: act-order, damp 0.01, the
per-group clipping search over the factors 0.95-0.8, 4 coordinate-descent refinement sweeps) against llm-compressor's ``GPTQModifier`` defaults
for the ``W4A16_ASYM`` preset, read from its installed source (:func:`llmcompressor_defaults`): its
``actorder`` sentinel (``"static"``, an alias of ``"weight"``), its ``dampening_frac`` (0.01), block 128
and the weight observer its calibration falls back to (``memoryless_minmax``). ``--llmc-observer`` adds
llm-compressor runs with other weight observers on the same defaults: ``mse`` (which its calibration turns
into ``memoryless_mse`` for weights: a shrink search over 1.00, 0.99, ... 0.81 of each group's range, per
row, minimizing the 2.4-norm of the rounding error, the like-for-like of lowbit's scale search) and
``imatrix_mse`` (its own defaults: shrink factors 1.00 down to 0.05 in steps of 0.05, 3-norm, the error
weighted by each input's mean square, fed here from the calibration rows' Gram diagonal as its forward
hook would accumulate it). The calibration sentences are batched
without padding by default in this mode (``--batching same-length``), as ``lowbit quantize`` does, so the
Hessian both get holds only real tokens. Both still get the same Hessian from the float model for every
layer (non-sequential), so each row compares the shipped per-layer algorithms on one problem; neither
tool's own calibration pipeline (lowbit's stage-by-stage, llm-compressor's sequential one) is run.
``--lowbit-damp``, ``--lowbit-scale-search``, ``--lowbit-refine-sweeps`` and ``--lowbit-refine-damp`` change
lowbit's side away from its defaults, to tell which setting a difference comes from.

llm-compressor is a benchmark tool here, not a lowbit dependency: install it next to lowbit with
``pip install --no-deps llmcompressor`` (plus, with ``--no-deps`` too, compressed-tensors and loguru where
missing; lowbit's ``interop`` extra already pins compressed-tensors). Its top-level package imports the whole
oneshot stack, datasets and accelerate included; this script imports only the per-layer GPTQ function and the
observer, from their modules, without running ``llmcompressor/__init__.py``.

Run from the repository root: ``PYTHONPATH=src python benchmarks/experiments/gptq_crosscheck.py``
(``--shipped --calib 379 --llmc-observer memoryless_minmax mse imatrix_mse`` for the shipped comparison).
"""

from __future__ import annotations

import argparse
import ast
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


def llmcompressor_root() -> pathlib.Path:
    spec = importlib.util.find_spec("llmcompressor")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("llmcompressor is not installed (pip install --no-deps llmcompressor ...)")
    return pathlib.Path(list(spec.submodule_search_locations)[0])


def llmcompressor_gptq(act_order: bool | str = False):
    """(``quantize_weight``, llm-compressor's observer registry, the W4A16_ASYM weight args with act-order
    off, ``"weight"`` with ``act_order=True``, or the given ``actorder`` string), imported from their
    modules without ``llmcompressor/__init__.py``."""
    root = llmcompressor_root()
    # Empty package stubs: each real __init__ imports the oneshot stack (datasets, accelerate, the recipe
    # machinery), which the per-layer function and the observers do not need.
    for name, sub in (("llmcompressor", ""), ("llmcompressor.modifiers", "modifiers"),
                      ("llmcompressor.modifiers.gptq", "modifiers/gptq"),
                      ("llmcompressor.modifiers.utils", "modifiers/utils"),
                      ("llmcompressor.utils", "utils"),
                      ("llmcompressor.observers", "observers")):
        if name not in sys.modules:
            pkg = types.ModuleType(name)
            pkg.__path__ = [str(root / sub)]
            sys.modules[name] = pkg
    from compressed_tensors.quantization import QuantizationArgs
    from compressed_tensors.quantization.quant_scheme import W4A16_ASYM
    from llmcompressor.modifiers.gptq.gptq_quantize import quantize_weight
    from llmcompressor.observers.base import Observer
    # Importing the modules registers their observers.
    import llmcompressor.observers.imatrix  # noqa: F401
    import llmcompressor.observers.min_max  # noqa: F401
    import llmcompressor.observers.mse  # noqa: F401

    actorder = act_order if isinstance(act_order, str) else ("weight" if act_order else None)
    # Validated, not model_copy(update=...): the alias "static" is then checked like a user's value.
    args = QuantizationArgs.model_validate({**W4A16_ASYM["weights"].model_dump(), "actorder": actorder})
    return quantize_weight, Observer, args


def llmcompressor_defaults() -> dict:
    """What ``GPTQModifier(scheme="W4A16_ASYM")`` uses when the user sets nothing, read from the installed
    source (``GPTQModifier`` needs the whole oneshot stack to import): the class's field defaults
    (``dampening_frac``, ``block_size``, the ``actorder`` sentinel, which ``resolve_quantization_config``
    turns into that ordering when the scheme sets none, as W4A16_ASYM does not) and the weight observer
    that ``initialize_observer`` falls back to. Raises if the source no longer has the expected shape, so a
    new version is not compared under an old version's defaults."""
    root = llmcompressor_root()
    src = (root / "modifiers/gptq/base.py").read_text()
    cls = next(n for n in ast.walk(ast.parse(src)) if isinstance(n, ast.ClassDef) and n.name == "GPTQModifier")
    fields = {n.target.id: n.value for n in cls.body
              if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name) and n.value is not None}
    act = fields["actorder"]
    if not (isinstance(act, ast.Call) and getattr(act.func, "id", "") == "Sentinel"):
        raise RuntimeError(f"GPTQModifier.actorder default is {ast.unparse(act)}, not a Sentinel(...)")
    calib = (root / "modifiers/quantization/calibration.py").read_text()
    m = re_search(r'observer = "(\w+)" if base_name == "weight" else', calib)
    return {"dampening_frac": ast.literal_eval(fields["dampening_frac"]),
            "block_size": ast.literal_eval(fields["block_size"]),
            "actorder": ast.literal_eval(act.args[0]),
            "weight_observer": m}


def re_search(pattern: str, text: str) -> str:
    import re

    m = re.search(pattern, text)
    if m is None:
        raise RuntimeError(f"llm-compressor's source no longer matches {pattern!r}")
    return m.group(1)


# llm-compressor's calibration swaps these for their memoryless versions on weights (calibration.py).
WEIGHT_OBSERVER_ALIASES = {"minmax": "memoryless_minmax", "static_minmax": "memoryless_minmax",
                           "mse": "memoryless_mse"}


def llmc_qparams(Observer, name: str, args, W: torch.Tensor, imatrix: tuple[torch.Tensor, int] | None):
    """Scales and zero points of llm-compressor's weight observer ``name`` on ``W``, as ``GPTQModifier``
    computes them before its loop. ``imatrix``: (sum of x^2 per input, rows), what ``imatrix_mse``'s
    forward hook would have accumulated over the calibration rows."""
    name = WEIGHT_OBSERVER_ALIASES.get(name, name)
    obs = Observer.load_from_registry(name, base_name="weight", args=args.model_copy(deep=True))
    if name == "imatrix_mse":
        if imatrix is None:
            raise ValueError("imatrix_mse needs the calibration rows' sum of squares")
        obs._imatrix_sum = imatrix[0].float().clone()
        obs._imatrix_count = torch.tensor(imatrix[1], dtype=torch.int64)
        obs.strict = True  # raise instead of its silent fall-back to the unweighted search
    obs(W)
    return obs.get_qparams()


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


def llmc_quantize(quantize_weight, args, W, H, scale, zero_point, damp, blocksize=128):
    Q, _, fallback = quantize_weight(W.clone()[None], H.clone()[None], scale[None], zero_point[None], None,
                                     args, blocksize=blocksize, percdamp=damp)
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


def ratio_summary(rows: list[dict], lb: str, lc: str, short: dict) -> dict:
    """Per split: layers where ``lb``'s error <= ``lc``'s, geometric mean / min / max of the ratio, the layers
    where ``lb`` is worse."""
    out = {}
    for split in ("cal", "eval"):
        ratios = [r[lb][split] / r[lc][split] for r in rows]
        worst = max(range(len(rows)), key=lambda i: ratios[i])
        best = min(range(len(rows)), key=lambda i: ratios[i])
        out[split] = {"wins": sum(x <= 1 for x in ratios), "layers": len(rows),
                      "geomean": math.exp(sum(math.log(x) for x in ratios) / len(ratios)),
                      "min": ratios[best], "min_layer": short[rows[best]["layer"]],
                      "max": ratios[worst], "max_layer": short[rows[worst]["layer"]],
                      "worse": {short[r["layer"]]: round(x, 4) for r, x in zip(rows, ratios) if x > 1}}
    return out


def print_comparison(rows: list[dict], lb: str, lc: str, title: str, short: dict) -> dict:
    print(f"\n### {title}\n")
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
    summary = ratio_summary(rows, lb, lc, short)
    for split, v in summary.items():
        print(f"{split}: lowbit <= llmc on {v['wins']}/{v['layers']} layers; lowbit/llmc ratio geomean "
              f"{v['geomean']:.3f}, min {v['min']:.3f} ({v['min_layer']}), max {v['max']:.3f} ({v['max_layer']}); "
              f"lowbit worse on: {', '.join(f'{k} {x:.3f}' for k, x in v['worse'].items()) or 'none'}")
    return summary


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--damp", type=float, nargs="+", default=None,
                   help="dampening fractions, each run for both implementations (default 0.1 0.01; "
                        "not with --shipped, where each tool uses its own default)")
    p.add_argument("--calib", type=int, default=64,
                   help="the first N sentences of lowbit's built-in calibration set (default 64)")
    p.add_argument("--batching", choices=("padded", "same-length"), default=None,
                   help="calibration batches: padded (the Hessian counts the padding rows) or of one token "
                        "length each, no padding, as lowbit quantize batches them (default: padded, "
                        "same-length with --shipped)")
    p.add_argument("--diag", action="store_true",
                   help="also run llm-compressor's loop with lowbit's round-to-nearest scales")
    p.add_argument("--act-order", action="store_true",
                   help="both with act-order (lowbit GPTQ(act_order=True), llm-compressor actorder='weight', "
                        "its default): columns by decreasing diag(H), static groups")
    p.add_argument("--shipped", action="store_true",
                   help="each tool as shipped: lowbit GPTQ(**lowbit.cli.GPTQ_DEFAULTS) against "
                        "llm-compressor's GPTQModifier defaults for W4A16_ASYM")
    p.add_argument("--llmc-observer", nargs="+", default=None,
                   help="with --shipped: llm-compressor weight observers to run, each on its other defaults "
                        "(default: the one it ships, memoryless_minmax; also mse, imatrix_mse)")
    p.add_argument("--lowbit-damp", type=float, default=None,
                   help="with --shipped: lowbit's damp instead of its default (to attribute a difference)")
    p.add_argument("--lowbit-scale-search", type=float, nargs="+", default=None,
                   help="with --shipped: lowbit's clipping factors instead of its default (to attribute a "
                        "difference)")
    p.add_argument("--lowbit-refine-sweeps", type=int, default=None,
                   help="with --shipped: lowbit's coordinate-descent refinement sweeps instead of its default")
    p.add_argument("--lowbit-refine-damp", type=float, default=None,
                   help="with --shipped: the refinement's dampening instead of its default")
    p.add_argument("--no-cosine", action="store_true", help="skip the whole-model embedding cosines")
    p.add_argument("--json", type=pathlib.Path, help="write every number here")
    a = p.parse_args()
    warnings.filterwarnings("ignore")
    torch.manual_seed(0)

    if a.diag and (a.act_order or a.shipped):
        p.error("--diag compares loops in column order: run it without --act-order or --shipped")
    if a.shipped and (a.damp is not None or a.act_order):
        p.error("--shipped uses each tool's own damp and act-order: drop --damp / --act-order")
    lowbit_changes = (a.lowbit_damp, a.lowbit_scale_search, a.lowbit_refine_sweeps, a.lowbit_refine_damp)
    if not a.shipped and (a.llmc_observer or any(x is not None for x in lowbit_changes)):
        p.error("--llmc-observer and --lowbit-* go with --shipped")
    batching = a.batching or ("same-length" if a.shipped else "padded")
    versions = {k: importlib.metadata.version(k) for k in ("llmcompressor", "compressed-tensors", "torch")}
    if a.shipped:
        from lowbit.cli import GPTQ_DEFAULTS

        llmc_def = llmcompressor_defaults()
        observers = a.llmc_observer or [llmc_def["weight_observer"]]
        quantize_weight, Observer, qargs = llmcompressor_gptq(llmc_def["actorder"])
        lb_opts = dict(GPTQ_DEFAULTS)
        if a.lowbit_damp is not None:
            lb_opts["damp"] = a.lowbit_damp
        if a.lowbit_scale_search is not None:
            lb_opts["scale_search"] = tuple(a.lowbit_scale_search)
        if a.lowbit_refine_sweeps is not None:
            lb_opts["refine_sweeps"] = a.lowbit_refine_sweeps
        if a.lowbit_refine_damp is not None:
            lb_opts["refine_damp"] = a.lowbit_refine_damp
        lb_config = GPTQ(**lb_opts)
        print(f"versions: {versions}; torch threads {torch.get_num_threads()}; shipped: lowbit "
              f"GPTQ(**{lb_opts}){'' if lb_opts == GPTQ_DEFAULTS else ' (NOT its defaults)'}, llm-compressor GPTQModifier defaults {llmc_def} "
              f"(actorder -> {qargs.actorder!s}), observers {observers}; batching {batching}")
    else:
        a.damp = a.damp or [0.1, 0.01]
        quantize_weight, Observer, qargs = llmcompressor_gptq(a.act_order)
        print(f"versions: {versions}; torch threads {torch.get_num_threads()}; act-order {a.act_order}; "
              f"batching {batching}")

    enc = SentenceEncoder(bundled_model_dir())
    sents = load_sentences()
    calib = enc.batches(sents.calibration_sentences(a.calib), same_length=batching == "same-length")
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
    print(f"{len(layers)} Linear layers; {a.calib} calibration sentences; calibration rows (the Hessian's) "
          f"per token layer: {gcal[next(iter(layers))].n} ({real} real tokens), evaluation rows: "
          f"{geval[next(iter(layers))].n}")

    rows: list[dict] = []
    qw: dict[str, dict[str, torch.Tensor]] = {}
    times: dict[str, float] = {}

    def put(method: str, name: str, Q: torch.Tensor) -> None:
        qw.setdefault(method, {})[name] = Q

    def timed(method: str, fn):
        t0 = time.perf_counter()
        out = fn()
        times[method] = times.get(method, 0.0) + time.perf_counter() - t0
        return out

    for n, lin in layers.items():
        W = lin.weight.detach().float()
        g = scheme.group_size(lin.in_features)
        assert g == qargs.group_size, f"{n}: lowbit uses group {g}, llm-compressor's args {qargs.group_size}"
        H = hess[n].H
        row = {"layer": n, "shape": list(W.shape), "group": g}
        Qr = lowbit.dequantize(lowbit.quantize(W, "int4_awq", group_size=g), torch.float32)
        put("rtn", n, Qr)
        if a.shipped:
            # As apply_gptq hands a config's factors to the grid (a direct call takes them as an option).
            _, Ql = timed("lowbit", lambda: gptq_quantize(W, H, "int4_awq", config=lb_config, group_size=g,
                                                          scale_search=lb_config.scale_search))
            put("lowbit", n, Ql)
            # imatrix_mse's hook accumulates sum(x^2) per input over the rows the Hessian saw.
            imat = (gcal[n].G.diagonal().clone(), gcal[n].n)
            for ob in observers:
                def run_llmc(ob=ob):
                    qp = llmc_qparams(Observer, ob, qargs, W, imat)
                    return llmc_quantize(quantize_weight, qargs, W, H, qp["scale"], qp["zero_point"],
                                         llmc_def["dampening_frac"], llmc_def["block_size"])
                put(f"llmc-{ob}", n, timed(f"llmc-{ob}", run_llmc))
        else:
            qp = llmc_qparams(Observer, "memoryless_minmax", qargs, W, None)
            static = lowbit_static_qparams(W, g) if a.diag else None
            for d in a.damp:
                _, Ql = timed(f"lowbit@{d:g}", lambda: gptq_quantize(
                    W, H, "int4_awq", config=GPTQ(damp=d, block_size=128, act_order=a.act_order), group_size=g))
                Qc = timed(f"llmc@{d:g}", lambda: llmc_quantize(quantize_weight, qargs, W, H, qp["scale"],
                                                                qp["zero_point"], d))
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
        print(f"  {n}: " + ", ".join(f"{m} {row[m]['cal']:.4f}/{row[m]['eval']:.4f}" for m in qw), flush=True)

    methods = list(qw)
    cos = {}
    if not a.no_cosine:
        ref = enc.embed(enc.load_fp32(), evalb)
        for method in methods:
            cos[method] = cosine_stats(ref, embed_with(enc, qw[method], evalb))

    # ------------------------------------------------------------------ report
    short = {n: n.replace("encoder.layer.", "L").replace("attention.self.", "").replace("attention.output.", "ao.")
             for n in layers}
    summaries = {}
    if a.shipped:
        for ob in observers:
            summaries[f"lowbit vs llmc-{ob}"] = print_comparison(
                rows, "lowbit", f"llmc-{ob}",
                f"shipped: lowbit {'GPTQ_DEFAULTS' if lb_opts == GPTQ_DEFAULTS else f'GPTQ(**{lb_opts})'} "
                f"vs llm-compressor defaults, observer {ob}", short)
    else:
        for d in a.damp:
            summaries[f"damp {d:g}"] = print_comparison(rows, f"lowbit@{d:g}", f"llmc@{d:g}", f"damp {d:g} (both)",
                                                        short)
    for d in a.damp or []:
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
    print(f"\nGPTQ seconds over all layers (llmc: observer included): { {k: round(v, 1) for k, v in times.items()} }")
    if a.json:
        a.json.write_text(json.dumps({"versions": versions, "damp": a.damp, "act_order": a.act_order,
                                      "shipped": a.shipped, "calib": a.calib, "batching": batching,
                                      "llmc_defaults": llmc_def if a.shipped else None,
                                      "lowbit_gptq": lb_opts if a.shipped else None,
                                      "layers": rows, "summary": summaries, "cosine": cos,
                                      "seconds": times}, indent=1))


if __name__ == "__main__":
    main()
