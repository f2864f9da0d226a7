"""The runner end to end on CPU with a fake timer (the timing itself needs CUDA: see the gpu test below):
rows, statuses, the correctness gate, baselines and speedups, the JSON schema and the table."""

import json

import pytest
import torch

from lowbit import bench
from lowbit.bench import envinfo
from lowbit.bench.registry import Case, Op, Skip

CPU = {"device": "cpu", "backend": "torch"}


def _run(ops, tmp_path, timer, **kw):
    path = tmp_path / "r.json"
    kw = {**CPU, "baselines": "none", **kw}
    result = bench.run(ops, timer=timer, json_path=path, progress=None, header=envinfo.header(), **kw)
    assert json.loads(path.read_text()) == json.loads(json.dumps(result, default=str))
    bench.validate(result)
    return result


def test_registered_ops_on_cpu(tmp_path, fake_timer):
    ops = bench.select(["quantize.mxfp4", "quantize.nvfp4.swizzled", "dequantize.nf4", "dequantize.int4_awq"])
    result = _run(ops, tmp_path, fake_timer, shapes=[(128, 256)])
    assert result["complete"] and [r["status"] for r in result["rows"]] == ["ok"] * 4
    copy = result["reference"]["copy"]["GBps"]
    for row in result["rows"]:
        op = bench.REGISTRY[row["op"]]
        assert row["bytes"] == op.nbytes((128, 256)) and row["shape"] == [128, 256]
        assert row["GBps"] == pytest.approx(row["bytes"] / 0.01 / 1e6)
        assert row["pct_copy"] == pytest.approx(100 * row["GBps"] / copy)
        assert row["check"] == "bitexact" and row["ms_graph"] == 0.005  # small: also graph-timed
        assert row["ms_p20"] < row["ms"] < row["ms_p80"]
    text = bench.format_table(result)
    assert "quantize.mxfp4" in text and "copy roof" in text and "4 ok / 4 cases" in text


def _op(name, setup, **kw):
    return Op(name, setup=setup, shapes=((64, 64),), **kw)


def test_statuses_gate_and_baselines(tmp_path, fake_timer):
    x = torch.randn(64, 64)

    def ok(shape, ctx):
        return Case(
            fn=lambda: x + 1,
            bytes=2 * x.nbytes,
            check=lambda: None,
            baselines={"slow": lambda: x * 2, "absent": "foo not installed", "broken": lambda: 1 / 0}
            if ctx.baselines
            else {},
        )

    def skip(shape, ctx):
        raise Skip("no triton kernel yet")

    def boom(shape, ctx):
        raise RuntimeError("setup exploded")

    def wrong(shape, ctx):
        def check():
            raise AssertionError("data bytes: 3 of 4096 elements differ")

        return Case(fn=lambda: x, bytes=x.nbytes, check=check)

    def miscounted(shape, ctx):
        return Case(fn=lambda: x, bytes=123)

    ops = [
        _op("t.ok", ok),
        _op("t.skip", skip),
        _op("t.pre", ok, unavailable=lambda ctx: "not here"),
        _op("t.boom", boom),
        _op("t.wrong", wrong),
        _op("t.count", miscounted, nbytes=lambda s: 124),
    ]
    result = _run(ops, tmp_path, fake_timer, baselines="one")
    rows = {r["op"]: r for r in result["rows"]}
    assert rows["t.ok"]["status"] == "ok"
    b = rows["t.ok"]["baselines"]
    assert b["slow"]["ms"] == 0.01 and b["slow"]["speedup"] == pytest.approx(1.0)
    assert b["slow"]["GBps"] == pytest.approx(rows["t.ok"]["GBps"])
    assert b["absent"] == {"skipped": "foo not installed"}
    assert b["broken"]["failed"].startswith("ZeroDivisionError")
    assert (rows["t.skip"]["status"], rows["t.skip"]["reason"]) == ("skipped", "no triton kernel yet")
    assert (rows["t.pre"]["status"], rows["t.pre"]["reason"]) == ("skipped", "not here")
    assert rows["t.boom"]["status"] == "failed" and "setup exploded" in rows["t.boom"]["reason"]
    # the gate: a case that differs from the reference carries no numbers
    assert rows["t.wrong"]["status"] == "check_failed" and rows["t.wrong"]["ms"] is None
    assert "byte count" in rows["t.count"]["reason"]
    text = bench.format_table(result)
    assert "skipped: no triton kernel yet\n    t.skip[64x64]" in text
    assert "baseline absent skipped: foo not installed\n    t.ok[64x64]" in text
    assert "check_failed: data bytes" in text and "1 ok / 6 cases" in text


def test_budget_skips_baselines_not_cases(tmp_path, fake_timer):
    x = torch.randn(8, 8)
    op = _op(
        "t.ok",
        lambda s, ctx: Case(fn=lambda: x, bytes=x.nbytes, baselines={"b": lambda: x, "lowbit.c": lambda: x}),
    )
    result = _run([op], tmp_path, fake_timer, baselines="all", budget_s=0.0)
    row = result["rows"][0]
    assert row["status"] == "ok" and row["ms"] == 0.01
    assert row["baselines"] == {
        "b": {"skipped": "time budget spent"},
        "lowbit.c": {"skipped": "time budget spent"},
    }


def test_external_baselines_time_before_lowbit_ones(tmp_path, fake_timer):
    x = torch.randn(8, 8)
    order = []

    def setup(shape, ctx):
        return Case(
            fn=lambda: x,
            bytes=x.nbytes,
            baselines={
                "lowbit.formats[compiled]": lambda: order.append("lowbit"),
                "peer": lambda: order.append("peer"),
            },
        )

    result = _run([_op("t.a", setup), _op("t.b", setup)], tmp_path, fake_timer, baselines="one")
    assert order[0] == order[2] == "peer" and order[-1] == "lowbit" and set(order[:4]) == {"peer"}
    assert list(result["rows"][0]["baselines"]) == ["peer", "lowbit.formats[compiled]"]


def test_validate_rejects_bad_results(tmp_path, fake_timer):
    result = _run([], tmp_path, fake_timer)
    for breaks in (
        lambda r: r.pop("header"),
        lambda r: r["header"].pop("git_sha"),
        lambda r: r.update(schema="x"),
        lambda r: r["reference"]["copy"].update(bytes=1 << 20),
        lambda r: r["rows"].append({"op": "x"}),
    ):
        bad = json.loads(json.dumps(result))
        breaks(bad)
        with pytest.raises(ValueError):
            bench.validate(bad)


def test_header_names_what_targets_md_asks(monkeypatch):
    monkeypatch.setenv("GIT_SHA", "abc1234")
    h = envinfo.header()
    for key in ("date", "gpu", "driver", "cuda", "torch", "triton", "lowbit", "git_sha"):
        assert key in h
    assert h["git_sha"] == "abc1234" and h["torch"] == torch.__version__
    assert bench.default_json_name(h) == f"quant_kernels_{h['date']}.json"


@pytest.mark.gpu
def test_timing_on_gpu(tmp_path):
    """The real timing path: copy roof, launch floor, do_bench and CUDA-graph times for one small case."""
    result = bench.run(
        bench.select(["quantize.mxfp4"]),
        shapes=[(256, 4096)],
        baselines="none",
        progress=None,
        json_path=tmp_path / "r.json",
    )
    bench.validate(result)
    row = result["rows"][0]
    assert row["status"] == "ok", row
    assert row["check"] == "bitexact" and row["ms_graph"] is not None and row["ms_graph"] > 0
    assert result["reference"]["copy"]["GBps"] > 500
    assert 0 < result["reference"]["empty_triton_launch"]["graph_us"] < 1000
