"""W4A16 between the GEMV and prefill: the tensor-core GEMM (``gemm_w4``) against dequantize-then-cuBLAS
(``linear_dequant_gemm``) at M = 32 ... 2048, each against cuBLAS bf16 on the same shape.

    PYTHONPATH=src python benchmarks/experiments/sweep_w4a16_mid_m.py [--formats nvfp4,int4_awq] [--ms 64,256]

``lowbit.ops.policy.DEQUANT_GEMM_MIN_M`` decides between the two routes; this sweep sets it per call (1:
always dequantize, a huge value: always the GEMM) and times ``lowbit.linear`` both ways, plus cuBLAS, as
CUDA-graph replays with the weights rotated out of L2 (the GPU time inside a model's graph) and as eager
calls back to back (what an eager prefill pays, host included). Each route's output is checked against the
fp32 reference first. JSON to ``$OUT/sweep_w4a16_mid_m.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.nn.functional as F

import lowbit
from lowbit.ops import policy

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # this folder (_common)
from _common import SHAPES, _copies, _problem, _quantize, _rotating, eager_us, header

from lowbit.bench.common import rel_errors
from lowbit.bench.timing import graph_ms

ROUTES = {"gemm": 1 << 40, "dequant": 1}
lin = sys.modules["lowbit.ops.linear"]  # the package's `linear` attribute is the function


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--formats", default="nvfp4,mxfp4,int4_awq,nf4,fp4_b32")
    ap.add_argument("--ms", default="32,64,128,256,512,1024,2048")
    ap.add_argument("--shapes", default=None, help="NxK,... (default: the W4A16 benchmark's six)")
    ap.add_argument("--chunk-mb", default="64", help="dequantized chunk sizes to try (MB; the route's cap)")
    args = ap.parse_args()
    dev = torch.device("cuda")
    shapes = SHAPES if args.shapes is None else [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    rows = []
    out_path = os.path.join(os.environ.get("OUT", "."), "sweep_w4a16_mid_m.json")
    saved = policy.DEQUANT_GEMM_MIN_M, dict(policy.DEQUANT_GEMM_MIN_M_BY_FORMAT)
    policy.DEQUANT_GEMM_MIN_M_BY_FORMAT.clear()  # one threshold for every format while sweeping
    try:
        for n, k in shapes:
            for name in args.formats.split(","):
                _, w = _problem(n, k, 1, dev)
                q = _quantize(w, name)
                nq = _copies(w.numel() // 2)
                qs = [q] + [_quantize(w, name) for _ in range(min(nq, 8) - 1)]
                ws = [w] + [w.clone() for _ in range(min(_copies(w.numel() * 2), 8) - 1)]
                for m in (int(v) for v in args.ms.split(",")):
                    x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
                    ref = lowbit.ops.linear_reference(x, q, out_dtype=torch.float32)
                    row = {"fmt": name, "n": n, "k": k, "m": m}
                    cub = _rotating([lambda w_=w_, x=x: F.linear(x, w_) for w_ in ws])
                    row["cublas_graph_us"] = graph_ms(cub, repeats=10, calls=5) * 1e3
                    row["cublas_eager_us"] = eager_us(cub, calls=30, warmups=3)
                    routes = [("gemm", ROUTES["gemm"], None)] + [
                        ("dequant" if i == 0 else f"dequant{mb}", 1, mb)
                        for i, mb in enumerate(int(v) for v in args.chunk_mb.split(","))]
                    for route, thr, mb in routes:
                        policy.DEQUANT_GEMM_MIN_M = thr
                        if mb is not None:
                            lin.DEQUANT_CHUNK_BYTES = mb << 20
                            lin._KEPT_CHUNKS.clear()
                        path = lowbit.ops.plan_linear(x, q).path
                        out = lowbit.linear(x, q)
                        fro, _ = rel_errors(out.float(), ref)
                        fn = _rotating([lambda q_=q_, x=x: lowbit.linear(x, q_) for q_ in qs])
                        g = graph_ms(fn, repeats=10, calls=5) * 1e3
                        e = eager_us(fn, calls=30, warmups=3)
                        row[route] = {"path": path, "graph_us": g, "eager_us": e, "rel_fro": fro, "chunk_mb": mb,
                                      "graph_x_cublas": row["cublas_graph_us"] / g,
                                      "eager_x_cublas": row["cublas_eager_us"] / e}
                    extra = " ".join(f"{r}:{row[r]['graph_x_cublas']:.2f}" for r, _, mb in routes[2:])
                    rows.append(row)
                    gm, dq = row["gemm"], row["dequant"]
                    print(f"{name:9s} {n}x{k} M={m:5d}  cuBLAS {row['cublas_graph_us']:8.1f} us | gemm "
                          f"{gm['graph_x_cublas']:.2f}x graph {gm['eager_x_cublas']:.2f}x eager | dequant "
                          f"{dq['graph_x_cublas']:.2f}x graph {dq['eager_x_cublas']:.2f}x eager "
                          f"(err {gm['rel_fro']:.1e} / {dq['rel_fro']:.1e}) {extra}", flush=True)
                    with open(out_path, "w") as f:
                        json.dump({"header": header(), "rows": rows}, f, indent=1)
                del qs, ws
                torch.cuda.empty_cache()
    finally:
        policy.DEQUANT_GEMM_MIN_M = saved[0]
        policy.DEQUANT_GEMM_MIN_M_BY_FORMAT.update(saved[1])


if __name__ == "__main__":
    main()
