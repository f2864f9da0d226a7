"""One rank of a conversion in a process of its own, for test_convert_distributed.py (spawned processes import
this module by name, so it stays small and imports no test fixtures)."""

from __future__ import annotations

import json
import os
import sys


def rank_main(rank: int, world_size: int, port: int, phases: list, report: str, die_after: int | None = None) -> None:
    """Run ``phases``: ``(use a gloo group, [convert_checkpoint kwargs, ...])`` in order, as rank ``rank``.

    ``die_after``: after converting that many source shards this rank's process exits at once (as if killed)
    in the middle of its next one, as soon as the first bytes of that shard's files are on disk. The exit comes
    from the writer thread that wrote them: tensors are written in the background while the next ones are
    computed, so a kill at a fixed tensor would leave more or less on disk depending on how far the writer
    had got. Each
    job's error (or None) goes to ``report`` (a JSON list per rank)."""
    import lowbit
    import lowbit.io.convert as conv
    import lowbit.io.convert_writer as writer
    from lowbit.io.distributed import join_group, leave_group

    if die_after is not None:
        real_convert, real_write, calls = conv._convert_keys, writer.write_bytes, []

        def counting(keys, source, *a, **kw):
            calls.append(source.files[keys[0]].name.removesuffix(".safetensors"))
            return real_convert(keys, source, *a, **kw)

        def dying(path, *a, **kw):
            real_write(path, *a, **kw)
            if len(calls) > die_after and path.name.startswith(f".{calls[die_after]}.part"):
                os._exit(9)

        conv._convert_keys = counting
        writer.write_bytes = dying
    results = []
    for group, jobs in phases:
        if group:
            join_group(rank, world_size, port)
        for job in jobs:
            try:
                lowbit.convert_checkpoint(**job, rank=rank, world_size=world_size, progress=False)
                results.append(None)
            except Exception as e:  # noqa: BLE001 - reported to the test
                results.append(f"{type(e).__name__}: {e}")
        if group:
            leave_group()
    with open(f"{report}.rank{rank}.json", "w", encoding="utf-8") as fh:
        json.dump(results, fh)
    sys.exit(0)
