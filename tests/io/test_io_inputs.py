"""Bad arguments and mismatched configs in save_quantized / load_quantized / convert_checkpoint: each is a
ValueError/TypeError naming the argument or file, raised before anything is allocated or written."""

from __future__ import annotations

import json
import resource
from pathlib import Path

import pytest
import torch
from torch import nn

import lowbit
from lowbit.io import files as io_files
from lowbit.nn import QuantLinear

transformers = pytest.importorskip("transformers")


class Plain(nn.Module):
    """A model that is not a transformers model: save_quantized writes no model_type for it."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.up = nn.Linear(64, 128)
        self.down = nn.Linear(128, 64, bias=False)
        self.norm = nn.LayerNorm(64)


@pytest.fixture(scope="module")
def plain_ckpt(tmp_path_factory):
    q = lowbit.quantize_model(Plain(), "w4a16-nvfp4")
    return q, lowbit.save_quantized(q, tmp_path_factory.mktemp("plain") / "out")


@pytest.fixture(scope="module")
def bert_src(tmp_path_factory) -> Path:
    torch.manual_seed(0)
    cfg = transformers.BertConfig(
        vocab_size=96, hidden_size=64, num_hidden_layers=1, num_attention_heads=4, intermediate_size=128,
        max_position_embeddings=64,
    )  # fmt: skip
    d = tmp_path_factory.mktemp("src") / "bert"
    transformers.BertModel(cfg).save_pretrained(d)
    return d


def _with_config(src: Path, dst: Path, **changes) -> Path:
    import shutil

    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg.update(changes)
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


# ---------------------------------------------------------------------------------------------- plain modules


def test_load_plain_module_needs_model_and_loads_into_it(plain_ckpt):
    """The README's save/load round trip for a plain nn.Module: load_quantized says to pass model=, and with it
    the module gets the saved QuantLinear layers back bit for bit (also into a meta-device instance)."""
    q, out = plain_ckpt
    assert "model_type" not in json.loads((out / "config.json").read_text())
    with pytest.raises(ValueError, match=r"config\.json: no model_type.*pass model="):
        lowbit.load_quantized(out)
    for fresh in (Plain(), None):
        if fresh is None:
            with torch.device("meta"):
                fresh = Plain()
        back = lowbit.load_quantized(out, model=fresh)
        assert isinstance(back.up, QuantLinear) and isinstance(back.down, QuantLinear)
        assert torch.equal(back.up.weight_qtensor.data, q.up.weight_qtensor.data)
        assert torch.equal(back.up.bias, q.up.bias) and torch.equal(back.norm.weight, q.norm.weight)
        x = torch.randn(3, 64)
        assert torch.equal(back.down(back.up(x)), q.down(q.up(x)))
    with pytest.raises(TypeError, match="model must be a torch.nn.Module"):
        lowbit.load_quantized(out, model="Plain")


# ---------------------------------------------------------------------------------------------- arguments


@pytest.mark.parametrize("size", ["abc", "5XB", "", "nanGB", 0, -1, "0MB", "-5GB"])
def test_max_shard_size_rejected(tmp_path, plain_ckpt, size):
    q, _ = plain_ckpt
    with pytest.raises(ValueError, match="max_shard_size"):
        lowbit.save_quantized(q, tmp_path / "o", max_shard_size=size)
    assert list(tmp_path.iterdir()) == []  # refused before anything was written


def test_max_shard_size_types_and_units(tmp_path, plain_ckpt):
    q, _ = plain_ckpt
    for bad in (True, 1.5e9, None):
        with pytest.raises(TypeError, match="max_shard_size"):
            lowbit.save_quantized(q, tmp_path / "o", max_shard_size=bad)
    assert io_files.parse_size("2KiB") == 2048 and io_files.parse_size(" 1.5 MB ") == 1_500_000
    assert io_files.parse_size("10KB") == 10_000 and io_files.parse_size("123") == 123 and io_files.parse_size(7) == 7
    assert io_files.parse_size("64B") == 64


def test_bad_device(tmp_path, bert_src, plain_ckpt):
    with pytest.raises(ValueError, match="device .*'bogus'"):
        lowbit.convert_checkpoint(bert_src, tmp_path / "o", "w4a16-nf4", device="bogus", progress=False)
    with pytest.raises(ValueError, match="device .*'bogus'"):
        lowbit.load_quantized(plain_ckpt[1], model=Plain(), device="bogus")
    assert not (tmp_path / "o").exists()


# ---------------------------------------------------------------------------------------------- configs


def test_string_quantization_config(tmp_path, bert_src):
    src = _with_config(bert_src, tmp_path / "s", quantization_config="fp8")
    with pytest.raises(ValueError, match=r"config\.json: quantization_config must be a JSON object, got str"):
        lowbit.convert_checkpoint(src, tmp_path / "o", "w4a16-nf4", progress=False)
    src = _with_config(bert_src, tmp_path / "h", quantization_config={"quant_method": "hqq"})
    with pytest.raises(ValueError, match="already quantized.*'hqq'"):
        lowbit.convert_checkpoint(src, tmp_path / "o", "w4a16-nf4", progress=False)


def _rss_gb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6  # KiB on Linux


def test_huge_config_checked_from_headers_before_allocating(tmp_path, bert_src):
    """hidden_size 128000: one Linear alone would be 65 GB. The model is built on the meta device and its
    shapes compared with the safetensors headers first, so this is a ValueError, not an allocation."""
    src = _with_config(bert_src, tmp_path / "s", hidden_size=128000, num_attention_heads=1)
    before = _rss_gb()
    with pytest.raises(ValueError, match=r"model\.safetensors: tensor .* has shape \[64\] but config\.json"):
        lowbit.convert_checkpoint(src, tmp_path / "o", "w4a16-nf4", progress=False)
    with pytest.raises(ValueError, match="do not match"):
        lowbit.io.convert.check_source(src)
    out = lowbit.convert_checkpoint(bert_src, tmp_path / "q", "w4a16-nf4", progress=False)
    cfg = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps(dict(cfg, hidden_size=128000, num_attention_heads=1)))
    with pytest.raises(ValueError, match="do not match"):
        lowbit.load_quantized(out)
    # only Linear layers grow: no header to compare them with, the model's size against the files' says it
    (out / "config.json").write_text(json.dumps(dict(cfg, intermediate_size=10**8)))
    with pytest.raises(ValueError, match=r"GB of parameters but the checkpoint's safetensors hold"):
        lowbit.load_quantized(out)
    assert _rss_gb() - before < 2.0


def test_output_never_inside_or_around_the_source(tmp_path, bert_src):
    import shutil

    src = tmp_path / "m" / "src"
    shutil.copytree(bert_src, src)
    before = sorted(p.name for p in src.iterdir())
    with pytest.raises(ValueError, match="outside the source directory"):
        lowbit.convert_checkpoint(src, src / "nf4", "w4a16-nf4", progress=False)
    with pytest.raises(ValueError, match="outside the source directory"):
        lowbit.convert_checkpoint(src, src, "w4a16-nf4", progress=False, overwrite=True)
    # replacing a directory that holds the source would delete the source
    with pytest.raises(ValueError, match="must not contain it"):
        lowbit.convert_checkpoint(src, tmp_path / "m", "w4a16-nf4", progress=False, overwrite=True)
    q = lowbit.quantize_model(Plain(), "w4a16-nf4")
    with pytest.raises(ValueError, match="outside the source directory"):
        lowbit.save_quantized(q, src / "out", source_dir=src)
    assert sorted(p.name for p in src.iterdir()) == before
