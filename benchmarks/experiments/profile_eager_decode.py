"""Where an eager decode step of the e2e decoder spends its time, per config: host (cProfile, top functions)
and device (torch.profiler, top CUDA kernels), plus the tok/s of the same steps without profilers.

    python benchmarks/experiments/profile_eager_decode.py --configs bf16,lowbit:w8a8-fp8-block --layers 4
"""

from __future__ import annotations

import argparse
import cProfile
import dataclasses
import io
import pstats
import time

import torch

from lowbit.bench import e2e


def _steps(model, n, tok, pos):
    for _ in range(n):
        tok = model(tok, pos).argmax(-1, keepdim=True)
        pos += 1
    return tok


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--configs", default="bf16,lowbit:w8a8-fp8-block,lowbit:w4a16-nvfp4")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--top", type=int, default=25)
    args = ap.parse_args()
    s = dataclasses.replace(e2e.SHAPES["llama3-8b"], layers=args.layers)
    for config in args.configs.split(","):
        model = e2e.apply_config(e2e.build_decoder(s, 256, device="cuda"), config)
        tok = torch.zeros(1, 1, dtype=torch.long, device="cuda")
        pos = torch.tensor([8], device="cuda")
        with torch.inference_mode():
            _steps(model, 3, tok, pos)
            torch.cuda.synchronize()
            pos.fill_(8)
            t0 = time.perf_counter()
            _steps(model, args.steps, tok, pos)
            torch.cuda.synchronize()
            dt = time.perf_counter() - t0
            print(f"== {config}: {args.steps / dt:.1f} tok/s, {dt / args.steps * 1e3:.2f} ms/step ({args.layers} layers)")
            pr = cProfile.Profile()
            pos.fill_(8)
            pr.enable()
            _steps(model, args.steps, tok, pos)
            torch.cuda.synchronize()
            pr.disable()
            buf = io.StringIO()
            pstats.Stats(pr, stream=buf).sort_stats("tottime").print_stats(args.top)
            print(buf.getvalue()[-6000:])
            pos.fill_(8)
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                    torch.profiler.ProfilerActivity.CUDA]) as prof:
                _steps(model, 4, tok, pos)
                torch.cuda.synchronize()
            print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=12, max_name_column_width=60))
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12, max_name_column_width=60))
        del model
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
