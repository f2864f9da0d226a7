"""``convert_checkpoint``: quantize a safetensors model directory tensor by tensor, never loading the whole model.

Sources: a transformers model directory (``config.json`` with ``model_type``: the config's model, built on the
meta device, says which tensors are Linear weights), or a diffusers model folder (``config.json`` with
``_class_name`` and no ``model_type``) or a bare folder of ``*.safetensors`` files (no config.json), where the
name and shape rules of :mod:`lowbit.io.rules` decide from the safetensors headers.

This module runs a conversion: the tensors of each piece of work quantized one at a time
(:func:`_convert_keys`), the ranks of a multi-process conversion, and the last step (index, config,
publishing). What it runs on lives beside it: the plan derived from the arguments and the source
(:mod:`lowbit.io.convert_plan`), the output files laid out in advance and the pieces of work
(:mod:`lowbit.io.convert_layout`), the background writer that puts each tensor's bytes at its place in its
file (:mod:`lowbit.io.convert_writer`) and the progress records that make a conversion resumable
(:mod:`lowbit.io.convert_progress`).

Memory bound: one source tensor at a time on ``device`` besides the next one, read ahead (the members of a
fused q/k/v or gate/up group are held there together until their shared NVFP4 global scale is known), its
quantized output, plus the outputs handed to the writer and not yet written, at most ``max_shard_size`` bytes
(on a GPU, where they stay in device memory until written, at most ``DEVICE_PENDING_BYTES``; or one tensor, if
larger). So peak memory is about that bound + twice the largest source tensor (or the largest fused group plus
one tensor), whatever the size of the checkpoint or of its shards, plus the quantizer's working memory for one
tensor: on a GPU that is device memory, and the host holds only the page-locked staging chunks of the reader
and the writer (:mod:`lowbit.io.staging`, a few hundred MB); on the CPU the reference quantizers hold up to
three fp32 copies of the tensor (measured on a 25.3 GB machine converting a 29.1 GB checkpoint to
w8a8-fp8-block with ``max_shard_size="1GB"``: 4.0 GB of anonymous memory at the peak,
``benchmarks/experiments/convert_larger_than_ram.py``; the safetensors files are memory-mapped, and the pages
read count as the process's file-backed resident memory, which the kernel reclaims like any page cache).
Output files follow the source shards (one per shard, split into numbered parts where a shard's output
exceeds ``max_shard_size``), byte for byte as ``safetensors.torch.save_file`` writes them.

Resumable: a rerun with the same source, scheme and format, on any number of processes, skips the pieces
finished by any of them (:mod:`lowbit.io.convert_progress`). The last step renames the temp directory to
``out_dir`` in one operation, so ``out_dir`` never holds a half checkpoint.

Several processes (``rank``/``world_size``, a ``torch.distributed`` process group or torchrun's environment):
each rank converts its share of the pieces (by source bytes) into the shared files of the temp directory; once
all are done rank 0 alone writes index and config from every rank's records and publishes, so the result is
the single-process one byte for byte (:mod:`lowbit.io.distributed` says how the ranks meet).
"""

from __future__ import annotations

import shutil
import sys
import warnings
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from ..nn.modules import QuantLinear
from ..nn.quantize import DEFAULT_SKIP
from ..nn.schemes import Scheme, get_scheme
from .checkpoint import choose_layout
from .convert_layout import Piece, quantize_target
from .convert_plan import ConversionPlan, check_source, check_unquantized_config, plan_conversion
from .convert_progress import MANIFEST, finished_pieces, progress_bar, read_progress
from .convert_writer import STAGING_CHUNK_BYTES, TensorWriter
from .distributed import (
    DEFAULT_TIMEOUT,
    SYNC_TAG,
    DistributedConvertError,
    FileSync,
    GroupSync,
    World,
    assign_runs,
    check_statuses,
    check_timeout,
    on_device,
    rank_device,
    resolve_world,
)
from .files import (
    CONFIG_NAME,
    INDEX_FILE,
    SAFETENSORS_DTYPES,
    SINGLE_FILE,
    TensorSource,
    copy_extra_files,
    parse_size,
    publish,
    temp_dir_for,
    write_json,
)
from .layouts import DTYPE_NAMES, NAME_DTYPES, params_from_json, params_to_json
from .rules import check_patterns
from .staging import PinnedRing, upload

# False: every tensor is written in the converting thread before the next is read (the sequential reference
# the tests compare the overlapped writer's bytes with); not a user option, the output is the same
_OVERLAP_WRITES = True

DEVICE_PENDING_BYTES = 1 << 30
"""On a GPU, the outputs handed to the writer and not yet written (device memory) are bounded by this, or by
``max_shard_size`` if smaller."""


def _stub(name: str, info: dict, scheme: Scheme) -> QuantLinear:
    """A QuantLinear without tensors carrying what ``layout.config`` reads (scheme, shape, format options)."""
    out_f, in_f = info["shape"]
    # the conversion's own scheme object: it may be one that is not registered by name (LightX2V's W6A8)
    m = QuantLinear(in_f, out_f, False, scheme=scheme if info["scheme"] == scheme.name else info["scheme"])
    m._meta = {
        "dtype": NAME_DTYPES.get(info["dtype"], torch.bfloat16),
        "scale_layout": info.get("scale_layout", "linear"),
        "params": params_from_json(info.get("params", {})),
    }
    return m


def _release_host_cache() -> None:
    """Give the pinned blocks left in torch's host cache (the staging chunks of the reader and the writer) back to
    the system: a conversion should not keep page-locked memory in the caller's process."""
    for name in ("_host_emptyCache", "_accelerator_emptyHostCache"):
        fn = getattr(torch._C, name, None)
        if fn is not None:
            fn()
            return


READ_THREADS = 8
"""Threads reading the chunks of a Linear weight from its file at once (a read from the page cache is a copy
bound by one core's speed: 4 threads read about 15 GB/s from tmpfs on an H200 host, 8 about 26)."""


class _Reader:
    """Reads the next source tensor in a background thread while the current one is quantized and written.
    A Linear weight is read with positional reads, in chunks over ``READ_THREADS`` threads: for a GPU into a
    few reused page-locked chunks (:mod:`lowbit.io.staging`) whose copies to the device go on a stream of the
    reader's own (the quantizing stream waits for it); for the CPU straight into a buffer of the weight's own.
    Other tensors (and a weight whose header safetensors alone reads) come through safetensors."""

    def __init__(self, source: TensorSource, targets, device: torch.device) -> None:
        self.source, self.targets, self.device = source, targets, device
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="lowbit-convert-reader")
        self.io = ThreadPoolExecutor(READ_THREADS, thread_name_prefix="lowbit-convert-read")
        self.stream = self.ring = None
        if device.type == "cuda":
            self.stream = torch.cuda.Stream(device)
            self.ring = PinnedRing(device, 2 * READ_THREADS, STAGING_CHUNK_BYTES)

    def _load(self, key: str):
        span = self.source.span(key) if key in self.targets else None
        if span is None:
            return self.source.get(key), None, None
        if self.stream is None:
            return self.source.read_into(key, torch.empty(span.nbytes, dtype=torch.uint8), self.io), None, None
        with torch.cuda.device(self.device), torch.cuda.stream(self.stream):
            flat = torch.empty(span.nbytes, dtype=torch.uint8, device=self.device)
        upload(self.ring, self.stream, flat, lambda start, out: self.source.read_bytes(key, start, out), self.io)
        with torch.cuda.device(self.device):
            done = torch.cuda.Event()
            done.record(self.stream)
        w = flat.view(span.dtype).view(span.shape)
        return w, w, done

    def submit(self, key: str):
        return self.pool.submit(self._load, key)

    def take(self, pending):
        t, w, done = pending.result()
        if done is not None:
            current = torch.cuda.current_stream(self.device)
            current.wait_event(done)
            w.record_stream(current)  # allocated on the reader's stream, used and freed on this one
        return t, w

    def close(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)
        self.io.shutdown(wait=True)
        if self.ring is not None:
            self.ring.close()


def _batches(keys, targets: dict[str, tuple[str, str]], global_scale) -> list[list[str]]:
    """``keys`` in batches of work: a fused group's members among ``keys`` together, at the first one's place,
    so that they are read one after another and their shared global scale comes from the copies already on the
    device; every other key alone (the order of work does not change the files: each tensor has its planned
    place)."""
    key_of = {targets[k][0]: k for k in keys if k in targets}
    out, seen = [], set()
    for key in keys:
        if key in seen:
            continue
        group = global_scale.group(targets[key][0]) if key in targets else None
        batch = [key_of[n] for n in group if n in key_of] if group else [key]
        seen.update(batch)
        out.append(batch)
    return out


def _convert_keys(
    keys,
    source: TensorSource,
    targets: dict[str, tuple[str, str]],
    scheme: Scheme,
    layout,
    device: torch.device,
    global_scale,
    bar,
    reader: _Reader | None = None,
):
    """Per source key: ``(key, output tensors, (module name, info) or None)``; Linear weights among ``keys`` are
    quantized (outputs on ``device``, made on its current stream), the rest passed through (on the CPU). One
    source tensor is held at a time besides the next one, read ahead, and the members of a fused group among
    ``keys`` (held on the device until their shared global scale is known); a generator, so the caller decides
    when outputs are written and dropped."""
    batches = _batches(keys, targets, global_scale)
    order = [k for batch in batches for k in batch]
    own_reader = reader is None
    if own_reader:
        reader = _Reader(source, targets, device)
    try:
        pending = reader.submit(order[0]) if order else None
        n = 0
        for batch in batches:
            loaded = []
            for key in batch:
                t, w = reader.take(pending)
                n += 1
                pending = reader.submit(order[n]) if n < len(order) else None
                loaded.append((key, t, w))
            if batch[0] not in targets:
                (key, t, _), = loaded
                yield key, {key: t.contiguous()}, None
                del t, loaded
                if bar is not None:
                    bar.update(1)
                continue
            loaded = [(key, t, t.to(device) if w is None else w) for key, t, w in loaded]
            amax = ({targets[key][0]: global_scale.amax(w) for key, _, w in loaded}
                    if global_scale.group(targets[batch[0]][0]) else None)
            while loaded:
                key, t, w = loaded.pop(0)
                name, prefix = targets[key]
                m, q = quantize_target(w, scheme, layout, global_scale(name, amax))
                out = {f"{prefix}{k}": v.detach().contiguous() for k, v in layout.export(m).items()}
                info = {
                    "scheme": scheme.name,
                    "shape": [w.shape[0], w.shape[1]],
                    "dtype": DTYPE_NAMES.get(t.dtype, "float32"),
                    "scale_layout": q.scale_layout,
                    "params": params_to_json(q.params),
                }
                del t, w, q, m
                yield key, out, (name, info)
                if bar is not None:
                    bar.update(1)
    finally:
        if own_reader:
            reader.close()


def _convert_pieces(
    plan: ConversionPlan, todo: list[Piece], tmp: Path, manifest_path: Path, kept: dict[str, dict], dev: torch.device,
    progress: bool, done_count: int, total: int, label: str,
) -> None:
    """Convert the pieces ``todo``, writing into the planned files of ``tmp``, recording each finished one in
    ``manifest_path`` (after ``kept``, the records this file held that are still intact)."""
    manifest: dict[str, Any] = {**plan.ident, "pieces": dict(kept)}
    outputs = plan.outputs
    bar = progress_bar(total, progress, label)
    if bar is not None:
        bar.update(done_count)

    def recorder(i: int, piece: Piece, infos: dict[str, dict]) -> Callable[[], None]:
        # runs in the writer thread once the piece's files are fsynced: the only place the manifest changes
        def record() -> None:
            manifest["pieces"][piece.id] = {"source": piece.source, "modules": infos}
            write_json(manifest_path, manifest)
            if bar is None and progress:
                print(f"{label}: piece {i + 1}/{len(todo)} ({piece.id}) done", file=sys.stderr)

        return record

    cuda = dev.type == "cuda"
    # on a GPU the outputs handed to the writer are device memory until written
    writer = TensorWriter(tmp, outputs.files, _OVERLAP_WRITES,
                          min(plan.limit, DEVICE_PENDING_BYTES) if cuda else plan.limit, label)
    reader = None
    try:
        reader = _Reader(plan.source, plan.targets, dev) if todo else None
        for i, piece in enumerate(todo):
            infos: dict[str, dict] = {}
            for key, tensors, info in _convert_keys(piece.keys, plan.source, plan.targets, plan.scheme,
                                                    plan.layout, dev, plan.global_scale, bar, reader=reader):
                specs = outputs.specs[key]
                got = {k: (v.dtype, tuple(v.shape)) for k, v in tensors.items()}
                want = {s.name: (SAFETENSORS_DTYPES.get(s.dtype), s.shape) for s in specs}
                if got != want:
                    raise RuntimeError(
                        f"convert_checkpoint: {key!r} gave tensors {got}, but the files were laid out for {want}"
                    )
                ready = None
                if cuda and any(v.device.type == "cuda" for v in tensors.values()):
                    ready = torch.cuda.Event()
                    ready.record(torch.cuda.current_stream(dev))
                for k, v in tensors.items():
                    tmp_name, offset = outputs.where[k]
                    writer.write(tmp_name, offset, v, ready)
                del tensors
                if info is not None:
                    infos[info[0]] = info[1]
            writer.end_piece(piece.files, recorder(i, piece, infos))
        writer.close()
    except BaseException as e:
        writer.abort(e)
        raise
    finally:
        if reader is not None:
            reader.close()
        if bar is not None:
            bar.close()
        if cuda:
            _release_host_cache()


def _finalize(plan: ConversionPlan, tmp: Path, overwrite: bool) -> None:
    """Check that every piece is done, rename the files to their names, write index, config and extra files
    into ``tmp`` and publish it."""
    manifests, _ = read_progress(tmp, plan.ident)
    done = finished_pieces(tmp, manifests.values(), plan.outputs)
    missing = [p.id for p in plan.outputs.pieces if p.id not in done]
    if missing:
        raise RuntimeError(
            f"convert_checkpoint: {tmp} lacks piece(s) {missing[:5]} of the output that every rank reported done "
            "(was the temp directory changed meanwhile?); rerun to convert them"
        )
    files = plan.outputs.files
    for f in files.values():
        with open(tmp / f.tmp_name, "rb") as fh:
            if fh.read(len(f.header)) != f.header:
                raise RuntimeError(f"convert_checkpoint: {tmp / f.tmp_name} does not start with its planned header "
                                   "(was the temp directory changed meanwhile?); rerun to convert it")
    # only the planned files stay: files of another conversion and progress files go, so the directory holds
    # what a run that was never interrupted writes
    for p in tmp.iterdir():
        if p.name in files and p.is_file() and not p.is_symlink():
            continue
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p)
        else:
            p.unlink()
    for f in files.values():
        (tmp / f.tmp_name).replace(tmp / f.name)
    infos = {n: info for rec in done.values() for n, info in rec["modules"].items()}
    stubs = {n: _stub(n, info, plan.scheme) for n, info in infos.items()}
    ignore = sorted(set(plan.ignore) | {n for n in plan.linears if n not in stubs})
    layout = choose_layout(stubs, plan.layout.name)
    if [f.name for f in files.values()] != [SINGLE_FILE]:
        wmap = {k: f.name for f in files.values() for k in f.keys}
        total_size = sum(f.tensor_bytes for f in files.values())
        write_json(tmp / INDEX_FILE, {"metadata": {"total_size": total_size}, "weight_map": wmap})
    cfg = plan.cfg
    if cfg is not None:
        src_dtype = NAME_DTYPES.get(str(cfg.get("dtype", cfg.get("torch_dtype"))).removeprefix("torch."))
    else:
        src_dtype = NAME_DTYPES.get(next(iter(infos.values()))["dtype"]) if infos else None
    config = dict(cfg) if cfg is not None else {}
    if cfg is None and src_dtype is not None:
        # a bare folder has no config to say the weights' dtype; load_quantized reads it from here
        config["dtype"] = DTYPE_NAMES[src_dtype]
    config["quantization_config"] = layout.config(stubs, ignore, src_dtype)
    write_json(tmp / CONFIG_NAME, config)
    for name, data in layout.extra_files(stubs, ignore).items():
        write_json(tmp / name, data)
    copy_extra_files(plan.src_dir, tmp)
    try:
        publish(tmp, plan.out_dir, overwrite)
    except BaseException:
        # keep the finished pieces for a rerun: back to their temp names, with their records
        for f in files.values():
            if (tmp / f.name).is_file():
                (tmp / f.name).replace(tmp / f.tmp_name)
        write_json(tmp / MANIFEST, {**plan.ident, "pieces": done})
        raise


def convert_checkpoint(
    src_dir: str | Path,
    out_dir: str | Path,
    scheme: str | Scheme,
    *,
    device: str | torch.device | Sequence[str | torch.device] | None = None,
    skip: str | Iterable[str] | None = DEFAULT_SKIP,
    include: str | Iterable[str] | None = None,
    exclude: str | Iterable[str] | None = None,
    progress: bool = True,
    format: str = "auto",
    overwrite: bool = False,
    max_shard_size: int | str = "5GB",
    model_class: Any = None,
    trust_remote_code: bool = False,
    rank: int | None = None,
    world_size: int | None = None,
    timeout: float = DEFAULT_TIMEOUT,
) -> Path:
    """Quantize the Linear weights of a safetensors model directory into a new checkpoint directory.

    Args:
        src_dir: a transformers model directory (``config.json`` with ``model_type`` and ``model.safetensors``
            or ``model.safetensors.index.json`` + shards), a diffusers model folder (``config.json`` with
            ``_class_name``) or a folder of ``*.safetensors`` files without config.json. It is only read.
        out_dir: the checkpoint to create (same layout rules as :func:`lowbit.save_quantized`); it must lie
            outside ``src_dir`` and must not contain it.
        scheme: a name from ``lowbit.SCHEMES`` (or a :class:`Scheme`, e.g. one of
            ``lowbit.io.lightx2v.LIGHTX2V_SCHEMES``).
        device: where each tensor is quantized (None: CUDA if available, else CPU; with several ranks
            ``cuda:<LOCAL_RANK>``); a list or tuple gives one device per rank. ValueError if torch does not
            know it.
        skip: fnmatch patterns of module names kept in full precision (default ``lm_head``).
        include: module-name patterns (globs, or regular expressions after ``re:``; :mod:`lowbit.io.rules`):
            only matching Linear weights are quantized. Without a transformers model it also replaces the
            default name rules (embeddings, norms, modulation, final projection).
        exclude: module-name patterns never quantized (in addition to ``skip``).
        progress: show a tqdm bar (or a line per piece of work on stderr without tqdm).
        format: checkpoint layout, as ``save_quantized(format=...)``; ``"lightx2v"`` writes LightX2V's keys
            and quantizes the weights exactly as LightX2V's converter does.
        overwrite: replace an existing ``out_dir``.
        max_shard_size: size bound of an output file (``"5GB"``, ``"500MB"`` or bytes): a source shard whose
            output is larger is written in numbered parts. Also the bound on the output waiting to be written
            (tensors are written in the background while the next is quantized), so peak memory is about this
            plus twice the largest source tensor.
        model_class, trust_remote_code: for building the model skeleton (meta device) that says which tensors
            are Linear weights; without transformers, or for diffusers/bare folders, the rules of
            :mod:`lowbit.io.rules` decide.
        rank, world_size: this process's rank among ``world_size`` processes converting together (both or
            neither). None: the initialized ``torch.distributed`` process group's, else torchrun's ``RANK`` and
            ``WORLD_SIZE`` environment variables, else a single process.
        timeout: without a process group, the seconds a rank may stay silent before the others give up on
            it (a killed rank, or one never started); a process group's own timeout applies otherwise.

    Returns:
        ``Path(out_dir)`` (on every rank, once rank 0 has published it).

    Activation scales are dynamic (no calibration data here); fused q/k/v and gate/up NVFP4 weights share one
    global scale as in :func:`lowbit.quantize_model`, so a checkpoint converted here and a model quantized in
    memory and saved hold the same bytes. The output of a diffusers or bare folder has a config.json holding
    the source's config (if any) and the ``quantization_config``; load it with
    ``lowbit.load_quantized(out_dir, model=<the module>)``.

    Several processes: every rank is called with the same arguments. The source shards are cut into pieces of
    about 256 MB at module boundaries, split over the ranks in contiguous runs of about equal bytes
    (:mod:`lowbit.io.convert_layout`, :func:`lowbit.io.distributed.assign_runs`: each rank writes files of its
    own but where a run ends); each rank converts its own on its own device, writing into
    the shared files of the temp directory at their planned offsets (its progress in
    ``progress.rank<r>.json``), and once all ranks are done (a barrier: the process group's, else files, see
    :mod:`lowbit.io.distributed`) rank 0 alone writes the index and config and publishes; the result is byte for
    byte the single-process one, whatever the number of ranks. A failed rank fails every rank
    (:class:`lowbit.io.distributed.DistributedConvertError` on the others) and nothing is published; a rerun,
    with any number of ranks, resumes from the finished pieces.
    """
    scheme = get_scheme(scheme)
    world = resolve_world(rank, world_size)
    dev = rank_device(device, world)
    include_p = check_patterns(include, "include")
    exclude_p = check_patterns(exclude, "exclude")
    limit = parse_size(max_shard_size)
    timeout = check_timeout(timeout)
    src_dir, out_dir = Path(src_dir), Path(out_dir)
    opts = dict(skip=skip, include_p=include_p, exclude_p=exclude_p, format=format, overwrite=overwrite, limit=limit,
                model_class=model_class, trust_remote_code=trust_remote_code)
    if world.size == 1:
        with on_device(dev):
            plan = plan_conversion(src_dir, out_dir, scheme, dev, **opts)
            tmp = temp_dir_for(out_dir, "convert")
            try:
                manifests, stale = read_progress(tmp, plan.ident) if tmp.is_dir() else ({}, False)
                if stale and not manifests:
                    warnings.warn(
                        f"lowbit.convert_checkpoint: {tmp} is from another conversion; starting over", stacklevel=2
                    )
                    shutil.rmtree(tmp)
                tmp.mkdir(parents=True, exist_ok=True)
                done = finished_pieces(tmp, manifests.values(), plan.outputs)
                own = (finished_pieces(tmp, [manifests[tmp / MANIFEST]], plan.outputs)
                       if tmp / MANIFEST in manifests else {})
                _run_pieces(plan, plan.outputs.pieces, tmp, tmp / MANIFEST, own, done, dev, progress,
                            "lowbit convert")
            finally:
                plan.source.close()
            _finalize(plan, tmp, overwrite)
        return out_dir
    return _convert_ranks(src_dir, out_dir, scheme, world, dev, progress, timeout, opts)


def _run_pieces(
    plan: ConversionPlan, mine: list[Piece], tmp: Path, manifest_path: Path, own: dict[str, dict],
    done: dict[str, dict], dev: torch.device, progress: bool, label: str,
) -> None:
    """Convert the pieces ``mine`` that ``done`` does not hold yet."""
    todo = [p for p in mine if p.id not in done]
    total = sum(len(p.keys) for p in mine)
    done_count = total - sum(len(p.keys) for p in todo)
    _convert_pieces(plan, todo, tmp, manifest_path, own, dev, progress, done_count, total, label)


def _convert_ranks(
    src_dir: Path, out_dir: Path, scheme: Scheme, world: World, dev: torch.device, progress: bool, timeout: float,
    opts: dict,
) -> Path:
    """One rank of a multi-process conversion (see :func:`convert_checkpoint`)."""
    sync = GroupSync(world, dev) if world.group else FileSync(temp_dir_for(out_dir, SYNC_TAG), world, timeout)
    sync.start()
    status: dict[str, Any] = {"ok": True, "error": None, "ident": None, "world_size": world.size}
    err: BaseException | None = None
    plan = tmp = None
    try:
        try:
            with on_device(dev):
                plan = plan_conversion(src_dir, out_dir, scheme, dev, **opts)
                status["ident"] = plan.ident_hash
                tmp = temp_dir_for(out_dir, "convert")
                try:
                    # no rank deletes anything here: files of another conversion are replaced or, at the end,
                    # removed by rank 0 once no rank writes any more
                    tmp.mkdir(parents=True, exist_ok=True)
                    manifests, stale = read_progress(tmp, plan.ident)
                    if stale and world.rank == 0:
                        warnings.warn(
                            f"lowbit.convert_checkpoint: {tmp} holds files of another conversion; they are replaced",
                            stacklevel=3,
                        )
                    done = finished_pieces(tmp, manifests.values(), plan.outputs)
                    path = tmp / f"progress.rank{world.rank}.json"
                    own = finished_pieces(tmp, [manifests[path]], plan.outputs) if path in manifests else {}
                    owner = assign_runs([(p.id, p.nbytes) for p in plan.outputs.pieces], world.size)
                    mine = [p for p in plan.outputs.pieces if owner[p.id] == world.rank]
                    _run_pieces(plan, mine, tmp, path, own, done, dev, progress,
                                f"lowbit convert rank {world.rank}/{world.size}")
                finally:
                    plan.source.close()
        except Exception as e:  # noqa: BLE001 - reported to every rank, then raised here
            err = e
            status.update(ok=False, error=f"{type(e).__name__}: {e}")
        statuses = sync.exchange(status)
        if world.rank == 0:
            problem = check_statuses(statuses, world)
            if problem is None:
                try:
                    with on_device(dev):
                        _finalize(plan, tmp, opts["overwrite"])
                    outcome = {"ok": True}
                except Exception as e:  # noqa: BLE001 - reported to every rank, then raised here
                    err = e
                    outcome = {"ok": False, "error": f"rank 0 could not publish: {type(e).__name__}: {e}"}
            else:
                outcome = {"ok": False, "error": problem}
        else:
            outcome = None
        outcome = sync.outcome(outcome)
    finally:
        sync.close()
    if err is not None:
        raise err
    if not outcome.get("ok"):
        where = f"; the finished pieces stay in {tmp} for a rerun" if tmp is not None else ""
        raise DistributedConvertError(
            f"convert_checkpoint rank {world.rank} of {world.size}: {outcome.get('error')}; nothing was published"
            f" at {out_dir}{where}"
        )
    return out_dir


__all__ = ["check_source", "check_unquantized_config", "convert_checkpoint"]
