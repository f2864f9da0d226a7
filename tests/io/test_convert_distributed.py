"""convert_checkpoint on several ranks: the output directory is byte for byte the single-process one for any
number of ranks (threads meeting through the file barrier, spawned processes in a gloo group and without one),
a failed or killed rank publishes nothing and a rerun (with any number of ranks) resumes, and bad rank
arguments are refused. CPU only."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest
import torch

import lowbit
from lowbit.io import distributed as dist_io
from lowbit.io.distributed import DistributedConvertError, assign_runs, resolve_world
from lowbit.testing import tree_digest, write_bare_blocks, write_tiny_llama

transformers = pytest.importorskip("transformers")

SCHEME = "w4a16-nvfp4"  # fused q/k/v and gate/up share a global scale: siblings in other ranks' shards


@pytest.fixture(scope="module")
def llama_src(tmp_path_factory) -> Path:
    d = write_tiny_llama(tmp_path_factory.mktemp("llama") / "model")
    (d / "tokenizer_config.json").write_text("{}")
    assert len(list(d.glob("*.safetensors"))) >= 6
    return d


@pytest.fixture(scope="module")
def bare_src(tmp_path_factory) -> Path:
    """Three safetensors files of different sizes, no config.json (the name rules pick the Linears)."""
    return _bare(tmp_path_factory.mktemp("bare") / "dit", (1, 3, 2))


def _bare(d: Path, blocks: tuple[int, ...]) -> Path:
    """Files ``part-<i>.safetensors`` of ``blocks[i]`` transformer blocks each."""
    return write_bare_blocks(d, blocks, seed=1)


@pytest.fixture(scope="module")
def refs(tmp_path_factory, llama_src, bare_src) -> dict[str, dict[str, str]]:
    """The single-process conversions' files and digests."""
    out = tmp_path_factory.mktemp("refs")
    return {
        "llama": tree_digest(lowbit.convert_checkpoint(llama_src, out / "llama", SCHEME, progress=False)),
        "bare": tree_digest(lowbit.convert_checkpoint(bare_src, out / "bare", SCHEME, progress=False)),
    }


@pytest.fixture(autouse=True)
def _one_skeleton_at_a_time(monkeypatch):
    """transformers builds a model under a process-wide default dtype that it sets and restores: two threads
    doing so at once can leave it at bfloat16 for the rest of the session. Real ranks are processes; the ranks
    on threads here take turns for that step."""
    import lowbit.io.convert_plan as plan

    lock, real = threading.Lock(), plan.build_skeleton

    def one_at_a_time(*a, **kw):
        with lock:
            return real(*a, **kw)

    monkeypatch.setattr(plan, "build_skeleton", one_at_a_time)
    yield
    assert torch.get_default_dtype() == torch.float32


def _threads(world_size: int, fn) -> list[BaseException | None]:
    """``fn(rank)`` on a thread per rank (named ``rank<r>``); each rank's exception or None."""
    errors: list[BaseException | None] = [None] * world_size

    def run(r: int) -> None:
        try:
            fn(r)
        except BaseException as e:  # noqa: BLE001
            errors[r] = e

    threads = [threading.Thread(target=run, args=(r,), name=f"rank{r}") for r in range(world_size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    return errors


def _siblings(d: Path) -> list[str]:
    return sorted(p.name for p in d.iterdir())


# ---------------------------------------------------------------------------------------------- the plan


def _best_largest_run(sizes: list[int], world: int) -> int:
    """The smallest largest run of any cut into at most ``world`` contiguous runs, by brute force."""
    import itertools

    best = sum(sizes)
    for cuts in itertools.combinations(range(1, len(sizes)), min(world - 1, len(sizes) - 1)):
        bounds = [0, *cuts, len(sizes)]
        best = min(best, max(sum(sizes[a:b]) for a, b in itertools.pairwise(bounds)))
    return best


def test_assign_runs_cuts_contiguous_runs_with_the_smallest_largest_load():
    sizes = [("a", 5), ("b", 5), ("c", 9), ("d", 1), ("e", 4)]
    assert assign_runs(sizes, 1) == dict.fromkeys("abcde", 0)
    assert assign_runs(sizes, 2) == {"a": 0, "b": 0, "c": 1, "d": 1, "e": 1}  # 10 and 14
    assert assign_runs(sizes, 3) == {"a": 0, "b": 0, "c": 1, "d": 1, "e": 2}  # 10, 10, 4: largest 10 at best
    got = assign_runs(sizes, 7)  # more ranks than items: some idle, runs still in order
    assert list(got.values()) == sorted(got.values()) and max(got.values()) < 7
    assert assign_runs([("a", 0), ("b", 0)], 2) == {"a": 0, "b": 0}
    assert assign_runs([], 3) == {}
    g = torch.Generator().manual_seed(0)
    for world in range(1, 6):
        for _ in range(20):
            n_items = int(torch.randint(1, 9, (1,), generator=g))
            items = [(f"p{i}", int(n)) for i, n in enumerate(torch.randint(0, 1000, (n_items,), generator=g))]
            owner = assign_runs(items, world)
            ranks = [owner[name] for name, _ in items]
            assert ranks == sorted(ranks) and all(0 <= r < world for r in ranks)  # contiguous, in order
            largest = max(sum(n for name, n in items if owner[name] == r) for r in range(world))
            assert largest == _best_largest_run([n for _, n in items], world), (world, items, owner)


def test_resolve_world_from_arguments_and_torchrun_env(monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    assert resolve_world() == dist_io.World()
    assert resolve_world(2, 3) == dist_io.World(rank=2, size=3, local_rank=2)
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert resolve_world() == dist_io.World(rank=3, size=4, local_rank=1)
    # not the environment's rank, so not its LOCAL_RANK either
    assert resolve_world(0, 2) == dist_io.World(rank=0, size=2, local_rank=0)
    assert dist_io.rank_device(None, resolve_world()) == torch.device("cpu")
    assert dist_io.rank_device(["cpu", "cpu:0", "cpu", "meta"], resolve_world()) == torch.device("meta")
    monkeypatch.setenv("WORLD_SIZE", "four")
    with pytest.raises(ValueError, match="WORLD_SIZE must be an integer"):
        resolve_world()
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "4")
    with pytest.raises(ValueError, match="RANK must satisfy"):
        resolve_world()


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"rank": 0}, ValueError, "rank and world_size go together"),
        ({"world_size": 2}, ValueError, "rank and world_size go together"),
        ({"rank": 2, "world_size": 2}, ValueError, r"0 <= rank < world_size \(2\)"),
        ({"rank": -1, "world_size": 2}, ValueError, "0 <= rank < world_size"),
        ({"rank": 0, "world_size": 0}, ValueError, "world_size must be at least 1"),
        ({"rank": True, "world_size": 2}, TypeError, "rank must be an int"),
        ({"rank": 0, "world_size": 2.0}, TypeError, "world_size must be an int"),
        ({"rank": 0, "world_size": 2, "device": ["cpu"]}, ValueError, r"one per rank \(2\), got 1"),
        ({"rank": 0, "world_size": 2, "device": ["cpu", "nowhere"]}, ValueError, "device must name a torch device"),
        ({"timeout": 0}, ValueError, "timeout must be a positive"),
        ({"timeout": float("nan")}, ValueError, "timeout must be a positive"),
        ({"timeout": "5"}, TypeError, "timeout must be a number"),
    ],
)
def test_bad_rank_arguments(tmp_path, bare_src, kwargs, error, match):
    with pytest.raises(error, match=match):
        lowbit.convert_checkpoint(bare_src, tmp_path / "o", SCHEME, progress=False, **kwargs)
    assert _siblings(tmp_path) == []  # refused before anything is written


# ------------------------------------------------------------------------------------ byte-identical output


@pytest.mark.parametrize("world_size", [1, 2, 3, 5])
@pytest.mark.parametrize("which", ["llama", "bare"])
def test_ranks_on_threads_write_the_single_process_bytes(tmp_path, llama_src, bare_src, refs, which, world_size):
    src = llama_src if which == "llama" else bare_src
    before = tree_digest(src)
    out = tmp_path / "out"
    errors = _threads(world_size, lambda r: lowbit.convert_checkpoint(
        src, out, SCHEME, progress=False, rank=r, world_size=world_size, device=["cpu"] * world_size, timeout=30))
    assert errors == [None] * world_size
    assert tree_digest(out) == refs[which]
    assert _siblings(tmp_path) == ["out"]  # no temp or sync directory left
    assert tree_digest(src) == before


def _spawn(world_size: int, phases: list, tmp_path: Path, die: tuple[int, int] | None = None) -> list:
    """Run ``_convert_ranks.rank_main`` in a spawned process per rank; (exit codes, each rank's job errors)."""
    from _convert_ranks import rank_main

    store = dist_io.host_store(world_size)
    report = str(tmp_path / "report")
    procs = dist_io.spawn_workers(
        rank_main, range(world_size),
        lambda r: (r, world_size, store.port, phases, report, die[1] if die and die[0] == r else None),
    )
    codes = dist_io.stop_workers(procs, wait_s=240)
    results = []
    for r in range(world_size):
        p = Path(f"{report}.rank{r}.json")
        results.append(json.loads(p.read_text()) if p.exists() else None)
    return codes, results


def _job(src, out, **kw):
    return {"src_dir": str(src), "out_dir": str(out), "scheme": SCHEME, "device": "cpu", **kw}


def test_spawned_ranks_in_a_gloo_group_and_through_files(tmp_path, bare_src, refs):
    """Two processes: in a gloo group, then with no group (file barrier). The bare folder only: a process
    converting it never imports transformers (seconds per process); the Llama runs on the thread ranks above."""
    phases = [(True, [_job(bare_src, tmp_path / "group")]), (False, [_job(bare_src, tmp_path / "files", timeout=60)])]
    codes, results = _spawn(2, phases, tmp_path)
    assert codes == [0, 0] and results == [[None, None]] * 2, results
    assert tree_digest(tmp_path / "group") == refs["bare"]
    assert tree_digest(tmp_path / "files") == refs["bare"]
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def test_three_spawned_ranks_in_a_gloo_group(tmp_path, bare_src, refs):
    codes, results = _spawn(3, [(True, [_job(bare_src, tmp_path / "bare")])], tmp_path)
    assert codes == [0, 0, 0] and results == [[None]] * 3, results
    assert tree_digest(tmp_path / "bare") == refs["bare"]


_GROUP_THREADS_SCRIPT = """
import os, sys, time
from lowbit.io import distributed as d

def gloo_threads():
    names = []
    for t in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{t}/comm") as f:
                names.append(f.read().strip())
        except OSError:
            pass
    return [n for n in names if "gloo" in n]

if sys.argv[1] == "without":
    d.import_before_group = lambda: None
store = d.host_store(1)
d.join_group(0, 1, store.port)
during = gloo_threads()
import torch._dynamo  # a conversion imports it after the group exists (its meta-device probe)
d.leave_group()
for _ in range(100 if sys.argv[1] == "with" else 0):  # a thread told to stop may take a moment to leave /proc
    if not gloo_threads():
        break
    time.sleep(0.05)
print(len(during), len(gloo_threads()), flush=True)
os._exit(0)  # a group left alive may abort the interpreter's shutdown: the very failure checked here
"""


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="lists the process's threads through /proc")
def test_leaving_the_group_ends_its_threads(tmp_path):
    """A group that outlives its ranks' work aborted them at exit (a gloo thread freeing a work object while
    the interpreter shut down): leaving it must end its threads, also after torch._dynamo was imported with
    the group in place, as every conversion does. Without the early imports the threads stay (checked too,
    so the check can fail)."""
    import os
    import subprocess
    import sys

    script = tmp_path / "group_threads.py"
    script.write_text(_GROUP_THREADS_SCRIPT)
    env = {**os.environ, "PYTHONPATH": str(Path(lowbit.__file__).resolve().parents[1])}
    got = {}
    for mode in ("with", "without"):
        p = subprocess.run([sys.executable, str(script), mode], check=False, capture_output=True, text=True,
                           timeout=300, env=env)
        assert p.returncode == 0, p.stderr
        got[mode] = tuple(int(v) for v in p.stdout.split())
    assert got["with"][0] > 0 and got["with"][1] == 0, got
    assert got["without"][1] > 0, got


# --------------------------------------------------------------------------------------- failures, resume


def test_killed_rank_publishes_nothing_and_a_rerun_resumes(tmp_path, monkeypatch):
    # small output files: a shard's output is written in parts, so the killed rank leaves some behind
    limit = "5KB"
    bare_src = _bare(tmp_path / "src", (2, 1, 1))  # rank 0: part-0; rank 1: part-1, then part-2
    ref = tree_digest(lowbit.convert_checkpoint(bare_src, tmp_path / "ref", SCHEME, progress=False,
                                                max_shard_size=limit))
    out = tmp_path / "out"
    (tmp_path / "r").mkdir()
    # rank 1 dies in the middle of its second shard; rank 0 notices its silence (5 s: rank 0's one shard may be
    # done before a loaded machine has started rank 1, which must not count as silence here)
    codes, results = _spawn(2, [(False, [_job(bare_src, out, timeout=5, max_shard_size=limit)])], tmp_path / "r",
                            die=(1, 1))
    assert codes[1] == 9 and results[1] is None
    assert codes[0] == 0 and "rank 1 failed: silent for 5 s" in results[0][0], results
    assert "DistributedConvertError" in results[0][0]
    assert not out.exists()  # nothing at out_dir, so nothing there loads
    (tmp,) = [p for p in tmp_path.iterdir() if p.name.startswith(".out.")]
    assert tmp.name == ".out.lowbit-convert.tmp"  # the sync directory is gone, the shards stay for a rerun
    assert list(tmp.glob(".part-2.part*.safetensors"))  # what the killed rank had written of its shard
    progress = {p.name: json.loads(p.read_text()) for p in tmp.glob("progress.rank*.json")}
    assert {s["source"] for s in progress["progress.rank1.json"]["pieces"].values()} == {"part-1.safetensors"}

    # the rerun, on one process, converts only the shard not yet finished
    import lowbit.io.convert as conv

    real, converted = conv._convert_keys, []

    def count(keys, *a, **kw):
        converted.append(keys[0])
        return real(keys, *a, **kw)

    monkeypatch.setattr(conv, "_convert_keys", count)
    lowbit.convert_checkpoint(bare_src, out, SCHEME, progress=False, max_shard_size=limit)
    assert [k.split(".")[1] for k in converted] == ["2"]  # part-2's tensors are blocks.2.*
    assert tree_digest(out) == ref
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "r", "ref", "src"]


def test_failed_rank_fails_every_rank_and_a_rerun_resumes(tmp_path, bare_src, refs, monkeypatch):
    import lowbit.io.convert as conv

    real = conv._convert_keys

    def fail_on_rank1(*a, **kw):
        if threading.current_thread().name == "rank1":
            raise OSError("disk on fire")
        return real(*a, **kw)

    monkeypatch.setattr(conv, "_convert_keys", fail_on_rank1)
    out = tmp_path / "out"
    errors = _threads(2, lambda r: lowbit.convert_checkpoint(bare_src, out, SCHEME, progress=False, rank=r,
                                                             world_size=2, timeout=30))
    assert isinstance(errors[1], OSError)  # the failing rank raises its own error
    assert isinstance(errors[0], DistributedConvertError)
    assert "rank 1 failed: OSError: disk on fire" in str(errors[0]) and "nothing was published" in str(errors[0])
    assert not out.exists()
    monkeypatch.setattr(conv, "_convert_keys", real)
    errors = _threads(3, lambda r: lowbit.convert_checkpoint(bare_src, out, SCHEME, progress=False, rank=r,
                                                             world_size=3, timeout=30))
    assert errors == [None] * 3
    assert tree_digest(out) == refs["bare"]
    assert _siblings(tmp_path) == ["out"]


def test_ranks_given_different_arguments_publish_nothing(tmp_path, bare_src, refs):
    out = tmp_path / "out"
    errors = _threads(2, lambda r: lowbit.convert_checkpoint(
        bare_src, out, SCHEME if r == 0 else "w8a8-fp8-block", progress=False, rank=r, world_size=2, timeout=30))
    assert all(isinstance(e, DistributedConvertError) for e in errors), errors
    assert "convert another source, scheme or options" in str(errors[0])
    assert not out.exists()
    # rank 1's shards of the other scheme are replaced by a rerun, and cleared away before publishing
    with pytest.warns(UserWarning, match="files of another conversion"):
        errors = _threads(2, lambda r: lowbit.convert_checkpoint(bare_src, out, SCHEME, progress=False, rank=r,
                                                                 world_size=2, timeout=30))
    assert errors == [None, None]
    assert tree_digest(out) == refs["bare"]


def test_a_rank_that_never_starts_times_out(tmp_path, bare_src):
    with pytest.raises(DistributedConvertError, match=r"rank 1 failed: silent for 0.5 s .*nothing was published"):
        lowbit.convert_checkpoint(bare_src, tmp_path / "out", SCHEME, progress=False, rank=0, world_size=2,
                                  timeout=0.5)
    assert [p.name for p in tmp_path.iterdir()] == [".out.lowbit-convert.tmp"]  # the finished shards, for a rerun
    with pytest.raises(DistributedConvertError, match="rank 0 silent for 0.5 s"):
        lowbit.convert_checkpoint(bare_src, tmp_path / "out", SCHEME, progress=False, rank=1, world_size=2,
                                  timeout=0.5)
    assert not (tmp_path / "out").exists()


def test_existing_output_is_refused_on_every_rank(tmp_path, bare_src):
    out = tmp_path / "out"
    out.mkdir()
    errors = _threads(2, lambda r: lowbit.convert_checkpoint(bare_src, out, SCHEME, progress=False, rank=r,
                                                             world_size=2, timeout=30))
    assert all(isinstance(e, FileExistsError) for e in errors), errors
    assert list(out.iterdir()) == []
