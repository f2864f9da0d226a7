"""Tile sweep of the bf16 dequantize kernels (nvfp4/mxfp4, nf4, int4_awq) on prefill-sized weights.

    PYTHONPATH=src python benchmarks/experiments/sweep_dequant_tile.py

The chunked prefill path (``lowbit.ops.linear.linear_dequant_gemm``) pays one dequantize per call, so its
bandwidth is part of every M = 4096 result. Each variant's output is checked bit for bit against the shipped
config's before it is timed. Times are ``do_bench`` medians (L2 flushed); GB/s counts bytes read + written.
JSON to ``$OUT/sweep_dequant_tile.json``.
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch

import lowbit
from lowbit.kernels import blockscaled, int4_awq, nf4

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # this folder (_common)
from _common import _quantize, bench, header  # noqa: E402

MODULES = {"nvfp4": blockscaled, "mxfp4": blockscaled, "nf4": nf4, "int4_awq": int4_awq}
VARIANTS = {
    "nvfp4": [{"elems": e, "warps": w} for e in (2048, 4096, 8192, 16384) for w in (4, 8)],
    "nf4": [{"elems": e, "warps": w} for e in (2048, 4096, 8192, 16384) for w in (4, 8)],
    "int4_awq": [{"elems": e, "cols": c, "warps": w} for e in (4096, 8192, 16384) for c in (64, 128)
                 for w in (4, 8)],
}
VARIANTS["mxfp4"] = VARIANTS["nvfp4"]


def weight_bytes(q) -> int:
    return sum(t.numel() * t.element_size() for t in (q.data, q.scale, q.zeros, q.nested_scale) if t is not None)


def main() -> None:
    dev = torch.device("cuda")
    rows, t0 = [], time.time()
    for n, k in [(8192, 8192), (28672, 8192)]:
        w = torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02
        for fmt in ("nvfp4", "mxfp4", "nf4", "int4_awq"):
            q = _quantize(w, fmt)
            mod = MODULES[fmt]
            shipped = dict(mod.TILE)
            want = lowbit.dequantize(q, torch.bfloat16)
            nbytes = weight_bytes(q) + want.numel() * 2
            for v in VARIANTS[fmt]:
                mod.TILE.update(v)
                try:
                    got = lowbit.dequantize(q, torch.bfloat16)
                    exact = torch.equal(got.view(torch.int16), want.view(torch.int16))
                    us = bench(lambda: lowbit.dequantize(q, torch.bfloat16), 40) * 1e3  # noqa: B023
                    row = {"format": fmt, "N": n, "K": k, "tile": v, "us": us, "gbps": nbytes / us / 1e3,
                           "exact": exact, "shipped": v == shipped}
                except Exception as e:  # noqa: BLE001 - record a variant that does not launch
                    row = {"format": fmt, "N": n, "K": k, "tile": v, "error": f"{type(e).__name__}: {e}"[:300]}
                finally:
                    mod.TILE.clear()
                    mod.TILE.update(shipped)
                rows.append(row)
                print(json.dumps(row), flush=True)
            del q, want
        del w
        torch.cuda.empty_cache()
    out = os.environ.get("OUT", "benchmarks/results/tmp")
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "sweep_dequant_tile.json"), "w") as f:
        json.dump({"header": header(), "rows": rows, "seconds": time.time() - t0}, f, indent=1)


if __name__ == "__main__":
    main()
