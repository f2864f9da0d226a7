"""Sweep the tensor-core GEMV (``_gemv_mma``) configs against the FMA kernel on NVFP4/MXFP4 decode shapes.

    python3 benchmarks/experiments/sweep_gemv_mma.py --shapes 28672x8192,8192x8192,4096x4096 --ms 1,4,16 --out $OUT

Each variant is checked against the fp32 reference first (relative Frobenius error), then timed as a CUDA
graph of 20 calls over rotated weight copies (every call reads its weight from HBM); cuBLAS bf16 on the same
shape is timed the same way. Prints one line per case and writes ``sweep_gemv_mma_<date>.json``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys

import torch

import lowbit
from lowbit.kernels import gemv_w4 as G

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # this folder (_common)
from _common import _copies, _copy_roof, _git, _rotating, _time_graph  # noqa: E402


def variants():
    """(name, mma_config): the FMA kernel (mma_config False), the default, and rg / j / split-K variants."""
    out = [("fma", False), ("default", {**G.MMA, "m1_min_weights": 0})]
    for rg, j, w, cps in [(1, 4, 4, 4), (1, 4, 4, 8), (2, 4, 4, 4), (2, 4, 4, 8), (2, 4, 4, 16), (4, 4, 4, 4),
                          (2, 2, 2, 8), (2, 8, 8, 4), (4, 8, 8, 4)]:
        out.append((f"rg{rg} j{j} w{w} c{cps}", {"min_m": 1, "max_m": 16, "rg": rg, "j": j, "warps": w,
                                                 "ctas_per_sm": cps}))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="28672x8192,8192x8192,4096x4096")
    ap.add_argument("--ms", default="1,4,16")
    ap.add_argument("--formats", default="nvfp4")
    ap.add_argument("--only", default="", help="comma-separated substrings of variant names")
    ap.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results/tmp"))
    a = ap.parse_args()
    torch.manual_seed(0)
    dev = torch.cuda.get_device_name()
    meta = {"device": dev, "torch": torch.__version__, "git": _git(), "copy_GBps": _copy_roof(),
            "date": datetime.date.today().isoformat()}
    rows = []
    vs = [v for v in variants() if not a.only or any(s in v[0] for s in a.only.split(","))]
    for fmt in a.formats.split(","):
        for shape in a.shapes.split(","):
            n, k = map(int, shape.split("x"))
            w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
            q = lowbit.quantize(w, fmt)
            copies = _copies(q.data.numel() * 1.1)
            qs = [q] + [lowbit.quantize(torch.randn_like(w), fmt) for _ in range(copies - 1)]
            ps = [G.prepare_w4(x) for x in qs]
            wref = lowbit.dequantize(q, torch.float32)
            wb = [torch.randn_like(w) for _ in range(_copies(w.numel() * 2))]
            for m in map(int, a.ms.split(",")):
                x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
                ref = x.float() @ wref.T
                t_cub = _time_graph(_rotating([lambda b=b, x=x: x @ b.T for b in wb]))
                line = [f"{fmt} {n}x{k} M={m}: cuBLAS {t_cub:6.1f}"]
                for name, cfg in vs:
                    row = {"format": fmt, "n": n, "k": k, "m": m, "variant": name, "cublas_us": t_cub}
                    try:
                        y = G.gemv_w4(x, ps[0], mma_config=cfg)
                        err = ((y.float() - ref).norm() / ref.norm()).item()
                        t = _time_graph(_rotating([lambda p=p, x=x, cfg=cfg: G.gemv_w4(x, p, mma_config=cfg)
                                                  for p in ps]))
                        row.update(rel_err=err, us=t, speedup=t_cub / t, GBps=(q.data.numel() + q.scale.numel()) / t / 1e3)
                        line.append(f"{name} {t:6.1f}{'!' if err > 1e-2 else ''}")
                    except Exception as e:  # noqa: BLE001 - a variant that fails to compile or launch
                        row["error"] = f"{type(e).__name__}: {e}"[:300]
                        line.append(f"{name} ERR")
                    rows.append(row)
                print(" | ".join(line), flush=True)
            del w, q, qs, ps, wref, wb
            torch.cuda.empty_cache()
    os.makedirs(a.out, exist_ok=True)
    path = os.path.join(a.out, f"sweep_gemv_mma_{meta['date']}.json")
    with open(path, "w") as f:
        json.dump({**meta, "rows": rows}, f, indent=1)
    best = {}
    for r in rows:
        if "us" in r and r["rel_err"] <= 1e-2:
            key = (r["format"], r["n"], r["k"], r["m"])
            if key not in best or r["us"] < best[key]["us"]:
                best[key] = r
    print("\nbest per case (graph us, speedup vs cuBLAS bf16, GB/s):")
    for key, r in best.items():
        print(f"  {key}: {r['variant']:28} {r['us']:7.1f} us  {r['speedup']:.2f}x  {r['GBps']:.0f} GB/s")
    print("wrote", path)


if __name__ == "__main__":
    main()
