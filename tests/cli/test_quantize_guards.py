"""``lowbit quantize`` refuses up front, in one line with exit 2, what it cannot do right: an --out inside the
source or holding files lowbit did not write, a source that is already quantized or whose config does not
match its weights, a source that computes NaN. Also: --version, quiet exit on a closed pipe, bench help."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

from ._helpers import run_cli, snapshot


def _one_line(rc: int, err: str) -> str:
    assert rc == 2, err
    assert "Traceback" not in err and err.count("\n") == 1, err
    return err


@pytest.fixture(scope="module")
def tiny_src(tmp_path_factory, bundled_dir):
    """A random 2-layer BERT (seed 0) with the bundled tokenizer files: converts in well under a second."""
    import torch
    import transformers

    torch.manual_seed(0)
    src = tmp_path_factory.mktemp("tiny") / "tiny-bert"
    cfg = transformers.BertConfig(hidden_size=64, num_hidden_layers=1, num_attention_heads=4, intermediate_size=128)
    transformers.BertModel(cfg).save_pretrained(src)
    for f in ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json"):
        shutil.copy(bundled_dir / f, src / f)
    return src


def _copy(src, dst, **config):
    shutil.copytree(src, dst)
    if config:
        cfg = json.loads((dst / "config.json").read_text())
        cfg.update(config)
        (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def _quantize(src, out, *extra):
    return run_cli("quantize", str(src), "--scheme", "w4a16-nf4", "--out", str(out), *extra)


# ---------------------------------------------------------------------------------------------- --out


def test_users_report_files_are_never_replaced(tiny_src, tmp_path):
    out = tmp_path / "o"
    out.mkdir()
    (out / "report.txt").write_text("my own notes")
    (out / "report.json").write_text('{"mine": 1}')
    for extra in ((), ("--overwrite",)):
        err = _one_line(*_quantize(tiny_src, out, *extra)[::2])
        assert "report.txt, report.json" in err and "not written by lowbit quantize" in err
    assert sorted(p.name for p in out.iterdir()) == ["report.json", "report.txt"]
    assert (out / "report.txt").read_text() == "my own notes"


def test_out_inside_or_equal_to_the_source(tiny_src, tmp_path):
    src = _copy(tiny_src, tmp_path / "m" / "w4a16-nf4")
    before = snapshot(src)
    for out in (src, src / "out", src / "a" / "b"):
        for extra in ((), ("--overwrite",)):
            err = _one_line(*_quantize(src, out, *extra)[::2])
            assert "inside the source model directory" in err
    # DIR/<scheme> would be the source itself
    err = _one_line(*_quantize(src, tmp_path / "m", "--overwrite")[::2])
    assert "would replace the source model directory" in err
    assert snapshot(src) == before


def test_another_tools_checkpoint_is_not_replaced(tiny_src, tmp_path):
    """DIR/<scheme> holding a quantized checkpoint lowbit did not write (here: one written by the library
    directly, as another tool would) is refused with and without --overwrite; its extra files stay."""
    import lowbit

    out = tmp_path / "o"
    theirs = lowbit.convert_checkpoint(tiny_src, out / "w4a16-nf4", "w4a16-nf4", progress=False)
    (theirs / "recipe.yaml").write_text("their recipe")
    before = snapshot(out)
    for extra in ((), ("--overwrite",)):
        err = _one_line(*_quantize(tiny_src, out, *extra)[::2])
        assert "w4a16-nf4 exists and was not written by lowbit quantize" in err
    assert snapshot(out) == before


def test_own_output_replaced_only_with_overwrite_and_only_unchanged(tiny_src, tmp_path):
    out = tmp_path / "o"
    rc, _, err = _quantize(tiny_src, out)
    assert rc == 0, err
    marker = json.loads((out / ".lowbit-quantize.json").read_text())
    assert set(marker["checkpoints"]) == {"w4a16-nf4"} and {"report.txt", "report.json"} <= set(marker["files"])
    before = snapshot(out)
    err = _one_line(*_quantize(tiny_src, out)[::2])
    assert "pass --overwrite" in err
    assert snapshot(out) == before
    rc, _, err = _quantize(tiny_src, out, "--overwrite")
    assert rc == 0, err
    # a file the user added to lowbit's checkpoint makes it theirs: no longer replaced
    (out / "w4a16-nf4" / "notes.md").write_text("mine")
    err = _one_line(*_quantize(tiny_src, out, "--overwrite")[::2])
    assert "not written by lowbit quantize" in err
    assert (out / "w4a16-nf4" / "notes.md").read_text() == "mine"
    # an edited report too
    (out / "w4a16-nf4" / "notes.md").unlink()
    (out / "report.txt").write_text("edited")
    err = _one_line(*_quantize(tiny_src, out, "--overwrite")[::2])
    assert "report.txt exists and was not written" in err


# ---------------------------------------------------------------------------------------------- the source


@pytest.mark.parametrize(("scheme", "fmt"), [("w4a16-nvfp4", "compressed-tensors"), ("w4a16-fp4b32", "lowbit")])
def test_already_quantized_source(tiny_src, tmp_path, scheme, fmt):
    import lowbit

    q = lowbit.convert_checkpoint(tiny_src, tmp_path / "q", scheme, format=fmt, progress=False)
    from lowbit.io.files import copy_extra_files

    copy_extra_files(tiny_src, q)
    err = _one_line(*_quantize(q, tmp_path / "o")[::2])
    assert "is already quantized" in err and "install" not in err
    assert not (tmp_path / "o").exists()
    # without its quantization_config the tensor names still give it away
    cfg = json.loads((q / "config.json").read_text())
    cfg.pop("quantization_config")
    (q / "config.json").write_text(json.dumps(cfg))
    err = _one_line(*_quantize(q, tmp_path / "o")[::2])
    assert "is already quantized" in err and "from the tensor names" in err


@pytest.mark.parametrize("qc", [{"quant_method": "hqq"}, "fp8"], ids=["unknown-quant-method", "string"])
def test_quantization_config_fails_once_up_front(tiny_src, tmp_path, qc):
    src = _copy(tiny_src, tmp_path / "s", quantization_config=qc)
    rc, out, err = run_cli("quantize", str(src), "--scheme", "w4a16-nf4,w4a16-mxfp4", "--out", str(tmp_path / "o"))
    _one_line(rc, err)
    assert "is already quantized" in err and "FAILED" not in out
    assert not (tmp_path / "o").exists()


def test_config_problem_is_not_called_a_tokenizer_problem(tiny_src, tmp_path):
    src = _copy(tiny_src, tmp_path / "s", model_type="no-such-model")
    err = _one_line(*_quantize(src, tmp_path / "o")[::2])
    assert "config.json" in err and "tokenizer" not in err
    src = _copy(tiny_src, tmp_path / "l")
    (src / "config.json").write_text("[1, 2]")
    err = _one_line(*_quantize(src, tmp_path / "o")[::2])
    assert "config.json" in err and "JSON object" in err and "tokenizer" not in err


def test_huge_config_fails_from_the_headers(tiny_src, tmp_path):
    import resource

    src = _copy(tiny_src, tmp_path / "s", hidden_size=128000, num_attention_heads=1)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    err = _one_line(*_quantize(src, tmp_path / "o")[::2])
    assert "do not match" in err and "model.safetensors" in err
    assert (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1e6 < 2.0  # KiB -> GB


def test_nan_in_the_source_is_blamed_on_the_source(tiny_src, tmp_path):
    import torch
    from safetensors.torch import load_file, save_file

    src = _copy(tiny_src, tmp_path / "s")
    sd = load_file(src / "model.safetensors")
    key = next(k for k in sd if k.endswith("embeddings.LayerNorm.weight"))
    sd[key][0] = float("nan")
    save_file(sd, src / "model.safetensors", metadata={"format": "pt"})
    err = _one_line(*_quantize(src, tmp_path / "o")[::2])
    assert "source model itself produces non-finite" in err and "quantized model" not in err
    assert torch.isnan(load_file(src / "model.safetensors")[key]).any()


# ---------------------------------------------------------------------------------------------- the command


def test_version():
    import lowbit

    rc, out, _ = run_cli("--version")
    assert rc == 0 and out.strip() == f"lowbit {lowbit.__version__}"


def test_bench_help_has_no_doubled_percent():
    rc, out, _ = run_cli("bench", "--help")
    assert rc == 0 and "% of the copy bandwidth" in out and "%%" not in out


def test_closed_pipe_exits_quietly():
    """`lowbit quantize --scheme list | head -0`: the reader is gone before lowbit prints."""
    p = subprocess.Popen(
        [sys.executable, "-m", "lowbit.cli", "quantize", "--scheme", "list"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    p.stdout.close()
    err = p.stderr.read().decode()
    rc = p.wait(timeout=120)
    assert "Traceback" not in err and "BrokenPipeError" not in err, err
    assert rc == 141


@pytest.mark.parametrize("device, words", [("meta", "bad --device meta: meta tensors hold no values"),
                                           ("bogus", "bad --device 'bogus': not a torch device")])
def test_device_meta_or_bogus_is_refused_up_front(tiny_src, tmp_path, device, words):
    out = tmp_path / "o"
    err = _one_line(*_quantize(tiny_src, out, "--device", device)[::2])
    assert words in err
    assert not out.exists()
