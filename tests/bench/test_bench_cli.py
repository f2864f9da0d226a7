"""`lowbit` CLI parsing, `lowbit env` and `lowbit bench --list` on CPU; importing it does no GPU work."""

import json
import subprocess
import sys

import pytest
import torch

from lowbit import cli


def test_parser():
    p = cli.build_parser()
    a = p.parse_args(
        [
            "bench",
            "--ops",
            "quantize.mx*,nf4",
            "--shapes",
            "4096,1x7168",
            "--json",
            "o.json",
            "--quick",
            "--baselines",
            "none",
            "--no-check",
            "--budget-s",
            "60",
        ]
    )
    assert (a.command, a.ops, a.shapes, a.json_path, a.quick, a.baselines, a.check, a.budget_s) == (
        "bench",
        "quantize.mx*,nf4",
        "4096,1x7168",
        "o.json",
        True,
        "none",
        False,
        60.0,
    )
    a = p.parse_args(["bench"])
    assert (a.ops, a.shapes, a.json_path, a.quick, a.baselines, a.check) == (
        None,
        None,
        None,
        False,
        "one",
        True,
    )
    assert p.parse_args(["env", "--json"]).json
    with pytest.raises(SystemExit):
        p.parse_args([])
    with pytest.raises(SystemExit):
        p.parse_args(["bench", "--baselines", "some"])


def test_env_runs(capsys, monkeypatch):
    monkeypatch.setenv("LOWBIT_BACKEND", "torch")
    assert cli.main(["env"]) == 0
    out = capsys.readouterr().out
    assert "torch" in out and "LOWBIT_BACKEND=torch" in out and "backends torch: yes" in out
    assert cli.main(["env", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["env"] == {"LOWBIT_BACKEND": "torch"} and info["cuda_available"] == torch.cuda.is_available()
    assert set(info["kernels"]) >= {"nvfp4", "nf4", "int4_awq"} and info["backends"]["torch"] == "yes"


def test_bench_list_and_errors(capsys):
    assert cli.main(["bench", "--list", "--ops", "nf4"]) == 0
    assert "dequantize.nf4.dq" in capsys.readouterr().out
    assert cli.main(["bench", "--ops", "nope"]) == 2
    assert cli.main(["bench", "--shapes", "4096xq"]) == 2


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only message")
def test_bench_without_cuda_says_so(capsys):
    assert cli.main(["bench", "--quick"]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err


def test_module_entry_and_no_import_time_gpu_work():
    code = (
        "import sys, torch, lowbit.cli, lowbit.bench; "
        "assert 'triton' not in sys.modules and 'torchao' not in sys.modules; "
        "assert not torch.cuda.is_initialized(); print('clean')"
    )
    assert (
        subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
        == "clean\n"
    )
    out = subprocess.run(
        [sys.executable, "-m", "lowbit.bench", "--list", "--ops", "int4_awq"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert out.startswith("dequantize.int4_awq")


def test_bench_list_names_the_suites(capsys):
    assert cli.main(["bench", "--list"]) == 0
    out = capsys.readouterr().out
    assert "suites (lowbit bench <suite> [options]):" in out
    for line in ("  e2e ", "  dit ", "  offload "):
        assert line in out
    assert "linear.nvfp4.decode" in out and "baselines at every shape" in out
    assert cli.main(["bench", "--list", "--ops", "scaled_mm.*.decode"]) == 0
    out = capsys.readouterr().out
    assert "scaled_mm.nvfp4.decode" in out and "scaled_mm.nvfp4.prefill" not in out and "suites" not in out


def test_bench_subcommand_errors(capsys):
    assert cli.main(["bench", "nope"]) == 2
    err = capsys.readouterr().err
    assert "unknown subcommand 'nope'" in err and "compare" in err and "offload" in err
    assert cli.main(["bench", "e2e", "--modes", "eager,warp"]) == 2  # the suite's own argument check
    assert "lowbit e2e: unknown modes" in capsys.readouterr().err
    assert cli.main(["dit", "--modes", "warp"]) == 2  # the alias reaches the same suite
    assert "lowbit dit: unknown modes" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main(["bench", "offload", "--iters", "x"])


def test_suites_run_through_lowbit_bench(tmp_path, monkeypatch):
    """lowbit bench offload / e2e run the suite modules (tiny CPU shapes; the numbers mean nothing here)."""
    from lowbit import bench

    calls = []
    for name in ("e2e", "dit"):
        suite = bench.SUITES[name]
        module = __import__(suite.module, fromlist=["main"])
        monkeypatch.setattr(module, "main", lambda argv, name=name: calls.append((name, argv)) or 0)
    assert cli.main(["bench", "e2e", "--configs", "bf16"]) == 0
    assert cli.main(["e2e", "--steps", "2"]) == 0
    assert cli.main(["bench", "dit", "--tokens", "8"]) == 0
    assert cli.main(["dit"]) == 0
    assert calls == [("e2e", ["--configs", "bf16"]), ("e2e", ["--steps", "2"]), ("dit", ["--tokens", "8"]),
                     ("dit", [])]
    out = tmp_path / "offload.json"
    rc = cli.main(["bench", "offload", "--device", "cpu", "--dim", "64", "--ffn-dim", "128", "--heads", "2",
                   "--n-blocks", "2", "--tokens", "8", "--ctx", "4", "--iters", "1", "--json", str(out)])
    assert rc == 0 and json.loads(out.read_text())["shapes"]["n_blocks"] == 2


def test_register_suite_rejects_reserved_names():
    from lowbit.bench import Suite, register_suite

    with pytest.raises(ValueError, match="reserved"):
        register_suite(Suite("compare", "lowbit.bench.e2e"))
    with pytest.raises(ValueError, match="already registered"):
        register_suite(Suite("e2e", "lowbit.bench.e2e"))
