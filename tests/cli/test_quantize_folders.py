"""``lowbit quantize DIR`` on a diffusers model folder and on a bare folder of safetensors files: converted
without evaluation (there is no sentence encoder for them), each scheme into OUT/<scheme> with the name/shape
rules and --include/--exclude, the same --out guards, and a report of what each checkpoint holds."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from ._helpers import run_cli, snapshot


def _tensors():
    g = torch.Generator().manual_seed(0)
    t = {
        "patch_embedding.weight": torch.randn(64, 4, 1, 2, 2, generator=g),
        "blocks.0.norm1.weight": torch.ones(64),
        "proj_out.weight": torch.randn(16, 64, generator=g),
    }
    for name in ("attn1.to_q", "attn1.to_k", "attn1.to_v", "ffn.net.0.proj"):
        t[f"blocks.0.{name}.weight"] = torch.randn(128, 64, generator=g).to(torch.bfloat16)
        t[f"blocks.0.{name}.bias"] = torch.zeros(128).to(torch.bfloat16)
    return t


@pytest.fixture(params=["diffusers", "safetensors"])
def folder(request, tmp_path):
    src = tmp_path / f"src-{request.param}"
    src.mkdir()
    save_file(_tensors(), str(src / "diffusion_pytorch_model.safetensors"))
    if request.param == "diffusers":
        (src / "config.json").write_text(json.dumps({"_class_name": "WanTransformer3DModel", "num_layers": 1}))
    return request.param, src


def _quantize(src, out, *extra):
    return run_cli("quantize", str(src), "--scheme", "w4a16-nvfp4", "--out", str(out), *extra)


def test_folder_converts_without_evaluation(folder, tmp_path):
    kind, src = folder
    before = snapshot(src)
    out = tmp_path / "out"
    rc, stdout, err = _quantize(src, out)
    assert rc == 0, err
    assert "convert only" in stdout and f"{kind} folder" in stdout
    report = json.loads((out / "report.json").read_text())
    (row,) = report["schemes"]
    assert row["status"] == "ok" and row["quantized_layers"] == 4, row  # the four block Linears, nothing else
    assert (out / "report.txt").read_text().startswith(str(src))
    rc, info, err = run_cli("inspect", str(out / "w4a16-nvfp4"))
    assert rc == 0 and "nvfp4" in info, err
    assert snapshot(src) == before  # the source is only read


def test_include_exclude_and_the_out_guards(folder, tmp_path):
    _, src = folder
    out = tmp_path / "out"
    rc, _, err = _quantize(src, out, "--exclude", "*to_k*", "--exclude", "re:.*ffn.*")
    assert rc == 0, err
    assert json.loads((out / "report.json").read_text())["schemes"][0]["quantized_layers"] == 2
    rc, _, err = _quantize(src, out)  # an earlier run's output: only with --overwrite
    assert rc == 2 and "--overwrite" in err and err.count("\n") == 1, err
    rc, _, err = _quantize(src, out, "--overwrite", "--include", "blocks.0.attn1.to_q")
    assert rc == 0, err
    assert json.loads((out / "report.json").read_text())["schemes"][0]["quantized_layers"] == 1
    rc, _, err = _quantize(src, src / "inside")
    assert rc == 2 and "inside the source" in err, err


def test_pattern_flags_are_refused_for_a_transformers_model(tmp_path):
    rc, _, err = run_cli("quantize", "--scheme", "w4a16-nf4", "--out", str(tmp_path / "o"), "--exclude", "x")
    assert rc == 2 and "--include, --exclude and --format apply to diffusers" in err, err
