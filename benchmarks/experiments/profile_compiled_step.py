"""Where the host time of a ``torch.compile``d decode step goes (default mode, no CUDA graphs): tokens/s and a
cProfile of the compiled step for bf16 and lowbit schemes on the ``lowbit e2e`` decoder, plus the step's time
with the GPU idle (one synchronized step) against its GPU time (a CUDA-graph replay of the eager step); which
launcher Inductor gave each Triton kernel of the step (its static launcher or Triton's, per kernel name), the
time of one evaluation of the step's guards and their count by kind, and,
with ``$OUT`` set, the generated code of each config (``$OUT/compiled_step_<config>.py``).

    PYTHONPATH=src python benchmarks/experiments/profile_compiled_step.py [--configs bf16,lowbit:w4a16-nvfp4] [--layers 4]
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import io
import os
import pstats
import re
import time
from collections import Counter

import torch

from lowbit.bench import e2e


def _autotuners() -> dict[int, object]:
    from torch._inductor.runtime.triton_heuristics import CachingAutotuner

    # type(), not isinstance(): isinstance of a dead weak proxy among gc's objects raises ReferenceError
    return {id(o): o for o in gc.get_objects() if issubclass(type(o), CachingAutotuner)}


def launcher_kinds(new: list) -> Counter:
    """(kernel name, launcher kind) counts of the given Inductor kernels: ``StaticTritonCompileResult`` is the
    static launcher, ``TritonCompileResult`` Triton's Python-side launcher."""
    kinds: Counter = Counter()
    for o in new:
        name = getattr(getattr(o, "fn", None), "__name__", "?")
        for r in getattr(o, "compile_results", []) or [None]:
            kinds[(name, type(r).__name__)] += 1
    return kinds


def guard_report(fn, frame_locals: dict, calls: int = 200) -> str:
    """Time of one evaluation of the guards Dynamo keeps for ``fn``'s compiled code (what every call checks
    before the compiled code runs), and their count by kind (a Python-evaluated ``LAMBDA_GUARD`` costs more)."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    entries = _debug_get_cache_entry_list(fn.__code__)
    if not entries:
        return "guards: no compiled entry"
    guards = entries[0].guard_manager
    if not guards.check(frame_locals):
        return "guards: the given locals fail them"
    t0 = time.perf_counter()
    for _ in range(calls):
        guards.check(frame_locals)
    us = (time.perf_counter() - t0) / calls * 1e6
    kinds = Counter(m.group(1) for m in re.finditer(r"\+- ([A-Z_]+):", str(guards)))
    return f"guards: {us:.1f} us per check; " + ", ".join(f"{k} {c}" for k, c in kinds.most_common(6))


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
        def step(t, p, m=model):
            return m(t, p).argmax(-1, keepdim=True)

        fn = torch.compile(step, fullgraph=True)
        tok = torch.zeros(1, 1, dtype=torch.long, device="cuda")
        pos = torch.tensor([8], device="cuda")
        before = set(_autotuners())
        with torch.inference_mode():
            from torch._inductor.utils import run_and_get_code

            tok, codes = run_and_get_code(fn, tok, pos)
            out = os.environ.get("OUT")
            if out:
                with open(os.path.join(out, "compiled_step_" + re.sub(r"[^A-Za-z0-9]+", "_", config) + ".py"),
                          "w") as f:
                    f.write("\n\n# ---- next module ----\n\n".join(codes))
            for _ in range(2):
                tok = fn(tok, pos)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(args.steps):
                tok = fn(tok, pos)
            torch.cuda.synchronize()
            step_ms = (time.perf_counter() - t0) / args.steps * 1e3
            host = []
            for _ in range(args.steps):  # one step's launches with the GPU idle and the launch queue empty
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                fn(tok, pos)
                host.append(time.perf_counter() - t0)
            host_ms = sorted(host)[len(host) // 2] * 1e3
            torch.cuda.synchronize()
            pr = cProfile.Profile()
            pr.enable()
            for _ in range(args.steps):
                fn(tok, pos)
            pr.disable()
            torch.cuda.synchronize()
        buf = io.StringIO()
        pstats.Stats(pr, stream=buf).sort_stats("tottime").print_stats(args.top)
        print(f"== {config}: {args.layers} layers, compiled step {step_ms:.2f} ms, "
              f"host-only (median, GPU idle) {host_ms:.2f} ms, "
              f"launches in the generated code {sum(c.count('.run(') for c in codes)}")
        kinds = launcher_kinds([o for i, o in _autotuners().items() if i not in before])
        print("launchers: " + ", ".join(f"{n} {k} x{c}" for (n, k), c in sorted(kinds.items())))
        print(guard_report(step, {"t": tok, "p": pos, "m": model}))
        print(buf.getvalue()[:6000], flush=True)
        del model, fn


if __name__ == "__main__":
    main()
