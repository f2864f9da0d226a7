"""Which allocation makes block offload's steady device memory larger than the all-on-device run's (beyond
the slots): a small Wan-shaped stack run both ways under ``torch.cuda.memory._record_memory_history``, then
the live allocations of each steady state compared by size, with the Python frames of every allocation the
offload run holds and the other does not.

    PYTHONPATH=src python benchmarks/experiments/probe_offload_memory.py [--blocks 4]
"""

from __future__ import annotations

import argparse
import collections

import torch

from lowbit.bench.offload import WAN_14B, _run, build_stack
from lowbit.nn.offload import enable_block_offload


def _where(frames, limit: int = 400) -> str:
    """The Python frames of an allocation (lowbit's and the model's; torch's own left out but nn.Module
    calls), innermost first."""
    return " <- ".join(f"{f['filename'].split('/')[-1]}:{f['line']}:{f['name']}" for f in frames or ()
                       if f["filename"].endswith(".py")
                       and ("torch/" not in f["filename"] or "nn/modules" in f["filename"]))[:limit]


def _live(snapshot) -> list[tuple[int, str]]:
    out = []
    for seg in snapshot["segments"]:
        for blk in seg["blocks"]:
            if blk["state"] == "active_allocated":
                out.append((blk["requested_size"], f"stream {seg['stream']}: {_where(blk.get('frames'))}"))
    return out


def _peak_live(snapshot) -> tuple[int, collections.Counter]:
    """Replay the allocator trace: the largest total of live allocations and what was live then
    (size and allocating frames)."""
    live: dict[int, tuple[int, str]] = {}
    total = best = 0
    best_live: dict = {}
    for ev in snapshot["device_traces"][0]:
        if ev["action"] == "alloc":
            live[ev["addr"]] = (ev["size"], _where(ev.get("frames"), 300))
            total += ev["size"]
            if total > best:
                best, best_live = total, dict(live)
        elif ev["action"] == "free_completed" and ev["addr"] in live:
            total -= live.pop(ev["addr"])[0]
    return best, collections.Counter(best_live.values())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--blocks", type=int, default=4)
    args = ap.parse_args()
    dev = torch.device("cuda")
    shape = {**WAN_14B, "n_blocks": args.blocks}
    model = build_stack(shape["dim"], shape["ffn_dim"], shape["heads"], shape["n_blocks"], device=dev,
                        dtype=torch.bfloat16, scheme=None)
    g = torch.Generator(device=dev).manual_seed(1)
    inputs = (torch.randn(1, shape["tokens"], shape["dim"], device=dev, dtype=torch.bfloat16, generator=g),
              torch.randn(1, shape["ctx"], shape["dim"], device=dev, dtype=torch.bfloat16, generator=g),
              torch.randn(1, shape["dim"], device=dev, dtype=torch.bfloat16, generator=g))
    _run(model, inputs, 1, dev)
    torch.cuda.memory._record_memory_history(max_entries=500000)
    _run(model, inputs, 1, dev)
    snap_on = torch.cuda.memory._snapshot()
    on = _live(snap_on)
    torch.cuda.memory._record_memory_history(enabled=None)
    off = enable_block_offload(model, model.blocks, dev, 1)
    torch.cuda.empty_cache()
    _run(model, inputs, 1, dev)
    torch.cuda.memory._record_memory_history(max_entries=500000)
    _run(model, inputs, 1, dev)
    snap_off = torch.cuda.memory._snapshot()
    offl = _live(snap_off)
    torch.cuda.memory._record_memory_history(enabled=None)
    off.remove()
    # transient allocations during one step (allocated and freed within the traced window)
    for name, snap in (("on-device", snap_on), ("offload", snap_off)):
        peak, at_peak = _peak_live(snap)
        print(f"{name}: trace peak of allocations made in the step {peak}")
        for (size, where), n in sorted(at_peak.items(), key=lambda kv: -kv[0][0] * kv[1])[:14]:
            print(f"   {size:>12} x{n}  {where}")
    c_on = collections.Counter(s for s, _ in on)
    c_off = collections.Counter(s for s, _ in offl)
    print("steady bytes: on-device", sum(s for s, _ in on), "offload", sum(s for s, _ in offl))
    extra = c_off - c_on
    print("sizes live only in the offload run (size x count):", sorted(extra.items(), key=lambda kv: -kv[0])[:20])
    shown = 0
    for size, where in sorted(offl, key=lambda t: -t[0]):
        if extra.get(size, 0) > 0 and shown < 12:
            print(f"  {size:>12}  {where}")
            shown += 1
    print("sizes live only on-device:", sorted((c_on - c_off).items(), key=lambda kv: -kv[0])[:10])


if __name__ == "__main__":
    main()
