"""``lowbit quantize DIR`` on a checkpoint that is not a transformers model: a diffusers model folder
(``config.json`` with ``_class_name``) or a folder of ``*.safetensors`` files without config.json.

There is no sentence encoder to evaluate such a model with, so the command converts only: each scheme into
``OUT/<scheme>`` through :func:`lowbit.convert_checkpoint` (streaming tensor by tensor, the name/shape rules of
:mod:`lowbit.io.rules` with ``include``/``exclude``), with the same ``--out`` guards as the evaluated run
(:mod:`lowbit.eval.outdir`), and a report of what each checkpoint holds (``OUT/report.{txt,json}``).
"""

from __future__ import annotations

import datetime
import json
import time
from pathlib import Path
from typing import Any, Callable, Sequence

from .checkpoint_info import CheckpointError, inspect_checkpoint
from .encoder import ModelDirError
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
) -> dict[str, Any]:
    """Convert ``model_dir`` (see :func:`source_kind`) with each scheme into ``out_dir/<scheme>`` and write
    ``out_dir/report.{txt,json}``; returns the report dict (each scheme ``"ok"`` or ``"error"``).

    Raises:
        ModelDirError: not such a folder, already quantized, or an ``out_dir`` the guards refuse.
    """
    from .. import convert_checkpoint
    from .quality import default_out_dir

    say = log or (lambda s: None)
    src = Path(model_dir)
    kind = source_kind(src)
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
    target.create()
    say(f"lowbit quantize: {src} ({kind} folder, {info['total_bytes'] / 1e6:.1f} MB), {len(schemes)} scheme(s), "
        f"convert only (no evaluation for a non-transformers model), output {out}")
    rows: list[dict[str, Any]] = []
    for i, name in enumerate(schemes, 1):
        t0 = time.perf_counter()
        row: dict[str, Any] = {"scheme": name}
        try:
            convert_checkpoint(src, target.ckpts[name], name, device=device, include=include, exclude=exclude,
                               progress=progress, format=fmt, overwrite=target.replace[name])
            target.record_checkpoint(name)
            ci = inspect_checkpoint(target.ckpts[name])
            row.update(status="ok", quantized_layers=ci["quantized_layers"], formats=ci["formats"],
                       total_bytes=ci["total_bytes"], seconds=time.perf_counter() - t0)
            say(f"[{i}/{len(schemes)}] {name:16} {ci['quantized_layers']} layers quantized, "
                f"{ci['total_bytes'] / 1e6:.1f} MB ({row['seconds']:.1f} s)")
        except (ValueError, TypeError, FileExistsError, CheckpointError) as e:
            row.update(status="error", error=f"{type(e).__name__}: {e}")
            say(f"[{i}/{len(schemes)}] {name:16} error: {row['error']}")
        rows.append(row)
    report = {
        "model_dir": str(src), "kind": kind, "out_dir": str(out), "source_bytes": info["total_bytes"],
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "include": list(include or []), "exclude": list(exclude or []), "format": fmt, "schemes": rows,
    }
    lines = [f"{src} ({kind} folder, {info['total_bytes'] / 1e6:.1f} MB): converted without evaluation",
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


__all__ = ["convert_only", "source_kind"]
