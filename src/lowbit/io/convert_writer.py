"""Writing a conversion's output files: one background thread per process overlaps writing with computing.

A finished file (a source shard's output, or one numbered part of it) is written and fsynced by the writer
thread while the next is quantized, so a process takes about the larger of its compute and its writes rather
than their sum (ranks sharing one disk otherwise wait for each other's writes with their devices idle). At
most one write is pending: handing over the next file waits for the previous one, and a write's error is
raised in the converting thread there or at the end of its shards (:class:`ShardWriter`). :func:`write_shard`
cuts one source shard's outputs into files of at most ``max_shard_size`` bytes and, once the last is on disk,
renames them into place and records them.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as futures_wait
from pathlib import Path
from typing import Any

import torch

from .files import save_safetensors, tensor_nbytes


class ShardWriter:
    """Writes finished output files in one background thread while the converting thread computes the next.

    ``submit`` first waits for the write before it (raising that write's error, if any, in the caller), so at
    most one write is pending and at most one finished file is held in memory besides the one being filled.
    ``close`` waits for the last write and raises its error; ``abort`` (for the caller's own error, interrupts
    included) waits for the pending write too, so the writer thread never outlives the conversion call and a
    file that was computed is still written and recorded for a rerun. ``overlap=False`` runs every write in the
    calling thread, in the same order, with the same bytes.
    """

    def __init__(self, overlap: bool) -> None:
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="lowbit-convert-writer") if overlap else None
        self._pending: Future | None = None

    def submit(self, fn: Callable[..., None], /, *args: Any) -> None:
        self.wait()
        if self._pool is None:
            fn(*args)
        else:
            self._pending = self._pool.submit(fn, *args)

    def wait(self) -> None:
        """Block until the pending write is done; its error is raised here."""
        pending = self._pending
        if pending is None:
            return
        futures_wait([pending])  # an interrupt while waiting leaves the write pending, for abort to join
        self._pending = None
        pending.result()

    def close(self) -> None:
        try:
            self.wait()
        finally:
            self._shutdown()

    def abort(self, error: BaseException) -> None:
        """Join the writer after ``error`` stopped the caller; a failed pending write is added to ``error``'s
        notes (``error`` is what propagates: it is why the conversion stopped)."""
        pending, self._pending = self._pending, None
        try:
            # exception() waits without raising the write's error; an interrupt while waiting still propagates
            failed = pending.exception() if pending is not None else None
            if failed is not None and failed is not error:
                note = ("lowbit.convert_checkpoint: the pending background write failed too: "
                        f"{type(failed).__name__}: {failed}")
                if hasattr(error, "add_note"):
                    error.add_note(note)
                else:  # Python 3.10
                    warnings.warn(note, stacklevel=3)
        finally:
            self._shutdown()

    def _shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None


def _write_file(tensors: dict[str, torch.Tensor], path: Path, finish: Callable[[], None] | None) -> None:
    """One writer job: a part file (temp name, fsync, rename), then, for a shard's last part, ``finish``."""
    save_safetensors(tensors, path)  # looked up here, so tests can make it fail
    if finish is not None:
        finish()


def write_shard(
    src_file: Path, out_name: str, outputs, tmp: Path, limit: int, writer: ShardWriter,
    record: Callable[[dict[str, dict]], None],
) -> None:
    """Write one source shard's outputs as ``out_name`` or, past ``limit`` bytes, as numbered parts; the buffer
    is handed to ``writer`` before a tensor would take it over ``limit``. Once the last part is on disk the
    writer renames the parts to their final names and calls ``record`` with their manifest entries."""
    stem = out_name.removesuffix(".safetensors")
    parts: list[tuple[Path, dict]] = []
    buf: dict[str, torch.Tensor] = {}
    infos: dict[str, dict] = {}
    size = 0

    def finish(parts: list[tuple[Path, dict]]) -> None:
        out: dict[str, dict] = {}
        for i, (path, entry) in enumerate(parts):
            name = out_name if len(parts) == 1 else f"{stem}-part{i + 1:05d}-of-{len(parts):05d}.safetensors"
            path.replace(tmp / name)
            out[name] = entry
        record(out)

    def flush(last: bool) -> None:
        nonlocal buf, infos, size
        path = tmp / f".{stem}.part{len(parts):05d}.safetensors"
        parts.append((path, {"source": src_file.name, "keys": list(buf), "bytes": size, "modules": infos}))
        tensors, buf, infos, size = buf, {}, {}, 0
        # the part count, hence the final names, is known only once the last part is handed over
        writer.submit(_write_file, tensors, path, (lambda p=list(parts): finish(p)) if last else None)

    for tensors, info in outputs:
        n = sum(tensor_nbytes(v) for v in tensors.values())
        if buf and size + n > limit:
            flush(last=False)
        buf.update(tensors)
        size += n
        if info is not None:
            infos[info[0]] = info[1]
        del tensors
    flush(last=True)


__all__ = ["ShardWriter", "write_shard"]
