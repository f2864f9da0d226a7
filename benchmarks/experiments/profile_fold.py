"""Where the time of scaled_mm's FP8 re-encoding route goes: each re-encoding launch and the whole call, timed
eagerly (do_bench, L2 flushed) and as CUDA-graph replays (no host launch cost), against cuBLAS bf16.

    PYTHONPATH=src python benchmarks/experiments/profile_fold.py [--shapes 7168x2048,8192x8192] [--ms 1024,4096]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

import torch
import triton
from triton.testing import do_bench

import lowbit
from lowbit.kernels import blockscaled as kb

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # this folder (_common)
from _common import _time_graph  # noqa: E402 - CUDA graph of 20 calls


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="7168x2048,8192x8192")
    ap.add_argument("--ms", default="1024,4096")
    ap.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results/tmp"))
    args = ap.parse_args()
    meta = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "triton": triton.__version__,
            "git": os.environ.get("GIT_SHA", "unknown"), "host": platform.node(), "date": time.strftime("%Y-%m-%d")}
    rows = []
    for shape in args.shapes.split(","):
        n, k = (int(v) for v in shape.split("x"))
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.05
        wq = lowbit.quantize(w, "mxfp4")
        for m in (int(v) for v in args.ms.split(",")):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            flag = torch.zeros(1, dtype=torch.int32, device="cuda")
            cases = {
                "cublas_bf16": lambda: x @ w.T,  # noqa: B023
                "fold_weight_128x128": lambda: kb.mxfp4_fold(wq, (128, 128), flag),  # noqa: B023
            }
            for act in ("mxfp4", "fp8_rowwise", "fp8_block"):
                a = lowbit.quantize(x, act)
                if act == "mxfp4":
                    cases["fold_activation_1x128"] = lambda a=a, flag=flag: kb.mxfp4_fold(a, (1, 128), flag)
                cases[f"scaled_mm_{act}"] = lambda a=a, wq=wq: lowbit.scaled_mm(a, wq)
            cases["quantize_x_fp8_block"] = lambda: lowbit.quantize(x, "fp8_block")  # noqa: B023
            # the FP8 GEMM alone on operands folded once: cuBLASLt's (as the route runs it) and DeepGEMM's
            wf = kb.mxfp4_fold(wq, (128, 128), flag, cublas_scales=True)
            af = lowbit.quantize(x, "fp8_block")
            from lowbit.kernels import cublas_fp8_block as cb

            sa = cb.activation_scales(af.scale, m, k // 128, None)
            cases["fp8_gemm_cublas_only"] = lambda: cb.mm(af.data, sa, wf.data, wf.scale, None, None,  # noqa: B023
                                                          torch.bfloat16, b_scale_zero_padded=True)
            try:
                import deep_gemm

                wd = kb.mxfp4_fold(wq, (128, 128), flag)
                out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
                cases["fp8_gemm_deepgemm_only"] = lambda: deep_gemm.fp8_gemm_nt(  # noqa: B023
                    (af.data, sa), (wd.data, wd.scale.contiguous()), out)  # noqa: B023
            except ImportError:
                pass
            for name, fn in cases.items():
                row = {"N": n, "K": k, "M": m, "case": name,
                       "eager_us": do_bench(fn, rep=25, return_mode="median") * 1e3, "graph_us": _time_graph(fn)}
                rows.append(row)
                print(f"{n}x{k} M={m} {name:24s} eager {row['eager_us']:8.1f} us  graph {row['graph_us']:8.1f} us",
                      flush=True)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "profile_fold.json"), "w") as f:
        json.dump({**meta, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
