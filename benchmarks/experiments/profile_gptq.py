"""Where the time of one GPTQ layer goes: ``lowbit bench gptq``'s Llama-3-8B layer quantized with the
``lowbit quantize`` settings under cProfile, after a warm-up on the tiny layer; prints the lowbit and torch
functions by cumulative time (GPU waits land on the call that synchronizes).

    python benchmarks/experiments/profile_gptq.py --scheme w4a16-nvfp4 [--set refine_sweeps=0] [--top 45]
"""

from __future__ import annotations

import argparse
import cProfile
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


if __name__ == "__main__":
    main()
