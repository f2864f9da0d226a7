"""``lowbit quantize`` killed (SIGKILL) at several moments of a run: whatever it leaves under --out is either
absent or a complete checkpoint, identical to an uninterrupted run's, and the marker never claims a file whose
content it did not write."""

from __future__ import annotations

import hashlib
import json
import shutil
import signal
import subprocess
import sys
import time

import pytest

SCHEMES = "w4a16-nf4,w8a8-fp8-block"


@pytest.fixture(scope="module")
def tiny_src(tmp_path_factory, bundled_dir):
    import torch
    import transformers

    torch.manual_seed(0)
    src = tmp_path_factory.mktemp("tiny") / "tiny-bert"
    cfg = transformers.BertConfig(hidden_size=128, num_hidden_layers=2, num_attention_heads=4, intermediate_size=256)
    transformers.BertModel(cfg).save_pretrained(src)
    for f in ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json"):
        shutil.copy(bundled_dir / f, src / f)
    return src


def _cmd(src, out):
    return [sys.executable, "-m", "lowbit.cli", "quantize", str(src), "--scheme", SCHEMES, "--out", str(out)]


def _digest(d):
    return {str(p.relative_to(d)): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(d.rglob("*")) if p.is_file()}


def test_killed_run_leaves_no_partial_checkpoint(tiny_src, tmp_path):
    import lowbit

    clean = tmp_path / "clean"
    t0 = time.monotonic()
    p = subprocess.run(_cmd(tiny_src, clean), capture_output=True, text=True, timeout=600)
    total = time.monotonic() - t0
    assert p.returncode == 0, p.stderr
    expected = {s: _digest(clean / s) for s in SCHEMES.split(",")}
    for i, frac in enumerate((0.55, 0.7, 0.8, 0.9, 0.97)):
        out = tmp_path / f"k{i}"
        proc = subprocess.Popen(_cmd(tiny_src, out), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(total * frac)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=60)
        if not out.exists():
            continue
        visible = [d for d in out.iterdir() if not d.name.startswith(".")]
        for d in visible:
            if d.is_dir():  # a checkpoint: all of it or nothing
                assert _digest(d) == expected[d.name], d
                lowbit.load_quantized(d)
        marker_path = out / ".lowbit-quantize.json"
        if marker_path.exists():
            marker = json.loads(marker_path.read_text())
            for name, digests in marker["files"].items():
                if (out / name).exists():
                    assert hashlib.sha256((out / name).read_bytes()).hexdigest() in digests, name
