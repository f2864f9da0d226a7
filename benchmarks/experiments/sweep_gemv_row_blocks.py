"""The tensor-core GEMV past M = 16: blocks of up to ``block_rows`` x rows in programs of their own
(``MMA_MAX_M``, an ``mma_config`` with ``max_m`` up to 64), against what ``lowbit.linear`` runs there without
row blocks (the tensor-core GEMM) and cuBLAS bf16, at M = 16 ... 64.

    PYTHONPATH=src python benchmarks/experiments/sweep_gemv_row_blocks.py [--formats nvfp4,int4_awq] [--ms 24,32]
        [--block-rows 16,32] [--ctas-per-sm 4,8] [--maxnreg 0,168]

CUDA-graph replays with the weights rotated out of L2 (the GPU time inside a model's graph). Each output is
checked against the fp32 reference first. JSON to ``$OUT/sweep_gemv_row_blocks.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.nn.functional as F

import lowbit
from lowbit.kernels import gemv_w4 as G
from lowbit.kernels.gemv_mma_layout import mma_layout
from lowbit.kernels.gemv_prepack import prepare_w4

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # this folder (_common)
from _common import _copies, _problem, _quantize, _rotating, header

from lowbit.bench.common import rel_errors
from lowbit.bench.timing import graph_ms


_MMA_PLAN = G.mma_plan
_MAXNREG = [0]


def _plan_with_register_limit(*a, **k):
    plan = _MMA_PLAN(*a, **k)
    if _MAXNREG[0]:
        plan.launch = G.Launch(plan.fn, plan.grid, plan.consts, plan.num_warps, maxnreg=_MAXNREG[0])
    return plan


def _limit_registers(ps, regs: int) -> None:
    """The tensor-core GEMV's launches compiled with ptxas' register limit ``regs`` (0: Triton's default) from
    now on: the weights' cached plans are dropped, and new ones carry the option."""
    _MAXNREG[0] = regs
    G.mma_plan = _plan_with_register_limit
    for p_ in ps:
        mma_layout(p_).plans.clear()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--formats", default="nvfp4,mxfp4,int4_awq,nf4")
    ap.add_argument("--ms", default="16,24,32,48,64")
    ap.add_argument("--shapes", default="6144x4096,4096x14336,28672x8192")
    ap.add_argument("--ctas-per-sm", default="4", help="the split-K target(s) to try for M > 16, comma-separated")
    ap.add_argument("--block-rows", default="16,32", help="the most x rows per block to try, comma-separated")
    ap.add_argument("--maxnreg", default="0", help="ptxas register limits to try (0: Triton's default), "
                    "comma-separated")
    args = ap.parse_args()
    dev = torch.device("cuda")
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    rows = []
    out_path = os.path.join(os.environ.get("OUT", "."), "sweep_gemv_row_blocks.json")
    for n, k in shapes:
        for name in args.formats.split(","):
            _, w = _problem(n, k, 1, dev)
            q = _quantize(w, name)
            qs = [q] + [_quantize(w, name) for _ in range(min(_copies(w.numel() // 2), 8) - 1)]
            ps = [prepare_w4(q_) for q_ in qs]
            for p_ in ps:
                mma_layout(p_)  # laid out now: a graph capture does not build a layout (the call would fall back)
            ws = [w] + [w.clone() for _ in range(min(_copies(w.numel() * 2), 8) - 1)]
            for m in (int(v) for v in args.ms.split(",")):
                x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
                ref = lowbit.ops.linear_reference(x, q, out_dtype=torch.float32)
                row = {"fmt": name, "n": n, "k": k, "m": m}
                row["cublas_us"] = graph_ms(_rotating([lambda w_=w_, x=x: F.linear(x, w_) for w_ in ws]),
                                            repeats=10, calls=5) * 1e3
                routes = G.MMA["row_blocks_max_m"]
                G.MMA["row_blocks_max_m"] = {}   # the route without row blocks (they are measured below)
                try:
                    row["default_path"] = lowbit.ops.plan_linear(x, q).path
                    for q_ in qs:
                        lowbit.linear(x, q_)  # each copy's route prepared (e.g. its fragments) before the capture
                    fn = _rotating([lambda q_=q_, x=x: lowbit.linear(x, q_) for q_ in qs])
                    row["default_us"] = graph_ms(fn, repeats=10, calls=5) * 1e3
                finally:
                    G.MMA["row_blocks_max_m"] = routes
                row["blocks"] = {}
                variants = [(int(c), int(b), int(r)) for c in args.ctas_per_sm.split(",")
                            for b in args.block_rows.split(",") for r in args.maxnreg.split(",")]
                for cps, br, regs in variants:
                    cfg = {**G.MMA, "max_m": 64, "ctas_per_sm": cps, "block_rows": br}
                    _limit_registers(ps, regs)
                    out = G.gemv_w4(x, ps[0], mma_config=cfg)
                    fro, peak = rel_errors(out.float(), ref)
                    fn = _rotating([lambda p_=p_, x=x, cfg=cfg: G.gemv_w4(x, p_, mma_config=cfg) for p_ in ps])
                    us = graph_ms(fn, repeats=10, calls=5) * 1e3
                    name_ = f"cps{cps}/r{br}" + (f"/reg{regs}" if regs else "")
                    row["blocks"][name_] = {"us": us, "rel_fro": fro, "rel_peak": peak,
                                            "x_cublas": row["cublas_us"] / us, "x_default": row["default_us"] / us}
                _limit_registers(ps, 0)
                best = min(row["blocks"].values(), key=lambda v: v["us"])
                rows.append(row)
                blocks = " ".join(f"{c}:{v['us']:.1f}" for c, v in row["blocks"].items())
                print(f"{name:9s} {n}x{k} M={m:3d}  cuBLAS {row['cublas_us']:7.1f} us | default "
                      f"({row['default_path']}) {row['default_us']:7.1f} | row blocks {blocks} -> "
                      f"{best['x_default']:.2f}x GEMM route, {best['x_cublas']:.2f}x cuBLAS "
                      f"(err {best['rel_fro']:.1e})",
                      flush=True)
                with open(out_path, "w") as f:
                    json.dump({"header": header(), "rows": rows}, f, indent=1)
            del qs, ps, ws
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
