"""The Gluon W4A16 GEMMs, warp-specialized (``gemm_w4.gemm_w4_ws``), register-operand (``gemm_w4.gemm_w4_ra``,
with ``--ra``) and register-fragment (``gemm_w4.gemm_w4_rf``, with ``--rf``), against cuBLAS bf16, the Triton
GEMM (``gemm_w4``) and what ``lowbit.linear`` runs today, at
M = 32 ... 4096 on the W4A16 benchmark's shapes.

    PYTHONPATH=src python benchmarks/experiments/sweep_w4a16_ws.py [--formats nvfp4,int4_awq] [--ms 64,256]
        [--configs 'RLAG=2;RLAG=4,RSTAGES=8'] [--ra='-;BM=64;BM=128,STAGES=3'] [--rf='WG=2,BM=256'] [--skip-ws]

Every route's output is checked against the fp32 reference first. Times are CUDA-graph replays with the
weights rotated out of L2 (the GPU time inside a model's graph). JSON to ``$OUT/sweep_w4a16_ws.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.nn.functional as F

import lowbit
from lowbit.kernels import gemm_w4 as g

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # this folder (_common)
from _common import SHAPES, _copies, _problem, _quantize, _rotating, header

from lowbit.bench.common import rel_errors
from lowbit.bench.timing import graph_ms


def _configs(text: str, kind: str = "ws", default: bool = True) -> list[tuple[str, dict]]:
    """``'KEY=V,KEY=V;...'`` -> [(label, config)]; ``-`` is the default config (always first with ``default``)."""
    out = [(kind, {})] if default else []
    for item in filter(None, text.split(";")):
        if item == "-":
            if not default:
                out.append((kind, {}))
            continue
        cfg = {kv.split("=")[0]: int(kv.split("=")[1]) for kv in item.split(",")}
        out.append((f"{kind}[{item}]", cfg))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--formats", default="nvfp4,mxfp4,int4_awq")
    ap.add_argument("--ms", default="32,64,256,1024,2048,4096")
    ap.add_argument("--shapes", default=None, help="NxK,... (default: the W4A16 benchmark's six)")
    ap.add_argument("--configs", default="", help="extra ws configs: 'KEY=V,KEY=V;...'")
    ap.add_argument("--triton-gemm", action="store_true", help="also time the Triton GEMM")
    ap.add_argument("--ra", default="", help="register-operand kernel configs: 'KEY=V,...;...' ('-': the default)")
    ap.add_argument("--rf", default="", help="register-fragment kernel configs, as --ra")
    ap.add_argument("--skip-ws", action="store_true", help="do not time the warp-specialized kernel")
    args = ap.parse_args()
    dev = torch.device("cuda")
    shapes = SHAPES if args.shapes is None else [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    configs = [] if args.skip_ws else _configs(args.configs)
    ra_configs = _configs(args.ra, "ra", default=False)
    rf_configs = _configs(args.rf, "rf", default=False)
    rows = []
    out_path = os.path.join(os.environ.get("OUT", "."), "sweep_w4a16_ws.json")
    for n, k in shapes:
        for name in args.formats.split(","):
            _, w = _problem(n, k, 1, dev)
            q = _quantize(w, name)
            qs = [q] + [_quantize(w, name) for _ in range(min(_copies(w.numel() // 2), 8) - 1)]
            ws = [w] + [w.clone() for _ in range(min(_copies(w.numel() * 2), 8) - 1)]
            for m in (int(v) for v in args.ms.split(",")):
                x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
                ref = lowbit.ops.linear_reference(x, q, out_dtype=torch.float32)
                row = {"fmt": name, "n": n, "k": k, "m": m, "route": lowbit.ops.plan_linear(x, q).path}
                cub = _rotating([lambda w_=w_, x=x: F.linear(x, w_) for w_ in ws])
                row["cublas_us"] = graph_ms(cub, repeats=10, calls=5) * 1e3
                cases = [("linear", lambda q_, x=x: lowbit.linear(x, q_))]
                if args.triton_gemm:
                    cases.append(("gemm", lambda q_, x=x: g.gemm_w4(x, q_)))
                cases += [(label, lambda q_, x=x, c=cfg: g.gemm_w4_ws(x, q_, config=c)) for label, cfg in configs]
                cases += [(label, lambda q_, x=x, c=cfg: g.gemm_w4_ra(x, q_, config=c)) for label, cfg in ra_configs]
                cases += [(label, lambda q_, x=x, c=cfg: g.gemm_w4_rf(x, q_, config=c)) for label, cfg in rf_configs]
                for label, call in cases:
                    try:
                        fro, _ = rel_errors(call(q).float(), ref)
                        for q_ in qs:  # per-weight layouts made before the capture, as a model's load does
                            call(q_)
                        us = graph_ms(_rotating([lambda q_=q_, c=call: c(q_) for q_ in qs]), repeats=10, calls=5) * 1e3
                        row[label] = {"us": us, "x_cublas": row["cublas_us"] / us, "rel_fro": fro}
                    except Exception as e:  # noqa: BLE001 - a failing route is a result of the sweep
                        row[label] = {"error": f"{type(e).__name__}: {e}"[:300]}
                rows.append(row)
                parts = []
                for label, _ in cases:
                    r = row[label]
                    parts.append(f"{label} {r['x_cublas']:.2f}x ({r['rel_fro']:.0e})" if "us" in r
                                 else f"{label} ERR {r['error'][:80]}")
                print(f"{name:9s} {n}x{k} M={m:5d} cuBLAS {row['cublas_us']:8.1f} us [{row['route']}] | "
                      + " | ".join(parts), flush=True)
                with open(out_path, "w") as f:
                    json.dump({"header": header(), "rows": rows}, f, indent=1)
            del qs, ws
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
