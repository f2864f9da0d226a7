"""Sweep elements-per-program and warps of the block-scaled kernels on the GPU (one device call)."""

import json
import os

import torch
from triton.testing import do_bench

import lowbit
from lowbit.kernels import blockscaled as kb

out_dir = os.environ.get("OUT", "benchmarks/results/tmp")
x = torch.randn(16384, 16384, device="cuda", dtype=torch.bfloat16)
big = torch.empty(1 << 29, dtype=torch.bfloat16, device="cuda").normal_()
dst = torch.empty_like(big)
copy = 2 * big.numel() * 2 / do_bench(lambda: dst.copy_(big), return_mode="median") / 1e6
del big, dst
rows = []
for elems in (2048, 4096, 8192, 16384):
    for warps in (4, 8):
        kb.TILE.update(elems=elems, warps=warps)
        for fmt, opts in [("nvfp4", {"global_scale": torch.tensor(1.0)}), ("mxfp4", {}), ("mxfp6_e3m2", {}),
                          ("mxfp8_e4m3", {}), ("fp4_b32", {})]:
            q = lowbit.quantize(x, fmt, backend="triton", **opts)
            nbytes = x.numel() * 2 + q.data.numel() * q.data.element_size() + q.scale.numel() * q.scale.element_size()
            tq = do_bench(lambda: lowbit.quantize(x, fmt, backend="triton", **opts), return_mode="median")
            td = do_bench(lambda: lowbit.dequantize(q, torch.bfloat16, backend="triton"), return_mode="median")
            rows.append(dict(elems=elems, warps=warps, fmt=fmt, q_pct=100 * nbytes / tq / 1e6 / copy,
                             dq_pct=100 * nbytes / td / 1e6 / copy))
            print(f"{elems:6} {warps} {fmt:12} quant {rows[-1]['q_pct']:5.1f}%  dequant {rows[-1]['dq_pct']:5.1f}%", flush=True)
json.dump({"copy_GBps": copy, "rows": rows}, open(f"{out_dir}/tile_sweep.json", "w"), indent=1)
