"""Where the time of the chunked prefill path (``lowbit.ops.linear.linear_dequant_gemm``) goes, M = 4096.

    PYTHONPATH=src python benchmarks/experiments/profile_prefill.py [--formats nvfp4 nf4] [--chunk-mb 16 32 64]

Per shape and format: cuBLAS bf16 ``x @ w.T``, the whole-weight dequantize alone, the chunked path at several
chunk sizes, and the earlier chunked variant (``F.linear`` per chunk into a temporary, then a copy into the
output) for comparison; then a torch.profiler table of the GPU kernels of one chunked call. Times are
``triton.testing.do_bench`` medians (L2 flushed before each call). JSON to ``$OUT/profile_prefill.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import torch.nn.functional as F

import lowbit
from lowbit.formats.rows import nf4_without_double_quant, slice_rows
from lowbit.ops.linear import _chunk_rows, linear_dequant_gemm

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # this folder (_common)
from _common import FORMATS, SHAPES, _problem, _quantize, bench, capture, header  # noqa: E402


def chunked_copy(x2, w, chunk_bytes=None):
    """The chunked path before the direct-output change: each chunk's GEMM output is a temporary copied in."""
    m, n = x2.shape[0], w.shape[0]
    wq = nf4_without_double_quant(w) if w.fmt == "nf4" else w
    rows = _chunk_rows(w, x2.element_size(), chunk_bytes)
    out = torch.empty((m, n), dtype=x2.dtype, device=x2.device)
    for n0 in range(0, n, rows):
        n1 = min(n, n0 + rows)
        out[:, n0:n1] = F.linear(x2, lowbit.dequantize(slice_rows(wq, n0, n1), x2.dtype))
    return out


def graph_time(fn, reps: int = 20) -> float:
    """Median µs of ``fn`` as a CUDA-graph replay, L2 flushed before each call: a graph of (flush, fn) minus
    a graph of the flush alone, so host launch overhead is out of the figure (prefill in a serving engine
    is launched ahead of the GPU; a do_bench loop waits for the host on short calls)."""
    flush = torch.empty(256 << 20, dtype=torch.int8, device="cuda")

    def flushed():
        flush.zero_()
        fn()

    graphs = [capture(flushed), capture(flush.zero_)]
    out = []
    for g in graphs:
        times = []
        for _ in range(reps):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            g.replay()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) * 1e3)
        out.append(sorted(times)[reps // 2])
    return out[0] - out[1]


def kernel_table(fn, steps: int = 3) -> list[dict]:
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            fn()
        torch.cuda.synchronize()
    rows = []
    for e in prof.key_averages():
        us = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
        if us > 0:
            rows.append({"name": e.key[:90], "calls": e.count // steps, "us_per_call": us / steps})
    rows.sort(key=lambda r: -r["us_per_call"])
    return rows[:8]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--formats", nargs="+", default=["nvfp4", "mxfp4", "nf4", "int4_awq"], choices=list(FORMATS))
    p.add_argument("--shapes", default=None, help="N×K list like 4096x4096,8192x8192")
    p.add_argument("--m", type=int, default=4096)
    p.add_argument("--chunk-mb", type=int, nargs="+", default=[16, 32, 64, 128])
    p.add_argument("--rep", type=int, default=60)
    p.add_argument("--profile", action="store_true", help="torch.profiler kernel table per case")
    p.add_argument("--graph", action="store_true", help="also time cuBLAS and the chunked path (first --chunk-mb) "
                   "as CUDA-graph replays")
    p.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results/tmp"))
    args = p.parse_args()
    shapes = SHAPES if not args.shapes else [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    dev = torch.device("cuda")
    rows, t0 = [], time.time()
    for n, k in shapes:
        x, w = _problem(n, k, args.m, dev)
        t_cublas = bench(lambda: x @ w.T, args.rep)  # noqa: B023
        ref = x.float() @ w.float().T
        for name in args.formats:
            q = _quantize(w, name)
            row = {"format": name, "M": args.m, "N": n, "K": k, "cublas_us": t_cublas * 1e3}
            row["dequant_us"] = bench(lambda: lowbit.dequantize(q, torch.bfloat16), args.rep) * 1e3  # noqa: B023
            row["copy_chunked_us"] = bench(lambda: chunked_copy(x, q), args.rep) * 1e3  # noqa: B023
            for mb in args.chunk_mb:
                cb = mb << 20
                y = linear_dequant_gemm(x, q, chunk_bytes=cb)
                err = ((y.float() - ref).norm() / ref.norm()).item()
                t = bench(lambda cb=cb: linear_dequant_gemm(x, q, chunk_bytes=cb), args.rep) * 1e3  # noqa: B023
                row[f"chunk{mb}_us"] = t
                row[f"chunk{mb}_ratio"] = row["cublas_us"] / t
                row[f"chunk{mb}_rows"] = _chunk_rows(q, 2, cb)
                row[f"chunk{mb}_err_vs_bf16"] = err
            if args.graph:
                cb = args.chunk_mb[0] << 20
                row["graph_cublas_us"] = graph_time(lambda: x @ w.T)  # noqa: B023
                row["graph_chunked_us"] = graph_time(lambda: linear_dequant_gemm(x, q, chunk_bytes=cb))  # noqa: B023
                row["graph_ratio"] = row["graph_cublas_us"] / row["graph_chunked_us"]
                print(f"   graph: cuBLAS {row['graph_cublas_us']:.1f} us, chunked ({args.chunk_mb[0]} MB) "
                      f"{row['graph_chunked_us']:.1f} us: {row['graph_ratio']:.3f}", flush=True)
            if args.profile:
                row["kernels"] = kernel_table(lambda: linear_dequant_gemm(x, q))  # noqa: B023
            rows.append(row)
            best = max(args.chunk_mb, key=lambda mb: row[f"chunk{mb}_ratio"])  # noqa: B023
            print(f"{name:9s} {n:6d}x{k:<6d} cuBLAS {row['cublas_us']:8.1f} us  dequant {row['dequant_us']:7.1f}  "
                  f"copy-variant {row['copy_chunked_us']:8.1f}  "
                  + "  ".join(f"{mb}MB {row[f'chunk{mb}_us']:8.1f} ({row[f'chunk{mb}_ratio']:.3f})"
                              for mb in args.chunk_mb)
                  + f"  best {best} MB", flush=True)
            for kr in row.get("kernels", []):
                print(f"      {kr['us_per_call']:8.1f} us x{kr['calls']:<3d} {kr['name']}")
            del q
        del x, w, ref
        torch.cuda.empty_cache()
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "profile_prefill.json")
    with open(path, "w") as f:
        json.dump({"header": header(), "rows": rows, "seconds": time.time() - t0}, f, indent=1)
    print("wrote", path)


if __name__ == "__main__":
    main()
