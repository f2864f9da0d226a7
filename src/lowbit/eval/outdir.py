"""What ``lowbit quantize`` may write in its ``--out`` directory, and the marker that says what it wrote.

``--out DIR`` receives ``DIR/<scheme>/`` (one checkpoint per scheme) and ``DIR/report.{txt,json,png}``. Before
anything is written, every one of those paths that already exists must be lowbit's own earlier output, and
lowbit replaces it only with ``--overwrite``; anything else there (the user's own report.txt, another tool's
checkpoint, a lowbit output changed since) is refused, with or without ``--overwrite``. ``DIR`` must lie outside
the source model directory (and no output path may contain it): the source is only read.

Earlier output is recognised by the marker ``DIR/.lowbit-quantize.json``, which lowbit updates as it writes:
for each report file the SHA-256 digests it wrote, for each checkpoint a fingerprint (SHA-256 of its
``config.json`` plus the name and size of every file under it). A path whose content no longer matches its
record counts as the user's. The marker is written before a report file is replaced (both digests accepted)
and right after a checkpoint is published, each time atomically, so a run killed at any moment leaves
nothing that a rerun would mistake for its own beyond what it actually wrote.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from ..io.files import file_sha256
from .encoder import ModelDirError

MARKER = ".lowbit-quantize.json"
WRITER = "lowbit quantize"
REPORT_FILES = ("report.txt", "report.json", "report.png")


def _is_regular(path: Path) -> bool:
    try:
        return stat.S_ISREG(os.lstat(path).st_mode)
    except OSError:
        return False


def checkpoint_fingerprint(path: Path) -> str | None:
    """SHA-256 of ``config.json`` and of the (name, size) of every file under ``path``; None when ``path`` is
    not a real directory with a regular ``config.json`` (then it cannot be lowbit's)."""
    if path.is_symlink() or not path.is_dir() or not _is_regular(path / "config.json"):
        return None
    h = hashlib.sha256(file_sha256(path / "config.json").encode())
    for p in sorted(path.rglob("*")):
        st = os.lstat(p)
        if not stat.S_ISDIR(st.st_mode):
            h.update(f"{p.relative_to(path)}\0{st.st_mode:o}\0{st.st_size}\n".encode())
    return h.hexdigest()


def _load_marker(out: Path) -> dict[str, Any]:
    path = out / MARKER
    if not path.exists() and not path.is_symlink():
        return {"written_by": WRITER, "files": {}, "checkpoints": {}}
    try:
        if not _is_regular(path):
            raise ValueError
        data = json.loads(path.read_text(encoding="utf-8"))
        if not (
            isinstance(data, dict)
            and data.get("written_by") == WRITER
            and isinstance(data.get("files"), dict)
            and isinstance(data.get("checkpoints"), dict)
        ):
            raise ValueError
    except (OSError, UnicodeDecodeError, ValueError):
        raise ModelDirError(
            f"{path} exists but is not lowbit quantize's marker; choose another --out directory"
        ) from None
    return data


def _save_marker(out: Path, marker: dict[str, Any]) -> None:
    tmp = out / f".{MARKER}.tmp"
    tmp.write_text(json.dumps(marker, indent=1, sort_keys=True) + "\n", encoding="utf-8")
    with open(tmp, "rb+") as f:
        os.fsync(f.fileno())
    os.replace(tmp, out / MARKER)


class OutDir:
    """The checked ``--out`` directory of one ``lowbit quantize`` run (see the module docstring)."""

    def __init__(self, out: Path, src: Path, schemes: Iterable[str], *, overwrite: bool = False) -> None:
        self.path = Path(out)
        self.overwrite = overwrite
        src_real = Path(src).resolve()
        out_real = self.path.resolve()
        if out_real == src_real or out_real.is_relative_to(src_real):
            raise ModelDirError(
                f"--out {self.path} is inside the source model directory {src}; lowbit never writes into "
                "the source: choose a directory outside it"
            )
        self.ckpts = {s: self.path / s for s in schemes}
        targets = [*self.ckpts.values(), *(self.path / f for f in REPORT_FILES)]
        for t in targets:
            t_real = t.resolve()
            if src_real == t_real or src_real.is_relative_to(t_real):
                raise ModelDirError(
                    f"--out {self.path}: the output {t} would replace the source model directory {src}; "
                    "choose another --out directory"
                )
        if self.path.exists() and not self.path.is_dir():
            raise ModelDirError(f"--out {self.path} exists and is not a directory")
        self.marker = _load_marker(self.path)
        ours, foreign = [], []
        for name, ckpt in self.ckpts.items():
            if ckpt.exists() or ckpt.is_symlink():
                fp = checkpoint_fingerprint(ckpt)
                (ours if fp is not None and self.marker["checkpoints"].get(name) == fp else foreign).append(ckpt)
        for f in REPORT_FILES:
            p = self.path / f
            if p.exists() or p.is_symlink():
                ok = _is_regular(p) and file_sha256(p) in self.marker["files"].get(f, [])
                (ours if ok else foreign).append(p)
        if foreign:
            raise ModelDirError(
                f"--out {self.path}: {', '.join(p.name for p in foreign)} "
                f"{'exists' if len(foreign) == 1 else 'exist'} and {'was' if len(foreign) == 1 else 'were'} "
                "not written by lowbit quantize (or changed since); lowbit never replaces them, "
                "--overwrite included: choose another --out directory or move them"
            )
        if ours and not overwrite:
            raise ModelDirError(
                f"--out {self.path}: {', '.join(p.name for p in ours)} from an earlier lowbit quantize run "
                f"{'exists' if len(ours) == 1 else 'exist'}; pass --overwrite to replace "
                + ("it" if len(ours) == 1 else "them")
            )
        self.replace = {name: ckpt in ours for name, ckpt in self.ckpts.items()}

    def create(self) -> None:
        self.path.mkdir(parents=True, exist_ok=True)

    def record_checkpoint(self, scheme: str) -> None:
        """Call right after ``DIR/<scheme>`` is published: it is lowbit's from now on."""
        fp = checkpoint_fingerprint(self.ckpts[scheme])
        if fp is not None:
            self.marker["checkpoints"][scheme] = fp
            _save_marker(self.path, self.marker)
            self.replace[scheme] = True

    def write_file(self, name: str, data: bytes) -> None:
        """Replace ``DIR/name`` atomically; the marker accepts the new digest before the file changes."""
        digest = hashlib.sha256(data).hexdigest()
        self._accept(name, digest)
        tmp = self.path / f".{name}.lowbit-tmp"
        tmp.write_bytes(data)
        os.replace(tmp, self.path / name)
        self._accept(name, digest, only=True)

    def adopt_file(self, name: str, tmp: Path) -> None:
        """Move the finished temp file ``tmp`` (same directory) to ``DIR/name``, recorded first."""
        digest = file_sha256(tmp)
        self._accept(name, digest)
        os.replace(tmp, self.path / name)
        self._accept(name, digest, only=True)

    def _accept(self, name: str, digest: str, only: bool = False) -> None:
        known = [] if only else list(self.marker["files"].get(name, []))
        self.marker["files"][name] = [*known, digest] if digest not in known else known
        _save_marker(self.path, self.marker)
