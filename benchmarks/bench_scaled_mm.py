"""lowbit.scaled_mm (two quantized operands) vs cuBLAS bf16 and torch._scaled_mm per-tensor FP8; JSON to $OUT.

    PYTHONPATH=src python benchmarks/bench_scaled_mm.py                 # DeepSeek-V3 shapes at M=4096, 8192^3, decode M
    PYTHONPATH=src python benchmarks/bench_scaled_mm.py --pairs fp8_block --ms 4096

Times are ``triton.testing.do_bench`` medians (L2 flushed before each call). Every case is checked against
``lowbit.ops.scaled_mm_reference`` first (relative Frobenius error in the JSON). "gemm" times take both operands
already quantized; "fused" times include quantizing the bf16 activation (``scaled_linear``).
Ratios: cuBLAS bf16 time / lowbit time, and torch._scaled_mm (FP8 e4m3, per-tensor scales) time / lowbit time.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

import torch
import triton
from triton.testing import do_bench

import lowbit
from lowbit.ops import policy
from lowbit.ops import scaled_linear, scaled_mm_reference

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _peers  # the benchmarks folder is not a package

SHAPES = [(7168, 2048), (24576, 1536), (2112, 7168), (7168, 16384), (4096, 7168), (8192, 8192)]  # (N, K)
# pair -> (activation format, options), (weight format, options)
PAIRS = {
    "fp8_block": (("fp8_block", {}), ("fp8_block", {"block": (128, 128)})),
    "nvfp4": (("nvfp4", {}), ("nvfp4", {})),
    "mxfp4": (("mxfp4", {}), ("mxfp4", {})),
    "mxfp8": (("mxfp8_e4m3", {}), ("mxfp8_e4m3", {})),
    "mxfp6_mxfp8": (("mxfp8_e4m3", {}), ("mxfp6_e3m2", {})),
    "w4a8_mxfp4": (("fp8_rowwise", {}), ("mxfp4", {})),
}


GRAPH = False  # --graph: time CUDA-graph replays instead (no host launch cost in the figure)


def _bench(fn, rep: int) -> float:
    """Milliseconds per call: eager ``do_bench`` median, or with ``--graph`` bench_w4a16's CUDA-graph timing."""
    if not GRAPH:
        return do_bench(fn, rep=rep, return_mode="median")
    import bench_w4a16  # the benchmarks folder is on sys.path

    return bench_w4a16._time_graph(fn) * 1e-3


def _rel(y, ref) -> float:
    return ((y.float() - ref.float()).norm() / ref.float().norm()).item()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pairs", default=",".join(PAIRS))
    ap.add_argument("--ms", default="4096,16")
    ap.add_argument("--shapes", default=None, help="NxK list")
    ap.add_argument("--rep", type=int, default=40)
    ap.add_argument("--sweep", action="store_true", help="only: tile configs of each pair on 7168x16384, M=4096")
    ap.add_argument("--decode-graph", action="store_true",
                    help="only: decode M (--ms, <= 64) timed as CUDA-graph replays over weight copies that do not "
                         "fit in L2, with the weight bytes per second as a share of the copy bandwidth")
    ap.add_argument("--fold-sweep", action="store_true",
                    help="only: TMA configs of the FP8 re-encoded mxfp4 pairs (the policy's fold route) at --ms on --shapes, vs "
                         "the decoding kernel and cuBLAS bf16")
    ap.add_argument("--graph", action="store_true",
                    help="time every case as CUDA-graph replays of bench_w4a16.GRAPH_CALLS calls (GPU time without "
                         "the host's launch cost; eager do_bench by default)")
    ap.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results/tmp"))
    args = ap.parse_args()
    global GRAPH
    GRAPH = args.graph
    shapes = SHAPES if not args.shapes else [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    ms = [int(v) for v in args.ms.split(",")]
    os.makedirs(args.out, exist_ok=True)
    meta = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "triton": triton.__version__,
            "git": os.environ.get("GIT_SHA", "unknown"), "host": platform.node(),
            "date": time.strftime("%Y-%m-%d")}
    print(meta, flush=True)
    if args.sweep:
        return sweep(args, meta)
    if args.decode_graph:
        return decode_graph(args, meta, shapes, ms)
    if args.fold_sweep:
        return fold_sweep(args, meta, shapes, ms)
    rows = []
    path = os.path.join(args.out, "bench_scaled_mm_graph.json" if args.graph else "bench_scaled_mm.json")
    meta["timing"] = "cuda_graph_replay" if args.graph else "do_bench_eager"
    dev = "cuda"
    for n, k in shapes:
        w = torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.05
        w8 = w.to(torch.float8_e4m3fn)
        quantized = {}
        for pair in args.pairs.split(","):
            (_, _), (wf, wo) = PAIRS[pair]
            quantized[pair] = lowbit.quantize(w, wf, **wo)
        for m in ms + ([8192] if (n, k) == (8192, 8192) and 4096 in ms else []):
            if (n, k) == (8192, 8192) and m == 4096:
                continue
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            t_bf16 = _bench(lambda: x @ w.T, args.rep)  # noqa: B023
            x8 = x.to(torch.float8_e4m3fn)
            one = torch.ones((), device=dev)
            try:
                t_fp8 = _bench(lambda: torch._scaled_mm(x8, w8.T, scale_a=one, scale_b=one,  # noqa: B023
                                                        out_dtype=torch.bfloat16), args.rep)
            except Exception as e:  # noqa: BLE001 - baseline not available
                print(f"torch._scaled_mm unavailable: {e}")
                t_fp8 = None
            print(f"{n}x{k} M={m}: cuBLAS bf16 {t_bf16 * 1e3:.1f} us ({2 * m * n * k / t_bf16 / 1e9:.0f} TFLOPS)"
                  + (f", _scaled_mm fp8 {t_fp8 * 1e3:.1f} us" if t_fp8 else ""), flush=True)
            for pair, wq in quantized.items():
                (af, ao), _ = PAIRS[pair]
                row = {"pair": pair, "M": m, "N": n, "K": k, "cublas_bf16_ms": t_bf16, "scaled_mm_fp8_ms": t_fp8}
                try:
                    a = lowbit.quantize(x, af, **ao)
                    y = lowbit.scaled_mm(a, wq)
                    row["rel_err"] = _rel(y, scaled_mm_reference(a, wq))
                    row["ms"] = _bench(lambda: lowbit.scaled_mm(a, wq), args.rep)  # noqa: B023
                    row["fused_ms"] = _bench(lambda: scaled_linear(x, wq, af, act_options=ao), args.rep)  # noqa: B023
                    row["tflops"] = 2 * m * n * k / row["ms"] / 1e9
                    row["vs_cublas_bf16"] = t_bf16 / row["ms"]
                    row["fused_vs_cublas_bf16"] = t_bf16 / row["fused_ms"]
                    if t_fp8:
                        row["vs_scaled_mm_fp8"] = t_fp8 / row["ms"]
                    row["weight_GBps"] = wq.nbytes / (row["ms"] * 1e-3) / 1e9
                    ks = _ks()
                    route = policy.scaled_route(a, wq, None, torch.bfloat16)
                    folds = route == "fold"
                    if route == "cublas" or (
                            folds and ks.cb.unsupported(m, n, k, x.device, True, None, torch.bfloat16) is None):
                        # the default ran cuBLASLt's block-scaled GEMM: lowbit's own kernel, and the peer alone
                        row["gemm"] = "cublas_blockwise"
                        row["triton_ms"] = _bench(lambda: ks.scaled_mm(a, wq, None, None, torch.bfloat16,  # noqa: B023
                                                                       route, cublas=False), args.rep)
                        row["triton_vs_cublas_bf16"] = t_bf16 / row["triton_ms"]
                        if t_fp8:
                            row["triton_vs_scaled_mm_fp8"] = t_fp8 / row["triton_ms"]
                        if pair == "fp8_block":
                            row["cublas_blockwise_ms"] = _bench(
                                lambda: ks.cb.mm(a.data, a.scale, wq.data, wq.scale, None, None,  # noqa: B023
                                                 torch.bfloat16), args.rep)
                    if folds:
                        # the same pair on the decoding kernel, and the share of the re-encoding passes
                        row["route"] = "fold"
                        row["decoding_ms"] = _bench(lambda: _ks().scaled_mm(a, wq, None, None, torch.bfloat16,  # noqa: B023
                                                                            "kernel"), args.rep)
                        row["decoding_vs_cublas_bf16"] = t_bf16 / row["decoding_ms"]
                        row["reencode_ms"] = _bench(lambda: _reencode(a, wq), args.rep)  # noqa: B023
                        fa, fw, exact = _folded(a, wq)
                        row["fold_exact"] = exact  # False would mean the decoding fallback ran as well
                        row["gemm_only_ms"] = _bench(lambda: lowbit.scaled_mm(fa, fw), args.rep)  # noqa: B023
                    print(f"  {pair:12s} {row['ms'] * 1e3:8.1f} us {row['tflops']:6.0f} TFLOPS  "
                          f"x{row['vs_cublas_bf16']:.2f} bf16" + (f"  x{row['vs_scaled_mm_fp8']:.2f} fp8" if t_fp8 else "")
                          + f"  fused x{row['fused_vs_cublas_bf16']:.2f}  err {row['rel_err']:.1e}"
                          + f"  {row['weight_GBps']:.0f} GB/s weights"
                          + (f"  [cuBLASLt GEMM; lowbit Triton x{row['triton_vs_cublas_bf16']:.2f} bf16]"
                             if "gemm" in row else "")
                          + (f"  [fold; decoding kernel x{row['decoding_vs_cublas_bf16']:.2f}, re-encoding "
                             f"{row['reencode_ms'] * 1e3:.1f} us, FP8 GEMM alone {row['gemm_only_ms'] * 1e3:.1f} us"
                             f"{'' if row['fold_exact'] else ', NOT EXACT: fallback ran'}]" if "route" in row else ""),
                          flush=True)
                except Exception as e:  # noqa: BLE001 - record and go on
                    row["error"] = f"{type(e).__name__}: {e}"[:300]
                    print(f"  {pair:12s} ERROR {row['error']}", flush=True)
                rows.append(row)
        w = w8 = quantized = None  # free before the next shape
        torch.cuda.empty_cache()
        _peers.write_json(path, {**meta, "complete": False, "rows": rows})
    _peers.write_json(path, {**meta, "complete": True, "rows": rows})
    print(f"wrote {path}")


def decode_graph(args, meta, shapes, ms) -> None:
    """Decode as a serving engine runs it: each case is a CUDA graph of bench_w4a16.GRAPH_CALLS calls, each on
    the next of enough weight copies (3x L2) that every call reads its weight from HBM; cuBLAS bf16 the same
    way. The activation is quantized outside the timed call ("gemm"), as in the main table."""
    import bench_w4a16 as W  # the benchmarks folder is on sys.path

    roof = W._copy_roof()
    print(f"copy roof {roof:.0f} GB/s", flush=True)
    rows = []
    path = os.path.join(args.out, "bench_scaled_mm_decode_graph.json")
    for n, k in shapes:
        w0 = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.05
        wb = [w0] + [torch.randn_like(w0) * 0.05 for _ in range(W._copies(n * k * 2) - 1)]
        for pair in args.pairs.split(","):
            (af, ao), (wf, wo) = PAIRS[pair]
            q0 = lowbit.quantize(w0, wf, **wo)
            qs = [q0] + [lowbit.quantize(wb[i % len(wb)] * (1 + i // len(wb)), wf, **wo)
                         for i in range(1, W._copies(q0.nbytes))]
            for m in ms:
                x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
                t_bf16 = W._time_graph(W._rotating([lambda w=w, x=x: x @ w.T for w in wb]))
                a = lowbit.quantize(x, af, **ao)
                row = {"pair": pair, "M": m, "N": n, "K": k, "graph_cublas_bf16_us": t_bf16, "copy_GBps": roof}
                try:
                    row["rel_err"] = _rel(lowbit.scaled_mm(a, q0), scaled_mm_reference(a, q0))
                    for q in qs:  # weight layouts are made once, in eager mode (QuantLinear does it at load)
                        lowbit.scaled_mm(a, q)
                    t = W._time_graph(W._rotating([lambda q=q, a=a: lowbit.scaled_mm(a, q) for q in qs]))
                    row["graph_us"] = t
                    row["graph_vs_cublas_bf16"] = t_bf16 / t
                    row["weight_GBps"] = q0.nbytes / (t * 1e-6) / 1e9
                    row["pct_of_copy"] = 100 * row["weight_GBps"] / roof
                    print(f"{pair:12s} {n}x{k} M={m:3d}: {t:7.1f} us vs cuBLAS bf16 {t_bf16:7.1f} us "
                          f"x{row['graph_vs_cublas_bf16']:.2f}  {row['weight_GBps']:.0f} GB/s "
                          f"({row['pct_of_copy']:.0f}% of copy)  err {row['rel_err']:.1e}", flush=True)
                except Exception as e:  # noqa: BLE001 - record and go on
                    row["error"] = f"{type(e).__name__}: {e}"[:300]
                    print(f"{pair:12s} {n}x{k} M={m}: ERROR {row['error']}", flush=True)
                rows.append(row)
            qs = None
        wb = w0 = None
        torch.cuda.empty_cache()
        _peers.write_json(path, {**meta, "complete": False, "rows": rows})
    _peers.write_json(path, {**meta, "complete": True, "rows": rows})
    print(f"wrote {path}")


def _ks():
    from lowbit.kernels import scaled_mm as ks

    return ks


def _reencode(a, wq) -> None:
    from lowbit.kernels import blockscaled as kb

    flag = torch.zeros(1, dtype=torch.int32, device=wq.data.device)
    kb.mxfp4_fold(wq, (128, 128), flag)
    if a.fmt == "mxfp4":
        kb.mxfp4_fold(a, (1, 128), flag)


def _folded(a, wq):
    """The fp8_block operands the fold route multiplies, and whether both re-encodings were exact."""
    from lowbit.kernels import blockscaled as kb

    fw, ok_w = kb.mxfp4_as_fp8_block(wq, (128, 128))
    if a.fmt == "mxfp4":
        fa, ok_a = kb.mxfp4_as_fp8_block(a, (1, 128))
    else:
        tiles = -(-a.shape[1] // 128)
        scale = a.scale.reshape(-1, 1).expand(-1, tiles).contiguous() if a.fmt == "fp8_rowwise" else a.scale
        fa, ok_a = lowbit.QTensor(a.data, scale, "fp8_block", a.shape, a.dtype, params={"block": (1, 128)}), True
    return fa, fw, bool(ok_w) and bool(ok_a)


# (BM, BN, warps, stages, persistent programs per SM or 0), BK = 128
FOLD_SWEEP = [(64, 128, 4, 3, 2), (64, 128, 4, 4, 0), (128, 128, 8, 3, 1), (128, 128, 8, 4, 0), (128, 256, 8, 3, 0),
              (64, 256, 4, 3, 1), (128, 128, 4, 3, 1)]


def fold_sweep(args, meta, shapes, ms) -> None:
    ks = _ks()
    rows = []
    path = os.path.join(args.out, "bench_scaled_mm_fold_sweep.json")
    for n, k in shapes:
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.05
        for m in ms:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            t_bf16 = _bench(lambda: x @ w.T, args.rep)  # noqa: B023
            for pair in args.pairs.split(","):
                (af, ao), (wf, wo) = PAIRS[pair]
                a, wq = lowbit.quantize(x, af, **ao), lowbit.quantize(w, wf, **wo)
                if ks.fold_unsupported(a, wq) is not None and m >= policy.FOLD_MIN_M:
                    continue
                ref = scaled_mm_reference(a, wq)
                base = {"pair": pair, "M": m, "N": n, "K": k, "cublas_bf16_ms": t_bf16}
                t_dec = _bench(lambda: ks.scaled_mm(a, wq, None, None, torch.bfloat16, "kernel"), args.rep)  # noqa: B023
                t_re = _bench(lambda: _reencode(a, wq), args.rep)  # noqa: B023
                rows.append({**base, "config": "decoding", "ms": t_dec, "vs_cublas_bf16": t_bf16 / t_dec})
                rows.append({**base, "config": "reencode_only", "ms": t_re})
                print(f"{pair:12s} {n}x{k} M={m}: decoding x{t_bf16 / t_dec:.2f} bf16, re-encoding {t_re * 1e3:.1f} us",
                      flush=True)
                for bm, bn, nw, ns, per_sm in FOLD_SWEEP:
                    cfg = {"BM": bm, "BN": bn, "BK": 128, "GROUP_M": 8, "num_warps": nw, "num_stages": ns,
                           "tma": True, "persistent": per_sm > 0, "per_sm": max(per_sm, 1)}
                    row = {**base, "config": cfg}
                    try:
                        y = ks.scaled_mm(a, wq, None, None, torch.bfloat16, "fold", config=cfg)
                        row["rel_err"] = _rel(y, ref)
                        row["ms"] = _bench(lambda c=cfg: ks.scaled_mm(a, wq, None, None, torch.bfloat16,  # noqa: B023
                                                                      "fold", config=c), args.rep)
                        row["vs_cublas_bf16"] = t_bf16 / row["ms"]
                        print(f"   {bm}x{bn} w{nw} s{ns} p{per_sm}: x{row['vs_cublas_bf16']:.2f} bf16  "
                              f"err {row['rel_err']:.1e}", flush=True)
                    except Exception as e:  # noqa: BLE001
                        row["error"] = f"{type(e).__name__}: {e}"[:200]
                        print(f"   {cfg} ERROR {row['error']}", flush=True)
                    rows.append(row)
        w = None
        torch.cuda.empty_cache()
        _peers.write_json(path, {**meta, "complete": False, "rows": rows})
    _peers.write_json(path, {**meta, "complete": True, "rows": rows})
    print(f"wrote {path}")


SWEEP = [(128, 128, 128, 8, 4), (128, 256, 128, 8, 3), (128, 128, 128, 4, 4), (64, 256, 128, 4, 4),
         (256, 128, 128, 8, 3), (128, 256, 64, 8, 4), (128, 128, 64, 4, 5)]


def sweep(args, meta) -> None:
    from lowbit.kernels import scaled_mm as ks

    m, n, k = 4096, 7168, 16384
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.05
    t_bf16 = _bench(lambda: x @ w.T, args.rep)
    rows = []
    for pair in args.pairs.split(","):
        (af, ao), (wf, wo) = PAIRS[pair]
        a, wq = lowbit.quantize(x, af, **ao), lowbit.quantize(w, wf, **wo)
        ref = scaled_mm_reference(a, wq)
        for bm, bn, bk, nw, ns in SWEEP:
            cfg = {"BM": bm, "BN": bn, "BK": bk, "GROUP_M": 8, "num_warps": nw, "num_stages": ns}
            row = {"pair": pair, "config": cfg}
            try:
                y = ks.scaled_mm(a, wq, None, None, torch.bfloat16, config=cfg)
                row["rel_err"] = _rel(y, ref)
                row["ms"] = _bench(lambda c=cfg: ks.scaled_mm(a, wq, None, None, torch.bfloat16, config=c), args.rep)  # noqa: B023
                row["vs_cublas_bf16"] = t_bf16 / row["ms"]
                print(f"{pair:12s} {cfg}  x{row['vs_cublas_bf16']:.2f} bf16  err {row['rel_err']:.1e}", flush=True)
            except Exception as e:  # noqa: BLE001
                row["error"] = f"{type(e).__name__}: {e}"[:200]
                print(f"{pair:12s} {cfg}  ERROR {row['error']}", flush=True)
            rows.append(row)
    with open(os.path.join(args.out, "bench_scaled_mm_sweep.json"), "w") as f:
        json.dump({**meta, "cublas_bf16_ms": t_bf16, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
