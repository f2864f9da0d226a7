"""W4A16 decode GEMV (``lowbit.kernels.gemv_w4``) vs cuBLAS bf16 ``x @ w.T`` on one GPU; JSON to $OUT.

    python benchmarks/bench_w4a16.py                    # every format x shape, M = 1, 4, 16 (about 5 min on an H100)
    python benchmarks/bench_w4a16.py --sweep            # also try TILE variants, report the best per case
    python benchmarks/bench_w4a16.py --formats nvfp4 --shapes 8192x8192 --ms 1,16 --sweep

Timing: ``triton.testing.do_bench`` median. Where a weight (bf16 or 4-bit) fits in 3x the L2 cache,
several copies are made and each call uses the next copy, so every call reads its weights from HBM.
"graph" times replay a CUDA graph of 20 such calls (no launch overhead; what a serving engine that
captures its decode step sees); "eager" times include Python launch overhead. Every case is first
checked against the fp32 reference (relative Frobenius error). Speedup = cuBLAS time / gemv_w4 time at
the same M and timing mode; bytes = the 4-bit weight with its scales (x and out are negligible).
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import subprocess
import sys
import time

import torch
import triton
from triton.testing import do_bench

import lowbit
from lowbit.kernels import gemv_w4 as G

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _peers  # the benchmarks folder is not a package

SHAPES = [(4096, 4096), (8192, 8192), (28672, 8192), (8192, 28672), (6144, 4096), (4096, 14336)]
FORMATS = {
    "nvfp4": ("nvfp4", {}),
    "mxfp4": ("mxfp4", {}),
    "fp4_b32": ("fp4_b32", {}),
    "nf4": ("nf4", {}),
    "nf4-dq": ("nf4", {"double_quant": True}),
    "int4_awq": ("int4_awq", {"group_size": 128}),
}
GRAPH_CALLS = 20

SWEEP = [
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
SWEEP_MMA = [{"mma": False}] + [
    {"mma": {"min_m": 1, "max_m": 16, "rg": rg, "j": j, "warps": w, "ctas_per_sm": cps}}
    for rg, j, w, cps in [(2, 4, 4, 8), (2, 4, 4, 4), (1, 4, 4, 8), (4, 4, 4, 4), (2, 8, 8, 4)]
]
# M = 1: the tensor-core GEMV against the FMA kernel on every weight size (where MMA["m1_min_weights"] belongs)
SWEEP_M1 = [{"mma": False}, {"mma": {**G.MMA, "m1_min_weights": 0}}]
SWEEPS = {"all": SWEEP, "mma": SWEEP_MMA, "m1": SWEEP_M1}


def _git() -> str:
    if os.environ.get("GIT_SHA"):
        return os.environ["GIT_SHA"]
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              check=False).stdout.strip()
    except OSError:
        return "?"


def _copies(nbytes: int) -> int:
    l2 = getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 50 << 20)
    return max(1, math.ceil(3 * l2 / max(nbytes, 1)))


def _rotating(fns):
    state = [0]

    def call():
        i = state[0]
        state[0] = (i + 1) % len(fns)
        return fns[i]()

    return call


def _time_eager(fn) -> float:
    return do_bench(fn, warmup=25, rep=100, return_mode="median") * 1e3  # us


def capture(body, warm=None) -> torch.cuda.CUDAGraph:
    """A CUDA graph of ``body()``, after ``warm()`` (default ``body``) ran on a side stream (first launches
    compile and allocate outside the capture)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            (warm or body)()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        body()
    return graph


def _time_graph(fn) -> float:
    graph = capture(lambda: [fn() for _ in range(GRAPH_CALLS)], warm=fn)
    return do_bench(graph.replay, warmup=25, rep=100, return_mode="median") * 1e3 / GRAPH_CALLS


def _copy_roof() -> float:
    a = torch.empty(1 << 28, dtype=torch.bfloat16, device="cuda")
    b = torch.empty_like(a)
    t = do_bench(lambda: b.copy_(a), return_mode="median")
    return 2 * (1 << 28) * 2 / (t * 1e-3) / 1e9


def _reference_error(x, q, y) -> float:
    ref = x.float() @ lowbit.dequantize(q, torch.float32).T
    return ((y.float() - ref).norm() / ref.norm()).item()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--formats", default=",".join(FORMATS))
    ap.add_argument("--shapes", default=",".join(f"{n}x{k}" for n, k in SHAPES))
    ap.add_argument("--ms", default="1,4,16", help="rows of x (the full set: 1,2,4,8,16)")
    ap.add_argument("--sweep", action="store_true", help="also time the SWEEP tile variants")
    ap.add_argument("--sweep-set", default="all", choices=sorted(SWEEPS), help="which variants --sweep times")
    ap.add_argument("--no-graph", action="store_true")
    ap.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results/tmp"))
    args = ap.parse_args()
    formats = args.formats.split(",")
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    ms = [int(m) for m in args.ms.split(",")]
    os.makedirs(args.out, exist_ok=True)
    torch.manual_seed(0)
    t0 = time.time()
    meta = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "triton": triton.__version__,
            "git": _git(), "host": platform.node(), "tile": G.TILE, "graph_calls": GRAPH_CALLS,
            "copy_GBps": _copy_roof()}
    print(f"{meta['device']}  copy roof {meta['copy_GBps']:.0f} GB/s  git {meta['git']}")
    rows, sweep_rows = [], []
    path = os.path.join(args.out, "bench_w4a16.json")
    for n, k in shapes:
        w0 = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.05
        nb = _copies(n * k * 2)
        w_bf16 = [w0] + [torch.randn_like(w0) * 0.05 for _ in range(nb - 1)]
        prepared = {}
        for name in formats:
            fmt, opts = FORMATS[name]
            src = [w.half() if fmt == "int4_awq" else w for w in w_bf16]
            q0 = lowbit.quantize(src[0], fmt, **opts)
            nq = _copies(q0.nbytes)
            qs = [q0] + [lowbit.quantize(src[i % len(src)] * (1 + i // len(src)), fmt, **opts) for i in range(1, nq)]
            prepared[name] = (q0, [G.prepare_w4(q) for q in qs])
            del src
        bias = torch.randn(n, device="cuda", dtype=torch.bfloat16)
        for m in ms:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            cublas = _rotating([lambda w=w, x=x: torch.matmul(x, w.t()) for w in w_bf16])
            base = {"eager": _time_eager(cublas)}
            if not args.no_graph:
                base["graph"] = _time_graph(cublas)
            ref = x.float() @ w_bf16[0].float().t()
            peers = {}
            if m in (1, 16):
                wanted = {"bitsandbytes_nf4": "nf4", "gemlite_int4": "int4_awq", "gemlite_mxfp4": "mxfp4"}
                for peer, ours in wanted.items():
                    if not any(FORMATS[f][0] == ours for f in formats):
                        continue
                    fns = (_peers.bnb_nf4(w_bf16) if peer == "bitsandbytes_nf4"
                           else _peers.gemlite(w_bf16, peer.split("_")[1]))
                    if fns is None:
                        continue
                    calls = [lambda f=f, x=x: f(x) for f in fns]
                    t = {"eager": _time_eager(_rotating(calls))}
                    if not args.no_graph:
                        try:
                            t["graph"] = _time_graph(_rotating(calls))
                        except Exception as e:  # noqa: BLE001 - a peer that cannot be captured
                            print(f"  {peer}: no CUDA graph ({type(e).__name__})")
                    peers[peer] = {"for": ours, "us": t, "rel_err_vs_bf16": _peers.rel_error(fns[0](x), ref)}
                    del fns, calls
            print(f"{n}x{k} M={m}: cuBLAS bf16 eager {base['eager']:.1f} us"
                  + (f", graph {base['graph']:.1f} us" if "graph" in base else "")
                  + "".join(f"; {p} eager {v['us']['eager']:.1f} us" for p, v in peers.items()), flush=True)
            for name in formats:
                q0, ps = prepared[name]
                err = _reference_error(x, q0, G.gemv_w4(x, ps[0]))
                row = {"format": name, "n": n, "k": k, "m": m, "weight_bytes": q0.nbytes, "copies": len(ps),
                       "rel_err": err, "cublas_us": base}
                plain = _rotating([lambda p=p, x=x: G.gemv_w4(x, p) for p in ps])
                row["us"] = {"eager": _time_eager(plain)}
                if not args.no_graph:
                    row["us"]["graph"] = _time_graph(plain)
                if m == 1:
                    fused = _rotating([lambda p=p, x=x, b=bias: G.gemv_w4(x, p, b, "gelu") for p in ps])
                    row["bias_gelu_us"] = {"eager": _time_eager(fused)}
                    if not args.no_graph:
                        row["bias_gelu_us"]["graph"] = _time_graph(fused)
                for peer, v in peers.items():
                    if v["for"] == FORMATS[name][0]:
                        row.setdefault("peers", {})[peer] = v
                        row.setdefault("speedup_vs", {})[peer] = {md: v["us"][md] / row["us"][md]
                                                                  for md in v["us"] if md in row["us"]}
                for mode, t in row["us"].items():
                    row.setdefault("speedup", {})[mode] = base[mode] / t
                    row.setdefault("GBps", {})[mode] = q0.nbytes / (t * 1e-6) / 1e9
                    row.setdefault("pct_copy", {})[mode] = 100 * row["GBps"][mode] / meta["copy_GBps"]
                if "bias_gelu_us" in row:
                    row["epilogue_overhead_pct"] = {md: 100 * (row["bias_gelu_us"][md] / row["us"][md] - 1)
                                                    for md in row["us"]}
                rows.append(row)
                gt = row["us"].get("graph")
                print(f"  {name:9} err {err:.1e}  eager {row['us']['eager']:7.1f} us ({row['speedup']['eager']:.2f}x)"
                      + (f"  graph {gt:7.1f} us ({row['speedup']['graph']:.2f}x, {row['pct_copy']['graph']:.0f}% copy)"
                         if gt else "")
                      + (f"  bias+gelu {row['epilogue_overhead_pct'].get('graph', row['epilogue_overhead_pct']['eager']):+.1f}%"
                         if "epilogue_overhead_pct" in row else "")
                      + "".join(f"  vs {p} {v.get('graph', v['eager']):.2f}x" for p, v in row.get("speedup_vs", {}).items()),
                      flush=True)
                if args.sweep:
                    for cfg_delta in SWEEPS[args.sweep_set]:
                        kw = ({"mma_config": cfg_delta["mma"]} if "mma" in cfg_delta
                              else {"config": {**G.TILE, **cfg_delta}})
                        try:
                            err_v = _reference_error(x, q0, G.gemv_w4(x, ps[0], **kw))
                            cfg_delta = {**cfg_delta, "rel_err": err_v}
                            fn = _rotating([lambda p=p, kw=kw, x=x: G.gemv_w4(x, p, **kw) for p in ps])
                            t = _time_graph(fn) if not args.no_graph else _time_eager(fn)
                        except Exception as e:  # noqa: BLE001 - a variant that does not compile or fit
                            t, cfg_delta = None, {**cfg_delta, "error": f"{type(e).__name__}: {e}"[:200]}
                        sweep_rows.append({"format": name, "n": n, "k": k, "m": m, "config": cfg_delta, "us": t})
                    best = min((r for r in sweep_rows if r["format"] == name and r["n"] == n and r["k"] == k
                                and r["m"] == m and r["us"]), key=lambda r: r["us"], default=None)
                    if best:
                        print(f"    sweep best {best['us']:.1f} us: {best['config']}", flush=True)
        del w_bf16, w0, prepared
        torch.cuda.empty_cache()
        meta["seconds"] = time.time() - t0
        _peers.write_json(path, {**meta, "complete": False, "rows": rows, "sweep": sweep_rows})
    _peers.write_json(path, {**meta, "complete": True, "rows": rows, "sweep": sweep_rows})
    print(f"wrote {path} ({meta['seconds']:.0f} s)")


if __name__ == "__main__":
    main()
