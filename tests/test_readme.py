"""The README's claims hold on a fresh clone (CPU): its Python snippets run, its commands exist, its links and
cited results files are there, and its support tables name every format and scheme lowbit has.

Snippets whose first line is ``# requires: ...`` need a GPU or outside files; they are skipped, visibly, with
that line as the reason. Every other ``python`` block runs, each in a fresh namespace and an empty directory.
"""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

import pytest

import lowbit
from lowbit import cli

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text(encoding="utf-8")
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.M | re.S)


def _blocks(lang: str) -> list[str]:
    return [body for kind, body in FENCE.findall(README) if kind == lang]


PY = _blocks("python")


def test_readme_has_runnable_snippets():
    runnable = [b for b in PY if not b.startswith("# requires:")]
    assert len(runnable) >= 2, "the README's quickstart snippets are gone or no longer fenced as ```python"


@pytest.mark.parametrize("i", range(len(PY)), ids=[f"python-{i}" for i in range(len(PY))])
def test_python_snippet_runs(i, tmp_path, monkeypatch):
    code = PY[i]
    first = code.splitlines()[0]
    if first.startswith("# requires:"):
        pytest.skip("README snippet " + first[2:])
    monkeypatch.chdir(tmp_path)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, f"README.md python block {i}", "exec"), {"__name__": "__readme__"})


def test_make_targets_exist():
    makefile = (ROOT / "Makefile").read_text(encoding="utf-8")
    for target in ("demo", "test", "setup"):
        assert f"make {target}" in README, target
        assert re.search(rf"^{target}:", makefile, re.M), f"Makefile has no {target} target"
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    assert "make test" in ci


def test_lowbit_commands_exist():
    commands = set()
    for block in _blocks("bash"):
        for line in block.splitlines():
            m = re.match(r"\s*lowbit (\w[\w-]*)", line)
            if m:
                commands.add(m.group(1))
    assert {"quantize", "inspect", "env", "bench", "e2e"} <= commands, commands
    for sub in sorted(commands):
        with contextlib.redirect_stdout(io.StringIO()), pytest.raises(SystemExit) as e:
            cli.main([sub, "--help"])
        assert e.value.code == 0, sub


def test_support_tables_name_every_format_and_scheme():
    missing = [f for f in lowbit.FORMATS if f"`{f}`" not in README]
    assert not missing, f"formats missing from the README's tables: {missing}"
    missing = [s for s in lowbit.SCHEMES if f"| `{s}` |" not in README]
    assert not missing, f"schemes missing from the README's scheme table: {missing}"


def test_links_and_cited_files_exist():
    for target in re.findall(r"\]\(([^)#]+)\)", README):
        if "://" not in target:
            assert (ROOT / target).exists(), f"README links to {target}, which does not exist"
    for path in re.findall(r"benchmarks/[\w/.-]+\.(?:py|json|xml|md)", README):
        assert (ROOT / path).exists(), f"README cites {path}, which does not exist"


@pytest.mark.parametrize("doc", sorted(p.name for p in (ROOT / "docs").glob("*.md")))
def test_docs_cite_existing_results(doc):
    """docs may cite the curated results; history.md also cites removed dated runs (kept in git history)."""
    text = (ROOT / "docs" / doc).read_text(encoding="utf-8")
    for name in re.findall(r"benchmarks/results/([\w.*-]+\.(?:json|xml|log))", text):
        if "*" in name or (doc == "history.md" and name.startswith("2026-")):
            continue
        assert (ROOT / "benchmarks" / "results" / name).exists(), f"docs/{doc} cites a missing {name}"
