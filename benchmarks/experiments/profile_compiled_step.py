"""Where the host time of a ``torch.compile``d decode step goes (default mode, no CUDA graphs): tokens/s and a
cProfile of the compiled step for bf16 and lowbit schemes on the ``lowbit e2e`` decoder, plus the step's time
with the GPU idle (one synchronized step) against its GPU time (a CUDA-graph replay of the eager step).

    PYTHONPATH=src python benchmarks/experiments/profile_compiled_step.py [--configs bf16,lowbit:w4a16-nvfp4] [--layers 4]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time

import torch

from lowbit.bench import e2e


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--configs", default="bf16,lowbit:w4a16-nvfp4")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--top", type=int, default=25)
    args = ap.parse_args()
    s = e2e.SHAPES["llama3-8b"]
    s = e2e.DecoderShape(**{**e2e.asdict(s), "layers": args.layers})
    for config in args.configs.split(","):
        torch._dynamo.reset()
        model = e2e.apply_config(e2e.build_decoder(s, 256, "cuda"), config)
        fn = torch.compile(lambda t, p: model(t, p).argmax(-1, keepdim=True), fullgraph=True)
        tok = torch.zeros(1, 1, dtype=torch.long, device="cuda")
        pos = torch.tensor([8], device="cuda")
        with torch.inference_mode():
            for _ in range(3):
                tok = fn(tok, pos)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(args.steps):
                tok = fn(tok, pos)
            torch.cuda.synchronize()
            step_ms = (time.perf_counter() - t0) / args.steps * 1e3
            t0 = time.perf_counter()
            for _ in range(args.steps):
                fn(tok, pos)
            host_ms = (time.perf_counter() - t0) / args.steps * 1e3  # launches only (queue not yet full)
            torch.cuda.synchronize()
            pr = cProfile.Profile()
            pr.enable()
            for _ in range(args.steps):
                fn(tok, pos)
            pr.disable()
            torch.cuda.synchronize()
        buf = io.StringIO()
        pstats.Stats(pr, stream=buf).sort_stats("tottime").print_stats(args.top)
        print(f"== {config}: {args.layers} layers, compiled step {step_ms:.2f} ms, host-only {host_ms:.2f} ms")
        print(buf.getvalue()[:6000], flush=True)
        del model, fn


if __name__ == "__main__":
    main()
