"""Run the W4A16 GEMV kernels (and cuBLAS bf16) a few times on decode shapes, for ``ncu`` to profile.

    ncu --clock-control none -k regex:'gemv|gemm|Kernel' --section SpeedOfLight ... python3 benchmarks/experiments/profile_gemv.py
    python3 benchmarks/experiments/profile_gemv.py --cases nvfp4:28672x8192:1,nvfp4:28672x8192:16
"""

import argparse
import json

import torch

import lowbit
from lowbit.kernels import gemv_w4 as G

p = argparse.ArgumentParser()
p.add_argument("--cases", default="nvfp4:8192x8192:1,nvfp4:28672x8192:1,nvfp4:28672x8192:16,nf4:28672x8192:1")
p.add_argument("--calls", type=int, default=2)
p.add_argument("--cublas", action="store_true")
p.add_argument("--mma-config", default=None, help="JSON dict passed as gemv_w4(mma_config=...)")
a = p.parse_args()
torch.manual_seed(0)
for case in a.cases.split(","):
    fmt, shape, m = case.split(":")
    n, k = map(int, shape.split("x"))
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(int(m), k, device="cuda", dtype=torch.bfloat16)
    opts = {"global_scale": torch.tensor(1.0)} if fmt == "nvfp4" else {}
    q = lowbit.quantize(w, fmt, **opts)
    pw = G.prepare_w4(q)
    for _ in range(a.calls):
        G.gemv_w4(x, pw, mma_config=None if a.mma_config is None else json.loads(a.mma_config))
        if a.cublas:
            x @ w.T
    torch.cuda.synchronize()
    print("ran", case, flush=True)
