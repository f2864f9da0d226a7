"""Prototype measurements of GPTQ's coordinate-descent refinement (``GPTQ(refine_sweeps=...)``,
:mod:`lowbit.algorithms.gptq_refine`) on the bundled model, layer by layer.

Every Linear's Hessian comes from the float model on the first ``--calib`` calibration sentences (batched
without padding, as ``lowbit quantize`` batches them; non-sequential, as in gptq_crosscheck.py), and each
variant runs ``gptq_quantize`` on every layer with lowbit's shipped settings (``lowbit.cli.GPTQ_DEFAULTS``)
plus its refinement options. Reported per variant: the objective's relative output error
``||X (W - Q)^T||_F / ||X W^T||_F`` on the calibration rows and on held-out rows (the real tokens of the 330
evaluation sentences), as the geometric mean over layers of the ratio to the unrefined run and the number of
layers where it is lower, the whole-model embedding cosine with every Linear's weight replaced by the chosen
values, and the seconds over all layers.

Variants are written ``[gG]sS[dD]``: GPTQ's damp ``G`` (default ``--damp``), ``S`` sweeps, refinement
Hessian damped by ``D`` (a fraction of its mean diagonal; default: GPTQ's damp). ``--against X.json`` (a ``gptq_crosscheck.py --shipped --json`` output, same ``--calib``) adds,
for int4_awq, the layers where each variant's error is <= each llm-compressor run's there. Example:

    PYTHONPATH=src python benchmarks/experiments/gptq_refine.py --formats int4_awq nvfp4 --variants s0 s1 s2 s1d0.03
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib
import re
import sys
import time
import warnings

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from gptq_crosscheck import Gram, embed_with, record, rel_error

from lowbit.algorithms.gptq import GPTQ, HessianAccumulator, gptq_quantize
from lowbit.cli import GPTQ_DEFAULTS
from lowbit.eval import SentenceEncoder, bundled_model_dir, load_sentences
from lowbit.eval.metrics import cosine_stats
from lowbit.nn.quantize import linear_layers
from lowbit.nn.schemes import get_scheme

SCHEMES = {"nvfp4": "w4a16-nvfp4", "mxfp4": "w4a16-mxfp4", "nf4": "w4a16-nf4", "bnb_fp4": "w4a16-bnb-fp4",
           "int4_awq": "w4a16-int4", "fp4_b32": "w4a16-fp4b32"}


def parse_variant(v: str) -> dict:
    m = re.fullmatch(r"(?:g([0-9.e-]+))?s(\d+)(?:d([0-9.e-]+))?", v)
    if m is None:
        raise SystemExit(f"bad variant {v!r}")
    out = {"refine_sweeps": int(m.group(2)), "refine_damp": None if m.group(3) is None else float(m.group(3))}
    if m.group(1):
        out["damp"] = float(m.group(1))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--calib", type=int, default=379)
    p.add_argument("--formats", nargs="+", default=["int4_awq"])
    p.add_argument("--variants", nargs="+", default=["s0", "s1", "s2"])
    p.add_argument("--damp", type=float, default=None, help="GPTQ's damp (default GPTQ_DEFAULTS')")
    p.add_argument("--no-cosine", action="store_true")
    p.add_argument("--against", type=pathlib.Path, help="a gptq_crosscheck.py --shipped --json output")
    p.add_argument("--json", type=pathlib.Path)
    a = p.parse_args()
    warnings.filterwarnings("ignore")

    enc = SentenceEncoder(bundled_model_dir())
    sents = load_sentences()
    calib = enc.batches(sents.calibration_sentences(a.calib), same_length=True)
    evalb = enc.batches(sents.sentences)
    model = enc.load_fp32()
    layers = dict(linear_layers(model))
    hess = {n: HessianAccumulator(m.in_features) for n, m in layers.items()}
    gcal = {n: Gram(m.in_features) for n, m in layers.items()}
    geval = {n: Gram(m.in_features) for n, m in layers.items()}
    record(model, layers, calib, hess, gcal, real_tokens_only=False)
    record(model, layers, evalb, None, geval, real_tokens_only=True)
    ref = None if a.no_cosine else enc.embed(enc.load_fp32(), evalb)
    base = dict(GPTQ_DEFAULTS)
    if a.damp is not None:
        base["damp"] = a.damp
    out: dict = {"calib": a.calib, "base": base, "results": {}}
    llmc = {}
    if a.against:
        xc = json.loads(a.against.read_text())
        assert xc["calib"] == a.calib and xc["batching"] == "same-length", "the cross-check's calibration differs"
        for r in xc["layers"]:
            for k, v in r.items():
                if k.startswith("llmc-"):
                    llmc.setdefault(k, {})[r["layer"]] = v
    for fmt in a.formats:
        scheme = get_scheme(SCHEMES[fmt])
        fl = {n: m for n, m in layers.items() if scheme.unsupported(m.out_features, m.in_features) is None}
        errs: dict[str, dict[str, list[float]]] = {}
        print(f"\n## {fmt} ({SCHEMES[fmt]}), {len(fl)} layers, GPTQ {base}", flush=True)
        print("| variant | cal geomean vs s0 | cal lower | held-out geomean vs s0 | held-out lower | "
              "cal rel err (mean) | held-out rel err (mean) | cos mean | cos min | s |")
        print("|---|---|---|---|---|---|---|---|---|---|")
        for v in a.variants:
            cfg = GPTQ(**{**base, **parse_variant(v)})
            qw, t = {}, 0.0
            e = {"cal": [], "eval": []}
            for n, lin in fl.items():
                W = lin.weight.detach().float()
                opts = scheme.weight_quantize_options(lin.in_features)
                t0 = time.perf_counter()
                _, Q = gptq_quantize(W, hess[n].H, fmt, config=cfg, **opts)
                t += time.perf_counter() - t0
                qw[n] = Q
                e["cal"].append(rel_error(W, Q, gcal[n].G))
                e["eval"].append(rel_error(W, Q, geval[n].G))
            errs[v] = e
            b = errs[a.variants[0]]
            row = {"seconds": t, "cal": e["cal"], "eval": e["eval"]}
            cells = [v]
            for split in ("cal", "eval"):
                r = [x / y for x, y in zip(e[split], b[split])]
                row[f"{split}_geomean"] = math.exp(sum(map(math.log, r)) / len(r))
                row[f"{split}_lower"] = sum(x < 1 for x in r)
                cells += [f"{row[f'{split}_geomean']:.4f}", f"{row[f'{split}_lower']}/{len(r)}"]
            cells += [f"{sum(e['cal']) / len(fl):.5f}", f"{sum(e['eval']) / len(fl):.5f}"]
            if ref is not None:
                c = cosine_stats(ref, embed_with(enc, qw, evalb))
                row["cos"] = c
                cells += [f"{c['mean']:.4f}", f"{c['min']:.4f}"]
            else:
                cells += ["-", "-"]
            cells.append(f"{t:.1f}")
            print("| " + " | ".join(cells) + " |", flush=True)
            if fmt == "int4_awq":
                names = list(fl)
                for k, by in llmc.items():
                    info = {}
                    for split in ("cal", "eval"):
                        r = [e[split][i] / by[n][split] for i, n in enumerate(names)]
                        worst = max(range(len(r)), key=r.__getitem__)
                        info[split] = (sum(x <= 1 for x in r), math.exp(sum(map(math.log, r)) / len(r)), r[worst],
                                       names[worst])
                    row[f"vs {k}"] = info
                    print(f"    vs {k}: " + "; ".join(
                        f"{sp} <= on {w}/{len(names)}, geomean {g:.4f}, worst {x:.4f} ({n})"
                        for sp, (w, g, x, n) in info.items()), flush=True)
            out["results"].setdefault(fmt, {})[v] = row
    if a.json:
        a.json.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
