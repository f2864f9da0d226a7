"""``lowbit bench compare NEW.json BASELINE.json`` and ``lowbit bench --compare``: the ratios of a run next to a
baseline run's, from two synthetic result files; the table is the one ``lowbit e2e --compare`` prints."""

import json

import pytest

from lowbit import bench, cli
from lowbit.bench import comparison as C


def _result(rows, date="2026-11-24"):
    header = {"date": date, "gpu": "NVIDIA H100 80GB HBM3", "driver": "x", "cuda": "x", "torch": "x",
              "triton": "x", "lowbit": "x", "git_sha": "x"}
    return {"schema": bench.SCHEMA, "header": header,
            "reference": {"copy": {"bytes": 2 << 30, "ms": 1.0, "GBps": 2000.0},
                          "empty_triton_launch": {"eager_us": 5.0, "graph_us": 2.0}},
            "config": {}, "rows": rows, "complete": True, "elapsed_s": 1.0}


def _row(op, shape, pct_copy, baselines, status="ok"):
    return {"op": op, "shape": list(shape), "status": status, "pct_copy": pct_copy, "baselines": baselines,
            "reason": None if status == "ok" else "no kernel"}


NEW = _result([
    _row("linear.nvfp4.decode", (1, 4096, 4096), 80.0,
         {"cublas.bf16": {"ms": 0.02, "speedup": 3.0, "speedup_graph": 3.3},
          "bitsandbytes.matmul_4bit": {"skipped": "bitsandbytes not installed"}}),
    _row("scaled_mm.nvfp4.prefill", (4096, 7168, 2048), 10.0, {"cublas.bf16": {"ms": 0.2, "speedup": 0.5}}),
    _row("linear.mxfp4.decode", (1, 4096, 4096), 0.0, {}, status="skipped"),
])
OLD = _result([
    _row("linear.nvfp4.decode", (1, 4096, 4096), 40.0, {"cublas.bf16": {"ms": 0.02, "speedup": 2.0, "speedup_graph": 3.3}}),
    _row("quantize.nvfp4", (4096, 4096), 50.0, {}),
], date="2026-11-01")


def test_ratios_of_a_result():
    assert callable(bench.compare) and callable(bench.ratios)  # not shadowed by a submodule of the same name
    r = bench.ratios(NEW)
    assert set(r) == {"linear.nvfp4.decode 1x4096x4096", "scaled_mm.nvfp4.prefill 4096x7168x2048"}  # ok rows only
    assert r["linear.nvfp4.decode 1x4096x4096"] == {"of_copy": 0.8, "vs cublas.bf16": 3.0,
                                                    "vs cublas.bf16 [graph]": 3.3}


def test_compare_table_side_by_side():
    lines = bench.compare(NEW, OLD).splitlines()
    assert lines[0] == "case | ratio | new | baseline | change"
    assert "linear.nvfp4.decode 1x4096x4096 | vs cublas.bf16 | 3.000 | 2.000 | 1.50x" in lines
    assert "linear.nvfp4.decode 1x4096x4096 | vs cublas.bf16 [graph] | 3.300 | 3.300 | 1.00x" in lines
    assert "linear.nvfp4.decode 1x4096x4096 | of_copy | 0.800 | 0.400 | 2.00x" in lines
    assert "scaled_mm.nvfp4.prefill 4096x7168x2048 | vs cublas.bf16 | 0.500 | - | -" in lines
    assert any(line.startswith("geomean change of vs cublas.bf16: 1.500x over 1 cases") for line in lines)
    assert any(line.startswith("in the baseline, not in the new run (1): quantize.nvfp4 4096x4096")
               for line in lines)


def test_newest_run_of_a_curated_file_counts():
    newer = _result([_row("linear.nvfp4.decode", (1, 4096, 4096), 75.0, {"cublas.bf16": {"speedup": 2.5}})])
    text = bench.compare(NEW, {"runs": [OLD, newer]})
    assert "linear.nvfp4.decode 1x4096x4096 | vs cublas.bf16 | 3.000 | 2.500 | 1.20x" in text
    # the older run still answers for a case the newer one lacks
    assert "in the baseline, not in the new run (1): quantize.nvfp4 4096x4096" in text


def test_compare_rejects_other_files():
    with pytest.raises(C.CompareError, match="new run is not a lowbit bench result"):
        bench.compare({"rows": []}, OLD)
    with pytest.raises(C.CompareError, match="baseline is not a lowbit bench result"):
        bench.compare(NEW, {"runs": [{"rows": [{"config": "bf16"}]}]})
    with pytest.raises(C.CompareError, match="baseline"):
        bench.compare(NEW, {"runs": []})


def test_shared_table_with_e2e():
    """lowbit e2e --compare prints the same table (lowbit.bench.comparison.table), keyed by config."""
    from lowbit.bench import e2e

    new = {"rows": [{"config": "bf16", "ratio": {"eager": 1.0, "host_vs_f_linear": 1.2}},
                    {"config": "lowbit:w4a16-nvfp4", "ratio": {"eager": 3.0}}]}
    old = {"runs": [{"rows": [{"config": "lowbit:w4a16-nvfp4", "ratio": {"eager": 2.0}}]}]}
    text = e2e.compare(new, old)
    assert text == C.table({"bf16": {"eager": 1.0, "host_vs_f_linear": 1.2}, "lowbit:w4a16-nvfp4": {"eager": 3.0}},
                           {"lowbit:w4a16-nvfp4": {"eager": 2.0}}, key="config",
                           skip=lambda c, k: c == "bf16" and k != "host_vs_f_linear")
    assert "lowbit:w4a16-nvfp4 | eager | 3.000 | 2.000 | 1.50x" in text and "bf16 | eager" not in text


def _write(tmp_path, name, data):
    path = tmp_path / name
    path.write_text(json.dumps(data) if not isinstance(data, str) else data)
    return str(path)


def test_cli_compare(tmp_path, capsys):
    new, old = _write(tmp_path, "new.json", NEW), _write(tmp_path, "old.json", {"runs": [OLD]})
    assert cli.main(["bench", "compare", new, old]) == 0
    out = capsys.readouterr().out
    assert "| vs cublas.bf16 | 3.000 | 2.000 | 1.50x" in out and "geomean change" in out


def test_cli_compare_e2e_results(tmp_path, capsys):
    e2e_new = {"settings": {"steps": 4}, "rows": [{"config": "lowbit:w4a16-nvfp4", "ratio": {"eager": 3.0}}]}
    e2e_old = {"settings": {"steps": 4}, "rows": [{"config": "lowbit:w4a16-nvfp4", "ratio": {"eager": 1.5}}]}
    assert cli.main(["bench", "compare", _write(tmp_path, "a.json", e2e_new), _write(tmp_path, "b.json", e2e_old)]) == 0
    assert "lowbit:w4a16-nvfp4 | eager | 3.000 | 1.500 | 2.00x" in capsys.readouterr().out


@pytest.mark.parametrize(
    "new,old,message",
    [
        ("missing.json", "old.json", "not a readable JSON result"),
        ("bad.json", "old.json", "not a readable JSON result"),
        ("list.json", "old.json", "not a lowbit bench result"),
        ("new.json", "e2e.json", "baseline is not a lowbit bench result"),
    ],
)
def test_cli_compare_errors_exit_2(tmp_path, capsys, new, old, message):
    _write(tmp_path, "new.json", NEW)
    _write(tmp_path, "old.json", OLD)
    _write(tmp_path, "bad.json", "{not json")
    _write(tmp_path, "list.json", [1, 2])
    _write(tmp_path, "e2e.json", {"settings": {"steps": 4}, "rows": [{"config": "bf16", "ratio": {}}]})
    assert cli.main(["bench", "compare", str(tmp_path / new), str(tmp_path / old)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("lowbit bench compare: ") and message in err and err.count("\n") == 1


def test_cli_compare_needs_two_files():
    with pytest.raises(SystemExit) as e:
        cli.main(["bench", "compare", "only.json"])
    assert e.value.code == 2


def test_bench_compare_flag_checks_the_baseline_before_running(tmp_path, capsys):
    """--compare with a bad baseline exits 2 before any GPU work (here: before saying CUDA is missing)."""
    assert cli.main(["bench", "--ops", "nvfp4", "--compare", str(tmp_path / "missing.json")]) == 2
    err = capsys.readouterr().err
    assert "--compare" in err and "not a readable JSON result" in err
    e2e_file = _write(tmp_path, "e2e.json", {"settings": {"steps": 4}, "rows": [{"config": "bf16"}]})
    assert cli.main(["bench", "--compare", e2e_file]) == 2
    assert "not a lowbit bench result" in capsys.readouterr().err
    p = cli.build_parser().parse_args(["bench", "--compare", "b.json"])
    assert p.compare == "b.json"


RESULTS = __import__("pathlib").Path(__file__).parents[2] / "benchmarks" / "results"


def test_curated_files_of_the_replaced_scripts_are_baselines():
    """The curated W4A16 GEMV and scaled_mm files predate the ops; their speedups compare all the same."""
    gemv = json.loads((RESULTS / "h100_w4a16_gemv.json").read_text())
    old = next(r for run in gemv["runs"] for r in run["rows"]
               if (r["format"], r["n"], r["k"], r["m"]) == ("nf4-dq", 28672, 8192, 1))
    dec = json.loads((RESULTS / "h100_scaled_mm_decode.json").read_text())
    old_dec = next(r for r in dec["rows"] if (r["pair"], r["M"], r["N"], r["K"]) == ("nvfp4", 16, 7168, 16384))
    new = _result([
        _row("linear.nf4.dq.decode", (1, 28672, 8192), 80.0,
             {"cublas.bf16": {"speedup": 2 * old["speedup"]["eager"], "speedup_graph": old["speedup"]["graph"]}}),
        _row("scaled_mm.nvfp4.decode", (16, 7168, 16384), 50.0,
             {"cublas.bf16": {"speedup": 1.0, "speedup_graph": 0.5 * old_dec["graph_vs_cublas_bf16"]}}),
    ])
    text = bench.compare(new, gemv)
    line = next(x for x in text.splitlines() if x.startswith("linear.nf4.dq.decode 1x28672x8192 | vs cublas.bf16 |"))
    assert line.endswith("| 2.00x") and f"{old['speedup']['eager']:.3f}" in line
    assert "linear.nf4.dq.decode 1x28672x8192 | vs cublas.bf16 [graph] |" in text
    assert "linear.nf4.dq.decode 1x28672x8192 | of_copy | 0.800 | - | -" in text  # bytes counted differently
    line = next(x for x in bench.compare(new, dec).splitlines()
                if x.startswith("scaled_mm.nvfp4.decode 16x7168x16384 | vs cublas.bf16 [graph] |"))
    assert line.endswith("| 0.50x")
    graph = json.loads((RESULTS / "h100_scaled_mm_graph.json").read_text())
    keys = bench.compare(new, graph)
    assert "scaled_linear.fp8_block 4096x2112x7168" in keys  # in the baseline, not in the new run
    with pytest.raises(C.CompareError, match="nor a result of the W4A16 GEMV or scaled_mm scripts"):
        bench.compare(new, {"rows": [{"format": "nvfp4", "M": 4096, "ratio_vs_cublas": 0.9}]})
