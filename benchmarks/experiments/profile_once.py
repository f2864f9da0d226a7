"""Run each block-scaled kernel once on 16384^2 bf16, for `ncu` to profile (one device call)."""

import torch

import lowbit

x = torch.randn(16384, 16384, device="cuda", dtype=torch.bfloat16)
g = torch.tensor(1.0)
for fmt, opts in [("nvfp4", {"global_scale": g}), ("mxfp4", {}), ("mxfp8_e4m3", {})]:
    q = lowbit.quantize(x, fmt, backend="triton", **opts)
    lowbit.dequantize(q, torch.bfloat16, backend="triton")
torch.cuda.synchronize()
