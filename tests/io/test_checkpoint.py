"""save_quantized / load_quantized / convert_checkpoint: bit-identical round trips per scheme and format, the
configs consumers parse, atomic writes, resumable conversion, and clear errors for bad checkpoints."""

from __future__ import annotations

import copy
import hashlib
import json
import shutil
from pathlib import Path

import pytest
import torch

import lowbit
from lowbit.io import files as io_files
from lowbit.nn import SCHEMES, QuantLinear

transformers = pytest.importorskip("transformers")

INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(INT_VIEW[t.element_size()]) if t.is_floating_point() else t


def _llama(dtype=torch.bfloat16, seed=0, **kw) -> torch.nn.Module:
    torch.manual_seed(seed)
    cfg = {
        "vocab_size": 96, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 1, "num_attention_heads": 4,
        "num_key_value_heads": 2, "max_position_embeddings": 64, "tie_word_embeddings": False,
    }  # fmt: skip
    cfg.update(kw)
    # built in its dtype (as from_pretrained does), so non-persistent buffers (rotary inv_freq) match a reload
    return transformers.LlamaForCausalLM._from_config(transformers.LlamaConfig(**cfg), dtype=dtype).eval()


def _bert(seed=0) -> torch.nn.Module:
    torch.manual_seed(seed)
    cfg = transformers.BertConfig(
        vocab_size=96, hidden_size=64, num_hidden_layers=1, num_attention_heads=4, intermediate_size=128,
        max_position_embeddings=64,
    )  # fmt: skip
    return transformers.BertModel(cfg).eval()


IDS = torch.arange(12).reshape(1, 12) % 96


def _qlinears(model) -> dict[str, QuantLinear]:
    return {n: m for n, m in model.named_modules() if isinstance(m, QuantLinear)}


def _assert_same_model(a, b, *, params: bool = True) -> None:
    qa, qb = _qlinears(a), _qlinears(b)
    assert set(qa) == set(qb) and qa
    for name in qa:
        x, y = qa[name], qb[name]
        assert x.scheme is y.scheme, name
        wx, wy = x.weight_qtensor, y.weight_qtensor
        for field in ("data", "scale", "global_scale", "zeros", "nested_scale", "nested_offset"):
            tx, ty = getattr(wx, field), getattr(wy, field)
            assert (tx is None) == (ty is None), (name, field)
            if tx is not None:
                assert tx.dtype == ty.dtype and tx.shape == ty.shape, (name, field, tx.dtype, ty.dtype)
                assert torch.equal(_bits(tx), _bits(ty)), (name, field)
        for buf in ("bias", "input_global_scale"):
            tx, ty = getattr(x, buf), getattr(y, buf)
            assert (tx is None) == (ty is None), (name, buf)
            if tx is not None:
                assert torch.equal(_bits(tx), _bits(ty)), (name, buf)
        if params:
            assert wx.params.keys() == wy.params.keys() and wx.dtype == wy.dtype, name
    sa = {k: v for k, v in a.state_dict().items() if k.rpartition(".")[0] not in qa}
    sb = {k: v for k, v in b.state_dict().items() if k.rpartition(".")[0] not in qb}
    assert sa.keys() == sb.keys()
    for k, v in sa.items():
        assert torch.equal(_bits(v), _bits(sb[k])), k


@pytest.fixture(scope="module")
def llama():
    return _llama()


def _tree_hash(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


# ---------------------------------------------------------------------------------------------- round trips


@pytest.mark.parametrize("scheme", list(SCHEMES))
def test_round_trip_auto_format(tmp_path, llama, scheme):
    q = lowbit.quantize_model(copy.deepcopy(llama), scheme)
    out = lowbit.save_quantized(q, tmp_path / "ckpt")
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == {
        "compressed-tensors": "compressed-tensors", "bitsandbytes": "bitsandbytes", "fp8": "fp8", "lowbit": "lowbit",
    }[SCHEMES[scheme].checkpoint]  # fmt: skip
    back = lowbit.load_quantized(out)
    assert type(back) is type(llama) and type(back.lm_head) is torch.nn.Linear
    # ecosystem layouts do not record lowbit's format options (convention, rounding): compare tensors
    _assert_same_model(q, back, params=qc["quant_method"] in ("lowbit", "bitsandbytes"))
    with torch.no_grad():
        assert torch.equal(q(IDS).logits, back(IDS).logits)


@pytest.mark.parametrize(
    ("scheme", "fmt"),
    [
        ("w4a16-int4", "awq"),
        ("w4a16-int4", "gptq"),
        ("w8a8-fp8-block", "compressed-tensors"),
        *[(s, "lowbit") for s in SCHEMES],
    ],
)
def test_round_trip_explicit_format(tmp_path, llama, scheme, fmt):
    # AWQ/GPTQ configs hold one group size: every K a multiple of 128 so all layers get group 128
    model = _llama(hidden_size=128, intermediate_size=256) if fmt in ("awq", "gptq") else llama
    q = lowbit.quantize_model(copy.deepcopy(model), scheme)
    back = lowbit.load_quantized(lowbit.save_quantized(q, tmp_path / "c", format=fmt))
    _assert_same_model(q, back, params=fmt == "lowbit")


def test_modelopt_round_trip_with_calibration(tmp_path, llama):
    calib = [IDS, IDS.flip(-1)]
    q = lowbit.quantize_model(copy.deepcopy(llama), "w4a4-nvfp4", calibration=calib)
    out = lowbit.save_quantized(q, tmp_path / "mo", format="modelopt")
    hf = json.loads((out / "hf_quant_config.json").read_text())
    assert hf["quantization"]["quant_algo"] == "NVFP4" and hf["quantization"]["exclude_modules"] == [
        "lm_head"
    ]
    back = lowbit.load_quantized(out)
    for name, m in _qlinears(q).items():
        b = _qlinears(back)[name]
        assert b.scheme.name == "w4a4-nvfp4"
        assert torch.equal(b.weight_data, m.weight_data) and torch.equal(
            _bits(b.weight_scale), _bits(m.weight_scale)
        )
        # ModelOpt stores divisors (1/g): lowbit keeps ModelOpt's own product; within one ulp of the multiplier
        torch.testing.assert_close(b.weight_global_scale, m.weight_global_scale, rtol=2**-23, atol=0)
        torch.testing.assert_close(b.input_global_scale, m.input_global_scale, rtol=2**-23, atol=0)
    again = lowbit.load_quantized(lowbit.save_quantized(back, tmp_path / "mo2", format="modelopt"))
    _assert_same_model(back, again)


def test_mixed_schemes_and_int4_groups(tmp_path):
    m = _llama(intermediate_size=96)  # down_proj K = 96: int4 group 32
    lowbit.quantize_model(m, "w4a16-int4", skip=["*mlp*", "lm_head"])
    lowbit.quantize_model(m, "w4a16-nvfp4", skip=["*self_attn*", "lm_head"])
    assert m.model.layers[0].mlp.down_proj.scheme.name == "w4a16-nvfp4"
    with pytest.raises(ValueError, match="format 'awq' cannot store 3 layer.*AutoAWQ stores int4, not nvfp4"):
        lowbit.save_quantized(m, tmp_path / "x", format="awq")
    out = lowbit.save_quantized(
        m, tmp_path / "mixed"
    )  # int4 -> CT, nvfp4 -> CT: one CT checkpoint, two groups
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["format"] == "mixed-precision" and len(qc["config_groups"]) == 2
    _assert_same_model(m, lowbit.load_quantized(out), params=False)


def test_save_bf16_fp16_and_dtype_override(tmp_path):
    m = lowbit.quantize_model(_bert(), "w4a16-nf4")
    out = lowbit.save_quantized(m, tmp_path / "b")
    back = lowbit.load_quantized(out, dtype=torch.bfloat16)
    assert back.embeddings.word_embeddings.weight.dtype == torch.bfloat16
    q = back.encoder.layer[0].attention.self.query
    assert q.bias.dtype == torch.bfloat16 and q.weight_data.dtype == torch.uint8
    with torch.no_grad():
        y = back(input_ids=IDS).last_hidden_state
    assert y.dtype == torch.bfloat16


# ---------------------------------------------------------------------------------------------- configs


def test_compressed_tensors_configs_match_the_presets(tmp_path):
    from compressed_tensors.quantization import QuantizationConfig
    from compressed_tensors.quantization.quant_scheme import preset_name_to_scheme

    llama = _llama(hidden_size=128, intermediate_size=256)  # every K a multiple of 128: one int4 group size

    for name, s in SCHEMES.items():
        if s.checkpoint != "compressed-tensors":
            continue
        calib = [IDS] if s.static_act_scale else None
        q = lowbit.quantize_model(copy.deepcopy(llama), name, calibration=calib)
        out = lowbit.save_quantized(q, tmp_path / name)
        qc = json.loads((out / "config.json").read_text())["quantization_config"]
        parsed = QuantizationConfig.model_validate(qc)
        (group,) = parsed.config_groups.values()
        preset = preset_name_to_scheme(s.ct_preset, ["Linear"])
        want_w = preset.weights.model_dump()
        assert group.weights.model_dump() == want_w, name
        got_a = group.input_activations.model_dump() if group.input_activations else None
        assert got_a == (preset.input_activations.model_dump() if preset.input_activations else None), name
        assert parsed.ignore == ["lm_head"]


def test_transformers_parses_the_other_configs(tmp_path, llama):
    q = lowbit.quantize_model(copy.deepcopy(llama), "w4a16-nf4")
    qc = json.loads((lowbit.save_quantized(q, tmp_path / "bnb") / "config.json").read_text())[
        "quantization_config"
    ]
    want = transformers.BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        llm_int8_skip_modules=["lm_head"],
        bnb_4bit_compute_dtype=torch.bfloat16,
    ).to_dict()
    assert qc == want
    with pytest.raises(ValueError, match="one group size; these layers use \\[64, 128\\]"):
        lowbit.save_quantized(
            lowbit.quantize_model(copy.deepcopy(llama), "w4a16-int4"), tmp_path / "x", format="awq"
        )
    q = lowbit.quantize_model(_llama(hidden_size=128, intermediate_size=256), "w4a16-int4")
    qc = json.loads((lowbit.save_quantized(q, tmp_path / "awq", format="awq") / "config.json").read_text())
    awq = transformers.AwqConfig.from_dict(qc["quantization_config"])
    assert awq.group_size == 128 and awq.zero_point and awq.modules_to_not_convert == ["lm_head"]
    q = lowbit.quantize_model(copy.deepcopy(llama), "w8a8-fp8-block")
    qc = json.loads((lowbit.save_quantized(q, tmp_path / "fp8") / "config.json").read_text())[
        "quantization_config"
    ]
    fp8 = transformers.FineGrainedFP8Config.from_dict(qc)
    assert list(fp8.weight_block_size) == [128, 128] and fp8.modules_to_not_convert == ["lm_head"]
    assert {k: qc[k] for k in ("activation_scheme", "fmt", "quant_method", "weight_block_size")} == {
        "activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": [128, 128],
    }  # fmt: skip


def test_compressed_tensors_decompresses_our_checkpoint(tmp_path):
    """compressed-tensors' own compressors decode every tensor we write exactly as lowbit does."""
    llama = _llama(hidden_size=128, intermediate_size=256)
    from compressed_tensors.compressors.base import BaseCompressor
    from compressed_tensors.quantization import QuantizationScheme
    from safetensors.torch import load_file

    for name in ("w4a16-nvfp4", "w4a16-mxfp4", "w4a16-int4", "w8a8-mxfp8", "w4a4-nvfp4"):
        q = lowbit.quantize_model(copy.deepcopy(llama), name, calibration=[IDS] if "a4-nv" in name else None)
        out = lowbit.save_quantized(q, tmp_path / name)
        qc = json.loads((out / "config.json").read_text())["quantization_config"]
        (group,) = qc["config_groups"].values()
        scheme = QuantizationScheme.model_validate(group)
        comp = BaseCompressor.get_value_from_registry(qc["format"])
        sd = load_file(out / "model.safetensors")
        for mod_name, m in _qlinears(q).items():
            local = {
                k[len(mod_name) + 1 :]: v
                for k, v in sd.items()
                if k.startswith(mod_name + ".") and "bias" not in k
            }
            theirs = comp.decompress(local, scheme)["weight"]
            ours = m.dequantize_weight(theirs.dtype)
            assert torch.equal(_bits(theirs), _bits(ours)), (name, mod_name)


# ---------------------------------------------------------------------------------------------- files


def test_copies_tokenizer_and_module_files(tmp_path, llama):
    src = tmp_path / "src"
    llama.save_pretrained(src)
    (src / "tokenizer.json").write_text("{}")
    (src / "1_Pooling").mkdir()
    (src / "1_Pooling" / "config.json").write_text('{"pooling_mode_mean_tokens": true}')
    (src / "pytorch_model.bin").write_bytes(b"not copied")
    before = _tree_hash(src)
    q = lowbit.quantize_model(copy.deepcopy(llama), "w4a16-mxfp4")
    out = lowbit.save_quantized(q, tmp_path / "o", source_dir=src)
    names = {str(p.relative_to(out)) for p in out.rglob("*") if p.is_file()}
    assert {
        "tokenizer.json",
        "1_Pooling/config.json",
        "generation_config.json",
        "config.json",
        "model.safetensors",
    } <= names
    assert "pytorch_model.bin" not in names
    assert _tree_hash(src) == before


def test_atomic_write_leaves_nothing_on_crash(tmp_path, llama, monkeypatch):
    q = lowbit.quantize_model(copy.deepcopy(llama), "w4a16-nvfp4")
    real = io_files.save_safetensors
    calls = []

    def crash(tensors, path, metadata=None):
        calls.append(path)
        if len(calls) == 2:
            raise KeyboardInterrupt("simulated crash mid-write")
        return real(tensors, path, metadata)

    monkeypatch.setattr(io_files, "save_safetensors", crash)
    with pytest.raises(KeyboardInterrupt):
        lowbit.save_quantized(q, tmp_path / "out", max_shard_size="10KB")
    assert len(calls) == 2
    assert list(tmp_path.iterdir()) == []  # no out dir, no temp dir
    monkeypatch.setattr(io_files, "save_safetensors", real)
    out = lowbit.save_quantized(q, tmp_path / "out", max_shard_size="10KB")
    assert (out / "model.safetensors.index.json").is_file()
    _assert_same_model(q, lowbit.load_quantized(out), params=False)
    with pytest.raises(FileExistsError, match="already exists"):
        lowbit.save_quantized(q, out)
    q2 = lowbit.quantize_model(copy.deepcopy(llama), "w4a16-nf4")
    lowbit.save_quantized(q2, out, overwrite=True)
    assert (
        json.loads((out / "config.json").read_text())["quantization_config"]["quant_method"] == "bitsandbytes"
    )
    assert not (out / "model.safetensors.index.json").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


@pytest.fixture(scope="module")
def saved(tmp_path_factory, llama):
    d = tmp_path_factory.mktemp("saved") / "ckpt"
    return lowbit.save_quantized(lowbit.quantize_model(copy.deepcopy(llama), "w4a16-nvfp4"), d)


def _copy(saved, tmp_path) -> Path:
    d = tmp_path / "c"
    shutil.copytree(saved, d)
    return d


def test_truncated_and_corrupt_files(tmp_path, saved):
    d = _copy(saved, tmp_path)
    f = d / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match=r"model\.safetensors.*(truncated|corrupt)"):
        lowbit.load_quantized(d)
    f.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all")
    with pytest.raises(ValueError, match=r"model\.safetensors"):
        lowbit.load_quantized(d)
    f.write_bytes(b"")
    with pytest.raises(ValueError, match=r"model\.safetensors"):
        lowbit.load_quantized(d)


def test_missing_files(tmp_path, saved):
    with pytest.raises(FileNotFoundError, match="checkpoint directory not found"):
        lowbit.load_quantized(tmp_path / "nope")
    d = _copy(saved, tmp_path)
    (d / "config.json").unlink()
    with pytest.raises(FileNotFoundError, match=r"config\.json.*not found"):
        lowbit.load_quantized(d)
    d = _copy(saved, tmp_path / "b")
    (d / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="no model.safetensors"):
        lowbit.load_quantized(d)
    (d / "pytorch_model.bin").write_bytes(b"\x80\x04K\x01.")
    with pytest.raises(ValueError, match="never unpickles"):
        lowbit.load_quantized(d)


def test_missing_shard_and_bad_index(tmp_path, llama):
    q = lowbit.quantize_model(copy.deepcopy(llama), "w4a16-nvfp4")
    d = lowbit.save_quantized(q, tmp_path / "s", max_shard_size="10KB")
    index = json.loads((d / "model.safetensors.index.json").read_text())
    shard = max(set(index["weight_map"].values()))
    (d / shard).rename(tmp_path / "moved")
    with pytest.raises(FileNotFoundError, match=f"{shard}: shard listed in"):
        lowbit.load_quantized(d)
    (tmp_path / "moved").rename(d / shard)
    index["weight_map"]["model.extra"] = "../../etc/passwd"
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match="plain file name"):
        lowbit.load_quantized(d)
    index["weight_map"].pop("model.extra")
    key = next(k for k, v in index["weight_map"].items() if v == shard)
    index["weight_map"][key + ".ghost"] = shard
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match="missing from the file"):
        lowbit.load_quantized(d)


def test_config_errors(tmp_path, saved):
    d = _copy(saved, tmp_path)
    cfg = json.loads((d / "config.json").read_text())
    bad = dict(cfg, intermediate_size=96)
    (d / "config.json").write_text(json.dumps(bad))
    with pytest.raises(ValueError, match="do not match"):
        lowbit.load_quantized(d)
    (d / "config.json").write_text(json.dumps({k: v for k, v in cfg.items() if k != "quantization_config"}))
    with pytest.raises(ValueError, match="no quantization_config"):
        lowbit.load_quantized(d)
    (d / "config.json").write_text(json.dumps(dict(cfg, quantization_config={"quant_method": "hqq"})))
    with pytest.raises(ValueError, match="quant_method 'hqq' is not supported"):
        lowbit.load_quantized(d)
    (d / "config.json").write_text("{broken")
    with pytest.raises(ValueError, match=r"config\.json.*not valid JSON"):
        lowbit.load_quantized(d)
    qc = dict(cfg["quantization_config"])
    qc["config_groups"] = {
        "g": dict(qc["config_groups"]["group_0"], input_activations={"num_bits": 3, "type": "int"})
    }
    (d / "config.json").write_text(json.dumps(dict(cfg, quantization_config=qc)))
    with pytest.raises(ValueError, match="match no lowbit activation format"):
        lowbit.load_quantized(d)


def test_missing_tensor(tmp_path, saved):
    from safetensors.torch import load_file, save_file

    d = _copy(saved, tmp_path)
    sd = load_file(d / "model.safetensors")
    sd.pop("model.norm.weight")
    save_file(sd, d / "model.safetensors")
    with pytest.raises(ValueError, match=r"missing from the checkpoint.*model\.norm\.weight"):
        lowbit.load_quantized(d)


def test_save_errors(tmp_path, llama):
    with pytest.raises(ValueError, match="no QuantLinear"):
        lowbit.save_quantized(copy.deepcopy(llama), tmp_path / "x")
    q = lowbit.quantize_model(copy.deepcopy(llama), "w4a16-fp4b32")
    with pytest.raises(ValueError, match="compressed-tensors has no format for fp4_b32"):
        lowbit.save_quantized(q, tmp_path / "x", format="compressed-tensors")
    with pytest.raises(ValueError, match="format must be one of"):
        lowbit.save_quantized(q, tmp_path / "x", format="gguf")
    assert not (tmp_path / "x").exists()


# ---------------------------------------------------------------------------------------------- conversion


@pytest.fixture(scope="module")
def sharded_src(tmp_path_factory, llama):
    d = tmp_path_factory.mktemp("src") / "model"
    llama.save_pretrained(d, max_shard_size="20KB")
    (d / "tokenizer_config.json").write_text("{}")
    assert len(list(d.glob("*.safetensors"))) >= 3
    return d


@pytest.mark.parametrize("scheme", ["w4a16-nvfp4", "w4a16-int4", "w8a8-fp8-block"])
def test_convert_equals_quantize_model_and_save(tmp_path, llama, sharded_src, scheme):
    before = _tree_hash(sharded_src)
    out = lowbit.convert_checkpoint(sharded_src, tmp_path / "conv", scheme, progress=False)
    assert _tree_hash(sharded_src) == before  # sources never modified
    assert (out / "tokenizer_config.json").is_file() and (out / "model.safetensors.index.json").is_file()
    mem = lowbit.quantize_model(copy.deepcopy(llama), scheme)
    _assert_same_model(mem, lowbit.load_quantized(out), params=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["conv"]


def test_convert_resumes_per_shard(tmp_path, sharded_src, monkeypatch):
    import lowbit.io.convert as conv

    real = conv._convert_keys  # called once per piece of work: one per shard of this small model
    calls = []

    def crash_on_second(keys, *a, **kw):
        calls.append(keys[0])
        if len(calls) == 2:
            raise RuntimeError("simulated crash")
        return real(keys, *a, **kw)

    monkeypatch.setattr(conv, "_convert_keys", crash_on_second)
    with pytest.raises(RuntimeError, match="simulated crash"):
        lowbit.convert_checkpoint(sharded_src, tmp_path / "out", "w4a16-nf4", progress=False)
    assert not (tmp_path / "out").exists()
    (tmp_dir,) = [p for p in tmp_path.iterdir() if p.name.startswith(".out.lowbit-convert")]
    manifest = json.loads((tmp_dir / "progress.json").read_text())
    assert len(manifest["pieces"]) == 1

    counted = []

    def count(keys, *a, **kw):
        counted.append(keys[0])
        return real(keys, *a, **kw)

    monkeypatch.setattr(conv, "_convert_keys", count)
    out = lowbit.convert_checkpoint(sharded_src, tmp_path / "out", "w4a16-nf4", progress=True)
    n_shards = len(list(sharded_src.glob("*.safetensors")))
    assert len(counted) == n_shards - 1 and calls[0] not in counted
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    clean = lowbit.convert_checkpoint(sharded_src, tmp_path / "clean", "w4a16-nf4", progress=False)
    _assert_same_model(lowbit.load_quantized(clean), lowbit.load_quantized(out))


def test_convert_errors(tmp_path, llama, sharded_src, saved):
    with pytest.raises(ValueError, match="unknown scheme"):
        lowbit.convert_checkpoint(sharded_src, tmp_path / "o", "int3")
    with pytest.raises(ValueError, match="already quantized"):
        lowbit.convert_checkpoint(saved, tmp_path / "o", "w4a16-nf4")
    with pytest.raises(FileExistsError):
        lowbit.convert_checkpoint(sharded_src, saved, "w4a16-nf4")
    with pytest.raises(ValueError, match="no Linear weight .* can take scheme w4a16-int4"):
        lowbit.convert_checkpoint(sharded_src, tmp_path / "o", "w4a16-int4", skip=["*"])
    src = tmp_path / "odd"
    _llama(hidden_size=48, intermediate_size=128).save_pretrained(src)
    with pytest.warns(UserWarning, match=r"left unquantized.*not a multiple of 32"):
        out = lowbit.convert_checkpoint(src, tmp_path / "odd-out", "w4a16-mxfp4", progress=False)
    back = lowbit.load_quantized(out)
    assert isinstance(back.model.layers[0].mlp.down_proj, QuantLinear)
    assert type(back.model.layers[0].self_attn.q_proj) is torch.nn.Linear


@pytest.mark.parametrize("scheme", ["w4a16-nf4", "w4a4-nvfp4", "w4a16-fp4b32"])
def test_inspect_checkpoint(tmp_path, llama, scheme):
    from lowbit.io.inspection import inspect_checkpoint

    q = lowbit.quantize_model(copy.deepcopy(llama), scheme, calibration=[IDS])
    out = lowbit.save_quantized(q, tmp_path / "c")
    r = inspect_checkpoint(out)
    mods = _qlinears(q)
    assert set(r["modules"]) == set(mods)
    for name, info in r["modules"].items():
        assert info["scheme"] == scheme and info["shape"] == [mods[name].out_features, mods[name].in_features]
        assert info["bytes"] >= mods[name].weight_nbytes
        assert info["static_input_scale"] == (scheme == "w4a4-nvfp4")
    assert r["dense_bytes"] == sum(m.out_features * m.in_features * 2 for m in mods.values())
    assert 3 < r["dense_bytes"] / r["quantized_bytes"] < 4
    size = sum(p.stat().st_size for p in out.glob("*.safetensors"))
    assert r["total_bytes"] <= size < r["total_bytes"] + 20000  # the rest is the safetensors header
