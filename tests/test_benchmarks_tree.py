"""benchmarks/: the curated results, docs/performance.md generated from them, and the scripts compile (CPU only).

- benchmarks/results holds one file per benchmark and GPU kind (``h100_<benchmark>.json``, ``h200_...``, and
  ``h100x2_...`` for a machine of two H100s; JUnit reports: one ``<gpu>_gpu_tests.xml`` per GPU kind, a testsuite
  per area), no dated runs and no one-off sweeps or probes (benchmarks/experiments/; git keeps their history);
- ``python benchmarks/make_performance_md.py`` reproduces docs/performance.md from the checked-in JSON, and
  ``--check`` notices a stale page;
- the W4A16 decode and scaled_mm tables render from a ``lowbit bench`` result as well as from the curated files
  of the scripts those ops replaced;
- every script in benchmarks/ and benchmarks/experiments/ compiles, the sibling modules it imports live where
  its ``sys.path`` setup looks for them, and the names it takes from ``_common`` and ``lowbit.bench`` exist;
- gpu_check.py runs the maintained benchmarks through ``python -m lowbit.bench`` only, with arguments the CLI
  accepts and op patterns that select ops.
"""

from __future__ import annotations

import ast
import importlib
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
    bad = [n for n in names if not re.fullmatch(r"h[12]00(x[248])?_[a-z0-9_]+\.(json|xml|log)", n)]
    assert not bad, f"not <gpu>_<benchmark>.<ext> (dated or one-off runs belong in git history): {bad}"
    bad = [n for n in names if n.endswith(".xml") and not re.fullmatch(r"h[12]00(x[248])?_gpu_tests\.xml", n)]
    assert not bad, f"JUnit reports must be one <gpu>_gpu_tests.xml per GPU kind: {bad}"
    bad = [n for n in names if re.search(r"_(sweep|probe|ab|gpu_smoke)_", n)]
    assert not bad, f"one-off sweeps and probes of benchmarks/experiments/ belong in git history: {bad}"


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
        gpu = "H100" if path.name.startswith("h100") else "H200"
        fields = {f for f in _gpu_fields(json.loads(path.read_text(encoding="utf-8"))) if "NVIDIA" in f}
        recorded += bool(fields)
        assert all(gpu in f for f in fields), f"{path.name} records {fields}"
    # 17 of the 18 curated JSON files name their GPU in a "device"/"gpu" string (h100x2_convert.json lists its
    # GPUs under host.gpus); a file that stops recording it lowers the count
    assert recorded >= 17


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
        assert re.match(r"h[12]00(x[248])?_", name) and (RESULTS / name).exists(), name
    for section in perf.SECTIONS:
        lines = section()
        assert any(line.startswith("Source: ") and ("H100" in line or "H200" in line) and "date " in line
                   for line in lines), section
        assert sum(line.startswith("| ") for line in lines) >= 3, f"{section.__name__} rendered no table rows"


def test_check_mode_notices_a_stale_page(perf, tmp_path):
    out = tmp_path / "performance.md"
    assert perf.main(["--out", str(out)]) == 0
    assert perf.main(["--check", "--out", str(out)]) == 0
    out.write_text(out.read_text(encoding="utf-8").replace("| 1.", "| 9.", 1), encoding="utf-8")
    assert perf.main(["--check", "--out", str(out)]) == 1


def _bench_result(rows):
    header = {"date": "2026-11-24", "gpu": "NVIDIA H100 80GB HBM3", "driver": "1", "cuda": "13.0",
              "torch": "2.11", "triton": "3.6", "lowbit": "0.1.0", "git_sha": "abc1234"}
    return {"schema": "lowbit.bench/1", "header": header, "config": {}, "complete": True, "elapsed_s": 1.0,
            "reference": {"copy": {"bytes": 2 << 30, "ms": 1.0, "GBps": 3000.0},
                          "empty_triton_launch": {"eager_us": 5.0, "graph_us": 2.0}},
            "rows": rows}


def _ok(op, shape, speedups, ms=0.01, ms_graph=0.008, nbytes=3_000_000):
    return {"op": op, "shape": list(shape), "status": "ok", "ms": ms, "ms_graph": ms_graph, "bytes": nbytes,
            "baselines": {name: {"ms": 1.0, "speedup": sp[0], "speedup_graph": sp[1]} for name, sp in speedups.items()}}


def test_tables_render_from_a_lowbit_bench_result(perf, tmp_path, monkeypatch):
    import json

    cub, fp8 = "cublas.bf16", "torch._scaled_mm[fp8]"
    gemv = _bench_result([
        _ok("linear.nvfp4.decode", (1, 8192, 8192), {cub: (2.5, 3.25)}),
        _ok("linear.nf4.dq.decode", (1, 8192, 8192), {cub: (1.5, 1.75)}),
        _ok("linear.nvfp4.decode", (16, 8192, 8192), {cub: (2.0, 2.125)}),
        {"op": "linear.mxfp4.decode", "shape": [1, 8192, 8192], "status": "skipped", "baselines": {}},
        _ok("linear.nvfp4.prefill", (4096, 8192, 8192), {cub: (9.0, 9.0)}),  # not a decode row
    ])
    mm = _bench_result([
        _ok("scaled_mm.fp8_block.prefill", (4096, 7168, 2048), {cub: (1.4, 1.5), fp8: (0.8, 0.9)}),
        _ok("scaled_mm.fp8_block.decode", (16, 7168, 16384), {cub: (1.8, 1.9)}, ms_graph=0.01, nbytes=30_000_000),
    ])
    for name, data in (("h100_w4a16_gemv.json", gemv), ("h100_scaled_mm_graph.json", mm),
                       ("h100_scaled_mm_decode.json", mm)):
        (tmp_path / name).write_text(json.dumps(data))
    monkeypatch.setattr(perf, "RESULTS", tmp_path)

    lines = perf.w4a16_gemv()
    assert "| 8192×8192 | 1 | 3.25 | — | — | — | 1.75 | — |" in lines
    assert "| 8192×8192 | 16 | 2.12 | — | — | — | — | — |" in lines
    assert not any("9.00" in line for line in lines)
    assert any(line.startswith("Source: `benchmarks/results/h100_w4a16_gemv.json`; NVIDIA H100") and "git abc1234"
               in line and "3000 GB/s" in line for line in lines)
    lines = perf.scaled_mm_graph()
    assert "| `fp8_block` | 1.50 / 0.90 |" in lines and "4096×7168×2048" in lines[-3]
    lines = perf.scaled_mm_decode()
    # 30 MB in 10 us = 3000 GB/s: 100 % of the copy roof
    assert "| `fp8_block` | 16 | 1.90 (100 %) |" in lines


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


def _top_level_names(path: Path) -> set[str]:
    names = set()
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names |= {t.id for t in node.targets if isinstance(t, ast.Name)}
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
    return names


@pytest.mark.parametrize("path", SCRIPTS, ids=[str(p.relative_to(BENCH)) for p in SCRIPTS])
def test_names_taken_from_helpers_exist(path):
    """What a script imports from experiments/_common.py or lowbit.bench is there (the scripts themselves need
    a GPU; a renamed helper would only show there)."""
    common = _top_level_names(BENCH / "experiments" / "_common.py")
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.module == "_common":
            missing = [a.name for a in node.names if a.name not in common]
            assert not missing, f"{path.name} imports {missing} from _common"
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("lowbit.bench"):
            mod = importlib.import_module(node.module)
            missing = [a.name for a in node.names if not hasattr(mod, a.name)
                       and importlib.util.find_spec(f"{node.module}.{a.name}") is None]
            assert not missing, f"{path.name} imports {missing} from {node.module}"
        elif (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in ("W", "_peers")
              and "import _common as" in path.read_text(encoding="utf-8")):
            assert node.attr in common, f"{path.name} uses {node.value.id}.{node.attr}, not in _common"


# ------------------------------------------------------------------------------------------- gpu_check

def test_gpu_check_runs_the_maintained_benchmarks_through_lowbit_bench():
    from lowbit import bench, cli

    gc = _load_script(BENCH / "gpu_check.py")
    names = [name for _, name, _ in gc.OPS_BENCHES]
    assert len(set(names)) == len(names)
    selected = set()
    for args, name, timeout in gc.OPS_BENCHES:
        cmd = gc.ops_command(args, f"/out/{name}", timeout)
        assert cmd[1:3] == ["-m", "lowbit.bench"] and cmd[-2:] == ["--json", f"/out/{name}"]
        parsed = cli.build_parser().parse_args(["bench", *cmd[3:]])
        assert 0 < parsed.budget_s < timeout
        ops = bench.select([p for p in parsed.ops.split(",") if p])
        selected |= {op.name for op in ops}
    kinds = {n.split(".")[0] for n in selected}
    assert kinds == {"linear", "qlinear", "scaled_mm", "scaled_linear"}, kinds
    # with the bench step (quantize/dequantize), every registered op runs somewhere
    quant = {n for n in bench.REGISTRY if n.split(".")[0] in ("quantize", "dequantize")}
    assert selected | quant == set(bench.REGISTRY)
    for suite in ("e2e", "dit", "offload"):
        cmd = gc.suite_command(suite, "/out/x.json", "--configs bf16")
        assert cmd[1:] == ["-m", "lowbit.bench", suite, "--json", "/out/x.json", "--configs", "bf16"]
        assert suite in bench.SUITES
    source = (BENCH / "gpu_check.py").read_text(encoding="utf-8")
    assert "benchmarks/bench_" not in source and "lowbit.bench." + "e2e" not in source
    # the convert step: convert_throughput.py with arguments its parser takes
    cmd = gc.convert_command("/out/convert.json", gc.CONVERT_ARGS)
    assert cmd[1].endswith("benchmarks/convert_throughput.py")
    ct = _load_script(BENCH / "convert_throughput.py")
    parsed = ct.parse_args(cmd[2:])
    assert parsed.out_json == "/out/convert.json" and parsed.assign == ["runs", "interleaved"]


def test_gpu_check_runs_every_single_gpu_test_file():
    """Every test file marked ``gpu`` outside tests/parallel (which needs two GPUs) is one of gpu_check.py's
    test paths, so the one device call that runs the GPU tests runs all of them."""
    paths = _load_script(BENCH / "gpu_check.py").GPU_TEST_PATHS
    listed = {ROOT / p for p in paths}
    missing = []
    for f in sorted((ROOT / "tests").rglob("test_*.py")):
        if "parallel" in f.parts or not re.search(r"^(pytestmark = |@)pytest\.mark\.gpu", f.read_text(), re.M):
            continue
        if f not in listed and not any(d.is_dir() and d in f.parents for d in listed):
            missing.append(str(f.relative_to(ROOT)))
    assert not missing, f"GPU test files gpu_check.py does not run: {missing}"
