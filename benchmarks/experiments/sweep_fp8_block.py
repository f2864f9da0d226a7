"""fp8_block x fp8_block (DeepSeek-V3 W8A8) kernel variants vs torch._scaled_mm per-tensor FP8 and seed 001's
Triton kernel (autotuned over its own list), on the issue's M=4096 DeepSeek shapes and 8192^3; JSON to $OUT.

    PYTHONPATH=src python benchmarks/experiments/sweep_fp8_block.py [--shapes 7168x2048,...] [--seed/--no-seed]

Each variant's result is checked against ``scaled_mm_reference`` (relative Frobenius error in the JSON).
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time

import torch
import triton
from triton.testing import do_bench

import lowbit
from lowbit.ops import policy
from lowbit.kernels import scaled_mm as ks
from lowbit.ops import scaled_mm_reference

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # this folder (_common)
import _common as _peers  # noqa: E402
import _seed001  # noqa: E402

SHAPES = [(4096, 7168, 2048), (4096, 24576, 1536), (4096, 2112, 7168), (4096, 7168, 16384), (4096, 4096, 7168),
          (8192, 8192, 8192)]


def _cfg(bm, bn, warps, stages, tma, persistent=False, group=8):
    return {"BM": bm, "BN": bn, "BK": 128, "GROUP_M": group, "num_warps": warps, "num_stages": stages,
            "tma": tma, "persistent": persistent}


VARIANTS = {
    "ptr_128x128_w8s4": _cfg(128, 128, 8, 4, False),
    "ptr_64x128_w8s5": _cfg(64, 128, 8, 5, False),
    "ptr_64x128_w4s5": _cfg(64, 128, 4, 5, False),
    "tma_128x128_w8s4": _cfg(128, 128, 8, 4, True),
    "tma_128x128_w8s3": _cfg(128, 128, 8, 3, True),
    "tma_64x128_w4s4": _cfg(64, 128, 4, 4, True),
    "tma_64x128_w4s6": _cfg(64, 128, 4, 6, True),
    "tma_64x128_w8s5": _cfg(64, 128, 8, 5, True),
    "tma_128x64_w4s5": _cfg(128, 64, 4, 5, True),
    "tmap_128x128_w8s4": _cfg(128, 128, 8, 4, True, True),
    "tmap_128x128_w8s3": _cfg(128, 128, 8, 3, True, True),
    "tmap_64x128_w4s4": _cfg(64, 128, 4, 4, True, True),
    "tmap2_64x128_w4s4": {**_cfg(64, 128, 4, 4, True, True), "per_sm": 2},
    "tmap_128x256_w8s3": _cfg(128, 256, 8, 3, True, True),
    "tmap_128x128_w8s3_g4": _cfg(128, 128, 8, 3, True, True, group=4),
    "tmap_128x128_w8s3_g16": _cfg(128, 128, 8, 3, True, True, group=16),
    "tmap_128x128_w8s2": _cfg(128, 128, 8, 2, True, True),
    "tmap2_64x128_w4s3": {**_cfg(64, 128, 4, 3, True, True), "per_sm": 2},
    "tmap2_64x128_w4s5": {**_cfg(64, 128, 4, 5, True, True), "per_sm": 2},
    "tmap2_64x128_w4s4_g16": {**_cfg(64, 128, 4, 4, True, True, group=16), "per_sm": 2},
    # the warp-specialized Gluon kernel (two consumer warpgroups of 64 rows, one TMA producer warp, persistent)
    "ws_128x128_s4": {**_cfg(128, 128, 4, 4, True), "ws": True},
    "ws_128x128_s5": {**_cfg(128, 128, 4, 5, True), "ws": True},
    "ws_128x128_s6": {**_cfg(128, 128, 4, 6, True), "ws": True},
    "ws_128x128_s5_g16": {**_cfg(128, 128, 4, 5, True, group=16), "ws": True},
    "ws_128x128_s5_g4": {**_cfg(128, 128, 4, 5, True, group=4), "ws": True},
    "ws_128x128_s3": {**_cfg(128, 128, 4, 3, True), "ws": True},
    "ws_128x128_s4_g16": {**_cfg(128, 128, 4, 4, True, group=16), "ws": True},
    "ws_128x128_s4_direct": {**_cfg(128, 128, 4, 4, True), "ws": True, "tma_store": False},
    "ws_128x64_s8": {**_cfg(128, 64, 4, 8, True), "ws": True},
    # lowbit.scaled_mm's default route (cuBLASLt's block-scaled GEMM where kernels.cublas_fp8_block.route allows)
    "default": None,
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default=None, help="MxNxK list")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--no-seed", action="store_true")
    ap.add_argument("--rep", type=int, default=50)
    ap.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results/tmp"))
    args = ap.parse_args()
    shapes = SHAPES if not args.shapes else [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    os.makedirs(args.out, exist_ok=True)
    meta = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "triton": triton.__version__,
            "git": os.environ.get("GIT_SHA", "unknown"), "host": platform.node(), "date": time.strftime("%Y-%m-%d"),
            "seed001_block_m": os.environ.get("LOWBIT_SEED_BM", "16,32,64")}
    print(meta, flush=True)
    path = os.path.join(args.out, "sweep_fp8_block.json")
    rows = []
    for m, n, k in shapes:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.05
        a = lowbit.quantize(x, "fp8_block")
        b = lowbit.quantize(w, "fp8_block", block=(128, 128))
        ref = scaled_mm_reference(a, b)
        flops = 2 * m * n * k
        x8, w8 = x.to(torch.float8_e4m3fn), w.to(torch.float8_e4m3fn)
        one = torch.ones((), device="cuda")
        t_fp8 = do_bench(lambda: torch._scaled_mm(x8, w8.T, scale_a=one, scale_b=one, out_dtype=torch.bfloat16),  # noqa: B023
                         rep=args.rep, return_mode="median")
        row = {"M": m, "N": n, "K": k, "scaled_mm_fp8_ms": t_fp8, "scaled_mm_fp8_tflops": flops / t_fp8 / 1e9}
        print(f"{m}x{n}x{k}: torch._scaled_mm {t_fp8 * 1e3:.1f} us ({row['scaled_mm_fp8_tflops']:.0f} TFLOPS)",
              flush=True)
        if not args.no_seed:
            try:
                y = _seed001.fp8_gemm(a.data, a.scale, b.data, b.scale)
                t = do_bench(lambda: _seed001.fp8_gemm(a.data, a.scale, b.data, b.scale), rep=args.rep,  # noqa: B023
                             return_mode="median")
                row["seed001"] = {"ms": t, "tflops": flops / t / 1e9, "vs_scaled_mm_fp8": t_fp8 / t,
                                  "rel_err": _peers.rel_error(y, ref),
                                  "config": str(_seed001._seed_fp8_gemm_kernel.best_config)}
                print(f"  seed001 {t * 1e3:8.1f} us x{t_fp8 / t:.2f}  {row['seed001']['config']}", flush=True)
            except Exception as e:  # noqa: BLE001
                row["seed001"] = {"error": f"{type(e).__name__}: {e}"[:300]}
                print("  seed001 ERROR", row["seed001"]["error"], flush=True)
        for name in args.variants.split(","):
            cfg = VARIANTS[name]
            try:
                route = policy.scaled_route(a, b, None, torch.bfloat16) if cfg is None else "kernel"
                y = ks.scaled_mm(a, b, None, None, torch.bfloat16, route, config=cfg)
                t = do_bench(lambda c=cfg: ks.scaled_mm(a, b, None, None, torch.bfloat16, route, config=c),  # noqa: B023
                             rep=args.rep, return_mode="median")
                if cfg is None:
                    r_route = "cublas_blockwise" if route == "cublas" else "triton"
                r = {"ms": t, "tflops": flops / t / 1e9, "vs_scaled_mm_fp8": t_fp8 / t, "rel_err": _peers.rel_error(y, ref)}
                if cfg is None:
                    r["route"] = r_route
                if "seed001" in row and "ms" in row["seed001"]:
                    r["vs_seed001"] = row["seed001"]["ms"] / t
                print(f"  {name:22s} {t * 1e3:8.1f} us {r['tflops']:6.0f} TFLOPS x{r['vs_scaled_mm_fp8']:.2f} fp8"
                      f"  err {r['rel_err']:.1e}", flush=True)
            except Exception as e:  # noqa: BLE001
                r = {"error": f"{type(e).__name__}: {e}"[:300]}
                print(f"  {name:22s} ERROR {r['error']}", flush=True)
            row[name] = r
        rows.append(row)
        _peers.write_json(path, {**meta, "complete": False, "variants": VARIANTS, "rows": rows})
    _peers.write_json(path, {**meta, "complete": True, "variants": VARIANTS, "rows": rows})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
