"""convert_checkpoint on folders no transformers model describes: a diffusers folder (``_class_name``) and a bare
folder of safetensors files. Tensor-name/shape rules, include/exclude, bounded memory, loading with model=,
and lowbit inspect."""

from __future__ import annotations

import copy
import importlib
import json
import threading
import time
import weakref

import pytest
import torch
from safetensors.torch import save_file

import lowbit
from lowbit.bench.offload import WanStack
from lowbit.eval.checkpoint_info import inspect_checkpoint as inspect_headers
from lowbit.io import files as io_files
from lowbit.io.rules import DEFAULT_EXCLUDE, check_patterns, matches
from lowbit.nn import QuantLinear

convert_module = importlib.import_module("lowbit.io.convert")
convert_writer = importlib.import_module("lowbit.io.convert_writer")


def _wan(seed=0) -> WanStack:
    torch.manual_seed(seed)
    m = WanStack(dim=64, ffn_dim=128, heads=4, n_blocks=2).to(torch.bfloat16).eval()
    m.odd = torch.nn.Linear(40, 64).to(torch.bfloat16)  # K=40: no 32-block fits
    return m


def _write(model, folder, *, config: dict | None, files: int = 1):
    folder.mkdir(parents=True)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    keys = sorted(state)
    chunks = [keys[i::files] for i in range(files)]
    for i, chunk in enumerate(chunks):
        name = "diffusion_pytorch_model.safetensors" if files == 1 else f"part-{i}.safetensors"
        save_file({k: state[k] for k in chunk}, str(folder / name))
    if config is not None:
        (folder / "config.json").write_text(json.dumps(config))
    return folder


WAN_CONFIG = {"_class_name": "WanTransformer3DModel", "_diffusers_version": "0.35.0", "num_layers": 2}
QUANTIZED = {f"blocks.{i}.{m}" for i in range(2) for m in (
    "attn1.to_q", "attn1.to_k", "attn1.to_v", "attn1.to_out.0", "attn2.to_q", "attn2.to_k", "attn2.to_v",
    "attn2.to_out.0", "ffn.net.0.proj", "ffn.net.2")}  # fmt: skip


def _qlinears(model):
    return {n: m for n, m in model.named_modules() if isinstance(m, QuantLinear)}


@pytest.mark.parametrize("kind", ["diffusers", "bare"])
def test_convert_without_transformers_model(tmp_path, kind):
    model = _wan()
    src = _write(model, tmp_path / "src", config=WAN_CONFIG if kind == "diffusers" else None,
                 files=1 if kind == "diffusers" else 3)
    before = {p.name: p.read_bytes() for p in src.iterdir()}
    with pytest.warns(UserWarning, match=r"odd \[64, 40\].*not a multiple of 32"):
        out = lowbit.convert_checkpoint(src, tmp_path / "out", "w4a16-mxfp4", progress=False, device="cpu")
    assert {p.name: p.read_bytes() for p in src.iterdir()} == before  # the source is only read
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["quantization_config"]["quant_method"] == "compressed-tensors"
    if kind == "diffusers":
        assert cfg["_class_name"] == "WanTransformer3DModel" and "model_type" not in cfg
    else:
        assert cfg["dtype"] == "bfloat16"
    # no transformers model: load_quantized needs the module
    with pytest.raises(ValueError, match="no model_type"):
        lowbit.load_quantized(out)
    loaded = lowbit.load_quantized(out, model=_wan(seed=1))
    assert set(_qlinears(loaded)) == QUANTIZED  # norms, embeddings, time_proj, proj_out, odd K left alone
    ref = lowbit.quantize_model(copy.deepcopy(model), "w4a16-mxfp4", skip=())
    ref_q = _qlinears(ref)
    for name, m in _qlinears(loaded).items():
        a, b = m.weight_qtensor, ref_q[name].weight_qtensor
        assert torch.equal(a.data, b.data) and torch.equal(a.scale.view(torch.uint8), b.scale.view(torch.uint8))
    x, ctx, t = torch.randn(1, 8, 64).bfloat16(), torch.randn(1, 4, 64).bfloat16(), torch.randn(1, 64).bfloat16()
    ref_only = copy.deepcopy(model)
    for name, m in ref_q.items():
        if name in QUANTIZED:
            parent, _, child = name.rpartition(".")
            setattr(ref_only.get_submodule(parent), child, m)
    assert torch.equal(loaded(x, ctx, t), ref_only(x, ctx, t))
    info = inspect_headers(out)
    assert info["quantized_layers"] == len(QUANTIZED) and set(info["formats"]) >= {"mxfp4"}


def test_include_exclude(tmp_path):
    src = _write(_wan(), tmp_path / "src", config=WAN_CONFIG)
    out = lowbit.convert_checkpoint(src, tmp_path / "a", "w4a16-nvfp4", progress=False, device="cpu",
                                    include=r"re:^blocks\.0\.", exclude="*.ffn.*")
    names = set(_qlinears(lowbit.load_quantized(out, model=_wan())))
    assert names == {n for n in QUANTIZED if n.startswith("blocks.0.") and ".ffn." not in n}
    # include replaces the default name rules: time_proj is quantized when asked for
    out = lowbit.convert_checkpoint(src, tmp_path / "b", "w4a16-nvfp4", progress=False, device="cpu",
                                    include=["time_proj"])
    assert set(_qlinears(lowbit.load_quantized(out, model=_wan()))) == {"time_proj"}
    with pytest.raises(ValueError, match="include: 're:\\(' is not a valid regular expression"):
        lowbit.convert_checkpoint(src, tmp_path / "c", "w4a16-nvfp4", include="re:(")
    with pytest.raises(TypeError, match="exclude must hold module-name patterns"):
        lowbit.convert_checkpoint(src, tmp_path / "c", "w4a16-nvfp4", exclude=[3])
    with pytest.raises(ValueError, match="no Linear weight .* name rules"):
        lowbit.convert_checkpoint(src, tmp_path / "c", "w4a16-nvfp4", include="nothing*", progress=False)
    assert not (tmp_path / "c").exists()


def test_rules_units():
    assert matches("blocks.3.attn1.to_q", ["blocks.*.attn1.*"]) and not matches("blocks.3.ffn", ["re:attn"])
    assert matches("condition_embedder.time_embedder.linear_1", DEFAULT_EXCLUDE)
    assert matches("proj_out", DEFAULT_EXCLUDE) and not matches("single_blocks.0.proj_out", DEFAULT_EXCLUDE)
    assert check_patterns(None, "x") == () and check_patterns("a", "x") == ("a",)
    with pytest.raises(ValueError, match="x: an empty pattern"):
        check_patterns([""], "x")


@pytest.mark.parametrize("overlap", [False, True], ids=["inline-writes", "background-writer"])
def test_convert_memory_is_bounded(tmp_path, monkeypatch, overlap):
    """A folder 15x larger than max_shard_size converts holding at most the outputs waiting for the writer (at
    most max_shard_size) + the tensors in flight (the documented bound is max_shard_size + twice the largest
    tensor; how much of it is reached depends on how fast the writer thread runs, so the bound, not the
    timing, is what is checked)."""
    monkeypatch.setattr(convert_module, "_OVERLAP_WRITES", overlap)
    if overlap:  # a slow disk: the writer falls behind and the outputs wait for it
        real_write = convert_writer.write_bytes

        def slow_write(*args, **kwargs):
            time.sleep(0.002)
            return real_write(*args, **kwargs)

        monkeypatch.setattr(convert_writer, "write_bytes", slow_write)
    torch.manual_seed(0)
    state = {}
    for i in range(24):
        state[f"blocks.{i}.ffn.weight"] = torch.randn(64, 256)  # 64 KiB fp32 each, quantized
        state[f"blocks.{i}.norm.weight"] = torch.randn(16384)  # 64 KiB each, passed through
    src = tmp_path / "src"
    src.mkdir()
    save_file(state, str(src / "model.safetensors"))
    total = sum(t.numel() * t.element_size() for t in state.values())
    del state
    limit, largest = 200_000, 64 * 1024

    live: dict[int, int] = {}
    peak = [0]
    lock = threading.Lock()  # the writer thread drops the tensors of the files it wrote
    real_get = io_files.TensorSource.get
    real_read_into = io_files.TensorSource.read_into

    def forget(key):
        with lock:
            live.pop(key, None)

    def track(t):
        with lock:
            live[id(t)] = t.numel() * t.element_size()
            peak[0] = max(peak[0], sum(live.values()))
        weakref.finalize(t, forget, id(t))
        return t

    reads = []

    def tracked_read_into(self, key, out, pool=None):
        reads.append(key)
        # the buffer itself is what stays alive: track it, not only the view returned
        real_read_into(self, key, out, pool)
        track(out)
        return out.view(self.span(key).dtype).view(self.span(key).shape)

    monkeypatch.setattr(io_files.TensorSource, "get", lambda self, key: track(real_get(self, key)))
    monkeypatch.setattr(io_files.TensorSource, "read_into", tracked_read_into)
    out = lowbit.convert_checkpoint(src, tmp_path / "out", "w4a16-nf4", progress=False, device="cpu",
                                    max_shard_size=limit)
    assert total > 5 * (limit + 2 * largest)
    assert len(reads) == 24  # the Linear weights come through the positional reads, tracked too
    bound = limit + 2 * largest
    assert 0 < peak[0] <= bound, (peak[0], bound)
    parts = sorted(p.name for p in out.glob("*.safetensors"))
    assert len(parts) > 5 and all("-part" in p for p in parts) and (out / "model.safetensors.index.json").is_file()

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = torch.nn.ModuleList()
            for _ in range(24):
                b = torch.nn.Module()
                b.ffn = torch.nn.Linear(256, 64, bias=False)
                b.norm = torch.nn.Module()
                b.norm.weight = torch.nn.Parameter(torch.empty(16384))
                self.blocks.append(b)

    monkeypatch.setattr(io_files.TensorSource, "get", real_get)
    loaded = lowbit.load_quantized(out, model=Net())
    assert len(_qlinears(loaded)) == 24
