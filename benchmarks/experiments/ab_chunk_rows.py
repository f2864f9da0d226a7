"""Whether the dequantize route should decode a weight that fits one chunk in one piece: ``QuantLinear`` eager
and CUDA-graph microseconds per call with ``ops.linear._chunk_rows`` as shipped (at most half the rows per
chunk, so two chunks at least) against one chunk wherever the chunk cap holds the whole decoded weight.
JSON to ``$OUT/ab_chunk_rows.json``.

    PYTHONPATH=src python benchmarks/experiments/ab_chunk_rows.py [--schemes w4a16-nvfp4,w4a16-nf4] [--ms 256,512,1024]
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys

import torch

from lowbit.nn import QuantLinear

L = importlib.import_module("lowbit.ops.linear")  # the module (lowbit.ops.linear is also the function's name)

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # this folder (_common)
from _common import _time_graph, eager_us

SHIPPED = L._chunk_rows


def _one_chunk_rows(w, element_size, chunk_bytes):
    n, k = w.shape
    rows = (chunk_bytes or L.DEQUANT_CHUNK_BYTES) // (element_size * k)
    return n if rows >= n else SHIPPED(w, element_size, chunk_bytes)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--schemes", default="w4a16-nvfp4,w4a16-nf4")
    ap.add_argument("--shapes", default="1024x4096,4096x4096,6144x4096")
    ap.add_argument("--ms", default="256,512,1024")
    args = ap.parse_args()
    rows = []
    torch.manual_seed(0)
    for shape in args.shapes.split(","):
        n, k = (int(v) for v in shape.split("x"))
        lin = torch.nn.Linear(k, n, bias=False, device="cuda", dtype=torch.bfloat16)
        for scheme in args.schemes.split(","):
            for m in [int(v) for v in args.ms.split(",")]:
                x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
                row = {"scheme": scheme, "n": n, "k": k, "m": m}
                outs = {}
                for name, fn in (("shipped", SHIPPED), ("one", _one_chunk_rows)):
                    L._chunk_rows = fn
                    try:
                        with torch.inference_mode():
                            layer = QuantLinear.from_linear(lin, scheme)
                            outs[name] = layer(x).float()
                            row[f"{name}_chunks"] = len(L.weight_chunks(layer.weight_qtensor, 2))
                            row[f"{name}_eager_us"] = eager_us(lambda: layer(x))  # noqa: B023
                            row[f"{name}_graph_us"] = _time_graph(lambda: layer(x))  # noqa: B023
                    finally:
                        L._chunk_rows = SHIPPED
                ref = outs["shipped"]
                row["rel_diff"] = float((outs["one"] - ref).norm() / ref.norm().clamp_min(1e-30))
                rows.append(row)
                print(f"{scheme:12s} {n}x{k} M={m}: chunks {row['shipped_chunks']} -> {row['one_chunks']}, eager "
                      f"{row['shipped_eager_us']:.1f} -> {row['one_eager_us']:.1f} us, graph {row['shipped_graph_us']:.1f}"
                      f" -> {row['one_graph_us']:.1f} us, rel diff {row['rel_diff']:.1e}", flush=True)
    out = os.environ.get("OUT", "benchmarks/results/tmp")
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "ab_chunk_rows.json"), "w") as f:
        json.dump({"device": torch.cuda.get_device_name(0), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
