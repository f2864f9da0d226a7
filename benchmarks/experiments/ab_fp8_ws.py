"""A/B of the warp-specialized fp8_block kernel against the one-partition TMA kernel, eager and as CUDA-graph
replays (host launch cost out), for fp8_block x fp8_block and the FP8 re-encoded mxfp4 x mxfp4 route; JSON to $OUT.

    PYTHONPATH=src python benchmarks/experiments/ab_fp8_ws.py [--shapes 4096x7168x2048,...]
"""

import argparse
import json
import os

import torch
from triton.testing import do_bench

import lowbit
from lowbit.kernels import scaled_mm as ks


def _graph_ms(fn, reps=20):
    fn()
    torch.cuda.synchronize()
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for _ in range(reps):
                fn()
    torch.cuda.synchronize()
    return do_bench(g.replay, rep=100, return_mode="median") / reps


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="4096x7168x2048,4096x4096x7168")
    ap.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results/tmp"))
    args = ap.parse_args()
    rows = []
    for shape in args.shapes.split(","):
        m, n, k = (int(v) for v in shape.split("x"))
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.05
        x8, w8 = x.to(torch.float8_e4m3fn), w.to(torch.float8_e4m3fn)
        one = torch.ones((), device="cuda")
        row = {"M": m, "N": n, "K": k}
        row["scaled_mm_fp8"] = {"eager": do_bench(lambda: torch._scaled_mm(x8, w8.T, scale_a=one, scale_b=one,  # noqa: B023
                                                                         out_dtype=torch.bfloat16), return_mode="median")}
        pairs = {"fp8_block": (lowbit.quantize(x, "fp8_block"), lowbit.quantize(w, "fp8_block", block=(128, 128)), None),
                 "mxfp4_fold": (lowbit.quantize(x, "mxfp4"), lowbit.quantize(w, "mxfp4"), True)}
        for pname, (a, b, fold) in pairs.items():
            for cname, cfg in (("ws", ks.WS_CONFIG), ("one_partition", ks.ONE_PARTITION_CONFIG)):
                fn = lambda c=cfg, a=a, b=b, f=fold: ks.scaled_mm(a, b, None, None, torch.bfloat16,  # noqa: E731
                                                                  "fold" if f else "kernel", config=c)
                r = {"eager": do_bench(fn, return_mode="median"), "graph": _graph_ms(fn)}
                row[f"{pname}_{cname}"] = r
                print(shape, pname, cname, {kk: round(v * 1e3, 1) for kk, v in r.items()}, "us", flush=True)
        rows.append(row)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "ab_fp8_ws.json"), "w") as f:
        json.dump({"device": torch.cuda.get_device_name(0), "git": os.environ.get("GIT_SHA", "unknown"),
                   "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
