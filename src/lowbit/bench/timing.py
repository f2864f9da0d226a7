"""GPU timing: ``triton.testing.do_bench`` medians, CUDA-graph timing, the copy roof and the launch floor.

Everything here needs CUDA and imports triton inside the functions; the runner takes any object with the
same methods (the CPU tests pass a fake one).
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

COPY_BYTES = 1 << 30  # the copied buffer: >= 1 GiB, so the copy streams from HBM (L2 is 50-60 MB)


def capture_graph(body: Callable[[], Any], warm: Callable[[], Any] | None = None, warmups: int = 3,
                  before_capture: Callable[[], Any] | None = None):
    """A ``torch.cuda.CUDAGraph`` of ``body()``, captured after ``warmups`` calls of ``warm`` (default ``body``) on a
    side stream, as capture requires (allocators and kernels warmed outside the graph); ``before_capture`` runs
    between the two (a barrier across ranks). Call it under ``torch.inference_mode()`` when the model needs it."""
    import torch

    warm = body if warm is None else warm
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(warmups):
            warm()
    torch.cuda.current_stream().wait_stream(s)
    if before_capture is not None:
        before_capture()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        body()
    return g


def graph_ms(fn: Callable[[], Any], repeats: int, calls: int = 1) -> float:
    """Milliseconds per call of ``fn`` replayed from a CUDA graph holding ``calls`` calls (mean over ``repeats``
    replays; warmed up on a side stream first, as capture requires). No launch overhead, no L2 flush: the GPU
    time of a call inside a model's graph."""
    import torch

    def body():
        for _ in range(calls):
            fn()

    with torch.inference_mode():
        g = capture_graph(body, warm=fn, warmups=2)
        return replay_seconds(g, repeats) / calls * 1e3


def replay_seconds(g, replays: int, warm_replays: int = 1) -> float:
    """Seconds per replay of a captured CUDA graph ``g``: the mean of ``replays`` synchronized replays, after
    ``warm_replays`` untimed ones."""
    import time

    import torch

    for _ in range(warm_replays):
        g.replay()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(replays):
        g.replay()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / replays


def sync(device) -> None:
    """Wait for the work queued on ``device`` (nothing to wait for off CUDA)."""
    import torch

    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


@dataclass(frozen=True)
class Stats:
    """Milliseconds per call: the median and the 20th/80th percentiles of ``n`` timed calls."""

    ms: float
    p20: float
    p80: float
    n: int


def _quantile(xs: list[float], q: float) -> float:
    s = sorted(xs)
    pos = q * (len(s) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def summarize(times_ms: list[float]) -> Stats:
    return Stats(
        ms=statistics.median(times_ms),
        p20=_quantile(times_ms, 0.2),
        p80=_quantile(times_ms, 0.8),
        n=len(times_ms),
    )


class CudaTimer:
    """Times callables on the current CUDA device.

    Args:
        warmup, rep: ``do_bench`` warm-up and measurement budgets in ms (it flushes L2 before each call).
        graph_rep: ``do_bench_cudagraph`` budget in ms.
    """

    def __init__(self, warmup: int = 25, rep: int = 100, graph_rep: int = 20) -> None:
        import torch

        if not torch.cuda.is_available():
            raise RuntimeError("timing needs a CUDA GPU (torch.cuda.is_available() is False)")
        self.warmup, self.rep, self.graph_rep = warmup, rep, graph_rep

    def time(self, fn: Callable[[], Any]) -> Stats:
        """do_bench with ``return_mode="all"``; the median of those times is do_bench's ``"median"``."""
        from triton.testing import do_bench

        return summarize(do_bench(fn, warmup=self.warmup, rep=self.rep, return_mode="all"))

    def time_graph(self, fn: Callable[[], Any]) -> float:
        """Median ms per call with the calls replayed from a CUDA graph (no launch overhead, no L2 flush)."""
        from triton.testing import do_bench_cudagraph

        return do_bench_cudagraph(fn, rep=self.graph_rep, return_mode="median")

    def copy_bandwidth(self, nbytes: int = COPY_BYTES) -> dict[str, float]:
        """Device-to-device copy of ``nbytes``: GB/s counting the bytes read and the bytes written."""
        import torch

        st = self._time_copy(nbytes)
        torch.cuda.empty_cache()
        moved = 2 * nbytes
        return {"bytes": moved, "ms": st.ms, "GBps": moved / st.ms / 1e6}

    def _time_copy(self, nbytes: int) -> Stats:
        import torch
        from triton.testing import do_bench

        src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device="cuda").normal_()
        dst = torch.empty_like(src)
        return summarize(do_bench(lambda: dst.copy_(src), warmup=50, rep=300, return_mode="all"))

    def launch_overhead(self) -> dict[str, float]:
        """Median us of one launch of an empty Triton kernel: eager (do_bench) and from a CUDA graph."""
        import torch

        from ._empty_kernel import empty_kernel

        t = torch.empty(1, device="cuda")

        def launch():
            empty_kernel[(1,)](t)

        return {"eager_us": self.time(launch).ms * 1e3, "graph_us": self.time_graph(launch) * 1e3}

    def cleanup(self) -> None:
        import gc

        import torch

        gc.collect()
        torch.cuda.empty_cache()
