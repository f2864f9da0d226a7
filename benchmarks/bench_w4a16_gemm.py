"""Prefill W4A16 GEMM (``lowbit.kernels.gemm_w4``) vs cuBLAS bf16 ``x @ w_bf16.T``: TFLOPS and ratio.

    PYTHONPATH=src python benchmarks/bench_w4a16_gemm.py                   # M = 4096, 1000, 128, 33
    PYTHONPATH=src python benchmarks/bench_w4a16_gemm.py --m 4096 --formats nvfp4 int4_awq
    PYTHONPATH=src python benchmarks/bench_w4a16_gemm.py --sweep --m 4096 --formats nvfp4 int4_awq
                                                                            # tile sweep of M's regime

Times are ``triton.testing.do_bench`` medians; do_bench flushes L2 before every call, so weights are read
from HBM each time (no need to rotate weight copies). Every case is checked against the fp32 reference
``x.float() @ dequant(w).float().T`` first (relative Frobenius error, reported in the JSON). The JSON goes to
``$OUT/bench_w4a16_gemm.json`` (``--out`` overrides; default ``benchmarks/results/tmp``), with the config
each case ran (``choose_config``) so that ``--sweep`` results can be copied into ``gemm_w4.CONFIGS``.

Targets (issue 4): M = 4096 >= 0.95x cuBLAS bf16 throughput on every shape below.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

import lowbit
from lowbit.kernels import gemm_w4 as g

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _peers  # the benchmarks folder is not a package

SHAPES = [(4096, 4096), (8192, 8192), (28672, 8192), (8192, 28672), (6144, 4096), (4096, 14336)]  # (N, K)
FORMATS = {
    "nvfp4": ("nvfp4", {}),
    "mxfp4": ("mxfp4", {}),
    "fp4_b32": ("fp4_b32", {}),
    "nf4": ("nf4", {"double_quant": True}),
    "int4_awq": ("int4_awq", {"group_size": 128}),
}
# candidate tiles for --sweep, (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages), by regime; GROUP_M is
# swept separately on the best one. Configs over the shared-memory budget fail to launch and are recorded so.
SWEEP = {
    "large": [(256, 128, 64, 8, 3), (256, 128, 64, 8, 4), (128, 256, 64, 8, 3), (128, 256, 64, 8, 4),
              (128, 128, 64, 8, 4), (128, 128, 64, 8, 5), (128, 128, 128, 8, 3), (256, 128, 128, 8, 2),
              (128, 256, 128, 8, 2), (128, 128, 64, 4, 4)],
    "m512": [(128, 128, 64, 8, 4), (128, 128, 128, 8, 3), (64, 128, 128, 8, 4), (128, 64, 128, 4, 4),
             (256, 128, 64, 8, 4), (64, 64, 128, 4, 5)],
    "m128": [(64, 64, 128, 4, 5), (64, 128, 128, 8, 4), (128, 64, 128, 4, 4), (32, 64, 256, 4, 4),
             (64, 64, 256, 4, 3), (128, 128, 64, 8, 4)],
    "m64": [(64, 64, 128, 4, 5), (64, 64, 256, 4, 3), (64, 128, 128, 8, 4), (32, 64, 128, 4, 6)],
    "m32": [(32, 64, 128, 4, 5), (32, 64, 256, 4, 4), (16, 64, 256, 4, 4), (32, 128, 128, 8, 4)],
}
GROUP_M_SWEEP = [1, 4, 8, 16]


def bench(fn, rep: int) -> float:
    from triton.testing import do_bench

    return do_bench(fn, warmup=25, rep=rep, return_mode="median")


def rel_error(out: torch.Tensor, x: torch.Tensor, q) -> float:
    torch.backends.cuda.matmul.allow_tf32 = False
    ref = x.float() @ lowbit.dequantize(q, torch.float32).T
    return ((out.float() - ref).norm() / ref.norm()).item()


def header() -> dict:
    try:
        from lowbit.bench.envinfo import header as env_header

        return env_header()
    except Exception as e:  # noqa: BLE001 - the environment header is informative only
        return {"error": repr(e), "gpu": torch.cuda.get_device_name()}


def _problem(n: int, k: int, m: int, dev) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator(device=dev).manual_seed(n * 31 + k)
    w = torch.randn(n, k, device=dev, generator=gen, dtype=torch.bfloat16) * 0.02
    x = torch.randn(m, k, device=dev, generator=gen, dtype=torch.bfloat16)
    return x, w


def _quantize(w: torch.Tensor, name: str):
    fmt, opts = FORMATS[name]
    return lowbit.quantize(w.half() if fmt == "int4_awq" else w, fmt, **opts)


def _time_case(row: dict, x, q, cfg, t_cublas: float, rep: int, check: bool = True) -> dict:
    """Fill ``row`` with rel_err, ms, TFLOPS and the ratio to cuBLAS of gemm_w4(x, q, config=cfg)."""
    flops = 2.0 * row["M"] * row["N"] * row["K"]
    try:
        out = g.gemm_w4(x, q, config=cfg)
        if check:
            row["rel_err"] = rel_error(out, x, q)
        t = bench(lambda: g.gemm_w4(x, q, config=cfg), rep)
        row.update(ms=t, tflops=flops / t / 1e9, ratio_vs_cublas=t_cublas / t)
    except Exception as e:  # noqa: BLE001 - out of shared memory / registers: record and go on
        row["error"] = f"{type(e).__name__}: {e}"[:500]
    return row


def _time_peers(x, w, args) -> dict:
    """bitsandbytes nf4 and gemlite int4/mxfp4 on the same x and bf16 weight, where they run."""
    out = {}
    ref = x.float() @ w.float().T
    wanted = {"bitsandbytes_nf4": "nf4", "gemlite_int4": "int4_awq", "gemlite_mxfp4": "mxfp4"}
    for peer, ours in wanted.items():
        if not any(FORMATS[f][0] == ours for f in args.formats):
            continue
        fns = _peers.bnb_nf4([w]) if peer == "bitsandbytes_nf4" else _peers.gemlite([w], peer.split("_")[1])
        if fns is None:
            continue
        try:
            err = _peers.rel_error(fns[0](x), ref)
            t = bench(lambda f=fns[0]: f(x), args.rep)
        except Exception as e:  # noqa: BLE001 - optional baseline
            print(f"  {peer} failed: {type(e).__name__}: {str(e)[:200]}")
            continue
        out[peer] = {"for": ours, "ms": t, "tflops": 2.0 * x.shape[0] * w.shape[0] * w.shape[1] / t / 1e9,
                     "rel_err_vs_bf16": err}
    return out


def run(args) -> dict:
    dev = torch.device("cuda")
    rows = []
    for n, k in args.shapes:
        for m in args.m:
            x, w = _problem(n, k, m, dev)
            t_cublas = bench(lambda: x @ w.T, args.rep)  # noqa: B023 - called right here
            peers = _time_peers(x, w, args) if args.peers else {}
            for name in args.formats:
                q = _quantize(w, name)
                cfg = g.choose_config(m, n, k, q.fmt, q.params.get("group_size", 0), dev)
                row = dict(format=name, M=m, N=n, K=k, config=cfg, cublas_ms=t_cublas,
                           cublas_tflops=2.0 * m * n * k / t_cublas / 1e9)
                _time_case(row, x, q, cfg, t_cublas, args.rep)
                if args.chunked:
                    from lowbit.ops import linear_dequant_gemm

                    y = linear_dequant_gemm(x, q)
                    row["chunked_rel_err"] = rel_error(y, x, q)
                    row["chunked_ms"] = bench(lambda: linear_dequant_gemm(x, q), args.rep)  # noqa: B023
                    row["chunked_ratio_vs_cublas"] = t_cublas / row["chunked_ms"]
                if args.dequant_baseline and "error" not in row:
                    row["dequant_then_cublas_ms"] = bench(
                        lambda: x @ lowbit.dequantize(q, torch.bfloat16).T, args.rep)  # noqa: B023
                for peer, v in peers.items():
                    if v["for"] == FORMATS[name][0] and "ms" in row:
                        row.setdefault("peers", {})[peer] = v
                        row.setdefault("ratio_vs", {})[peer] = v["ms"] / row["ms"]
                rows.append(row)
                print(_line(row) + "".join(f"  vs {p} {r:.2f}x" for p, r in row.get("ratio_vs", {}).items()),
                      flush=True)
        torch.cuda.empty_cache()
        if args.partial_path:
            _peers.write_json(args.partial_path, {"header": header(), "complete": False, "rows": rows})
    return {"header": header(), "rows": rows}


def sweep(args) -> dict:
    """The SWEEP candidates of M = args.m[0]'s regime on each (format, shape), then GROUP_M and x without TMA
    on the best one."""
    dev = torch.device("cuda")
    m = args.m[0]
    regime = g.regime(m)
    rows, best_by_case = [], {}
    for n, k in args.shapes:
        x, w = _problem(n, k, m, dev)
        t_cublas = bench(lambda: x @ w.T, args.rep)  # noqa: B023 - called right here
        for name in args.formats:
            q = _quantize(w, name)
            default = g.choose_config(m, n, k, q.fmt, q.params.get("group_size", 0), dev)
            cands = [dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, num_warps=nw, num_stages=ns,
                          GROUP_M=default["GROUP_M"], SPLIT_K=default["SPLIT_K"])
                     for bm, bn, bk, nw, ns in SWEEP[regime]]
            case_rows = []
            for cfg in cands:
                case_rows.append(_time_case(dict(format=name, M=m, N=n, K=k, config=cfg,
                                                 cublas_tflops=2.0 * m * n * k / t_cublas / 1e9),
                                            x, q, cfg, t_cublas, args.rep))
            ok = [r for r in case_rows if "ms" in r]
            if ok:
                best = min(ok, key=lambda r: r["ms"])
                extra = [dict(best["config"], GROUP_M=gm) for gm in GROUP_M_SWEEP if gm != best["config"]["GROUP_M"]]
                extra.append(dict(best["config"], X_TMA=False))
                for cfg in extra:
                    case_rows.append(_time_case(dict(format=name, M=m, N=n, K=k, config=cfg,
                                                     cublas_tflops=best["cublas_tflops"]),
                                                x, q, cfg, t_cublas, args.rep, check=False))
                best = min((r for r in case_rows if "ms" in r), key=lambda r: r["ms"])
                best_by_case[f"{name} {n}x{k}"] = best
                print(f"best {name:9s} M={m} N={n:6d} K={k:6d}: {best['tflops']:7.1f} TFLOPS "
                      f"({best['ratio_vs_cublas']:.3f}x cuBLAS) {best['config']}", flush=True)
            rows += case_rows
        torch.cuda.empty_cache()
    return {"header": header(), "regime": regime, "candidates": SWEEP[regime], "best": best_by_case, "rows": rows}


def _line(row: dict) -> str:
    head = f"{row['format']:9s} M={row['M']:5d} N={row['N']:6d} K={row['K']:6d}"
    if "error" in row:
        return f"{head}  ERROR {row['error']}"
    return (f"{head}  {row['tflops']:7.1f} TFLOPS  cuBLAS {row['cublas_tflops']:7.1f}  "
            f"ratio {row['ratio_vs_cublas']:.3f}  rel_err {row['rel_err']:.1e}  [{row['config']['regime']}]"
            + (f"  chunked dequant+cuBLAS {row['chunked_ratio_vs_cublas']:.3f} (err {row['chunked_rel_err']:.1e})"
               if "chunked_ms" in row else ""))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--m", type=int, nargs="+", default=[4096, 1000, 128, 33])
    p.add_argument("--formats", nargs="+", default=list(FORMATS), choices=list(FORMATS))
    p.add_argument("--shapes", nargs="+", default=None, help="NxK, e.g. 4096x4096")
    p.add_argument("--rep", type=int, default=100, help="do_bench measurement budget per case, ms")
    p.add_argument("--sweep", action="store_true",
                   help="sweep the tile configs of the first --m's regime (e.g. --sweep --m 4096 --formats nvfp4)")
    p.add_argument("--no-peers", dest="peers", action="store_false",
                   help="skip the bitsandbytes / gemlite baselines")
    p.add_argument("--chunked", action="store_true",
                   help="also time lowbit.ops.linear.linear_dequant_gemm (chunked dequantize + cuBLAS)")
    p.add_argument("--dequant-baseline", action="store_true", help="also time dequantize + cuBLAS")
    p.add_argument("--out", default=None, help="output directory (default $OUT or benchmarks/results/tmp)")
    args = p.parse_args(argv)
    args.shapes = SHAPES if args.shapes is None else [tuple(int(v) for v in s.split("x")) for s in args.shapes]
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    t0 = time.time()
    out_dir = Path(args.out or os.environ.get("OUT") or "benchmarks/results/tmp")
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / (f"bench_w4a16_gemm_sweep_m{args.m[0]}.json" if args.sweep else "bench_w4a16_gemm.json")
    args.partial_path = str(path)
    result = sweep(args) if args.sweep else run(args)
    result["seconds"] = time.time() - t0
    result["complete"] = True
    _peers.write_json(str(path), result)
    print(f"wrote {path} ({result['seconds']:.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
