"""Where the time of one GPTQ layer goes: ``lowbit bench gptq``'s Llama-3-8B layer quantized with the
``lowbit quantize`` settings under cProfile, after a warm-up on the tiny layer; prints the lowbit and torch
functions by cumulative time (GPU waits land on the call that synchronizes).

    python benchmarks/experiments/profile_gptq.py --scheme w4a16-nvfp4 [--set refine_sweeps=0] [--top 45]
    python benchmarks/experiments/profile_gptq.py --phases     # wall time per phase, GPU work included

``--phases`` wraps the phases of GPTQ (statistics with their calibration passes, the asymmetric target, the
inverse Cholesky, the static groups' fits, the column loop's blocks, the refinement, the whole ``_run``) in
timers that synchronize the device before and after, so each phase's time includes the GPU work it queued
(the syncs themselves cost a little: the total is a bit above an unwrapped run).
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import functools
import pstats
import time

import torch

import lowbit
from lowbit.algorithms import GPTQ
from lowbit.bench.decoder import SHAPES
from lowbit.bench.gptq import build, hidden_states
from lowbit.cli.algorithm_flags import GPTQ_DEFAULTS


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--scheme", default="w4a16-nvfp4")
    ap.add_argument("--set", default="")
    ap.add_argument("--calib", type=int, default=128)
    ap.add_argument("--top", type=int, default=45)
    ap.add_argument("--phases", action="store_true", help="synchronized wall time per GPTQ phase, no cProfile")
    a = ap.parse_args()
    fields = dict(GPTQ_DEFAULTS)
    for item in filter(None, a.set.split(",")):
        k, _, v = item.partition("=")
        fields[k] = float(v) if "." in v else int(v)
    for k in ("act_order", "asymmetric"):
        fields[k] = bool(fields[k])
    config = GPTQ(**fields)
    s, dev = SHAPES["llama3-8b"], "cuda"
    lowbit.quantize_model(build(SHAPES["tiny"], dev), a.scheme, algorithm=config,
                          calibration=hidden_states(SHAPES["tiny"], 2, 64, dev, 9))
    calib = hidden_states(s, a.calib, 2048, dev, 1)
    m = build(s, dev)
    torch.cuda.synchronize()
    if a.phases:
        totals = _time_phases()
        t0 = time.perf_counter()
        lowbit.quantize_model(m, a.scheme, algorithm=config, calibration=calib)
        torch.cuda.synchronize()
        print(f"{a.scheme} {fields}: {time.perf_counter() - t0:.2f} s with synchronized phases")
        for name, (n, sec) in sorted(totals.items(), key=lambda kv: -kv[1][1]):
            print(f"  {name:28s} {n:6d} calls {sec:8.3f} s")
        return
    prof = cProfile.Profile()
    t0 = time.perf_counter()
    prof.enable()
    lowbit.quantize_model(m, a.scheme, algorithm=config, calibration=calib)
    torch.cuda.synchronize()
    prof.disable()
    print(f"{a.scheme} {fields}: {time.perf_counter() - t0:.2f} s under cProfile")
    st = pstats.Stats(prof).sort_stats("cumulative")
    st.print_stats(r"lowbit|torch/(linalg|functional)|cuda/graphs", a.top)
    st.sort_stats("tottime").print_stats(25)


def _time_phases() -> dict:
    """Wrap GPTQ's phases in synchronized timers; returns the dict they add (calls, seconds) to."""
    from lowbit.algorithms import gptq, gptq_graphs, grids

    totals: dict = collections.defaultdict(lambda: [0, 0.0])

    def timed(owner, attr: str, name: str) -> None:
        fn = getattr(owner, attr)

        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            torch.cuda.synchronize()
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                torch.cuda.synchronize()
                totals[name][0] += 1
                totals[name][1] += time.perf_counter() - t

        setattr(owner, attr, wrapper)

    timed(gptq, "_paired_statistics", "statistics (calibration)")
    timed(gptq, "_run", "gptq _run (all below)")
    timed(gptq, "_asymmetric_target", "  asymmetric target")
    timed(gptq, "_inverse_cholesky", "  inverse cholesky")
    timed(grids.Grid, "fit_groups", "  static group fits")
    timed(gptq_graphs.BlockGraphs, "run_block", "  column loop blocks")
    timed(gptq, "refine", "  refinement")
    return totals


if __name__ == "__main__":
    main()
