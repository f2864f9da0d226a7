"""Host and device time of eager ``lowbit.quantize`` calls per format (4096 x 4096 bf16): wall time per call of
back-to-back calls, the same calls' GPU time from CUDA events, and a cProfile of the host path.

    python benchmarks/experiments/profile_quantize.py
"""

from __future__ import annotations

import cProfile
import io
import pstats
import time

import torch

import lowbit
from lowbit.formats.blockscaled import nvfp4_default_global_scale


def main() -> None:
    x = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    gs = nvfp4_default_global_scale(x)
    cases = {
        "nvfp4": lambda: lowbit.quantize(x, "nvfp4"),
        "nvfp4.gs": lambda: lowbit.quantize(x, "nvfp4", global_scale=gs),
        "mxfp4": lambda: lowbit.quantize(x, "mxfp4"),
    }
    for name, fn in cases.items():
        for _ in range(5):
            fn()
        torch.cuda.synchronize()
        n = 200
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        host = (time.perf_counter() - t0) / n * 1e6
        torch.cuda.synchronize()
        wall = (time.perf_counter() - t0) / n * 1e6
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(n):
            fn()
        b.record()
        torch.cuda.synchronize()
        gpu = a.elapsed_time(b) / n * 1e3
        pr = cProfile.Profile()
        pr.enable()
        for _ in range(n):
            fn()
        pr.disable()
        torch.cuda.synchronize()
        buf = io.StringIO()
        pstats.Stats(pr, stream=buf).sort_stats("tottime").print_stats(14)
        print(f"== {name}: host {host:.1f} us/call, wall {wall:.1f}, events {gpu:.1f}")
        print(buf.getvalue()[:3500], flush=True)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(20):
                fn()
            torch.cuda.synchronize()
        print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=6, max_name_column_width=50))


if __name__ == "__main__":
    main()
