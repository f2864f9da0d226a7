"""``lowbit bench gptq`` on CPU with the tiny shape: rows with times and errors, GPTQ below round-to-nearest on
held-out inputs, bad arguments refused."""

from __future__ import annotations

import json

from lowbit.bench import SUITES
from lowbit.bench import gptq as suite


def test_gptq_suite_rows(tmp_path):
    out = tmp_path / "gptq.json"
    rc = suite.main(["--shape", "tiny", "--calib", "4", "--seq", "64", "--schemes", "w4a16-int4",
                     "--modes", "graphs,eager", "--device", "cpu", "--json", str(out)])
    assert rc == 0
    result = json.loads(out.read_text())
    assert "gptq" in SUITES
    (row,) = result["rows"]  # graphs mode needs CUDA: skipped on the CPU
    assert row["mode"] == "eager" and "error" not in row
    assert row["total_s"] > 0 and row["rtn_s"] > 0
    assert 0 < row["gptq_rel_err"] < row["rtn_rel_err"]
    assert "w4a16-int4" in suite.format_table(result)


def test_gptq_suite_refuses_unknown_names(capsys):
    assert suite.main(["--schemes", "w4a16-nope", "--device", "cpu"]) == 2
    assert suite.main(["--modes", "fast", "--device", "cpu"]) == 2
    assert "unknown" in capsys.readouterr().err
