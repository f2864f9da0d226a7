"""Where the host time of one ``QuantLinear`` call goes, per scheme: CPU microseconds per call (back-to-back
calls, no synchronization) at M = 1 and M = 2048 against ``F.linear``, GPU time of the same call (CUDA-graph
replays), the top functions of a cProfile of M = 1 calls and, at larger M, the GPU kernels of one call
(torch.profiler). JSON to ``$OUT/profile_layer_host.json``.

    PYTHONPATH=src python benchmarks/experiments/profile_layer_host.py [--schemes w4a16-nvfp4,w8a8-fp8-block] [--k 4096]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.nn.functional as F

import lowbit
from lowbit.bench.e2e import host_us_per_call
from lowbit.bench.timing import graph_ms
from lowbit.nn import SCHEMES, QuantLinear

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # this folder (_common)
from _common import cprofile_text  # noqa: E402


def _graph_us(fn, reps: int = 50) -> float:
    """GPU microseconds per call, 10 calls per CUDA-graph replay."""
    return graph_ms(fn, reps, calls=10) * 1e3


def _profile(fn, calls: int = 200, top: int = 18) -> str:
    for _ in range(5):
        fn()
    return cprofile_text(fn, calls, top)


def _gpu_kernels(fn, top: int = 8) -> list:
    """[(kernel name, microseconds per call)] of ``fn``'s CUDA kernels, the most expensive first."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    reps = 5
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    rows = [(e.key[:90], e.device_time_total / reps) for e in prof.key_averages() if e.device_time_total > 0]
    return sorted(rows, key=lambda r: -r[1])[:top]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--schemes", default=",".join(SCHEMES))
    ap.add_argument("--n", type=int, default=4096)
    ap.add_argument("--k", type=int, default=4096)
    ap.add_argument("--ms", default="1,2048")
    ap.add_argument("--profile-ms", default="1", help="the M values whose calls get a cProfile (the others: kernels)")
    args = ap.parse_args()
    out_dir = os.environ.get("OUT", "benchmarks/results/tmp")
    os.makedirs(out_dir, exist_ok=True)
    torch.manual_seed(0)
    lin = torch.nn.Linear(args.k, args.n, bias=False, device="cuda", dtype=torch.bfloat16)
    rows = []
    with torch.inference_mode():
        profiled = {int(v) for v in args.profile_ms.split(",")}
        for m in [int(v) for v in args.ms.split(",")]:
            x = torch.randn(m, args.k, device="cuda", dtype=torch.bfloat16)
            base = {"host_us": host_us_per_call(lambda: F.linear(x, lin.weight), "cuda", 300),
                    "gpu_us": _graph_us(lambda: F.linear(x, lin.weight))}
            if m > 1:
                base["gpu_kernels"] = _gpu_kernels(lambda: F.linear(x, lin.weight))
            print(f"M={m} F.linear host {base['host_us']:.1f} us, GPU {base['gpu_us']:.1f} us", flush=True)
            for scheme in args.schemes.split(","):
                row = {"scheme": scheme, "m": m, "f_linear": base}
                try:
                    layer = QuantLinear.from_linear(lin, scheme)
                    row["host_us"] = host_us_per_call(lambda: layer(x), "cuda", 300)
                    row["gpu_us"] = _graph_us(lambda: layer(x))
                    row["explain"] = (lowbit.explain(x, layer.weight_qtensor) if layer.scheme.weight_only else
                                      "scaled_linear")
                    if m in profiled:
                        row["profile"] = _profile(lambda: layer(x))
                    else:
                        row["gpu_kernels"] = _gpu_kernels(lambda: layer(x))
                except Exception as e:  # noqa: BLE001 - reported, the run goes on
                    row["error"] = f"{type(e).__name__}: {e}"
                rows.append(row)
                print(f"M={m} {scheme}: host {row.get('host_us', float('nan')):.1f} us "
                      f"({row.get('host_us', float('nan')) / base['host_us']:.2f}x F.linear), "
                      f"GPU {row.get('gpu_us', float('nan')):.1f} us {row.get('error', '')}", flush=True)
                if "profile" in row:
                    print(row["profile"][:2500], flush=True)
                for name, us in row.get("gpu_kernels", []):
                    print(f"    {us:9.1f} us  {name}", flush=True)
    with open(os.path.join(out_dir, "profile_layer_host.json"), "w") as f:
        json.dump({"device": torch.cuda.get_device_name(0), "n": args.n, "k": args.k, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
