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
