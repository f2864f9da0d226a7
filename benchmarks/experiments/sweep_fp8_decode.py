"""fp8_block decode (M <= 64) tile / split-K configs under CUDA-graph replay over weight copies out of L2;
JSON to $OUT. ``PYTHONPATH=src python benchmarks/experiments/sweep_fp8_decode.py``"""

from __future__ import annotations

import itertools
import os
import platform
import sys
import time

import torch
import triton

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # this folder (_common)
import _common as W  # noqa: E402

_peers = W
import lowbit  # noqa: E402
from lowbit.kernels import scaled_mm as ks

SHAPES = [(7168, 16384), (8192, 8192), (4096, 7168), (7168, 2048), (24576, 1536)]


def main() -> None:
    out = os.environ.get("OUT", "benchmarks/results/tmp")
    meta = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "triton": triton.__version__,
            "git": os.environ.get("GIT_SHA", "unknown"), "host": platform.node(), "date": time.strftime("%Y-%m-%d")}
    roof = W._copy_roof()
    configs = [{"BM": bm, "BN": bn, "BK": 128, "GROUP_M": 1, "num_warps": 4, "num_stages": st, "split_k": 16,
                "ctas_per_sm": c, "min_k_tiles": mk}
               for bm, bn, st, c, mk in itertools.product((16, 64), (64, 128), (3, 5), (2, 4, 8), (2,))]
    rows = []
    for n, k in SHAPES:
        w0 = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.05
        qs = [lowbit.quantize(w0 * (1 + i), "fp8_block", block=(128, 128)) for i in range(W._copies(n * k))]
        for m in (1, 16, 64):
            a = lowbit.quantize(torch.randn(m, k, device="cuda", dtype=torch.bfloat16), "fp8_block")
            best = None
            for cfg in configs:
                if cfg["BM"] < m:
                    continue
                try:
                    t = W._time_graph(W._rotating([lambda q=q, c=cfg: ks.scaled_mm(a, q, None, None, torch.bfloat16, config=c) for q in qs]))
                except Exception as e:  # noqa: BLE001
                    print("ERR", cfg, type(e).__name__, str(e)[:100], flush=True)
                    continue
                gbps = qs[0].nbytes / (t * 1e-6) / 1e9
                rows.append({"N": n, "K": k, "M": m, "config": cfg, "us": t, "pct_of_copy": 100 * gbps / roof})
                if best is None or t < best[0]:
                    best = (t, cfg, 100 * gbps / roof)
            print(f"{n}x{k} M={m}: best {best[0]:.1f} us ({best[2]:.0f}% of copy) {best[1]}", flush=True)
        _peers.write_json(os.path.join(out, "sweep_fp8_decode.json"), {**meta, "copy_GBps": roof, "rows": rows})


if __name__ == "__main__":
    main()
