"""Split-K workspace and arrival counters shared by the launchers (GEMV and scaled_mm decode).

One pair of buffers per (device, stream): launches on one stream run one after another, and every kernel
resets the counters it used before it exits, so each launcher can reuse them.
"""

from __future__ import annotations

import torch

from . import scratch_per_call

_SCRATCH: dict = {}


def split_k_scratch(device: torch.device, dev_index: int | None, ws_numel: int, n_cnt: int
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp32 workspace of at least ``ws_numel``, zeroed int32 counters of at least ``n_cnt``)."""
    if dev_index is not None and (torch._C._cuda_isCurrentStreamCapturing() or scratch_per_call()):
        # graph-owned buffers: never cached (the graph keeps them alive)
        return (torch.empty(ws_numel, dtype=torch.float32, device=device),
                torch.zeros(n_cnt, dtype=torch.int32, device=device))
    key = (dev_index, torch._C._cuda_getCurrentRawStream(dev_index) if dev_index is not None else 0)
    ws, cnt = _SCRATCH.get(key, (None, None))
    if ws is None or ws.numel() < ws_numel or cnt.numel() < n_cnt:
        if ws is None or ws.numel() < ws_numel:
            ws = torch.empty(max(ws_numel, 1 << 16), dtype=torch.float32, device=device)
        if cnt is None or cnt.numel() < n_cnt:
            cnt = torch.zeros(max(n_cnt, 4096), dtype=torch.int32, device=device)
        _SCRATCH[key] = (ws, cnt)
    return ws, cnt
