"""Split-K workspace and arrival counters shared by the launchers (GEMV and scaled_mm decode).

One pair of buffers per (device, stream): launches on one stream run one after another, and every kernel
resets the counters it used before it exits, so each launcher can reuse them.

A launch captured into a CUDA graph gets its own counters and workspace (a replay may run on another
stream than later eager calls). Its counters are a never-reused slice of a zeroed pool made outside any
capture, so the graph holds no memset node per launch; only when that pool is used up does a capture fall
back to a zeroed allocation of its own (a memset in the graph).
"""

from __future__ import annotations

import torch

from . import scratch_per_call

_SCRATCH: dict = {}
_GRAPH_POOL: dict = {}        # dev_index -> [zeroed int32 chunk, next free index, all chunks (kept alive)]
_POOL_CHUNK = 1 << 18         # counters per pool chunk (1 MB)
_POOL_LOW = 1 << 15           # an eager call adds a chunk when fewer than this many are left


def _refill_graph_pool(device: torch.device, dev_index: int) -> None:
    pool = _GRAPH_POOL.get(dev_index)
    if pool is None or pool[0].numel() - pool[1] < _POOL_LOW:
        chunk = torch.zeros(_POOL_CHUNK, dtype=torch.int32, device=device)
        kept = [] if pool is None else pool[2]
        kept.append(chunk)  # slices handed to captured graphs stay valid: the graphs hold raw pointers
        _GRAPH_POOL[dev_index] = [chunk, 0, kept]


def _graph_counters(device: torch.device, dev_index: int, n_cnt: int) -> torch.Tensor:
    pool = _GRAPH_POOL.get(dev_index)
    take = -(-n_cnt // 32) * 32
    if pool is None or pool[0].numel() - pool[1] < take:
        return torch.zeros(n_cnt, dtype=torch.int32, device=device)
    start = pool[1]
    pool[1] = start + take
    return pool[0][start:start + n_cnt]


def split_k_scratch(device: torch.device, dev_index: int | None, ws_numel: int, n_cnt: int
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp32 workspace of at least ``ws_numel``, zeroed int32 counters of at least ``n_cnt``)."""
    if dev_index is not None and torch._C._cuda_isCurrentStreamCapturing():
        # graph-owned workspace (the graph keeps it alive); counters from the zeroed pool
        return (torch.empty(ws_numel, dtype=torch.float32, device=device),
                _graph_counters(device, dev_index, n_cnt))
    if dev_index is not None and scratch_per_call():
        # inside a custom op (maybe a warm-up whose allocations land in a graph pool): nothing cached
        return (torch.empty(ws_numel, dtype=torch.float32, device=device),
                torch.zeros(n_cnt, dtype=torch.int32, device=device))
    if dev_index is not None:
        _refill_graph_pool(device, dev_index)
    key = (dev_index, torch._C._cuda_getCurrentRawStream(dev_index) if dev_index is not None else 0)
    ws, cnt = _SCRATCH.get(key, (None, None))
    if ws is None or ws.numel() < ws_numel or cnt.numel() < n_cnt:
        if ws is None or ws.numel() < ws_numel:
            ws = torch.empty(max(ws_numel, 1 << 16), dtype=torch.float32, device=device)
        if cnt is None or cnt.numel() < n_cnt:
            cnt = torch.zeros(max(n_cnt, 4096), dtype=torch.int32, device=device)
        _SCRATCH[key] = (ws, cnt)
        GENERATION[0] += 1
    return ws, cnt


GENERATION = [0]
"""Bumped whenever a (device, stream) pair of :func:`split_k_scratch` is replaced: a caller that keeps the pair
it got (with the stream and this number) may reuse it while both are unchanged."""


_capturing = torch._C._cuda_isCurrentStreamCapturing


class KeptScratch:
    """A runner's split-K pair from :func:`split_k_scratch`, kept between calls on one stream: ``get(stream)``
    returns the kept pair while the stream and :data:`GENERATION` are unchanged (a dict lookup less per call),
    else asks :func:`split_k_scratch` again (another stream, a grown pool, a capture with its own counters, or a
    custom op's call) and keeps the answer when it may be reused."""

    __slots__ = ("device", "dev_index", "ws_numel", "n_cnt", "kept")

    def __init__(self, device: torch.device, dev_index: int, ws_numel: int, n_cnt: int) -> None:
        self.device, self.dev_index, self.ws_numel, self.n_cnt = device, dev_index, ws_numel, n_cnt
        self.kept: tuple = (None, -1, None, None)  # (stream, generation, workspace, counters)

    def get(self, stream: int) -> tuple[torch.Tensor, torch.Tensor]:
        kept = self.kept
        if kept[0] == stream and kept[1] == GENERATION[0] and not _capturing() and not scratch_per_call():
            return kept[2], kept[3]
        gen = GENERATION[0]
        ws, cnt = split_k_scratch(self.device, self.dev_index, self.ws_numel, self.n_cnt)
        if not _capturing() and not scratch_per_call() and gen == GENERATION[0]:
            self.kept = (stream, gen, ws, cnt)
        return ws, cnt


_TRACED: dict = {}
"""device index -> the tensors every prepared layer of that device passes to its triton_op under
``torch.compile`` (:func:`traced_shared`)."""


def traced_scratch(device: torch.device, dev_index: int, ws_numel: int, n_cnt: int
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp32 workspace, zeroed int32 counters), at least that large, that compiled graphs take as inputs.

    A layer prepared for ``torch.compile`` asks for the pair its plans need when it is prepared; under
    ``torch.compile`` every layer of the device passes the device's current pair (:func:`traced_shared`), so
    the compiled code allocates no workspace and launches no memset per GEMV. One pair per device, shared by
    the layers (launches on a stream run one after another and reset their counters); a larger request
    replaces it with a larger one. The tensors are marked as static addresses: CUDA-graph trees neither copy
    them per replay nor record again for them.
    """
    shared = _TRACED.get(dev_index)
    ws, cnt = (None, None) if shared is None else shared[:2]
    if ws is None or ws.numel() < ws_numel or cnt.numel() < n_cnt:
        ws = torch.empty(max(ws_numel, 1 << 16, 0 if ws is None else ws.numel()), dtype=torch.float32,
                         device=device)
        cnt = torch.zeros(max(n_cnt, 4096, 0 if cnt is None else cnt.numel()), dtype=torch.int32, device=device)
        placeholders = shared[2:] if shared is not None else tuple(
            torch.zeros(16, dtype=dt, device=device) for dt in (torch.float32, torch.bfloat16, torch.float16))
        mark_static(ws, cnt, *placeholders)
        _TRACED[dev_index] = (ws, cnt, *placeholders)
    return ws, cnt


def traced_shared(dev_index: int) -> tuple[torch.Tensor, ...]:
    """(workspace, counters, fp32 placeholder, bfloat16 placeholder, float16 placeholder) of a device, for the
    triton_ops of prepared layers under ``torch.compile`` (after :func:`traced_scratch` for that device).

    The layers read these through this one table, not each through an attribute of its own: ``torch.compile``
    then sees one graph input per tensor, reached one way. The same tensor reached through every layer's own
    attribute would cost the compiled step an identity check per layer and tensor (evaluated in Python)
    on every call."""
    return _TRACED[dev_index]


def mark_static(*tensors: torch.Tensor) -> None:
    """``torch._dynamo.mark_static_address`` on each tensor (buffers that live as long as a layer: compiled
    graphs treat them as fixed addresses, like parameters)."""
    import torch._dynamo

    for t in tensors:
        torch._dynamo.mark_static_address(t)
