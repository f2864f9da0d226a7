"""Host time of eager ``lowbit.quantize`` / ``lowbit.dequantize`` calls per format, against the peers' calls:
microseconds of CPU per call of back-to-back calls on a small tensor (the GPU never the bound there), the
same calls' GPU time from CUDA events, and with ``--profile NAME`` a cProfile of one case's host path.

    python benchmarks/experiments/profile_quantize.py [--rows 256] [--profile quantize.nvfp4]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time

import torch

import lowbit
from lowbit.formats.blockscaled import nvfp4_default_global_scale


def _host_us(fn, n: int = 300) -> tuple[float, float]:
    """(host us per call, GPU us per call) of ``n`` back-to-back calls, best of 5 windows."""
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    best_host = best_gpu = float("inf")
    for _ in range(5):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        host = (time.perf_counter() - t0) / n * 1e6
        b.record()
        torch.cuda.synchronize()
        best_host = min(best_host, host)
        best_gpu = min(best_gpu, a.elapsed_time(b) / n * 1e3)
    return best_host, best_gpu


def _peers(x: torch.Tensor) -> dict:
    out = {}
    try:
        from torchao.prototype.mx_formats.config import ScaleCalculationMode
        from torchao.prototype.mx_formats.mx_tensor import to_mx
        from torchao.prototype.mx_formats.nvfp4_tensor import NVFP4Tensor, per_tensor_amax_to_scale

        mx4 = torch.compile(lambda t: to_mx(t, torch.float4_e2m1fn_x2, 32, ScaleCalculationMode.RCEIL))
        mx8 = torch.compile(lambda t: to_mx(t, torch.float8_e4m3fn, 32, ScaleCalculationMode.RCEIL))
        nv = torch.compile(lambda t: NVFP4Tensor.to_nvfp4(
            t, per_tensor_scale=per_tensor_amax_to_scale(torch.max(torch.abs(t)))))
        out["quantize.mxfp4"] = ("torchao to_mx[compiled]", lambda: mx4(x))
        out["quantize.mxfp8_e4m3"] = ("torchao to_mx[compiled]", lambda: mx8(x))
        out["quantize.nvfp4"] = ("torchao to_nvfp4[compiled]", lambda: nv(x))
    except Exception as e:  # noqa: BLE001 - a missing peer is reported, not fatal
        print(f"torchao: {type(e).__name__}: {e}")
    try:
        import bitsandbytes.functional as bnbf

        packed, state = bnbf.quantize_4bit(x, blocksize=64, compress_statistics=True, quant_type="nf4")
        out["dequantize.nf4.dq"] = ("bitsandbytes dequantize_4bit", lambda: bnbf.dequantize_4bit(packed, state))
    except Exception as e:  # noqa: BLE001
        print(f"bitsandbytes: {type(e).__name__}: {e}")
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=256)
    ap.add_argument("--cols", type=int, default=4096)
    ap.add_argument("--profile", default="")
    args = ap.parse_args()
    x = torch.randn(args.rows, args.cols, device="cuda", dtype=torch.bfloat16)
    gs = nvfp4_default_global_scale(x)
    qs = {f: lowbit.quantize(x, f) for f in ("nvfp4", "mxfp4", "mxfp8_e4m3")}
    qs["nf4.dq"] = lowbit.quantize(x.cpu(), "nf4", double_quant=True).to("cuda")
    qs["int4_awq"] = lowbit.quantize(x.cpu().half(), "int4_awq").to("cuda")
    cases = {
        "quantize.nvfp4": lambda: lowbit.quantize(x, "nvfp4"),
        "quantize.nvfp4.gs": lambda: lowbit.quantize(x, "nvfp4", global_scale=gs),
        "quantize.nvfp4.swizzled": lambda: lowbit.quantize(x, "nvfp4", scale_layout="swizzled"),
        "quantize.mxfp4": lambda: lowbit.quantize(x, "mxfp4"),
        "quantize.mxfp8_e4m3": lambda: lowbit.quantize(x, "mxfp8_e4m3"),
        **{f"dequantize.{f}": (lambda q=q: lowbit.dequantize(q, torch.bfloat16)) for f, q in qs.items()},
    }
    peers = _peers(x)
    print(f"x [{args.rows}, {args.cols}] bf16; host us per call (GPU us per call)")
    print(f"{'op':26s} {'lowbit':>16s} {'peer':>16s}  peer name")
    torch.cuda.synchronize()
    empty = torch.empty(1, device="cuda")
    base = _host_us(lambda: empty.add_(1))[0]
    print(f"{'(one torch launch)':26s} {base:9.1f}")
    for name, fn in cases.items():
        h, g = _host_us(fn)
        peer = peers.get(name)
        ptxt = ""
        if peer is not None:
            ph, pg = _host_us(peer[1])
            ptxt = f"{ph:9.1f} ({pg:5.1f})  {peer[0]}"
        print(f"{name:26s} {h:9.1f} ({g:5.1f}) {ptxt}", flush=True)
    if args.profile:
        fn = cases[args.profile]
        pr = cProfile.Profile()
        pr.enable()
        for _ in range(300):
            fn()
        pr.disable()
        torch.cuda.synchronize()
        buf = io.StringIO()
        pstats.Stats(pr, stream=buf).sort_stats("tottime").print_stats(20)
        print(buf.getvalue()[:5000])


if __name__ == "__main__":
    main()
