"""benchmarks/convert_throughput.py on CPU: a tiny synthetic Llama converted with one and with two processes,
the two outputs byte for byte the same, GB/s and the speedup reported in the JSON and the table, the synthetic
files removed. The GPU run is the same command with ``--size-gb 20 --devices 2``."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"

pytest.importorskip("transformers")


def test_model_dims_reach_the_size(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))
    import convert_throughput as ct

    big = ct.model_dims(20e9)
    assert big == ct.LLAMA_70B and round(20e9 / ct.layer_bytes(big)) == 12  # 1.71 GB a layer
    small = ct.model_dims(0.05e9)
    assert small["hidden_size"] == 512 and small["num_attention_heads"] * ct.HEAD_DIM == 512
    assert small["intermediate_size"] % 128 == 0 and 0.05e9 >= 4 * ct.layer_bytes(small)


@pytest.mark.parametrize("variant", [[], ["--assign", "interleaved,runs", "--read-threads", "1"], ["--profile"]],
                         ids=["default", "both-assignments-1-thread", "profile"])
def test_cpu_run_checks_identical_outputs_and_cleans_up(tmp_path, monkeypatch, capsys, variant):
    # in this process (the spawned ranks import the script by name from benchmarks/)
    monkeypatch.syspath_prepend(str(BENCH))
    import convert_throughput as ct

    work, out = tmp_path / "work", tmp_path / "convert.json"
    rc = ct.main(["--size-gb", "0.05", "--devices", "cpu,cpu", "--schemes", "w8a8-fp8-block",
                  "--workdir", str(work), "--out-json", str(out), *variant])
    printed = capsys.readouterr().out
    assert rc == 0, printed
    result = json.loads(out.read_text())
    profile = variant == ["--profile"]
    assert result["variant"] == ({"assign": "runs", "read_threads": None, "profile": True} if profile else
                                 {"assign": "interleaved", "read_threads": 1} if variant
                                 else {"assign": "runs", "read_threads": None})
    for run in result["runs"]:  # --profile: each rank's timers, printed and in its result
        for rk in run["ranks"]:
            whats = {r["what"] for r in rk.get("profile", [])}
            assert ("whole: the pieces' loop" in whats) == profile, whats
            assert ("ranks: exchange statuses (waits for the others)" in whats) == (profile and run["world_size"] > 1)
            assert (f"rank {rk['rank']} ({rk['device']})" in printed) == profile
    if variant and not profile:  # one process once, two once per assignment, all the same bytes; a speedup each
        assert [(r["world_size"], r["assign"]) for r in result["runs"]] == [(1, "interleaved"), (2, "interleaved"),
                                                                          (2, "runs")]
        by = result["speedup_by_assign"]["w8a8-fp8-block"]
        assert set(by) == {"interleaved", "runs"} and result["speedup"]["w8a8-fp8-block"] == by["interleaved"]
        assert "(pieces runs)" in printed and "pieces interleaved" in printed
        result["runs"] = result["runs"][:2]
    assert result["identical"] == {"w8a8-fp8-block": True}
    src = result["source"]
    assert 0.04e9 < src["bytes"] < 0.06e9 and src["shards"] >= 4 and src["hidden_size"] == 512
    one, two = result["runs"]
    assert (one["world_size"], two["world_size"]) == (1, 2) and one["ok"] and two["ok"]
    for run in (one, two):
        assert run["inner_s"] < run["outer_s"]
        assert math.isclose(run["inner_gbps"], src["bytes"] / 1e9 / run["inner_s"])
        assert all(r["startup_s"] > 0 for r in run["ranks"])
    assert result["speedup"]["w8a8-fp8-block"]["inner"] == pytest.approx(one["inner_s"] / two["inner_s"])
    assert "w8a8-fp8-block: 2 devices vs 1" in printed and "identical" in printed
    assert list(work.iterdir()) == []  # the synthetic checkpoint and the outputs are gone


def test_interleaved_assignment_alternates_neighbours(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))
    import convert_throughput as ct

    sizes = [("a", 5), ("b", 5), ("c", 9), ("d", 1), ("e", 4)]
    assert ct.interleaved(sizes, 2) == {"c": 0, "a": 1, "b": 1, "e": 0, "d": 1}  # loads 13 and 11
    assert ct.interleaved(list(reversed(sizes)), 2) == ct.interleaved(sizes, 2)


def test_bad_arguments(capsys, monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))
    import convert_throughput as ct

    assert ct.main(["--devices", "cpu,cpu", "--read-threads", "0"]) == 2
    assert "--read-threads must be at least 1" in capsys.readouterr().err
    for bad in ("runs,runs", "striped", ","):
        with pytest.raises(SystemExit):
            ct.main(["--devices", "cpu,cpu", "--assign", bad])
        assert "--assign takes runs and/or interleaved, each once" in capsys.readouterr().err

    assert ct.main(["--devices", "cpu,cpu", "--schemes", "w3a3"]) == 2
    assert "--schemes: unknown ['w3a3']" in capsys.readouterr().err
    assert ct.main(["--devices", "cuda:0,cuda:0"]) == 2
    assert "given twice" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        ct.main(["--size-gb", "-1"])
