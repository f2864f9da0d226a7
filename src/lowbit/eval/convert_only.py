"""``lowbit quantize DIR`` without evaluation: on a checkpoint that is not a transformers model (a diffusers
model folder, ``config.json`` with ``_class_name``, or a folder of ``*.safetensors`` files without config.json),
and on a transformers model directory with ``--no-eval``, ``--devices`` or under torchrun.

There is no sentence encoder to evaluate a diffusers or bare folder with, and a model converted on several
devices is usually one too large to evaluate here, so the command converts only: each scheme into
``OUT/<scheme>`` through :func:`lowbit.convert_checkpoint` (streaming tensor by tensor; for folders the
name/shape rules of :mod:`lowbit.io.rules` with ``include``/``exclude``), with the same ``--out`` guards as the
evaluated run (:mod:`lowbit.eval.outdir`), and a report of what each checkpoint holds
(``OUT/report.{txt,json}``).

Several devices: with ``devices`` this process is rank 0 on the first and starts one process per other device
(:func:`lowbit.io.distributed.spawn_workers`, a gloo process group over a local store); with ``world`` it is
one rank of processes started by torchrun. Every rank runs the same conversions; rank 0 alone writes the
report and the ``--out`` marker.
"""

from __future__ import annotations

import datetime
import json
import os
import sys
import time
from pathlib import Path
from typing import Any, Callable, Sequence

from .checkpoint_info import CheckpointError, inspect_checkpoint
from .encoder import ModelDirError, check_model_dir
from .outdir import OutDir


def source_kind(path: str | Path) -> str | None:
    """``"diffusers"`` (config.json with ``_class_name`` and no ``model_type``), ``"safetensors"`` (no
    config.json, ``*.safetensors`` files) or None (a transformers directory, or not a directory: the
    evaluated run says what is wrong with it)."""
    p = Path(path)
    if not p.is_dir():
        return None
    cfg = p / "config.json"
    if not cfg.exists():
        return "safetensors" if any(p.glob("*.safetensors")) else None
    try:
        data = json.loads(cfg.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError):
        return None
    if isinstance(data, dict) and "_class_name" in data and "model_type" not in data:
        return "diffusers"
    return None


def convert_only(
    model_dir: str | Path,
    schemes: Sequence[str],
    out_dir: str | Path | None,
    *,
    include: Sequence[str] | None = None,
    exclude: Sequence[str] | None = None,
    fmt: str = "auto",
    device: str | None = None,
    log: Callable[[str], None] | None = print,
    progress: bool = False,
    overwrite: bool = False,
    transformers: bool = False,
    devices: Sequence[str] | None = None,
    world: tuple[int, int] | None = None,
) -> dict[str, Any]:
    """Convert ``model_dir`` (see :func:`source_kind`; with ``transformers`` also a transformers model
    directory) with each scheme into ``out_dir/<scheme>`` and write ``out_dir/report.{txt,json}``; returns the
    report dict (each scheme ``"ok"`` or ``"error"``).

    ``devices``: convert on these devices at once, this process on the first and one started process per
    other. ``world``: ``(rank, world_size)`` of this process among processes started by torchrun (a gloo group
    is joined through torchrun's environment unless one is initialized); ranks other than 0 write nothing but
    checkpoint shards and return their own rows.

    Raises:
        ModelDirError: not such a folder, already quantized, or an ``out_dir`` the guards refuse.
    """
    from .quality import default_out_dir

    say = log or (lambda s: None)
    src = Path(model_dir)
    kind = source_kind(src)
    if kind is None and transformers:
        from ..io.convert import check_unquantized_config
        from ..io.files import read_json

        check_model_dir(src)
        try:
            check_unquantized_config(read_json(src / "config.json", "model config"), src / "config.json")
        except (ValueError, FileNotFoundError) as e:
            raise ModelDirError(str(e)) from None
        kind = "transformers"
    if kind is None:
        raise ModelDirError(f"{src}: neither a diffusers model folder nor a folder of *.safetensors files")
    try:
        info = inspect_checkpoint(src)
    except CheckpointError as e:
        raise ModelDirError(str(e)) from None
    if info["quantized_layers"]:
        raise ModelDirError(
            f"{src} is already quantized ({info['quantized_layers']} layers in {', '.join(info['formats'])}); "
            "lowbit quantize needs the unquantized model it came from")
    out = Path(out_dir) if out_dir is not None else default_out_dir(src.resolve().name)
    target = OutDir(out, src, schemes, overwrite=overwrite)
    rank, size = world if world is not None else (0, len(devices) if devices else 1)
    common = {"include": include, "exclude": exclude, "progress": progress, "format": fmt}
    jobs = [(str(target.ckpts[name]), name, target.replace[name]) for name in schemes]
    where = f"{size} processes ({', '.join(devices)})" if devices and size > 1 else (
        f"{size} torchrun processes" if size > 1 else None)
    if rank == 0:
        target.create()
        say(f"lowbit quantize: {src} ({kind} {'model directory' if kind == 'transformers' else 'folder'}, "
            f"{info['total_bytes'] / 1e6:.1f} MB), {len(schemes)} scheme(s), convert only (no evaluation"
            f"{' for a non-transformers model' if kind != 'transformers' else ''}), "
            + (f"on {where}, " if where else "") + f"output {out}")
    with _ranks(devices, world, src, jobs, common) as dist_kw:
        rows = _convert_all(src, target, schemes, device if not devices else devices[0], common, dist_kw, rank,
                            say)
    report = {
        "model_dir": str(src), "kind": kind, "out_dir": str(out), "source_bytes": info["total_bytes"],
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "include": list(include or []), "exclude": list(exclude or []), "format": fmt, "schemes": rows,
    }
    if size > 1:
        report["processes"] = size
        if devices:
            report["devices"] = list(devices)
    if rank != 0:
        return report
    label = "model directory" if kind == "transformers" else "folder"
    lines = [f"{src} ({kind} {label}, {info['total_bytes'] / 1e6:.1f} MB): converted without evaluation"
             + (f" on {where}" if where else ""),
             f"{'scheme':18}{'layers':>8}{'MB':>10}{'time s':>9}  status"]
    for r in rows:
        if r["status"] == "ok":
            lines.append(f"{r['scheme']:18}{r['quantized_layers']:>8}{r['total_bytes'] / 1e6:>10.1f}"
                         f"{r['seconds']:>9.1f}  ok")
        else:
            lines.append(f"{r['scheme']:18}{'':>8}{'':>10}{'':>9}  {r['error']}")
    target.write_file("report.txt", ("\n".join(lines) + "\n").encode())
    target.write_file("report.json", (json.dumps(report, indent=1) + "\n").encode())
    return report


def _convert_all(src: Path, target: OutDir, schemes: Sequence[str], device: str | None, common: dict,
                 dist_kw: dict, rank: int, say: Callable[[str], None]) -> list[dict[str, Any]]:
    from .. import convert_checkpoint
    rows: list[dict[str, Any]] = []
    for i, name in enumerate(schemes, 1):
        t0 = time.perf_counter()
        row: dict[str, Any] = {"scheme": name}
        try:
            convert_checkpoint(src, target.ckpts[name], name, device=device, overwrite=target.replace[name],
                               **common, **dist_kw)
            row.update(status="ok", seconds=time.perf_counter() - t0)
            if rank == 0:
                target.record_checkpoint(name)
                ci = inspect_checkpoint(target.ckpts[name])
                row.update(quantized_layers=ci["quantized_layers"], formats=ci["formats"],
                           total_bytes=ci["total_bytes"])
                say(f"[{i}/{len(schemes)}] {name:16} {ci['quantized_layers']} layers quantized, "
                    f"{ci['total_bytes'] / 1e6:.1f} MB ({row['seconds']:.1f} s)")
        except (ValueError, TypeError, FileExistsError, CheckpointError, RuntimeError) as e:
            # RuntimeError: also gloo's, when another rank's process died
            row.update(status="error", error=f"{type(e).__name__}: {e}")
            say(f"[{i}/{len(schemes)}] {name:16} error: {row['error']}")
        rows.append(row)
    return rows


class _ranks:
    """The ranks of a run: with ``devices`` start the other ranks' processes and join them in a gloo group;
    with ``world`` (torchrun) join torchrun's group unless one is initialized; else nothing. Yields the
    ``rank``/``world_size`` arguments of :func:`lowbit.convert_checkpoint`."""

    def __init__(self, devices, world, src, jobs, common) -> None:
        self.devices, self.world, self.src, self.jobs, self.common = devices, world, src, jobs, common
        self.procs: list = []
        self.joined = False
        self.store = None

    def __enter__(self) -> dict:
        from ..io import distributed as d

        if self.devices and len(self.devices) > 1:
            size = len(self.devices)
            self.store = d.host_store(size)
            port = self.store.port
            args = (size, port, list(self.devices), str(self.src), self.jobs, self.common)
            self.procs = d.spawn_workers(rank_main, range(1, size), lambda r: (r, *args))
            try:
                d.wait_ready(self.store, self.procs, range(1, size))
                d.join_group(0, size, port)
            except BaseException:
                self.__exit__(None, None, None)
                raise
            self.joined = True
            return {"rank": 0, "world_size": size}
        if self.world is not None and self.world[1] > 1:
            import torch.distributed as dist

            # a process group notices a rank that dies at once; without one (no torchrun rendezvous in the
            # environment) the ranks meet through files
            if (dist.is_available() and not dist.is_initialized() and os.environ.get("MASTER_ADDR")
                    and os.environ.get("MASTER_PORT")):
                d.join_group(*self.world)
                self.joined = True
            return {"rank": self.world[0], "world_size": self.world[1]}
        return {}

    def __exit__(self, *exc) -> None:
        from ..io import distributed as d

        if self.joined:
            d.leave_group()
            self.joined = False
        if self.procs:
            d.stop_workers(self.procs)
            self.procs = []
        self.store = None


def rank_main(rank: int, size: int, port: int, devices: list[str], src: str, jobs: list, common: dict) -> None:
    """A rank started by ``lowbit quantize --devices``: the same conversions as rank 0, on ``devices[rank]``.
    Failures are reported by rank 0 (every rank raises alike), so they are not printed again here."""
    from .. import convert_checkpoint
    from ..io import distributed as d

    d.join_group(rank, size, port)
    failed = 0
    try:
        for ckpt, scheme, overwrite in jobs:
            try:
                convert_checkpoint(src, ckpt, scheme, device=devices[rank], overwrite=overwrite, rank=rank,
                                   world_size=size, **common)
            except Exception:  # noqa: BLE001 - rank 0 reports each scheme's error
                failed += 1
    finally:
        d.leave_group()
    sys.exit(1 if failed else 0)


__all__ = ["convert_only", "source_kind"]
