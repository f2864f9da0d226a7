"""``lowbit quantize --devices`` and ``torchrun -m lowbit quantize``: one process per device converting its
share of the source shards, checkpoints byte for byte the single-process ones, rank 0 writing the report; bad
device lists and option combinations exit 2 with one line naming the option. CPU only."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

import lowbit
from lowbit.testing import tree_digest, write_tiny_llama

from ._helpers import run_cli


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    src = str(Path(lowbit.__file__).resolve().parents[1])
    env["PYTHONPATH"] = src + os.pathsep + env.get("PYTHONPATH", "")
    return env


def _lowbit(*argv: str, launcher: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    cmd = [sys.executable, *launcher, "-m", "lowbit", *argv]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=_env())


@pytest.fixture(scope="module")
def bare(tmp_path_factory) -> Path:
    g = torch.Generator().manual_seed(0)
    d = tmp_path_factory.mktemp("bare") / "dit"
    d.mkdir()
    for i in range(3):
        t = {f"blocks.{i}.{n}.weight": torch.randn(64, 64, generator=g).to(torch.bfloat16)
             for n in ("attn1.to_q", "attn1.to_k", "attn1.to_v")}
        t[f"blocks.{i}.norm1.weight"] = torch.ones(64)
        save_file(t, str(d / f"block-{i}.safetensors"))
    return d


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> Path:
    pytest.importorskip("transformers")
    d = write_tiny_llama(tmp_path_factory.mktemp("llama") / "tiny-llama", max_shard_size="30KB")
    assert len(list(d.glob("*.safetensors"))) >= 4
    return d


def test_devices_cpu_cpu_converts_a_transformers_model_without_evaluation(llama, tmp_path):
    schemes = ("w4a16-nvfp4", "w8a8-fp8-block")
    out = tmp_path / "out"
    p = _lowbit("quantize", str(llama), "--scheme", ",".join(schemes), "--out", str(out), "--devices", "cpu,cpu")
    assert p.returncode == 0, p.stderr
    assert "convert only (no evaluation), on 2 processes (cpu, cpu)" in p.stdout, p.stdout
    report = json.loads((out / "report.json").read_text())
    assert report["kind"] == "transformers" and report["processes"] == 2 and report["devices"] == ["cpu", "cpu"]
    assert [r["status"] for r in report["schemes"]] == ["ok", "ok"], report["schemes"]
    for scheme in schemes:
        ref = lowbit.convert_checkpoint(llama, tmp_path / f"ref-{scheme}", scheme, progress=False)
        assert tree_digest(out / scheme) == tree_digest(ref), scheme
    # no temp or sync directory left beside the checkpoints
    assert sorted(p.name for p in out.iterdir()) == sorted([".lowbit-quantize.json", "report.json", "report.txt",
                                                            *schemes])


def test_no_eval_converts_a_transformers_model_on_one_device(llama, tmp_path):
    out = tmp_path / "out"
    rc, stdout, err = run_cli("quantize", str(llama), "--scheme", "w4a16-nf4", "--out", str(out), "--no-eval",
                              "--include", "*mlp*")
    assert rc == 0, err
    assert "convert only (no evaluation)" in stdout and "processes" not in stdout
    ref = lowbit.convert_checkpoint(llama, tmp_path / "ref", "w4a16-nf4", include="*mlp*", progress=False)
    assert tree_digest(out / "w4a16-nf4") == tree_digest(ref)
    assert json.loads((out / "report.json").read_text())["schemes"][0]["quantized_layers"] == 6  # 3 per layer


def test_torchrun_runs_python_m_lowbit_on_every_rank(bare, tmp_path):
    out = tmp_path / "out"
    launcher = ("-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2")
    p = _lowbit("quantize", str(bare), "--scheme", "w4a16-nvfp4", "--out", str(out), "--json", launcher=launcher)
    assert p.returncode == 0, p.stderr
    report = json.loads(p.stdout)  # rank 0 alone prints
    assert report["processes"] == 2 and report["schemes"][0]["status"] == "ok"
    ref = lowbit.convert_checkpoint(bare, tmp_path / "ref", "w4a16-nvfp4", progress=False)
    assert tree_digest(out / "w4a16-nvfp4") == tree_digest(ref)


def test_python_m_lowbit():
    p = _lowbit("--version")
    assert p.returncode == 0 and p.stdout.startswith("lowbit "), p.stderr


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--devices", ""], "--devices is empty"),
        (["--devices", "cpu,,cpu"], "--devices 'cpu,,cpu': an empty entry"),
        (["--devices", "cuda:0,cuda:0"], "--devices: cuda:0 is given twice"),
        (["--devices", "cpu,nowhere:1"], "--devices: 'nowhere:1' is not a torch device"),
        (["--devices", "cpu,meta"], "--devices: 'meta': only cpu and cuda devices"),
        (["--devices", "cuda"], "--devices: 'cuda': name the GPU by its index"),
        (["--devices", "0"], "--devices 0: a count of devices must be at least 1"),
        (["--devices", "cpu,cpu", "--device", "cpu"], "--device and --devices exclude each other"),
        (["--devices", "cpu,cpu", "--calib", "4"], "--calib applies to evaluated runs; with --devices"),
        (["--no-eval", "--algorithm", "gptq", "--calib-file", "x"], "--calib-file, --algorithm apply to evaluated"),
    ],
)
def test_bad_devices_exit_2_with_one_line(bare, tmp_path, argv, message):
    rc, _, err = run_cli("quantize", str(bare), "--scheme", "w4a16-nvfp4", "--out", str(tmp_path / "o"), *argv)
    assert rc == 2 and message in err and err.count("\n") == 1, err
    assert not (tmp_path / "o").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the messages of a machine without CUDA")
@pytest.mark.parametrize(
    ("devices", "message"),
    [("2", "--devices 2: a count means cuda:0..cuda:1, but this machine has 0 CUDA device(s)"),
     ("cpu,cuda:1", "--devices: cuda:1 does not exist here (0 CUDA device(s): CUDA is not available)")],
)
def test_devices_this_machine_lacks(bare, tmp_path, devices, message):
    rc, _, err = run_cli("quantize", str(bare), "--scheme", "w4a16-nvfp4", "--out", str(tmp_path / "o"),
                         "--devices", devices)
    assert rc == 2 and message in err, err


def test_torchrun_environment_errors(bare, tmp_path, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    rc, _, err = run_cli("quantize", str(bare), "--scheme", "w4a16-nvfp4", "--out", str(tmp_path / "o"),
                         "--devices", "cpu,cpu")
    assert rc == 2 and "under torchrun every process is one rank already" in err, err
    monkeypatch.setenv("RANK", "2")
    rc, _, err = run_cli("quantize", str(bare), "--scheme", "w4a16-nvfp4", "--out", str(tmp_path / "o"))
    assert rc == 2 and "RANK must be set to 0..1 when WORLD_SIZE is 2, got '2'" in err, err
    assert not (tmp_path / "o").exists()
