"""``lowbit inspect``: formats, shapes, bytes, compression and producer from safetensors headers + config.json."""

from __future__ import annotations

import json
import struct

import pytest
import torch
from torch import nn

import lowbit
from lowbit.eval.checkpoint_info import inspect_checkpoint
from lowbit.eval.safetensors_header import read_header

from ._helpers import run_cli


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(100, 256)
        self.up = nn.Linear(256, 512)
        self.down = nn.Linear(512, 256, bias=False)
        self.norm = nn.LayerNorm(256)


# scheme, save_quantized format, producer text, lowbit format name, bits per weight (scales included)
CASES = [
    ("w4a16-nvfp4", "compressed-tensors", "compressed-tensors (llm-compressor), format nvfp4-pack-quantized", "nvfp4", 4.5),
    ("w4a16-nvfp4", "modelopt", "NVIDIA ModelOpt, NVFP4", "nvfp4", 4.5),
    ("w4a16-mxfp4", "compressed-tensors", "format mxfp4-pack-quantized", "mxfp4", 4.25),
    ("w8a8-mxfp8", "compressed-tensors", "format mxfp8-quantized", "mxfp8_e4m3", 8.25),
    ("w4a16-int4", "compressed-tensors", "format pack-quantized", "int4_awq", 4.0),
    ("w4a16-int4", "awq", "AutoAWQ, version gemm", "int4_awq", 4.0),
    ("w4a16-int4", "gptq", "GPTQ", "int4_awq", 4.0),
    ("w4a16-nf4", "bitsandbytes", "bitsandbytes, nf4", "nf4", 4.5),
    ("w8a8-fp8-block", "fp8", "DeepSeek / HF FP8 (weight_scale_inv), weight_block_size [128, 128]", "fp8_block", 8.0),
    ("w4a16-fp4b32", "lowbit", "lowbit (native layout), schemes w4a16-fp4b32", "fp4_b32", 5.0),
]  # fmt: skip


@pytest.mark.parametrize(("scheme", "fmt", "producer", "lowbit_fmt", "bits"), CASES, ids=lambda v: str(v))
def test_inspect_ecosystem_checkpoints(tmp_path, scheme, fmt, producer, lowbit_fmt, bits):
    model = lowbit.quantize_model(Tiny(), scheme)
    out = lowbit.save_quantized(model, tmp_path / "ckpt", format=fmt)
    info = inspect_checkpoint(out)
    assert producer in info["producer"]
    assert info["quantized_layers"] == 2 and set(info["formats"]) == {lowbit_fmt, "float (f32)"}
    layers = {x["name"]: x for x in info["layers"]}
    assert layers["up"]["shape"] == [512, 256] and layers["down"]["shape"] == [256, 512]
    assert layers["up"]["format"] == lowbit_fmt and layers["embed"]["format"] == "float"
    assert info["quantized_params"] == 2 * 256 * 512
    # group sizes for int4 here: 128 on both (K = 256, 512); scales + zeros ride in the bits per weight
    assert info["quantized_bits_per_weight"] == pytest.approx(bits, abs=0.3)
    assert info["params"] == 100 * 256 + 256 * 512 + 512 + 512 * 256 + 2 * 256
    assert info["total_bytes"] == sum(t.nbytes for f in info["files"] for t in read_header(f).values())
    rc, text, _ = run_cli("inspect", str(out))
    assert rc == 0 and producer in text and lowbit_fmt in text and "[512, 256] x1" in text
    rc, js, _ = run_cli("inspect", str(out), "--json")
    assert rc == 0 and json.loads(js)["formats"][lowbit_fmt]["layers"] == 2


def test_inspect_produced_checkpoints(quantized):
    report, out, _ = quantized
    rc, text, _ = run_cli("inspect", str(out / "w4a16-nf4"), "--layers")
    assert rc == 0
    assert "producer   bitsandbytes, nf4" in text and "model      BertModel" in text
    assert "37 layers" in text and "4.50 bits/weight" in text
    assert "encoder.layer.0.attention.self.query" in text and "weight.absmax" in text
    rc, js, _ = run_cli("inspect", str(out / "w8a8-fp8-block"), "--json")
    info = json.loads(js)
    assert info["quant_method"] == "fp8" and info["quantized_layers"] == 37
    assert info["formats"]["fp8_block"]["shapes"] == {"[384, 384]": 25, "[1536, 384]": 6, "[384, 1536]": 6}
    assert info["total_bytes"] == report["schemes"][0]["bytes"]


def test_inspect_unquantized_source(bundled_dir):
    info = inspect_checkpoint(bundled_dir)
    assert info["producer"] == "none (not quantized)" and info["quantized_layers"] == 0
    header = read_header(bundled_dir / "model.safetensors")
    assert info["params"] == sum(t.numel for t in header.values()) and 22e6 < info["params"] < 23e6
    assert info["formats"]["float (f32)"]["layers"] == 37 + 3  # the Linear layers + 3 embeddings
    assert info["ratio_vs_fp32"] == pytest.approx(1.0, abs=1e-3)


def _write_safetensors(path, tensors):
    from safetensors.torch import save_file

    save_file(tensors, str(path))


def test_inspect_errors(tmp_path):
    rc, _, err = run_cli("inspect", str(tmp_path / "nope"))
    assert rc == 2 and "does not exist" in err
    rc, _, err = run_cli("inspect", str(tmp_path))
    assert rc == 2 and "no *.safetensors" in err
    bin_file = tmp_path / "pytorch_model.bin"
    bin_file.write_bytes(b"\x80\x02pickle")
    rc, _, err = run_cli("inspect", str(bin_file))
    assert rc == 2 and "never unpickles" in err

    good = tmp_path / "good.safetensors"
    _write_safetensors(good, {"a.weight": torch.zeros(64, 64)})
    raw = good.read_bytes()
    truncated = tmp_path / "d1" / "model.safetensors"
    truncated.parent.mkdir()
    truncated.write_bytes(raw[:-100])
    rc, _, err = run_cli("inspect", str(truncated.parent))
    assert rc == 2 and "truncated" in err
    corrupt = tmp_path / "d2" / "model.safetensors"
    corrupt.parent.mkdir()
    n = struct.unpack("<Q", raw[:8])[0]
    corrupt.write_bytes(raw[:8] + b"{" * n + raw[8 + n :])
    rc, _, err = run_cli("inspect", str(corrupt))
    assert rc == 2 and "not valid JSON" in err
    huge = tmp_path / "d3" / "model.safetensors"
    huge.parent.mkdir()
    huge.write_bytes(struct.pack("<Q", 10**12) + b"{}")
    rc, _, err = run_cli("inspect", str(huge))
    assert rc == 2 and "exceeds the file" in err
    (tmp_path / "d4").mkdir()
    _write_safetensors(tmp_path / "d4" / "model.safetensors", {"a.weight": torch.zeros(4, 4)})
    (tmp_path / "d4" / "config.json").write_text("{not json")
    rc, _, err = run_cli("inspect", str(tmp_path / "d4"))
    assert rc == 2 and "config.json: not valid JSON" in err
    assert "Traceback" not in err
