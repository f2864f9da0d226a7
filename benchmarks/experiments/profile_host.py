"""Host cost of one ``lowbit.scaled_mm`` call: GPU time (CUDA-graph replays), eager time per call when calls are
issued back to back (host-bound when it exceeds the GPU time), and where the host time goes (cProfile).
JSON and profiles to $OUT.

    PYTHONPATH=src python benchmarks/experiments/profile_host.py
"""

from __future__ import annotations

import json
import os
import platform
import sys
import time

import torch
import triton

import lowbit

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # this folder (_common)
from _common import _time_graph, cprofile_text, eager_us

CASES = [  # (name, a format, a options, b format, b options, M, N, K)
    ("fp8_block_m16", "fp8_block", {}, "fp8_block", {"block": (128, 128)}, 16, 24576, 1536),
    ("fp8_block_m64", "fp8_block", {}, "fp8_block", {"block": (128, 128)}, 64, 2112, 7168),
    ("fp8_block_m4096", "fp8_block", {}, "fp8_block", {"block": (128, 128)}, 4096, 7168, 2048),
    ("fp8_block_m256", "fp8_block", {}, "fp8_block", {"block": (128, 128)}, 256, 2112, 7168),
    ("fp8_block_m256_long_k", "fp8_block", {}, "fp8_block", {"block": (128, 128)}, 256, 7168, 16384),
    ("mxfp4_m4096", "mxfp4", {}, "mxfp4", {}, 4096, 7168, 2048),
    ("w4a8_m4096", "fp8_rowwise", {}, "mxfp4", {}, 4096, 7168, 2048),
    ("nvfp4_m16", "nvfp4", {}, "nvfp4", {}, 16, 7168, 2048),
]


def main() -> None:
    out_dir = os.environ.get("OUT", "benchmarks/results/tmp")
    os.makedirs(out_dir, exist_ok=True)
    meta = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "triton": triton.__version__,
            "git": os.environ.get("GIT_SHA", "unknown"), "host": platform.node(), "date": time.strftime("%Y-%m-%d")}
    rows = []
    only = os.environ.get("CASES")
    for name, af, ao, bf, bo, m, n, k in CASES:
        if only and name not in only.split(","):
            continue
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
        aq = lowbit.quantize(x, af, **ao)
        wq = lowbit.quantize(w, bf, **bo)

        def fn(aq=aq, wq=wq):
            return lowbit.scaled_mm(aq, wq)

        row = {"case": name, "M": m, "N": n, "K": k, "plan": str(lowbit.ops.plan_scaled_mm(aq, wq))}
        row["graph_us"] = _time_graph(fn)
        row["eager_us"] = eager_us(fn)
        text = cprofile_text(fn, 100, 25)
        with open(os.path.join(out_dir, f"profile_host_{name}.txt"), "w") as f:
            f.write(text)
        print(row, flush=True)
        print("\n".join(text.splitlines()[:40]), flush=True)
        rows.append(row)
        with open(os.path.join(out_dir, "profile_host.json"), "w") as f:
            json.dump({**meta, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
