"""Eager against CUDA-graph time of one w4a4-nvfp4 ``QuantLinear`` at DiT sizes (the ``"dequant"`` route: the
activation quantized then decoded, the weight decoded a chunk of rows at a time, cuBLAS, the one-pass epilogue),
for a few chunk sizes (``scaled_mm_routes.DEQUANT_CHUNK_BYTES``), with cuBLAS bf16 of the same run, and a cProfile
of the eager call (where the host time goes). JSON and the profiles to $OUT.

    PYTHONPATH=src python benchmarks/experiments/profile_dequant_route.py [--shapes 8190x13824x5120]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

from lowbit.kernels import scaled_mm_routes
from lowbit.nn import QuantLinear

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # this folder (_common)
from _common import cprofile_text, eager_us, graph_ms  # noqa: E402


def _graph_us(fn) -> float:
    return graph_ms(fn, repeats=5, calls=4) * 1e3


def _eager_us(fn) -> float:
    return eager_us(fn, calls=20, warmups=3)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="8190x13824x5120,8190x5120x5120,32760x5120x13824")
    ap.add_argument("--chunks-mb", default="64,256,1024")
    args = ap.parse_args()
    default_chunk = scaled_mm_routes.DEQUANT_CHUNK_BYTES  # restored after each shape's sweep
    out_dir = os.environ.get("OUT", "benchmarks/results/tmp")
    os.makedirs(out_dir, exist_ok=True)
    rows = []
    for shape in args.shapes.split(","):
        m, n, k = (int(v) for v in shape.split("x"))
        lin = torch.nn.Linear(k, n, bias=True, device="cuda", dtype=torch.bfloat16)
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        row = {"shape": shape, "bf16_graph_us": _graph_us(lambda: lin(x)), "bf16_eager_us": _eager_us(lambda: lin(x))}
        for mb in (int(v) for v in args.chunks_mb.split(",")):
            scaled_mm_routes.DEQUANT_CHUNK_BYTES = mb << 20
            layer = QuantLinear.from_linear(lin, "w4a4-nvfp4")  # its runners decide under this chunk size
            layer(x)
            g, e = _graph_us(lambda: layer(x)), _eager_us(lambda: layer(x))
            row[f"chunk{mb}"] = {"graph_us": g, "eager_us": e, "graph_vs_bf16": row["bf16_graph_us"] / g,
                                 "eager_vs_bf16": row["bf16_eager_us"] / e}
            with open(os.path.join(out_dir, f"dequant_route_{shape}_{mb}mb.txt"), "w") as f:
                f.write(cprofile_text(lambda: layer(x), 5, 18))
            print(shape, mb, "MB:", json.dumps(row[f"chunk{mb}"]), flush=True)
        scaled_mm_routes.DEQUANT_CHUNK_BYTES = default_chunk
        print(json.dumps(row), flush=True)
        rows.append(row)
        with open(os.path.join(out_dir, "profile_dequant_route.json"), "w") as f:
            json.dump({"device": torch.cuda.get_device_name(0), "git": os.environ.get("GIT_SHA", "?"), "rows": rows},
                      f, indent=1)


if __name__ == "__main__":
    main()
