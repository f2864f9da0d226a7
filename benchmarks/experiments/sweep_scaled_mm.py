"""Tile sweeps of ``lowbit.kernels.scaled_mm`` (the sweep modes of the former scaled_mm benchmark script; the
maintained table is ``lowbit bench --ops 'scaled_mm.*'``); JSON to $OUT.

    PYTHONPATH=src python benchmarks/experiments/sweep_scaled_mm.py tiles [--pairs nvfp4,mxfp4]
    PYTHONPATH=src python benchmarks/experiments/sweep_scaled_mm.py fold --ms 1024,4096 [--shapes 7168x2048,...]

``tiles``: the decoding kernel's tile configs of each pair on 7168x16384 at M = 4096. ``fold``: TMA configs of the
FP8 re-encoded mxfp4 pairs (the policy's fold route) against the decoding kernel and cuBLAS bf16, with the time
of the re-encoding passes alone. Every variant is checked against ``scaled_mm_reference`` (relative Frobenius
error in the JSON); times are ``do_bench`` medians.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

import lowbit
from lowbit.bench.scaled_mm import NK, PAIRS
from lowbit.ops import policy, scaled_mm_reference

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # this folder (_common)
from _common import bench, header, rel_error, write_json  # noqa: E402

TILES = [(128, 128, 128, 8, 4), (128, 256, 128, 8, 3), (128, 128, 128, 4, 4), (64, 256, 128, 4, 4),
         (256, 128, 128, 8, 3), (128, 256, 64, 8, 4), (128, 128, 64, 4, 5)]
# (BM, BN, warps, stages, persistent programs per SM or 0), BK = 128
FOLD_TILES = [(64, 128, 4, 3, 2), (64, 128, 4, 4, 0), (128, 128, 8, 3, 1), (128, 128, 8, 4, 0), (128, 256, 8, 3, 0),
              (64, 256, 4, 3, 1), (128, 128, 4, 3, 1)]


def _ks():
    from lowbit.kernels import scaled_mm as ks

    return ks


def _reencode(a, wq) -> None:
    from lowbit.kernels import blockscaled as kb

    flag = torch.zeros(1, dtype=torch.int32, device=wq.data.device)
    kb.mxfp4_fold(wq, (128, 128), flag)
    if a.fmt == "mxfp4":
        kb.mxfp4_fold(a, (1, 128), flag)


def tiles(args) -> dict:
    ks = _ks()
    m, n, k = 4096, 7168, 16384
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.05
    t_bf16 = bench(lambda: x @ w.T, args.rep)
    rows = []
    for pair in args.pairs:
        (af, ao), (wf, wo) = PAIRS[pair]
        a, wq = lowbit.quantize(x, af, **ao), lowbit.quantize(w, wf, **wo)
        ref = scaled_mm_reference(a, wq)
        for bm, bn, bk, nw, ns in TILES:
            cfg = {"BM": bm, "BN": bn, "BK": bk, "GROUP_M": 8, "num_warps": nw, "num_stages": ns}
            row = {"pair": pair, "config": cfg}
            try:
                row["rel_err"] = rel_error(ks.scaled_mm(a, wq, None, None, torch.bfloat16, config=cfg), ref)
                row["ms"] = bench(lambda c=cfg: ks.scaled_mm(a, wq, None, None, torch.bfloat16, config=c),  # noqa: B023
                                  args.rep)
                row["vs_cublas_bf16"] = t_bf16 / row["ms"]
                print(f"{pair:12s} {cfg}  x{row['vs_cublas_bf16']:.2f} bf16  err {row['rel_err']:.1e}", flush=True)
            except Exception as e:  # noqa: BLE001 - a config over the shared-memory budget: record and go on
                row["error"] = f"{type(e).__name__}: {e}"[:200]
                print(f"{pair:12s} {cfg}  ERROR {row['error']}", flush=True)
            rows.append(row)
    return {"header": header(), "cublas_bf16_ms": t_bf16, "rows": rows}


def fold(args) -> dict:
    ks = _ks()
    rows = []
    for n, k in args.shapes:
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.05
        for m in args.ms:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            t_bf16 = bench(lambda: x @ w.T, args.rep)  # noqa: B023
            for pair in args.pairs:
                (af, ao), (wf, wo) = PAIRS[pair]
                a, wq = lowbit.quantize(x, af, **ao), lowbit.quantize(w, wf, **wo)
                if ks.fold_unsupported(a, wq) is not None and m >= policy.FOLD_MIN_M:
                    continue
                ref = scaled_mm_reference(a, wq)
                base = {"pair": pair, "M": m, "N": n, "K": k, "cublas_bf16_ms": t_bf16}
                t_dec = bench(lambda: ks.scaled_mm(a, wq, None, None, torch.bfloat16, "kernel"), args.rep)  # noqa: B023
                t_re = bench(lambda: _reencode(a, wq), args.rep)  # noqa: B023
                rows.append({**base, "config": "decoding", "ms": t_dec, "vs_cublas_bf16": t_bf16 / t_dec})
                rows.append({**base, "config": "reencode_only", "ms": t_re})
                print(f"{pair:12s} {n}x{k} M={m}: decoding x{t_bf16 / t_dec:.2f} bf16, re-encoding {t_re * 1e3:.1f} us",
                      flush=True)
                for bm, bn, nw, ns, per_sm in FOLD_TILES:
                    cfg = {"BM": bm, "BN": bn, "BK": 128, "GROUP_M": 8, "num_warps": nw, "num_stages": ns,
                           "tma": True, "persistent": per_sm > 0, "per_sm": max(per_sm, 1)}
                    row = {**base, "config": cfg}
                    try:
                        y = ks.scaled_mm(a, wq, None, None, torch.bfloat16, "fold", config=cfg)
                        row["rel_err"] = rel_error(y, ref)
                        row["ms"] = bench(lambda c=cfg: ks.scaled_mm(a, wq, None, None, torch.bfloat16,  # noqa: B023
                                                                     "fold", config=c), args.rep)
                        row["vs_cublas_bf16"] = t_bf16 / row["ms"]
                        print(f"   {bm}x{bn} w{nw} s{ns} p{per_sm}: x{row['vs_cublas_bf16']:.2f} bf16  "
                              f"err {row['rel_err']:.1e}", flush=True)
                    except Exception as e:  # noqa: BLE001
                        row["error"] = f"{type(e).__name__}: {e}"[:200]
                        print(f"   {cfg} ERROR {row['error']}", flush=True)
                    rows.append(row)
        torch.cuda.empty_cache()
    return {"header": header(), "rows": rows}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("mode", choices=("tiles", "fold"))
    ap.add_argument("--pairs", default=None, help="comma-separated pairs (default: all; fold: mxfp4, w4a8_mxfp4)")
    ap.add_argument("--ms", default="1024,4096", help="fold: rows of the activation")
    ap.add_argument("--shapes", default=None, help="fold: NxK list (default: the scaled_mm ops' shapes)")
    ap.add_argument("--rep", type=int, default=40)
    ap.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results/tmp"))
    args = ap.parse_args()
    default_pairs = list(PAIRS) if args.mode == "tiles" else ["mxfp4", "w4a8_mxfp4"]
    args.pairs = args.pairs.split(",") if args.pairs else default_pairs
    args.ms = [int(v) for v in args.ms.split(",")]
    args.shapes = list(NK) if not args.shapes else [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    os.makedirs(args.out, exist_ok=True)
    result = tiles(args) if args.mode == "tiles" else fold(args)
    path = os.path.join(args.out, f"sweep_scaled_mm_{args.mode}.json")
    write_json(path, result)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
