"""convert_checkpoint writes each quantized tensor into its planned file in a background thread while it
quantizes the next: the bytes are the sequential writer's (any number of ranks, files split in parts or not,
pieces of one file converted by different ranks), a failed write fails the conversion with its own error and a
rerun resumes, the outputs waiting for the writer stay under max_shard_size, and an error in the compute loop
still joins the writer and leaves what was computed recorded for a rerun. CPU only."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest

import lowbit
import lowbit.io.convert as conv
import lowbit.io.convert_layout as layout
import lowbit.io.convert_plan as plan
import lowbit.io.convert_writer as writer
from lowbit.io.distributed import DistributedConvertError
from lowbit.testing import tree_digest, write_bare_blocks, write_tiny_llama

SCHEME = "w4a16-nvfp4"
WRITER = "lowbit-convert-writer"


def _writer_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith(WRITER)]


@pytest.fixture(scope="module")
def bare_src(tmp_path_factory) -> Path:
    """Four safetensors files of different sizes, no config.json (the name rules pick the Linears)."""
    return write_bare_blocks(tmp_path_factory.mktemp("bare") / "dit", (2, 3, 1, 2), seed=3)


@pytest.fixture(scope="module")
def llama_src(tmp_path_factory) -> Path:
    pytest.importorskip("transformers")
    d = write_tiny_llama(tmp_path_factory.mktemp("llama") / "model")
    return d


class _Saves:
    """writer.write_bytes, recording which thread wrote into which file (and slowed down when asked)."""

    def __init__(self, monkeypatch, delay: float = 0.0) -> None:
        self.real, self.delay, self.calls = writer.write_bytes, delay, []
        monkeypatch.setattr(writer, "write_bytes", self)

    def __call__(self, path, fd, offset, data):
        self.calls.append((threading.current_thread().name, path.name))
        time.sleep(self.delay)
        self.real(path, fd, offset, data)


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
@pytest.mark.parametrize("piece_bytes", [layout.PIECE_BYTES, 20_000])  # a piece per shard; several per shard
def test_overlapped_writes_give_the_sequential_bytes(tmp_path, bare_src, monkeypatch, world_size, limit,
                                                     piece_bytes):
    monkeypatch.setattr(layout, "PIECE_BYTES", piece_bytes)
    saves = _Saves(monkeypatch)
    monkeypatch.setattr(conv, "_OVERLAP_WRITES", False)
    assert _convert(bare_src, tmp_path / "ref", max_shard_size=limit) == [None]
    assert saves.calls and all(not name.startswith(WRITER) for name, _ in saves.calls)  # really sequential
    ref = tree_digest(tmp_path / "ref")
    if limit == "5KB":
        assert sum("-part" in f for f in ref) > 4  # shards written in several parts

    saves.calls.clear()
    monkeypatch.setattr(conv, "_OVERLAP_WRITES", True)
    assert _convert(bare_src, tmp_path / "out", world_size, max_shard_size=limit) == [None] * world_size
    assert saves.calls and all(name.startswith(WRITER) for name, _ in saves.calls)  # really in the background
    assert tree_digest(tmp_path / "out") == ref
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "ref"]
    assert _writer_threads() == []
    if world_size > 1 and piece_bytes < layout.PIECE_BYTES:  # the ranks shared files, not just the shard list
        writers: dict[str, set[str]] = {}
        for thread, name in saves.calls:
            writers.setdefault(name, set()).add(thread)
        assert any(len(w) > 1 for w in writers.values())


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
    ref = tree_digest(tmp_path / "ref")
    assert "model.safetensors.index.json" in ref and "config.json" in ref
    assert tree_digest(tmp_path / "out") == ref


# ------------------------------------------------------------------------------------------ a failed write


@pytest.mark.parametrize("failing", ["part-1", "part-3"])  # a write followed by more compute; the last write
def test_failed_write_fails_the_conversion_and_a_rerun_resumes(tmp_path, bare_src, monkeypatch, failing):
    monkeypatch.setattr(conv, "_OVERLAP_WRITES", False)
    ref = tree_digest(lowbit.convert_checkpoint(bare_src, tmp_path / "ref", SCHEME, progress=False))
    monkeypatch.setattr(conv, "_OVERLAP_WRITES", True)
    saves = _Saves(monkeypatch)

    def broken(path, fd, offset, data):
        saves.calls.append((threading.current_thread().name, path.name))
        if path.name.startswith(f".{failing}."):
            raise OSError(f"no space left writing {path.name}")
        saves.real(path, fd, offset, data)

    monkeypatch.setattr(writer, "write_bytes", broken)
    out = tmp_path / "out"
    with pytest.raises(OSError, match=rf"no space left writing \.{failing}\.part00000"):
        lowbit.convert_checkpoint(bare_src, out, SCHEME, progress=False)
    assert not out.exists()
    assert _writer_threads() == []
    tmp = tmp_path / ".out.lowbit-convert.tmp"
    recorded = {s["source"] for s in json.loads((tmp / "progress.json").read_text())["pieces"].values()}
    before = {f"part-{i}.safetensors" for i in range(int(failing[-1]))}
    assert recorded == before  # every shard before the failed one, nothing after it

    converted = []
    real = conv._convert_keys

    def count(keys, source, *a, **kw):
        converted.append(source.files[keys[0]].name)
        return real(keys, source, *a, **kw)

    monkeypatch.setattr(writer, "write_bytes", saves.real)
    monkeypatch.setattr(conv, "_convert_keys", count)
    lowbit.convert_checkpoint(bare_src, out, SCHEME, progress=False)
    assert converted == [f"part-{i}.safetensors" for i in range(4) if f"part-{i}.safetensors" not in before]
    assert tree_digest(out) == ref
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "ref"]


def test_failed_write_on_one_rank_fails_every_rank(tmp_path, bare_src, monkeypatch):
    real = writer.write_bytes

    def broken(path, fd, offset, data):
        if "rank 1/2" in threading.current_thread().name:  # rank 1's writer thread
            raise OSError("disk on fire")
        real(path, fd, offset, data)

    monkeypatch.setattr(writer, "write_bytes", broken)
    out = tmp_path / "out"
    errors = _convert(bare_src, out, 2)
    assert isinstance(errors[1], OSError) and "disk on fire" in str(errors[1])
    assert isinstance(errors[0], DistributedConvertError) and "rank 1 failed: OSError: disk on fire" in str(errors[0])
    assert not out.exists() and _writer_threads() == []
    monkeypatch.setattr(writer, "write_bytes", real)
    monkeypatch.setattr(conv, "_OVERLAP_WRITES", False)
    assert _convert(bare_src, out, 3) == [None] * 3  # the rerun (sequential writes, three ranks) completes
    monkeypatch.setattr(conv, "_OVERLAP_WRITES", True)
    ref = lowbit.convert_checkpoint(bare_src, tmp_path / "ref", SCHEME, progress=False)
    assert tree_digest(out) == tree_digest(ref)


# ------------------------------------------------------------------------------- bounded pending writes


def test_pending_writes_stay_under_max_shard_size_and_overlap_compute(tmp_path, bare_src, monkeypatch):
    limit = 5_000
    pending, computed_while_writing, largest = [], [], [0]
    state = {"writing": False}
    real_submit = writer.TensorWriter._submit

    def submit(self, job, nbytes):
        real_submit(self, job, nbytes)
        largest[0] = max(largest[0], nbytes)
        with self._cond:  # handed over and not yet written, counting the one just handed over
            pending.append(self._pending)

    saves = _Saves(monkeypatch, delay=0.005)

    def slow_write(path, fd, offset, data):
        state["writing"] = True
        try:
            saves(path, fd, offset, data)
        finally:
            state["writing"] = False

    real_convert = conv._convert_keys

    def watched(*a, **kw):
        for item in real_convert(*a, **kw):
            computed_while_writing.append(state["writing"])
            yield item

    monkeypatch.setattr(writer.TensorWriter, "_submit", submit)
    monkeypatch.setattr(writer, "write_bytes", slow_write)
    monkeypatch.setattr(conv, "_convert_keys", watched)
    lowbit.convert_checkpoint(bare_src, tmp_path / "out", SCHEME, progress=False, max_shard_size=limit)
    assert len(saves.calls) > 8 and all(name.startswith(WRITER) for name, _ in saves.calls)
    assert 0 < largest[0] <= limit
    assert max(pending) <= limit  # never more than max_shard_size of output waiting
    assert max(pending) > largest[0]  # but more than one tensor: the writer fell behind and the loop went on
    assert any(computed_while_writing)  # the compute loop did run while a tensor was being written


# ------------------------------------------------------------------------------ compute fails, write pending


@pytest.mark.parametrize("error", [RuntimeError, KeyboardInterrupt])
def test_compute_error_while_a_write_is_pending_joins_the_writer(tmp_path, bare_src, monkeypatch, error):
    monkeypatch.setattr(conv, "_OVERLAP_WRITES", False)
    ref = tree_digest(lowbit.convert_checkpoint(bare_src, tmp_path / "ref", SCHEME, progress=False))
    monkeypatch.setattr(conv, "_OVERLAP_WRITES", True)
    started, release = threading.Event(), threading.Event()
    tmp = tmp_path / ".out.lowbit-convert.tmp"
    real_write, real_abort = writer.write_bytes, writer.TensorWriter.abort

    def slow_write(path, fd, offset, data):
        started.set()
        release.wait(30)  # still writing when the compute loop fails: released once the writer is being joined
        real_write(path, fd, offset, data)

    def abort(self, err):
        assert not (tmp / "progress.json").exists()  # the first piece is pending when the writer is joined
        release.set()
        return real_abort(self, err)

    real_convert, calls = conv._convert_keys, []

    def failing(keys, source, *a, **kw):
        calls.append(source.files[keys[0]].name)
        if len(calls) == 2:
            assert started.wait(10)  # the first shard's writes are pending
            raise error("compute failed")
        return real_convert(keys, source, *a, **kw)

    monkeypatch.setattr(writer, "write_bytes", slow_write)
    monkeypatch.setattr(writer.TensorWriter, "abort", abort)
    monkeypatch.setattr(conv, "_convert_keys", failing)
    out = tmp_path / "out"
    with pytest.raises(error, match="compute failed"):
        lowbit.convert_checkpoint(bare_src, out, SCHEME, progress=False)
    assert release.is_set() and _writer_threads() == []  # joined: the pending writes were completed
    assert not out.exists()
    manifest = json.loads((tmp / "progress.json").read_text())
    assert [s["source"] for s in manifest["pieces"].values()] == ["part-0.safetensors"]

    calls.clear()

    def count(keys, source, *a, **kw):
        calls.append(source.files[keys[0]].name)
        return real_convert(keys, source, *a, **kw)

    monkeypatch.setattr(writer, "write_bytes", real_write)
    monkeypatch.setattr(writer.TensorWriter, "abort", real_abort)
    monkeypatch.setattr(conv, "_convert_keys", count)
    lowbit.convert_checkpoint(bare_src, out, SCHEME, progress=False)
    assert calls == ["part-1.safetensors", "part-2.safetensors", "part-3.safetensors"]  # part-0 was kept
    assert tree_digest(out) == ref


def test_compute_error_and_a_failed_pending_write_raise_the_compute_error(tmp_path, bare_src, monkeypatch):
    started = threading.Event()

    def broken(path, fd, offset, data):
        started.set()
        time.sleep(0.2)
        raise OSError("write failed")

    real_convert, calls = conv._convert_keys, []

    def failing(*a, **kw):
        calls.append(1)
        if len(calls) == 2:
            started.wait(10)
            raise RuntimeError("compute failed")
        return real_convert(*a, **kw)

    monkeypatch.setattr(writer, "write_bytes", broken)
    monkeypatch.setattr(conv, "_convert_keys", failing)
    with pytest.raises(RuntimeError, match="compute failed") as info:
        lowbit.convert_checkpoint(bare_src, tmp_path / "out", SCHEME, progress=False)
    assert any("pending background write failed too: OSError: write failed" in n
               for n in getattr(info.value, "__notes__", []))
    assert _writer_threads() == [] and not (tmp_path / "out").exists()
