"""Writing a conversion's output: tensor bytes straight into the planned files, in a background thread.

The files are laid out in advance (:mod:`lowbit.io.convert_layout`), so a tensor is written the moment it is
quantized: its bytes go to its offset in its file with ``os.pwrite``, with no serializing copy, and the header goes
to offset 0 the first time a process opens the file. A tensor on a GPU is handed over as it is, with the event of
the work that made it; the writer copies it to the host through a few reused page-locked chunks
(:mod:`lowbit.io.staging`) and writes each chunk as soon as its copy is done, so the converting thread never waits
for those copies. Several ranks write into the same files at disjoint offsets. A piece of work ends with an fsync of
the files it wrote, then its record (``on_done``): a recorded piece is on disk.

:class:`TensorWriter` does this in one background thread while the converting thread quantizes the next tensor, so a
process takes about the larger of its compute and its writes rather than their sum. The tensors handed over and not
yet written are bounded (``max_pending`` bytes, at least one tensor): past that, handing over waits (on a GPU the
tensors handed over are device memory). A write's error is raised in the converting thread at its next hand-over or
at the end; the pieces after a failed write are neither written nor recorded. ``overlap=False`` writes in the
calling thread, in the same order, the same bytes.
"""

from __future__ import annotations

import contextlib
import os
import threading
import warnings
from collections import deque
from collections.abc import Callable
from pathlib import Path

import torch

from .convert_layout import OutputFile
from .staging import PinnedRing, download

WRITE_THREADS = 2
"""Threads writing the chunks of a GPU tensor: one writes a chunk while the next one's copy to the host finishes
(writes into one file take turns on its inode lock, so more threads would not write faster)."""

STAGING_CHUNK_BYTES = 16 << 20
"""Size of each page-locked chunk that a conversion's copies between a GPU and the host go through."""


def write_bytes(path: Path, fd: int, offset: int, data: memoryview) -> None:
    """Write all of ``data`` at ``offset`` of the open file ``fd`` (``path`` names it, for errors and for
    tests that make a write fail); ``pwrite`` may write less than asked, so it loops."""
    while data:
        n = os.pwrite(fd, data, offset)
        if n <= 0:
            raise OSError(f"{path}: pwrite wrote {n} bytes at offset {offset}")
        data = data[n:]
        offset += n


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, without a copy."""
    flat = t.reshape(-1)
    if flat.dtype != torch.uint8:
        flat = flat.view(torch.uint8)
    return memoryview(flat.numpy()).cast("B")


class TensorWriter:
    """Writes tensors into their planned files (see the module docstring)."""

    def __init__(self, tmp: Path, files: dict[str, OutputFile], overlap: bool, max_pending: int,
                 label: str = "") -> None:
        self.tmp = tmp
        self._staging = None  # (ring, stream, pool) for tensors on a GPU, made at the first one
        self.files = files
        self.max_pending = max(1, int(max_pending))
        self._fds: dict[str, int] = {}
        self._jobs: deque = deque()
        self._pending = 0
        self._error: BaseException | None = None
        self._cond = threading.Condition()
        self._closing = False
        self._thread = None
        if overlap:
            name = f"lowbit-convert-writer ({label})" if label else "lowbit-convert-writer"
            self._thread = threading.Thread(target=self._run, name=name, daemon=True)
            self._thread.start()

    # ------------------------------------------------------------------ the converting thread

    def write(self, tmp_name: str, offset: int, tensor: torch.Tensor, ready: torch.cuda.Event | None = None) -> None:
        """Write ``tensor`` (contiguous, on the CPU or a GPU) at ``offset`` of file ``tmp_name``; for a GPU tensor,
        ``ready`` is an event recorded after the work that made it (None: the work is done)."""
        self._submit(("write", tmp_name, offset, tensor, ready), tensor.numel() * tensor.element_size())

    def end_piece(self, tmp_names: tuple[str, ...], on_done: Callable[[], None]) -> None:
        """Once the writes handed over so far are done: fsync ``tmp_names``, then call ``on_done``."""
        self._submit(("piece", tmp_names, on_done), 0)

    def _submit(self, job: tuple, nbytes: int) -> None:
        if self._thread is None:
            self._do(job)
            return
        with self._cond:
            while self._error is None and self._jobs and self._pending + nbytes > self.max_pending:
                self._cond.wait()
            self._raise()
            self._jobs.append((job, nbytes))
            self._pending += nbytes
            self._cond.notify_all()

    def _raise(self) -> None:
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    def close(self) -> None:
        """Wait for every write; raise the first write error."""
        try:
            self._join()
            with self._cond:
                self._raise()
        finally:
            self._close_fds()

    def abort(self, error: BaseException) -> None:
        """Join the writer after ``error`` stopped the caller: what was handed over is still written and
        recorded (it was computed); a write error is added to ``error``'s notes, since ``error`` propagates."""
        try:
            self._join()
            failed = self._error
            self._error = None
            if failed is not None and failed is not error:
                note = ("lowbit.convert_checkpoint: the pending background write failed too: "
                        f"{type(failed).__name__}: {failed}")
                if hasattr(error, "add_note"):
                    error.add_note(note)
                else:  # Python 3.10
                    warnings.warn(note, stacklevel=3)
        finally:
            self._close_fds()

    def _join(self) -> None:
        if self._thread is None:
            return
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        self._thread.join()
        self._thread = None

    # ------------------------------------------------------------------ the writer thread

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._jobs and not self._closing:
                    self._cond.wait()
                if not self._jobs:
                    return
                job, nbytes = self._jobs[0]
                failed = self._error is not None
            if not failed:
                try:
                    self._do(job)
                except BaseException as e:  # noqa: BLE001 - raised in the converting thread
                    with self._cond:
                        self._error = e
            with self._cond:
                self._jobs.popleft()
                self._pending -= nbytes
                self._cond.notify_all()

    def _fd(self, tmp_name: str) -> int:
        fd = self._fds.get(tmp_name)
        if fd is None:
            f = self.files[tmp_name]
            path = self.tmp / tmp_name
            fd = os.open(path, os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o644)
            try:
                # every rank that writes into the file sets the same size and header: whichever comes first, the
                # others change nothing (a longer file left by another conversion is cut to size)
                if os.fstat(fd).st_size != f.size:
                    os.ftruncate(fd, f.size)
                write_bytes(path, fd, 0, memoryview(f.header))
            except BaseException:
                os.close(fd)
                raise
            self._fds[tmp_name] = fd
        return fd

    def _gpu_staging(self, device: torch.device):
        if self._staging is None:
            from concurrent.futures import ThreadPoolExecutor

            ring = PinnedRing(device, 2 * WRITE_THREADS, STAGING_CHUNK_BYTES)
            self._staging = (ring, torch.cuda.Stream(device),
                             ThreadPoolExecutor(WRITE_THREADS, thread_name_prefix="lowbit-convert-write"))
        return self._staging

    def _do(self, job: tuple) -> None:
        if job[0] == "write":
            _, tmp_name, offset, tensor, ready = job
            if not tensor.numel():
                return
            path, fd = self.tmp / tmp_name, self._fd(tmp_name)
            if tensor.device.type == "cuda":
                ring, stream, pool = self._gpu_staging(tensor.device)
                download(ring, stream, tensor, ready, lambda start, data: write_bytes(path, fd, offset + start, data),
                         pool)
            else:
                write_bytes(path, fd, offset, tensor_bytes(tensor))
        else:
            _, tmp_names, on_done = job
            for name in tmp_names:
                os.fsync(self._fd(name))
            on_done()

    def _close_fds(self) -> None:
        staging, self._staging = self._staging, None
        if staging is not None:
            ring, _, pool = staging
            pool.shutdown(wait=True)
            ring.close()
        fds, self._fds = self._fds, {}
        for fd in fds.values():
            with contextlib.suppress(OSError):
                os.close(fd)


__all__ = ["STAGING_CHUNK_BYTES", "WRITE_THREADS", "TensorWriter", "tensor_bytes", "write_bytes"]
