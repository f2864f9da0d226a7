"""Where the GPU time of one decode step goes: the kernels of a ``torch.compile``d decode step of the ``lowbit e2e``
decoder (default mode, so that the profiler sees each launch; the kernels are the ones reduce-overhead replays),
summed per kernel name per step, for bf16 and lowbit schemes, next to the step's reduce-overhead wall time.

    PYTHONPATH=src python benchmarks/experiments/profile_decode_kernels.py [--configs bf16,lowbit:w4a16-nvfp4] [--layers 8]
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import time

import torch

from lowbit.bench import e2e


def _kernel_table(fn, tok, pos, steps: int) -> tuple[list, float]:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            fn(tok, pos)
        torch.cuda.synchronize()
    per = collections.defaultdict(lambda: [0.0, 0])
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            per[ev.name][0] += ev.device_time / steps
            per[ev.name][1] += 1 / steps
    rows = sorted(([n, t, c] for n, (t, c) in per.items()), key=lambda r: -r[1])
    return rows, sum(r[1] for r in rows)


def _step_ms(fn, tok, pos, steps: int, graphs: bool) -> float:
    best = float("inf")
    for _ in range(3):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(steps):
            if graphs:
                torch.compiler.cudagraph_mark_step_begin()
            fn(tok, pos)
        torch.cuda.synchronize()
        best = min(best, (time.perf_counter() - t0) / steps * 1e3)
    return best


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--configs", default="bf16,lowbit:w4a16-nvfp4")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--top", type=int, default=14)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    s = e2e.SHAPES["llama3-8b"]
    s = e2e.DecoderShape(**{**e2e.asdict(s), "layers": args.layers})
    out = {}
    for config in args.configs.split(","):
        torch._dynamo.reset()
        model = e2e.apply_config(e2e.build_decoder(s, 2080, "cuda"), config)
        tok = torch.zeros(1, 1, dtype=torch.long, device="cuda")
        pos = torch.tensor([2048], device="cuda")
        res = {}
        with torch.inference_mode():
            for mode in ("default", "reduce-overhead"):
                torch._dynamo.reset()
                fn = torch.compile(lambda t, p: model(t, p).argmax(-1, keepdim=True), fullgraph=True,
                                   mode=None if mode == "default" else mode)
                for _ in range(3):
                    if mode != "default":
                        torch.compiler.cudagraph_mark_step_begin()
                    fn(tok, pos)
                res[mode + "_ms"] = _step_ms(fn, tok, pos, args.steps, mode != "default")
                if mode == "default":
                    rows, total = _kernel_table(fn, tok, pos, args.steps)
                    res["kernel_us_per_step"] = total
                    res["kernels"] = rows[: args.top]
                    res["launches_per_step"] = sum(r[2] for r in rows)
        out[config] = res
        print(f"== {config}: {args.layers} layers; default {res['default_ms']:.3f} ms/step, reduce-overhead "
              f"{res['reduce-overhead_ms']:.3f} ms/step; kernels {res['kernel_us_per_step']:.0f} us/step in "
              f"{res['launches_per_step']:.0f} launches", flush=True)
        for n, t, c in res["kernels"]:
            print(f"   {t:8.1f} us  x{c:5.1f}  {n[:110]}")
        del model, fn
        torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    os.environ.setdefault("TORCHINDUCTOR_FX_GRAPH_CACHE", "1")
    main()
