"""Ranks of a multi-process checkpoint conversion: which rank this is, which pieces of work it converts, on
which device, and how the ranks meet when their work is done.

:func:`lowbit.convert_checkpoint` with ``world_size > 1`` (given, or read from an initialized
``torch.distributed`` process group, or from torchrun's ``RANK``/``WORLD_SIZE``/``LOCAL_RANK``) splits the
pieces of the source shards over the ranks (:func:`assign_runs`), each rank writes its tensors into the
shared files of the one temp directory, and rank 0 alone writes the index and config and publishes once every
rank is done.

The ranks meet twice: after their work (each says whether it succeeded) and after rank 0 published (rank 0
says whether it did). With a process group this is two collectives (:class:`GroupSync`; gloo works on CPU).
Without one the ranks meet through small files in a hidden directory next to the output, ``.<out
name>.lowbit-convert.sync.tmp`` (:class:`FileSync`): every rank rewrites its own state file there every
``beat`` seconds, so a rank that was killed or never started is noticed after ``timeout`` seconds of silence
rather than waited for forever. Files left by an earlier, killed run cannot be taken for this run's: each rank
draws a fresh random nonce, rank 0 accepts a rank's state only when it echoes rank 0's nonce, and a rank
accepts rank 0's outcome only when it lists the rank's own nonce.

:func:`spawn_workers` starts ranks as processes of their own (the ``spawn`` start method) joined in a gloo
process group whose store the caller hosts; ``lowbit quantize --devices`` and the throughput benchmark use it.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import math
import os
import shutil
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

DEFAULT_TIMEOUT = 300.0
"""Seconds a rank may stay silent (file barrier) before the others give up on it."""

SYNC_TAG = "convert.sync"


class DistributedConvertError(RuntimeError):
    """Another rank of a multi-process conversion failed or stopped answering; nothing was published."""


@dataclass(frozen=True)
class World:
    """Where this process stands in a conversion: ``rank`` of ``size`` processes, ``local_rank`` on its host
    (picks the default CUDA device), and whether an initialized process group spans exactly these ranks."""

    rank: int = 0
    size: int = 1
    local_rank: int = 0
    group: bool = False


def _env_int(name: str) -> int | None:
    text = os.environ.get(name)
    if text is None or not text.strip():
        return None
    try:
        return int(text)
    except ValueError:
        raise ValueError(
            f"environment variable {name} must be an integer (as torchrun sets it), got {text!r}"
        ) from None


def _group_world() -> tuple[int, int] | None:
    """(rank, world size) of the initialized default process group, None without one."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return None


def resolve_world(rank: int | None = None, world_size: int | None = None) -> World:
    """This process's :class:`World`: ``rank``/``world_size`` when given (both or neither), else the
    initialized ``torch.distributed`` process group's, else torchrun's ``RANK``/``WORLD_SIZE`` environment
    variables, else a single process. TypeError/ValueError naming the argument for anything else."""
    if (rank is None) != (world_size is None):
        raise ValueError(f"rank and world_size go together: give both or neither (got rank={rank!r}, "
                         f"world_size={world_size!r})")
    for name, value in (("rank", rank), ("world_size", world_size)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    group = _group_world()
    env_rank, env_size = _env_int("RANK"), _env_int("WORLD_SIZE")
    if rank is not None:
        if world_size < 1:
            raise ValueError(f"world_size must be at least 1, got {world_size}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank must satisfy 0 <= rank < world_size ({world_size}), got {rank}")
        if group is not None and group != (rank, world_size):
            raise ValueError(
                f"rank={rank}, world_size={world_size} differ from the initialized torch.distributed process "
                f"group's rank {group[0]} of {group[1]}: leave them out to use the group, or convert outside it"
            )
        in_group = group is not None
    elif group is not None:
        rank, world_size = group
        in_group = True
    elif env_size is not None:
        if env_size < 1:
            raise ValueError(f"environment variable WORLD_SIZE must be at least 1, got {env_size}")
        if env_rank is None and env_size > 1:
            raise ValueError(f"environment variable WORLD_SIZE is {env_size} but RANK is not set (torchrun sets both)")
        rank, world_size = env_rank or 0, env_size
        if not 0 <= rank < world_size:
            raise ValueError(
                f"environment variable RANK must satisfy 0 <= RANK < WORLD_SIZE ({world_size}), got {rank}"
            )
        in_group = False
    else:
        return World()
    local = _env_int("LOCAL_RANK")
    # LOCAL_RANK belongs to this rank only when the environment describes the same rank
    if local is None or (env_rank is not None and env_rank != rank) or local < 0:
        local = rank
    return World(rank=rank, size=world_size, local_rank=local, group=in_group and world_size > 1)


def rank_device(device: Any, world: World) -> torch.device:
    """The device ``world.rank`` quantizes on: ``device`` (one for every rank, or a list/tuple indexed by
    rank), else ``cuda:<local rank>`` when CUDA is available (plain ``cuda`` for a single process), else cpu."""
    from .checkpoint import parse_device

    if isinstance(device, (list, tuple)):
        if len(device) != world.size:
            raise ValueError(f"device: a list of devices needs one per rank ({world.size}), got {len(device)}")
        devices = [parse_device(d) for d in device]  # all checked, so every rank fails alike
        return devices[world.rank]
    if device is not None:
        return parse_device(device)
    if not torch.cuda.is_available():
        return torch.device("cpu")
    if world.size == 1:
        return torch.device("cuda")
    return torch.device("cuda", world.local_rank % torch.cuda.device_count())


def on_device(dev: torch.device):
    """Make ``dev`` the current CUDA device for the block: Triton kernels launch on the current device, not
    on their tensors' device."""
    if dev.type == "cuda" and dev.index is not None:
        return torch.cuda.device(dev)
    return contextlib.nullcontext()


def assign_runs(sizes: Sequence[tuple[str, int]], world_size: int) -> dict[str, int]:
    """``{name: rank}`` for the ``(name, bytes)`` items of ``sizes`` in their order, cut into at most
    ``world_size`` contiguous runs, rank ``r`` taking the ``r``-th: the cut whose largest run is smallest (so
    no rank holds more than an equal share plus one item), found by bisecting on that largest load with a greedy
    fill; every rank computes the same assignment from the same items.

    Pieces of work in file order thus give each rank files of its own (two ranks share at most the file at a
    cut): the ranks' writes do not queue on one file's lock (tmpfs and ext4 take a per-file lock for a
    buffered write), and the fsync after a piece flushes the rank's own writes."""

    def runs(bound: int) -> list[int] | None:
        ranks, rank, load = [], 0, 0
        for _, n in sizes:
            if load + n > bound and load > 0:
                rank, load = rank + 1, 0
            if rank >= world_size:
                return None
            ranks.append(rank)
            load += n
        return ranks

    total = sum(n for _, n in sizes)
    lo = max([-(-total // world_size), *(n for _, n in sizes)]) if sizes else 0
    hi = max(lo, total)
    while lo < hi:
        mid = (lo + hi) // 2
        if runs(mid) is None:
            lo = mid + 1
        else:
            hi = mid
    return dict(zip((name for name, _ in sizes), runs(lo) or [], strict=True))


def check_timeout(timeout: Any) -> float:
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
        raise TypeError(f"timeout must be a number of seconds, got {type(timeout).__name__}")
    if not math.isfinite(timeout) or timeout <= 0:
        raise ValueError(f"timeout must be a positive finite number of seconds, got {timeout!r}")
    return float(timeout)


def check_statuses(statuses: Sequence[dict | None], world: World) -> str | None:
    """None when every rank succeeded on the same conversion, else a message naming the ranks that did not."""
    problems = []
    idents = {}
    for r, s in enumerate(statuses):
        if s is None:
            problems.append(f"rank {r} sent no status")
        elif s.get("world_size") != world.size:
            problems.append(f"rank {r} runs with world_size {s.get('world_size')}, rank 0 with {world.size}")
        elif not s.get("ok"):
            problems.append(f"rank {r} failed: {s.get('error')}")
        else:
            idents[r] = s.get("ident")
    if not problems and len(set(idents.values())) > 1:
        odd = [r for r, i in idents.items() if i != idents.get(0)]
        problems.append(f"rank(s) {odd} convert another source, scheme or options than rank 0 (every rank must "
                        "be given the same arguments)")
    return "; ".join(problems) or None


# ------------------------------------------------------------------------------------------- process group


class GroupSync:
    """The meeting points over the initialized ``torch.distributed`` process group (collectives)."""

    def __init__(self, world: World, device: torch.device) -> None:
        import torch.distributed as dist

        self.world = world
        backend = str(dist.get_backend())
        # NCCL moves objects through the current CUDA device; gloo (also under a mixed backend) through the CPU
        self.cuda = "nccl" in backend and "gloo" not in backend
        self.device = (device if device.type == "cuda" else torch.device("cuda", torch.cuda.current_device())
                       ) if self.cuda else None

    def start(self) -> None:
        pass

    def _ctx(self):
        return torch.cuda.device(self.device) if self.cuda else contextlib.nullcontext()

    def exchange(self, status: dict) -> list[dict | None]:
        import torch.distributed as dist

        out: list[Any] = [None] * self.world.size
        with self._ctx():
            dist.all_gather_object(out, status)
        return out

    def outcome(self, value: dict | None) -> dict:
        import torch.distributed as dist

        box = [value]
        with self._ctx():
            dist.broadcast_object_list(box, src=0, device=self.device)
        return box[0]

    def close(self) -> None:
        pass


# -------------------------------------------------------------------------------------------- file barrier


def _read_state(path: Path) -> dict | None:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _write_state(path: Path, data: dict) -> None:
    # temp + rename so a reader never sees half a file; no fsync: these files only live while the ranks do
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.tmp")
    tmp.write_text(json.dumps(data), encoding="utf-8")
    os.replace(tmp, path)


class FileSync:
    """The meeting points through state files in ``directory`` (see the module docstring).

    Rank ``r`` owns ``rank{r}.json``: its nonce, the rank-0 nonce it has seen (``ack``), its state
    (``working``, then ``done`` with its status), and ``beat``, the time of its last rewrite. Rank 0's file
    also carries the outcome and the nonces of the ranks it answers.
    """

    def __init__(self, directory: Path, world: World, timeout: float = DEFAULT_TIMEOUT) -> None:
        self.dir = Path(directory)
        self.world = world
        self.timeout = timeout
        self.beat = max(0.02, min(1.0, timeout / 10))
        self.nonce = uuid.uuid4().hex
        self.state: dict[str, Any] = {"rank": world.rank, "world_size": world.size, "nonce": self.nonce,
                                      "ack": None, "state": "working", "beat": 0.0}
        self.acks: dict[str, str] = {}  # rank 0: the nonces of the ranks whose state it took
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _path(self, rank: int) -> Path:
        return self.dir / f"rank{rank}.json"

    def _save(self, **changes: Any) -> None:
        with self._lock:
            if self._stop.is_set() and changes.get("state") != "left":
                return
            self.state.update(changes)
            self.state["beat"] = time.time()
            if self.world.rank != 0:
                # echo the nonce of rank 0's current file: rank 0 takes this rank's state only with its own
                head = _read_state(self._path(0))
                if head is not None and isinstance(head.get("nonce"), str):
                    self.state["ack"] = head["nonce"]
            with contextlib.suppress(OSError):
                _write_state(self._path(self.world.rank), self.state)

    def _heartbeat(self) -> None:
        while not self._stop.wait(self.beat):
            self._save()

    def start(self) -> None:
        self._save()
        self._thread = threading.Thread(target=self._heartbeat, name=f"lowbit-convert-beat-{self.world.rank}",
                                        daemon=True)
        self._thread.start()

    def _silent(self, state: dict | None, since: float) -> float:
        """Seconds the owner of ``state`` has been silent, counted from ``since`` at the earliest."""
        beat = state.get("beat") if state is not None else None
        last = max(since, beat) if isinstance(beat, (int, float)) else since
        return time.time() - last

    def exchange(self, status: dict) -> list[dict | None] | None:
        """Record this rank's ``status``; rank 0 waits for every rank's and returns them (a rank silent for
        ``timeout`` seconds gets a failed status), the others return None at once."""
        self._save(state="done", status=status)
        if self.world.rank != 0:
            return None
        out: list[dict | None] = [status] + [None] * (self.world.size - 1)
        self.acks = {}
        since = time.time()
        waiting = set(range(1, self.world.size))
        n = 0
        while waiting:
            for r in sorted(waiting):
                s = _read_state(self._path(r))
                if s is not None and s.get("ack") == self.nonce and s.get("state") == "done":
                    out[r] = s.get("status") if isinstance(s.get("status"), dict) else None
                    self.acks[str(r)] = s.get("nonce")
                    waiting.discard(r)
                elif self._silent(s, since) > self.timeout:
                    out[r] = {"ok": False, "world_size": self.world.size,
                              "error": f"silent for {self.timeout:g} s (killed, or never started with this "
                                       f"rank?); its state file is {self._path(r)}"}
                    waiting.discard(r)
            n += 1
            if waiting:
                time.sleep(min(0.25, 0.01 * n))
        return out

    def outcome(self, value: dict | None) -> dict:
        """Rank 0: announce ``value`` to the ranks it heard from, wait until they have read it, clean up.
        The others: wait for rank 0's outcome (DistributedConvertError after ``timeout`` s of silence)."""
        since = time.time()
        n = 0
        if self.world.rank == 0:
            self._save(outcome=value, acks=self.acks)
            pending = dict(self.acks)
            while pending:
                for r, nonce in list(pending.items()):
                    s = _read_state(self._path(int(r)))
                    if s is None or s.get("nonce") != nonce or s.get("state") == "left":
                        del pending[r]
                    elif self._silent(s, since) > self.timeout:
                        del pending[r]  # gone without a word: its answer was written, nothing to wait for
                n += 1
                if pending:
                    time.sleep(min(0.25, 0.01 * n))
            self.close()
            shutil.rmtree(self.dir, ignore_errors=True)
            return value
        while True:
            head = _read_state(self._path(0))
            acks = head.get("acks") if head is not None else None
            if isinstance(acks, dict) and acks.get(str(self.world.rank)) == self.nonce and "outcome" in head:
                result = head["outcome"]
                break
            if self._silent(head, since) > self.timeout:
                self.close()
                raise DistributedConvertError(
                    f"convert_checkpoint rank {self.world.rank}: rank 0 silent for {self.timeout:g} s (killed, or "
                    f"never started?); nothing is published, the finished shards stay for a rerun"
                )
            n += 1
            time.sleep(min(0.25, 0.01 * n))
        self._stop.set()
        self._save(state="left")
        with contextlib.suppress(OSError):
            self._path(self.world.rank).unlink()
        return result if isinstance(result, dict) else {"ok": False, "error": "rank 0 sent no outcome"}

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)


# ------------------------------------------------------------------------------------------- spawned ranks


def host_store(world_size: int, timeout_s: float = 600.0):
    """A TCPStore on 127.0.0.1 (a free port) that spawned ranks join with :func:`join_group`; keep it alive
    until they are done."""
    import torch.distributed as dist

    return dist.TCPStore("127.0.0.1", 0, None, is_master=True, wait_for_workers=False,
                         timeout=datetime.timedelta(seconds=timeout_s))


GROUP_TIMEOUT = datetime.timedelta(hours=6)
"""Collective timeout of the groups lowbit starts: a rank may wait that long for slower ranks' shards (a rank
that dies is noticed at once: gloo sees its connection close)."""


WORLD_CAPTURING_MODULES = (
    "torch.distributed.nn.functional",
    "torch.distributed.fsdp.sharded_grad_scaler",
    "torch.distributed.optim.zero_redundancy_optimizer",
)
"""torch modules whose functions take ``group=dist.group.WORLD`` as a default argument: imported while a
default group exists, they keep that group alive after ``destroy_process_group`` (torch._dynamo and
torch._inductor import them). Its gloo threads then outlive the interpreter's shutdown, and a work object the
gloo thread frees there needs the GIL a finalizing interpreter no longer gives: the process aborts
("terminate called without an active exception") after its work is done."""


def import_before_group() -> None:
    """Import :data:`WORLD_CAPTURING_MODULES` before a default process group exists (then they capture None),
    so that destroying the group ends its threads at once."""
    import importlib

    for name in WORLD_CAPTURING_MODULES:
        with contextlib.suppress(ImportError):
            importlib.import_module(name)


def join_group(rank: int, world_size: int, port: int | None = None) -> None:
    """Initialize the default gloo process group: through the TCPStore on ``port`` (:func:`host_store`), or
    with ``port=None`` through torchrun's environment (``env://``)."""
    import torch.distributed as dist

    import_before_group()
    if port is None:
        dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=GROUP_TIMEOUT)
        return
    store = dist.TCPStore("127.0.0.1", port, None, is_master=False, timeout=datetime.timedelta(seconds=600))
    store.set(f"lowbit-ready-{rank}", "1")  # see wait_ready
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size, timeout=GROUP_TIMEOUT)


def wait_ready(store: Any, procs: Sequence[Any], ranks: Sequence[int], timeout_s: float = 600.0) -> None:
    """Wait until the spawned ranks have reached the store (RuntimeError naming a rank whose process died
    first, or after ``timeout_s``): joining the group would otherwise wait the group's long timeout for a
    process that is gone."""
    keys = [f"lowbit-ready-{r}" for r in ranks]
    deadline = time.monotonic() + timeout_s
    n = 0
    while not store.check(keys):
        for r, p in zip(ranks, procs):
            if not p.is_alive():
                raise RuntimeError(f"the process of rank {r} exited (code {p.exitcode}) before it joined the others")
        if time.monotonic() > deadline:
            raise RuntimeError(f"the ranks {list(ranks)} did not start within {timeout_s:g} s")
        n += 1
        time.sleep(min(0.25, 0.01 * n))


def leave_group() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def spawn_workers(target: Callable[..., Any], ranks: Sequence[int], args: Callable[[int], tuple]) -> list:
    """Start ``target(*args(rank))`` in a new process (``spawn``) for each rank; returns the processes.

    ``target`` must be importable by name (a module-level function) and its arguments picklable."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    procs = []
    for r in ranks:
        p = ctx.Process(target=target, args=args(r), name=f"lowbit-convert-rank{r}", daemon=False)
        p.start()
        procs.append(p)
    return procs


def stop_workers(procs: Sequence[Any], wait_s: float = 60.0) -> list[int | None]:
    """Join the processes (terminating those still running after ``wait_s``); their exit codes."""
    deadline = time.monotonic() + wait_s
    for p in procs:
        p.join(timeout=max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.terminate()
            p.join(timeout=10)
    return [p.exitcode for p in procs]


__all__ = [
    "DEFAULT_TIMEOUT",
    "DistributedConvertError",
    "FileSync",
    "GroupSync",
    "World",
    "assign_runs",
    "check_statuses",
    "check_timeout",
    "host_store",
    "import_before_group",
    "join_group",
    "leave_group",
    "rank_device",
    "resolve_world",
    "spawn_workers",
    "stop_workers",
    "wait_ready",
]
