"""Tile sweeps of the W4A16 kernels (the sweep modes of the former W4A16 benchmark scripts; the maintained
tables are ``lowbit bench --ops 'linear.*'``); JSON to $OUT.

    PYTHONPATH=src python benchmarks/experiments/sweep_w4a16_tiles.py gemv [--set all|mma|m1] [--formats nvfp4]
        [--shapes 8192x8192] [--ms 1,16]
    PYTHONPATH=src python benchmarks/experiments/sweep_w4a16_tiles.py gemm --m 4096 [--formats nvfp4 int4_awq]

``gemv``: ``gemv_w4`` TILE / MMA variants per format, shape and M, each checked against the fp32 reference, then
timed as CUDA-graph replays of 20 calls over weight copies rotated out of L2; the best per case is printed.
``gemm``: the ``gemm_w4`` tile candidates of the first M's regime per format and shape, then GROUP_M and x
without TMA on the best one (copy the winners into ``gemm_w4.CONFIGS``); ``do_bench`` medians, L2 flushed.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

import lowbit
from lowbit.bench import linear as L

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # this folder (_common)
from _common import (  # noqa: E402
    FORMATS,
    _copies,
    _problem,
    _quantize,
    _rotating,
    _time_graph,
    bench,
    header,
    rel_error,
    write_json,
)

GEMV_SWEEP = [
    {"fma": {"bn": bn, "chunks": c, "warps": w, "stages": s}, "ctas_per_sm": cps}
    for bn, c, w, s, cps in [
        (16, 32, 4, 3, 4), (32, 32, 8, 3, 4), (32, 32, 4, 3, 4), (16, 32, 4, 4, 4), (16, 16, 4, 4, 4),
        (64, 32, 8, 2, 2), (16, 32, 4, 3, 8), (32, 32, 8, 4, 2), (8, 32, 4, 4, 8), (64, 8, 4, 3, 4),
    ]
] + [
    {"fma_max_m": 0, "dot": {"bn": bn, "chunks": c, "warps": w, "stages": s}, "ctas_per_sm": cps}
    for bn, c, w, s, cps in [
        (64, 8, 4, 3, 4), (64, 4, 4, 4, 4), (64, 16, 4, 2, 4), (128, 8, 8, 3, 4), (128, 4, 8, 4, 2),
        (64, 8, 4, 3, 8), (128, 8, 4, 3, 4),
    ]
] + [{"fma_max_m": fm} for fm in (1, 2, 4)]
# the tensor-core GEMV (NVFP4 / MXFP4, bf16 x); {"mma": False}: the FMA / dot kernels under the default TILE
GEMV_SWEEP_MMA = [{"mma": False}] + [
    {"mma": {"min_m": 1, "max_m": 16, "rg": rg, "j": j, "warps": w, "ctas_per_sm": cps}}
    for rg, j, w, cps in [(2, 4, 4, 8), (2, 4, 4, 4), (1, 4, 4, 8), (4, 4, 4, 4), (2, 8, 8, 4)]
]
GEMV_SETS = {"all": GEMV_SWEEP, "mma": GEMV_SWEEP_MMA}

# (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages) by regime; GROUP_M is swept separately on the best one.
# m512 / m64: one warpgroup with fewer pipeline stages (more programs per SM by shared memory: each waits for its
# own wgmmas before its next decode) and 256-wide x tiles (each weight tile decoded once at M = 256)
GEMM_SWEEP = {
    "large": [(256, 128, 64, 8, 3), (256, 128, 64, 8, 4), (128, 256, 64, 8, 3), (128, 256, 64, 8, 4),
              (128, 128, 64, 8, 4), (128, 128, 64, 8, 5), (128, 128, 128, 8, 3), (256, 128, 128, 8, 2),
              (128, 256, 128, 8, 2), (128, 128, 64, 4, 4)],
    "m512": [(128, 64, 128, 4, 4), (128, 64, 128, 4, 2), (128, 64, 128, 4, 3), (128, 64, 64, 4, 3),
             (256, 64, 64, 4, 2), (256, 64, 64, 4, 3), (256, 64, 128, 4, 2)],
    "m128": [(64, 64, 128, 4, 5), (64, 128, 128, 8, 4), (128, 64, 128, 4, 4), (32, 64, 256, 4, 4),
             (64, 64, 256, 4, 3), (128, 128, 64, 8, 4)],
    "m64": [(64, 64, 128, 4, 5), (64, 64, 128, 4, 2), (64, 64, 128, 4, 3), (64, 64, 256, 4, 2),
            (64, 64, 64, 4, 4)],
    "m32": [(32, 64, 128, 4, 5), (32, 64, 256, 4, 4), (16, 64, 256, 4, 4), (32, 128, 128, 8, 4)],
}
GROUP_M_SWEEP = [1, 4, 8, 16]


def _reference_error(x, q, y) -> float:
    return rel_error(y, x.float() @ lowbit.dequantize(q, torch.float32).T)


def gemv(args) -> dict:
    from lowbit.kernels import gemv_w4 as G

    variants = GEMV_SETS.get(args.set) or [{"mma": False}, {"mma": {**G.MMA, "m1_min_weights": 0}}]
    rows = []
    for n, k in args.shapes:
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.05
        for name in args.formats:
            fmt, opts = L.FORMATS[name]
            qs = [L.quantize_weight(w, fmt, opts)]
            qs += [L.quantize_weight(w, fmt, opts) for _ in range(_copies(qs[0].nbytes) - 1)]
            ps = [G.prepare_w4(q) for q in qs]
            for m in args.ms:
                x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
                case = []
                for delta in variants:
                    kw = {"mma_config": delta["mma"]} if "mma" in delta else {"config": {**G.TILE, **delta}}
                    row = {"format": name, "n": n, "k": k, "m": m, "config": delta}
                    try:
                        row["rel_err"] = _reference_error(x, qs[0], G.gemv_w4(x, ps[0], **kw))
                        row["us"] = _time_graph(_rotating([lambda p=p, kw=kw, x=x: G.gemv_w4(x, p, **kw) for p in ps]))
                    except Exception as e:  # noqa: BLE001 - a variant that does not compile or fit
                        row["error"] = f"{type(e).__name__}: {e}"[:200]
                    case.append(row)
                rows += case
                best = min((r for r in case if "us" in r), key=lambda r: r["us"], default=None)
                if best:
                    print(f"{name:9} {n}x{k} M={m}: best {best['us']:.1f} us {best['config']}", flush=True)
            del qs, ps
        torch.cuda.empty_cache()
    return {"header": header(), "tile": G.TILE, "rows": rows}


def _time_gemm(row: dict, x, q, cfg, t_cublas: float, rep: int, check: bool = True) -> dict:
    from lowbit.kernels import gemm_w4 as g

    flops = 2.0 * row["M"] * row["N"] * row["K"]
    try:
        out = g.gemm_w4(x, q, config=cfg)
        if check:
            row["rel_err"] = _reference_error(x, q, out)
        t = bench(lambda: g.gemm_w4(x, q, config=cfg), rep)
        row.update(ms=t, tflops=flops / t / 1e9, ratio_vs_cublas=t_cublas / t)
    except Exception as e:  # noqa: BLE001 - out of shared memory / registers: record and go on
        row["error"] = f"{type(e).__name__}: {e}"[:500]
    return row


def gemm(args) -> dict:
    from lowbit.kernels import gemm_w4 as g

    dev = torch.device("cuda")
    m = args.m
    regime = g.regime(m)
    rows, best_by_case = [], {}
    for n, k in args.shapes:
        x, w = _problem(n, k, m, dev)
        t_cublas = bench(lambda: x @ w.T, args.rep)  # noqa: B023 - called right here
        for name in args.formats:
            q = _quantize(w, name)
            default = g.choose_config(m, n, k, q.fmt, q.params.get("group_size", 0), dev)
            base = dict(format=name, M=m, N=n, K=k, cublas_tflops=2.0 * m * n * k / t_cublas / 1e9)
            if args.splits:  # the default tile with each split of K (the policy's own choice is "SPLIT_K" above)
                base["default_split"] = default["SPLIT_K"]
                cands = [dict({k: v for k, v in default.items() if k != "regime"}, SPLIT_K=s) for s in args.splits]
            else:
                cands = [dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, num_warps=nw, num_stages=ns,
                              GROUP_M=default["GROUP_M"], SPLIT_K=default["SPLIT_K"])
                         for bm, bn, bk, nw, ns in GEMM_SWEEP[regime]]
            case = [_time_gemm(dict(base, config=cfg), x, q, cfg, t_cublas, args.rep) for cfg in cands]
            ok = [r for r in case if "ms" in r]
            if ok and args.splits:
                for r in ok:
                    print(f"{name:9s} M={m} N={n:6d} K={k:6d} split {r['config']['SPLIT_K']}: "
                          f"{r['ratio_vs_cublas']:.3f}x cuBLAS (default split {default['SPLIT_K']})", flush=True)
            elif ok:
                best = min(ok, key=lambda r: r["ms"])
                extra = [dict(best["config"], GROUP_M=gm) for gm in GROUP_M_SWEEP if gm != best["config"]["GROUP_M"]]
                extra.append(dict(best["config"], X_TMA=False))
                case += [_time_gemm(dict(base, config=cfg), x, q, cfg, t_cublas, args.rep, check=False) for cfg in extra]
                best = min((r for r in case if "ms" in r), key=lambda r: r["ms"])
                best_by_case[f"{name} {n}x{k}"] = best
                print(f"best {name:9s} M={m} N={n:6d} K={k:6d}: {best['tflops']:7.1f} TFLOPS "
                      f"({best['ratio_vs_cublas']:.3f}x cuBLAS) {best['config']}", flush=True)
            rows += case
        torch.cuda.empty_cache()
    return {"header": header(), "regime": regime, "candidates": GEMM_SWEEP[regime], "best": best_by_case,
            "rows": rows}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("mode", choices=("gemv", "gemm"))
    ap.add_argument("--formats", nargs="+", default=None, help="format labels (gemv: lowbit.bench.linear.FORMATS)")
    ap.add_argument("--shapes", default=None, help="NxK list (default: the linear ops' shapes)")
    ap.add_argument("--ms", default="1,16", help="gemv: rows of x")
    ap.add_argument("--m", type=int, default=4096, help="gemm: rows of x (its regime's candidates are swept)")
    ap.add_argument("--set", default="all", choices=("all", "mma", "m1"), help="gemv: which variants")
    ap.add_argument("--splits", default=None, help="gemm: sweep these SPLIT_K values (e.g. 1,2,3,4) on the default "
                    "tile instead of the tile candidates")
    ap.add_argument("--rep", type=int, default=100, help="gemm: do_bench budget per case, ms")
    ap.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results/tmp"))
    args = ap.parse_args()
    args.shapes = list(L.NK) if not args.shapes else [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    args.ms = [int(v) for v in args.ms.split(",")]
    args.splits = [int(v) for v in args.splits.split(",")] if args.splits else None
    args.formats = args.formats or list(L.FORMATS if args.mode == "gemv" else FORMATS)
    os.makedirs(args.out, exist_ok=True)
    result = gemv(args) if args.mode == "gemv" else gemm(args)
    path = os.path.join(args.out, f"sweep_w4a16_{args.mode}" + (f"_m{args.m}" if args.mode == "gemm" else "")
                        + ("_split" if args.splits else "") + ".json")
    write_json(path, result)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
