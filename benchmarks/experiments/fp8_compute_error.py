"""Error of the FP8 compute mode of w4a4-nvfp4 layers (``lowbit.nn.set_compute(model, "fp8_block")``) against the
exact W4A4 product and the unquantized one, on random DiT-wide layers (any device; the CPU runs the references).

    PYTHONPATH=src python benchmarks/experiments/fp8_compute_error.py [--device cuda] [--m 512]
"""

from __future__ import annotations

import argparse

import torch
from torch import nn

import lowbit
from lowbit.nn import set_compute


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--m", type=int, default=512)
    args = ap.parse_args()
    print("K x N, activations | exact W4A4 vs fp32 | fp8 mode vs fp32 | fp8 mode vs exact | W4A16 (bf16 x) vs fp32")
    for k, n, dist in ((5120, 1024, "gaussian"), (5120, 1024, "1% channels x20"), (13824, 512, "gaussian")):
        torch.manual_seed(0)
        lin = nn.Linear(k, n, bias=False, device=args.device, dtype=torch.bfloat16)
        with torch.no_grad():
            lin.weight.normal_(0.0, 0.02)
        x = torch.randn(args.m, k, device=args.device)
        if dist != "gaussian":
            x[:, torch.randperm(k)[: k // 100]] *= 20
        x = x.to(torch.bfloat16)
        dense = x.float() @ lin.weight.float().T
        w4 = lowbit.dequantize(lowbit.quantize(lin.weight.float(), "nvfp4"), torch.float32)
        layer = lowbit.quantize_model(nn.Sequential(lin), "w4a4-nvfp4")
        with torch.inference_mode():
            exact = layer(x)
            set_compute(layer, "fp8_block")
            fast = layer(x)
        print(f"{k} x {n}, {dist} | {rel(exact, dense):.4f} | {rel(fast, dense):.4f} | {rel(fast, exact):.4f} | "
              f"{rel(x.float() @ w4.T, dense):.4f}")


if __name__ == "__main__":
    main()
