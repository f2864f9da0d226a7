"""Page-locked staging buffers for a conversion's copies between the host and a GPU.

A copy between pageable memory and a GPU goes through a bounce buffer of the driver's, and page-locking memory
for each tensor instead costs more than the copy: on the lent H200 hosts ``cudaHostAlloc`` of a fresh 512 MB
block took up to 0.3 s, and a conversion whose tensors each got their own page-locked block (torch's host
cache rounds them to powers of two) spent about a third of its time allocating and freeing them. A
:class:`PinnedRing` is a few page-locked chunks allocated once per conversion and reused for every tensor:

- :func:`upload` fills a device tensor chunk by chunk: a thread of a pool fills a free chunk (e.g. with
  positional reads of the file), its copy to the device goes on the given stream, and the chunk is taken again
  only once that copy is done. Reads and copies of different chunks overlap.
- :func:`download` runs the other way: chunks of a device tensor are copied into free chunks in order, and a
  pool thread hands each one to a writer (e.g. ``pwrite`` at its place in the output file) once its copy is
  done.

The memory a conversion keeps page-locked is then ``count`` chunks per direction, whatever the tensors' sizes.
"""

from __future__ import annotations

import queue
from collections.abc import Callable
from concurrent.futures import Executor

import torch

from .files import settle


class PinnedRing:
    """``count`` page-locked buffers of ``nbytes`` bytes each, taken and given back by any thread. A buffer given
    back with the event of a device copy that reads or fills it is handed out again only once that copy is done."""

    def __init__(self, device: torch.device, count: int, nbytes: int) -> None:
        if count < 1 or nbytes < 1:
            raise ValueError(f"PinnedRing: count and nbytes must be positive, got {count} and {nbytes}")
        with torch.cuda.device(device):  # the page-locked memory belongs to this GPU's context
            self._bufs = [torch.empty(nbytes, dtype=torch.uint8, pin_memory=True) for _ in range(count)]
        self._views = [memoryview(b.numpy()).cast("B") for b in self._bufs]
        self._events: list[torch.cuda.Event | None] = [None] * count
        self._free: queue.SimpleQueue[int] = queue.SimpleQueue()
        for i in range(count):
            self._free.put(i)
        self.nbytes = nbytes

    def take(self) -> int:
        """A free buffer's index (waits for one, and for the last device copy that used it)."""
        i = self._free.get()
        event, self._events[i] = self._events[i], None
        if event is not None:
            event.synchronize()
        return i

    def give(self, i: int, event: torch.cuda.Event | None = None) -> None:
        """Give buffer ``i`` back; ``event``: recorded after a device copy that still uses it."""
        self._events[i] = event
        self._free.put(i)

    def tensor(self, i: int, n: int) -> torch.Tensor:
        return self._bufs[i][:n]

    def view(self, i: int, n: int) -> memoryview:
        return self._views[i][:n]

    def close(self) -> None:
        """Wait for the copies still using the buffers, then free them."""
        for event in self._events:
            if event is not None:
                event.synchronize()
        self._events, self._views, self._bufs = [], [], []


def upload(ring: PinnedRing, stream: torch.cuda.Stream, dst: torch.Tensor, fill: Callable[[int, memoryview], None],
           pool: Executor) -> None:
    """Fill ``dst`` (a flat uint8 tensor on ``stream``'s GPU) with bytes that ``fill(start, out)`` puts into
    ``out`` (bytes ``start`` to ``start + len(out)``), chunk by chunk over ``pool``'s threads. Returns once every
    chunk's copy is on ``stream``; record an event there to know when ``dst`` is complete."""
    n = dst.numel()

    def chunk(start: int) -> None:
        size = min(ring.nbytes, n - start)
        i, event = ring.take(), None
        try:
            fill(start, ring.view(i, size))
            with torch.cuda.stream(stream):
                dst[start:start + size].copy_(ring.tensor(i, size), non_blocking=True)
                event = torch.cuda.Event()
                event.record(stream)
        finally:
            ring.give(i, event)

    settle([pool.submit(chunk, a) for a in range(0, n, ring.nbytes)])


def download(ring: PinnedRing, stream: torch.cuda.Stream, src: torch.Tensor, ready: torch.cuda.Event | None,
             write: Callable[[int, memoryview], None], pool: Executor) -> None:
    """Copy ``src`` (a contiguous tensor on ``stream``'s GPU) to the host chunk by chunk, after ``ready`` (the
    event of the work that made it), and call ``write(start, data)`` on ``pool``'s threads for each chunk's bytes
    as soon as its copy is done. Returns when every chunk is written; ``src`` is no longer read by then."""
    flat = src.reshape(-1).view(torch.uint8)
    n = flat.numel()
    if ready is not None:
        stream.wait_event(ready)

    def put(i: int, start: int, size: int, event: torch.cuda.Event) -> None:
        try:
            event.synchronize()
            write(start, ring.view(i, size))
        finally:
            ring.give(i)

    futures = []
    try:
        for start in range(0, n, ring.nbytes):
            size = min(ring.nbytes, n - start)
            i = ring.take()
            try:
                with torch.cuda.stream(stream):
                    ring.tensor(i, size).copy_(flat[start:start + size], non_blocking=True)
                    event = torch.cuda.Event()
                    event.record(stream)
            except BaseException:
                ring.give(i)
                raise
            futures.append(pool.submit(put, i, start, size, event))
            if any(f.done() and f.exception() is not None for f in futures):
                break  # a write failed: the chunks after it are not copied
    finally:
        settle(futures)


__all__ = ["PinnedRing", "download", "upload"]
