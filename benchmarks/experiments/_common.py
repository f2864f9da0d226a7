"""What the probes and sweeps here share, on top of ``lowbit.bench`` (the maintained benchmarks' helpers and
timer): weight copies rotated out of L2, CUDA-graph timing, the copy roof, the W4A16 problem of the GEMM
benchmark, atomic JSON writes, a cProfile of host calls and the GPU time per kernel. Not maintained beyond keeping the scripts here importable.
"""

from __future__ import annotations

import collections
import cProfile
import io
import json
import os
import pstats

import torch

from lowbit.bench import envinfo, linear
from lowbit.bench.common import copies, rel_errors, rotating
from lowbit.bench.timing import graph_ms

GRAPH_CALLS = 20
FORMATS = {label: linear.FORMATS[label] for label in linear.PREFILL_FORMATS}
FORMATS["nf4"] = FORMATS.pop("nf4.dq")  # the W4A16 GEMM benchmark's nf4 was double-quantized
SHAPES = list(linear.NK)


def _copies(nbytes: float) -> int:
    return copies(int(nbytes), "cuda")


_rotating = rotating


def _time_graph(fn) -> float:
    """Microseconds per call of ``fn`` replayed from a CUDA graph of :data:`GRAPH_CALLS` calls."""
    return graph_ms(fn, repeats=50, calls=GRAPH_CALLS) * 1e3


def eager_us(fn, calls: int = 200, warmups: int = 10) -> float:
    """Microseconds per call of ``fn`` called back to back eagerly (host and launches included), after
    ``warmups`` calls."""
    import time

    for _ in range(warmups):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / calls * 1e6


def _copy_roof() -> float:
    """GB/s of a device-to-device copy (bytes read + written)."""
    from lowbit.bench.timing import CudaTimer

    return CudaTimer().copy_bandwidth()["GBps"]


def _git() -> str:
    return envinfo.git_sha()


def capture(body, warm=None) -> torch.cuda.CUDAGraph:
    """A CUDA graph of ``body()``, after ``warm()`` (default ``body``) ran on a side stream."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            (warm or body)()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        body()
    return graph


def bench(fn, rep: int) -> float:
    """``triton.testing.do_bench`` median in ms (L2 flushed before each call)."""
    from triton.testing import do_bench

    return do_bench(fn, warmup=25, rep=rep, return_mode="median")


def header() -> dict:
    return envinfo.header()


def _problem(n: int, k: int, m: int, dev) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator(device=dev).manual_seed(n * 31 + k)
    w = torch.randn(n, k, device=dev, generator=gen, dtype=torch.bfloat16) * 0.02
    x = torch.randn(m, k, device=dev, generator=gen, dtype=torch.bfloat16)
    return x, w


def _quantize(w: torch.Tensor, name: str):
    fmt, opts = FORMATS[name]
    return linear.quantize_weight(w, fmt, opts)


def rel_error(y: torch.Tensor, ref: torch.Tensor) -> float:
    return rel_errors(y, ref)[0]


def write_json(path: str, payload: dict) -> None:
    """Write ``payload`` to ``path`` atomically (scripts call it after every shape)."""
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(payload, f, indent=1, default=str)
    os.replace(tmp, path)


def cprofile_text(fn, calls: int, top: int) -> str:
    """cProfile of ``calls`` calls of ``fn`` (the GPU synchronized before and after), the ``top`` entries by
    self time, as text."""
    prof = cProfile.Profile()
    torch.cuda.synchronize()
    prof.enable()
    for _ in range(calls):
        fn()
    prof.disable()
    torch.cuda.synchronize()
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(top)
    return buf.getvalue()


def kernel_times(fn, calls: int, warmups: int = 3) -> tuple[dict[str, float], float]:
    """(GPU us per call by kernel name, total GPU us per call) of ``fn`` under torch.profiler, over ``calls``
    calls after ``warmups``."""
    for _ in range(warmups):
        fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    per: dict[str, float] = collections.defaultdict(float)
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            per[ev.name[:90]] += ev.device_time_total / calls
    return dict(per), sum(per.values())
