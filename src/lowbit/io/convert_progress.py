"""A conversion's progress: the records that make it resumable, and the progress bar.

Work happens in ``.<out_name>.lowbit-convert.tmp`` next to the output directory; each finished piece of work
(:mod:`lowbit.io.convert_layout`) is recorded in ``progress.json`` there (``progress.rank<r>.json`` for rank
``r`` of several; by the writer, after the files it wrote are fsynced), together with the identity of the
conversion (source, scheme, format, options). A rerun with the same identity, on any number of processes,
skips the pieces finished by any of them: :func:`read_progress` reads the records that match,
:func:`finished_pieces` keeps those whose files are still there at their planned size.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Iterable
from pathlib import Path

from .convert_layout import OutputPlan
from .files import read_json

MANIFEST = "progress.json"
RANK_MANIFEST = re.compile(r"progress\.rank\d+\.json")


def progress_bar(total: int, enabled: bool, label: str = "lowbit convert"):
    if not enabled:
        return None
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return None
    return tqdm(total=total, desc=label, unit="tensor", file=sys.stderr)


def _progress_files(tmp: Path) -> list[Path]:
    return sorted(p for p in tmp.glob("progress*.json") if p.name == MANIFEST or RANK_MANIFEST.fullmatch(p.name))


def read_progress(tmp: Path, ident: dict) -> tuple[dict[Path, dict], bool]:
    """The progress files of ``tmp`` written for this conversion (``ident``), and whether others are there."""
    ours, stale = {}, False
    for p in _progress_files(tmp):
        try:
            m = read_json(p, "conversion manifest")
        except (FileNotFoundError, ValueError):
            stale = True
            continue
        if all(m.get(k) == v for k, v in ident.items()) and isinstance(m.get("pieces"), dict):
            ours[p] = m
        else:
            stale = True
    return ours, stale


def finished_pieces(tmp: Path, manifests: Iterable[dict], outputs: OutputPlan) -> dict[str, dict]:
    """``{piece id: record}`` of the planned pieces some manifest records whose files are all in ``tmp`` at
    their planned size, in plan order (so the result cannot depend on which rank wrote what, or when)."""
    recorded: dict[str, dict] = {}
    for m in manifests:
        for pid, info in m["pieces"].items():
            if isinstance(info, dict) and isinstance(info.get("modules"), dict):
                recorded[pid] = info
    intact: dict[str, bool] = {}

    def ok(name: str) -> bool:
        if name not in intact:
            path = tmp / name
            try:
                intact[name] = path.is_file() and not path.is_symlink() and path.stat().st_size == outputs.files[
                    name].size
            except OSError:
                intact[name] = False
        return intact[name]

    return {p.id: recorded[p.id] for p in outputs.pieces if p.id in recorded and all(ok(f) for f in p.files)}


__all__ = ["MANIFEST", "RANK_MANIFEST", "finished_pieces", "progress_bar", "read_progress"]
