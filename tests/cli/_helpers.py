"""Helpers of the CLI tests."""

from __future__ import annotations

import contextlib
import io
from pathlib import Path

from lowbit import cli

SCHEMES = ("w8a8-fp8-block", "w4a16-nf4")


def run_cli(*argv: str) -> tuple[int, str, str]:
    """``lowbit *argv`` in this process: (exit code, stdout, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            rc = cli.main(list(argv))
        except SystemExit as e:  # argparse errors
            rc = e.code
    return rc, out.getvalue(), err.getvalue()


def snapshot(d: Path) -> list[tuple[str, int, int]]:
    """(name, size, mtime_ns) of every file under ``d``."""
    return sorted((str(p.relative_to(d)), p.stat().st_size, p.stat().st_mtime_ns) for p in d.rglob("*"))
