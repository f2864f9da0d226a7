"""GPU time per kernel of one ``QuantLinear`` call (torch.profiler, CUDA activities), against cuBLAS bf16's
``F.linear`` on the same shapes: where a scheme's time goes at prefill / DiT sizes. Prints a table per case and
writes JSON to $OUT.

    PYTHONPATH=src python benchmarks/experiments/profile_qlinear_kernels.py --scheme w4a4-nvfp4 \
        [--shapes 8190x5120x5120,32760x5120x13824] [--bias] [--three-d]
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.nn.functional as F

from lowbit.nn import QuantLinear

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # this folder (_common)
from _common import kernel_times, write_json  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--scheme", default="w4a4-nvfp4")
    ap.add_argument("--shapes", default="8190x5120x5120,32760x5120x5120,32760x5120x13824")
    ap.add_argument("--bias", action="store_true")
    ap.add_argument("--three-d", action="store_true", help="x as [1, M, K], as a DiT block passes it")
    ap.add_argument("--calls", type=int, default=10)
    ap.add_argument("--dit", default=None, help="instead: one Wan2.1-14B-shaped DiT block (lowbit dit) in this "
                    "config (bf16, lowbit:<scheme>), at --tokens")
    ap.add_argument("--tokens", type=int, default=8190)
    args = ap.parse_args()
    if args.dit:
        _dit(args)
        return
    rows = []
    for shape in args.shapes.split(","):
        m, n, k = (int(v) for v in shape.split("x"))
        lin = torch.nn.Linear(k, n, bias=args.bias, device="cuda", dtype=torch.bfloat16)
        layer = QuantLinear.from_linear(lin, args.scheme)
        x = torch.randn(1, m, k, device="cuda", dtype=torch.bfloat16) if args.three_d else \
            torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        with torch.inference_mode():
            per, total = kernel_times(lambda layer=layer, x=x: layer(x), args.calls)
            _, ref = kernel_times(lambda lin=lin, x=x: F.linear(x, lin.weight, lin.bias), args.calls)
        print(f"{args.scheme} {shape}: {total:.1f} us of GPU time a call, cuBLAS bf16 {ref:.1f} us "
              f"({ref / total:.3f}x)", flush=True)
        for name, us in sorted(per.items(), key=lambda kv: -kv[1]):
            print(f"  {us:9.1f} us  {name}", flush=True)
        rows.append({"scheme": args.scheme, "shape": shape, "bias": args.bias, "three_d": args.three_d, "gpu_us": total, "cublas_bf16_us": ref,
                     "kernels_us": per})
        del layer, lin, x
        torch.cuda.empty_cache()
    out = os.environ.get("OUT", "benchmarks/results/tmp")
    os.makedirs(out, exist_ok=True)
    tag = ("_bias" if args.bias else "") + ("_3d" if args.three_d else "")
    path = os.path.join(out, f"profile_qlinear_kernels_{args.scheme}{tag}.json")
    write_json(path, {"device": torch.cuda.get_device_name(), "rows": rows})
    print(f"wrote {path}")


def _dit(args) -> None:
    from lowbit.bench import dit

    s = dit.SHAPES["wan2.1-14b"]
    with torch.inference_mode():
        model = dit.apply_config(dit.build_dit(s), args.dit)
        inputs = dit.make_inputs(s, args.tokens, torch.device("cuda"))
        per, total = kernel_times(lambda: model(*inputs), 3)
    print(f"DiT block {args.dit} at {args.tokens} tokens: {total:.1f} us of GPU time a call", flush=True)
    for name, us in sorted(per.items(), key=lambda kv: -kv[1])[:25]:
        print(f"  {us:9.1f} us  {name}", flush=True)
    print("layers:", sorted({type(m).__name__ for m in model.modules()}), flush=True)


if __name__ == "__main__":
    main()
