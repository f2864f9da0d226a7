"""convert_checkpoint writes each finished output file in a background thread while it quantizes the next: the
bytes are the sequential writer's (any number of ranks, files split in parts or not), a failed write fails the
conversion with its own error and a rerun resumes, at most one write is pending, and an error in the compute
loop still joins the writer and leaves what was computed recorded for a rerun. CPU only."""

from __future__ import annotations

import hashlib
import json
import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

import lowbit
import lowbit.io.convert as conv
import lowbit.io.convert_plan as plan
import lowbit.io.convert_writer as writer
from lowbit.io.distributed import DistributedConvertError

SCHEME = "w4a16-nvfp4"
WRITER = "lowbit-convert-writer"


def _tree(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def _writer_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith(WRITER)]


@pytest.fixture(scope="module")
def bare_src(tmp_path_factory) -> Path:
    """Four safetensors files of different sizes, no config.json (the name rules pick the Linears)."""
    g = torch.Generator().manual_seed(3)
    d = tmp_path_factory.mktemp("bare") / "dit"
    d.mkdir()
    for i, n_blocks in enumerate((2, 3, 1, 2)):
        t = {}
        for b in range(n_blocks):
            for name in ("attn1.to_q", "attn1.to_k", "attn1.to_v", "ffn.net.0.proj"):
                t[f"blocks.{i}.{b}.{name}.weight"] = torch.randn(64, 64, generator=g).to(torch.bfloat16)
            t[f"blocks.{i}.{b}.norm1.weight"] = torch.ones(64)
        save_file(t, str(d / f"part-{i}.safetensors"))
    return d


@pytest.fixture(scope="module")
def llama_src(tmp_path_factory) -> Path:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False,
    )  # fmt: skip
    model = transformers.LlamaForCausalLM._from_config(cfg, dtype=torch.bfloat16)
    d = tmp_path_factory.mktemp("llama") / "model"
    model.save_pretrained(d, max_shard_size="20KB")
    return d


class _Saves:
    """writer.save_safetensors, recording which thread wrote which file (and slowed down when asked)."""

    def __init__(self, monkeypatch, delay: float = 0.0) -> None:
        self.real, self.delay, self.calls = writer.save_safetensors, delay, []
        monkeypatch.setattr(writer, "save_safetensors", self)

    def __call__(self, tensors, path, metadata=None):
        self.calls.append((threading.current_thread().name, path.name))
        time.sleep(self.delay)
        self.real(tensors, path, metadata)


def _convert(src, out, world_size=1, **kw):
    """convert_checkpoint on ``world_size`` ranks (threads when more than one); each rank's error or None."""
    if world_size == 1:
        lowbit.convert_checkpoint(src, out, SCHEME, progress=False, **kw)
        return [None]
    errors: list[BaseException | None] = [None] * world_size

    def run(r: int) -> None:
        try:
            lowbit.convert_checkpoint(src, out, SCHEME, progress=False, rank=r, world_size=world_size, timeout=60,
                                      **kw)
        except BaseException as e:  # noqa: BLE001 - checked by the test
            errors[r] = e

    threads = [threading.Thread(target=run, args=(r,), name=f"rank{r}") for r in range(world_size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    return errors


# ------------------------------------------------------------------------------------------ the same bytes


@pytest.mark.parametrize("world_size", [1, 2, 3])
@pytest.mark.parametrize("limit", ["5GB", "5KB"])  # one file per shard; numbered parts
def test_overlapped_writes_give_the_sequential_bytes(tmp_path, bare_src, monkeypatch, world_size, limit):
    saves = _Saves(monkeypatch)
    monkeypatch.setattr(conv, "_OVERLAP_WRITES", False)
    assert _convert(bare_src, tmp_path / "ref", max_shard_size=limit) == [None]
    assert saves.calls and all(not name.startswith(WRITER) for name, _ in saves.calls)  # really sequential
    ref = _tree(tmp_path / "ref")
    if limit == "5KB":
        assert sum("-part" in f for f in ref) > 4  # shards written in several parts

    saves.calls.clear()
    monkeypatch.setattr(conv, "_OVERLAP_WRITES", True)
    assert _convert(bare_src, tmp_path / "out", world_size, max_shard_size=limit) == [None] * world_size
    assert saves.calls and all(name.startswith(WRITER) for name, _ in saves.calls)  # really in the background
    assert _tree(tmp_path / "out") == ref
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "ref"]
    assert _writer_threads() == []


@pytest.mark.parametrize("world_size", [1, 2])
def test_overlapped_writes_give_the_sequential_bytes_for_a_transformers_model(tmp_path, llama_src, monkeypatch,
                                                                               world_size):
    lock, real = threading.Lock(), plan.build_skeleton

    def one_at_a_time(*a, **kw):  # transformers' default-dtype switch is process-wide: rank threads take turns
        with lock:
            return real(*a, **kw)

    monkeypatch.setattr(plan, "build_skeleton", one_at_a_time)
    monkeypatch.setattr(conv, "_OVERLAP_WRITES", False)
    _convert(llama_src, tmp_path / "ref")
    monkeypatch.setattr(conv, "_OVERLAP_WRITES", True)
    assert _convert(llama_src, tmp_path / "out", world_size) == [None] * world_size
    ref = _tree(tmp_path / "ref")
    assert "model.safetensors.index.json" in ref and "config.json" in ref
    assert _tree(tmp_path / "out") == ref


# ------------------------------------------------------------------------------------------ a failed write


@pytest.mark.parametrize("failing", ["part-1", "part-3"])  # a write followed by more compute; the last write
def test_failed_write_fails_the_conversion_and_a_rerun_resumes(tmp_path, bare_src, monkeypatch, failing):
    monkeypatch.setattr(conv, "_OVERLAP_WRITES", False)
    ref = _tree(lowbit.convert_checkpoint(bare_src, tmp_path / "ref", SCHEME, progress=False))
    monkeypatch.setattr(conv, "_OVERLAP_WRITES", True)
    saves = _Saves(monkeypatch)

    def broken(tensors, path, metadata=None):
        saves.calls.append((threading.current_thread().name, path.name))
        if path.name.startswith(f".{failing}."):
            raise OSError(f"no space left writing {path.name}")
        saves.real(tensors, path, metadata)

    monkeypatch.setattr(writer, "save_safetensors", broken)
    out = tmp_path / "out"
    with pytest.raises(OSError, match=rf"no space left writing \.{failing}\.part00000"):
        lowbit.convert_checkpoint(bare_src, out, SCHEME, progress=False)
    assert not out.exists()
    assert _writer_threads() == []
    tmp = tmp_path / ".out.lowbit-convert.tmp"
    recorded = {s["source"] for s in json.loads((tmp / "progress.json").read_text())["shards"].values()}
    before = {f"part-{i}.safetensors" for i in range(int(failing[-1]))}
    assert recorded == before  # every shard before the failed one, nothing after it

    converted = []
    real = conv._convert_shard

    def count(keys, source, *a, **kw):
        converted.append(source.files[keys[0]].name)
        return real(keys, source, *a, **kw)

    monkeypatch.setattr(writer, "save_safetensors", saves.real)
    monkeypatch.setattr(conv, "_convert_shard", count)
    lowbit.convert_checkpoint(bare_src, out, SCHEME, progress=False)
    assert converted == [f"part-{i}.safetensors" for i in range(4) if f"part-{i}.safetensors" not in before]
    assert _tree(out) == ref
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "ref"]


def test_failed_write_on_one_rank_fails_every_rank(tmp_path, bare_src, monkeypatch):
    owner = conv.assign_shards({f.name: f.stat().st_size for f in sorted(bare_src.glob("*.safetensors"))}, 2)
    victim = next(n for n, r in owner.items() if r == 1).removesuffix(".safetensors")
    real = writer.save_safetensors

    def broken(tensors, path, metadata=None):
        if path.name.startswith(f".{victim}."):
            raise OSError("disk on fire")
        real(tensors, path, metadata)

    monkeypatch.setattr(writer, "save_safetensors", broken)
    out = tmp_path / "out"
    errors = _convert(bare_src, out, 2)
    assert isinstance(errors[1], OSError) and "disk on fire" in str(errors[1])
    assert isinstance(errors[0], DistributedConvertError) and "rank 1 failed: OSError: disk on fire" in str(errors[0])
    assert not out.exists() and _writer_threads() == []
    monkeypatch.setattr(writer, "save_safetensors", real)
    monkeypatch.setattr(conv, "_OVERLAP_WRITES", False)
    assert _convert(bare_src, out, 3) == [None] * 3  # the rerun (sequential writes, three ranks) completes
    monkeypatch.setattr(conv, "_OVERLAP_WRITES", True)
    assert _tree(out) == _tree(lowbit.convert_checkpoint(bare_src, tmp_path / "ref", SCHEME, progress=False))


# ------------------------------------------------------------------------------------- one pending write


def test_at_most_one_write_is_pending_and_writes_overlap_compute(tmp_path, bare_src, monkeypatch):
    lock = threading.Lock()
    state = {"handed": 0, "finished": 0, "writing": False}
    outstanding, computed_while_writing = [], []
    real_submit = writer.ShardWriter.submit

    def submit(self, fn, *args):
        def job(*a):
            try:
                return fn(*a)
            finally:
                with lock:
                    state["finished"] += 1

        real_submit(self, job, *args)
        with lock:  # handed over and not yet written, counting the one just handed over
            state["handed"] += 1
            outstanding.append(state["handed"] - state["finished"])

    saves = _Saves(monkeypatch, delay=0.05)

    def slow_save(tensors, path, metadata=None):
        state["writing"] = True
        try:
            saves(tensors, path, metadata)
        finally:
            state["writing"] = False

    real_convert = conv._convert_shard

    def watched(*a, **kw):
        for item in real_convert(*a, **kw):
            computed_while_writing.append(state["writing"])
            yield item

    monkeypatch.setattr(writer.ShardWriter, "submit", submit)
    monkeypatch.setattr(writer, "save_safetensors", slow_save)
    monkeypatch.setattr(conv, "_convert_shard", watched)
    lowbit.convert_checkpoint(bare_src, tmp_path / "out", SCHEME, progress=False, max_shard_size="5KB")
    assert len(outstanding) == len(saves.calls) > 8
    assert max(outstanding) == 1  # never a second file waiting behind the one being written
    assert state["handed"] == state["finished"]
    assert any(computed_while_writing)  # the compute loop did run while a file was being written


# ------------------------------------------------------------------------------ compute fails, write pending


@pytest.mark.parametrize("error", [RuntimeError, KeyboardInterrupt])
def test_compute_error_while_a_write_is_pending_joins_the_writer(tmp_path, bare_src, monkeypatch, error):
    monkeypatch.setattr(conv, "_OVERLAP_WRITES", False)
    ref = _tree(lowbit.convert_checkpoint(bare_src, tmp_path / "ref", SCHEME, progress=False))
    monkeypatch.setattr(conv, "_OVERLAP_WRITES", True)
    started, finished, release = threading.Event(), threading.Event(), threading.Event()
    real_save, real_abort = writer.save_safetensors, writer.ShardWriter.abort

    def slow_save(tensors, path, metadata=None):
        started.set()
        release.wait(30)  # still writing when the compute loop fails: released once the writer is being joined
        real_save(tensors, path, metadata)
        finished.set()

    def abort(self, err):
        assert not finished.is_set()  # the write is pending when the converting thread joins the writer
        release.set()
        return real_abort(self, err)

    real_convert, calls = conv._convert_shard, []

    def failing(keys, source, *a, **kw):
        calls.append(source.files[keys[0]].name)
        if len(calls) == 2:
            assert started.wait(10) and not finished.is_set()  # the first shard's write is pending
            raise error("compute failed")
        return real_convert(keys, source, *a, **kw)

    monkeypatch.setattr(writer, "save_safetensors", slow_save)
    monkeypatch.setattr(writer.ShardWriter, "abort", abort)
    monkeypatch.setattr(conv, "_convert_shard", failing)
    out = tmp_path / "out"
    with pytest.raises(error, match="compute failed"):
        lowbit.convert_checkpoint(bare_src, out, SCHEME, progress=False)
    assert finished.is_set() and _writer_threads() == []  # joined: the pending write was completed
    assert not out.exists()
    tmp = tmp_path / ".out.lowbit-convert.tmp"
    manifest = json.loads((tmp / "progress.json").read_text())
    assert [s["source"] for s in manifest["shards"].values()] == ["part-0.safetensors"]

    calls.clear()

    def count(keys, source, *a, **kw):
        calls.append(source.files[keys[0]].name)
        return real_convert(keys, source, *a, **kw)

    monkeypatch.setattr(writer, "save_safetensors", real_save)
    monkeypatch.setattr(writer.ShardWriter, "abort", real_abort)
    monkeypatch.setattr(conv, "_convert_shard", count)
    lowbit.convert_checkpoint(bare_src, out, SCHEME, progress=False)
    assert calls == ["part-1.safetensors", "part-2.safetensors", "part-3.safetensors"]  # part-0 was kept
    assert _tree(out) == ref


def test_compute_error_and_a_failed_pending_write_raise_the_compute_error(tmp_path, bare_src, monkeypatch):
    started = threading.Event()

    def broken(tensors, path, metadata=None):
        started.set()
        time.sleep(0.2)
        raise OSError("write failed")

    real_convert, calls = conv._convert_shard, []

    def failing(*a, **kw):
        calls.append(1)
        if len(calls) == 2:
            started.wait(10)
            raise RuntimeError("compute failed")
        return real_convert(*a, **kw)

    monkeypatch.setattr(writer, "save_safetensors", broken)
    monkeypatch.setattr(conv, "_convert_shard", failing)
    with pytest.raises(RuntimeError, match="compute failed") as info:
        lowbit.convert_checkpoint(bare_src, tmp_path / "out", SCHEME, progress=False)
    assert any("pending background write failed too: OSError: write failed" in n
               for n in getattr(info.value, "__notes__", []))
    assert _writer_threads() == [] and not (tmp_path / "out").exists()
