"""A conversion's progress: the records that make it resumable, and the progress bar.

Work happens in ``.<out_name>.lowbit-convert.tmp`` next to the output directory; each finished output shard is
recorded in ``progress.json`` there (``progress.rank<r>.json`` for rank ``r`` of several; by the writer, after
the shard's files are fsynced and renamed into place), together with the identity of the conversion (source,
scheme, format, options). A rerun with the same identity, on any number of processes, skips the shards
finished by any of them: :func:`read_progress` reads the records that match, :func:`finished_shards` keeps
those whose files are all intact.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Iterable
from pathlib import Path

from .files import read_json, safetensors_keys

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
        if all(m.get(k) == v for k, v in ident.items()) and isinstance(m.get("shards"), dict):
            ours[p] = m
        else:
            stale = True
    return ours, stale


def finished_shards(tmp: Path, manifests: Iterable[dict]) -> dict[str, dict]:
    """``{output file: manifest entry}`` of the source shards finished with every output part intact, in
    source-shard then file name order (so the result cannot depend on which rank wrote what, or when)."""
    by_source: dict[str, dict[str, dict]] = {}
    for m in manifests:
        for f, info in m["shards"].items():
            if isinstance(info, dict) and isinstance(info.get("source"), str):
                by_source.setdefault(info["source"], {})[f] = info
    out: dict[str, dict] = {}
    for src in sorted(by_source):
        files = by_source[src]
        if all(_shard_ok(tmp / f, info.get("keys", [])) for f, info in files.items()):
            out.update((f, files[f]) for f in sorted(files))
    return out


def _shard_ok(path: Path, keys: list[str]) -> bool:
    try:
        return path.is_file() and set(safetensors_keys(path)) == set(keys)
    except (ValueError, OSError):
        return False


__all__ = ["MANIFEST", "RANK_MANIFEST", "finished_shards", "progress_bar", "read_progress"]
