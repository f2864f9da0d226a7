"""benchmarks/: the curated results, docs/performance.md generated from them, and the scripts compile (CPU only).

- benchmarks/results holds one file per benchmark and GPU kind (``h100_<benchmark>.json``, ``h200_...``; JUnit
  reports: one ``<gpu>_gpu_tests.xml`` per GPU kind, a testsuite per area), no dated runs;
- ``python benchmarks/make_performance_md.py`` reproduces docs/performance.md from the checked-in JSON, and
  ``--check`` notices a stale page;
- every script in benchmarks/ and benchmarks/experiments/ compiles, and the sibling modules it imports live
  where its ``sys.path`` setup looks for them.
"""

from __future__ import annotations

import ast
import importlib.util
import py_compile
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks"
RESULTS = BENCH / "results"


def _load_script(path: Path):
    spec = importlib.util.spec_from_file_location(path.stem, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


# ------------------------------------------------------------------------------------------- results

def test_results_are_curated():
    names = sorted(p.name for p in RESULTS.iterdir() if p.is_file())
    assert names, "benchmarks/results is empty"
    bad = [n for n in names if not re.fullmatch(r"h[12]00_[a-z0-9_]+\.(json|xml|log)", n)]
    assert not bad, f"not <gpu>_<benchmark>.<ext> (dated or one-off runs belong in git history): {bad}"
    bad = [n for n in names if n.endswith(".xml") and not re.fullmatch(r"h[12]00_gpu_tests\.xml", n)]
    assert not bad, f"JUnit reports must be one <gpu>_gpu_tests.xml per GPU kind: {bad}"


def _gpu_fields(obj):
    if isinstance(obj, dict):
        for k, v in obj.items():
            if k in ("device", "gpu") and isinstance(v, str):
                yield v
            else:
                yield from _gpu_fields(v)
    elif isinstance(obj, list):
        for v in obj:
            yield from _gpu_fields(v)


def test_curated_json_is_from_the_gpu_its_name_says():
    import json

    recorded = 0
    for path in sorted(RESULTS.glob("*.json")):
        gpu = "H100" if path.name.startswith("h100_") else "H200"
        fields = {f for f in _gpu_fields(json.loads(path.read_text(encoding="utf-8"))) if "NVIDIA" in f}
        recorded += bool(fields)
        assert all(gpu in f for f in fields), f"{path.name} records {fields}"
    assert recorded >= 20


# ----------------------------------------------------------------------------------- performance.md

@pytest.fixture(scope="module")
def perf():
    return _load_script(BENCH / "make_performance_md.py")


def test_performance_md_is_generated_from_the_checked_in_json(perf):
    text = perf.render()
    assert (ROOT / "docs" / "performance.md").read_text(encoding="utf-8") == text, (
        "docs/performance.md is stale: run python benchmarks/make_performance_md.py"
    )
    cited = set(re.findall(r"`benchmarks/results/([\w.-]+)`", text))
    assert len(cited) >= 6, cited
    for name in cited:
        assert name.startswith("h100_") and (RESULTS / name).exists(), name
    for section in perf.SECTIONS:
        lines = section()
        assert any(line.startswith("Source: ") and "H100" in line and "date " in line for line in lines), section
        assert sum(line.startswith("| ") for line in lines) >= 3, f"{section.__name__} rendered no table rows"


def test_check_mode_notices_a_stale_page(perf, tmp_path):
    out = tmp_path / "performance.md"
    assert perf.main(["--out", str(out)]) == 0
    assert perf.main(["--check", "--out", str(out)]) == 0
    out.write_text(out.read_text(encoding="utf-8").replace("| 1.", "| 9.", 1), encoding="utf-8")
    assert perf.main(["--check", "--out", str(out)]) == 1


# --------------------------------------------------------------------------------------------- scripts

SCRIPTS = sorted(BENCH.glob("*.py")) + sorted((BENCH / "experiments").glob("*.py"))


@pytest.mark.parametrize("path", SCRIPTS, ids=[str(p.relative_to(BENCH)) for p in SCRIPTS])
def test_script_compiles_and_finds_its_siblings(path, tmp_path):
    py_compile.compile(str(path), cfile=str(tmp_path / "x.pyc"), doraise=True)
    source = path.read_text(encoding="utf-8")
    here = {p.stem for p in path.parent.glob("*.py")}
    parent = {p.stem for p in BENCH.glob("*.py")} if path.parent != BENCH else set()
    adds_parent = "os.path.dirname(os.path.dirname(os.path.abspath(__file__)))" in source
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            mods = [a.name.split(".")[0] for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            mods = [node.module.split(".")[0]]
        else:
            continue
        for mod in mods:
            if mod in here or mod in {"lowbit", "torch", "triton"}:
                continue
            if mod in parent:
                assert adds_parent, f"{path.name} imports {mod} from benchmarks/ without putting it on sys.path"
                continue
            local = {p.stem for p in BENCH.rglob("*.py")}
            assert mod not in local, f"{path.name} imports {mod}, which is not in its folder or benchmarks/"
