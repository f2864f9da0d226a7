"""Whether a QuantLinear should run the register-operand GEMM (``gemm_w4.gemm_w4_ra``) at small M: eager median,
CUDA-graph replay and host microseconds per call (launches only, no sync; ``F.linear``'s for scale) with
``policy.REGISTER_OPERAND_SMALL_M_MIN_WORK`` as shipped and lowered to 1e8, so that the rule takes the smaller
layers too. Prints one line per (format, shape, setting) with the route the policy chose.

    PYTHONPATH=src python benchmarks/experiments/ab_register_operand.py [--m 64] [--formats nvfp4,mxfp4]
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F
import triton

from lowbit.nn import QuantLinear
from lowbit.ops import policy

SHAPES = [(6144, 4096), (4096, 14336), (28672, 8192), (1024, 4096)]


def host_us(fn, n: int = 200) -> float:
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    return (t1 - t) / n * 1e6


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--m", type=int, default=64)
    ap.add_argument("--formats", default="nvfp4,mxfp4")
    args = ap.parse_args()
    shipped = policy.REGISTER_OPERAND_SMALL_M_MIN_WORK
    torch.manual_seed(0)
    m = args.m
    for n, k in SHAPES:
        lin = torch.nn.Linear(k, n, bias=False, device="cuda", dtype=torch.bfloat16)
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        fl = host_us(lambda x=x, lin=lin: F.linear(x, lin.weight))
        for fmt in args.formats.split(","):
            for bound in (shipped, 10**8):
                policy.REGISTER_OPERAND_SMALL_M_MIN_WORK = bound
                layer = QuantLinear.from_linear(lin, f"w4a16-{fmt}")
                path = policy.linear_decide(m, x.device, layer.weight_qtensor, "auto")[0]
                layer(x)
                eager = triton.testing.do_bench(lambda layer=layer, x=x: layer(x), warmup=50, rep=300) * 1e3
                host = host_us(lambda layer=layer, x=x: layer(x))
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g):
                    layer(x)
                graph = triton.testing.do_bench(g.replay, warmup=50, rep=300) * 1e3
                print(f"{fmt} {n}x{k} M={m} bound={bound:.0e} path={path:12s} eager {eager:6.1f} us graph "
                      f"{graph:6.1f} us host {host:5.1f} us (F.linear host {fl:4.1f})", flush=True)
    policy.REGISTER_OPERAND_SMALL_M_MIN_WORK = shipped


if __name__ == "__main__":
    main()
