"""Throughput of ``lowbit.convert_checkpoint`` on one device and on N devices (one process each).

Writes a synthetic Llama-3-70B-shaped transformers checkpoint (hidden 8192, intermediate 28672, 64 heads, 8 KV
heads, a small vocabulary, as many layers as reach ``--size-gb``, random bf16 weights generated on the first
GPU, shards of about 4 GB) into ``--workdir``, then for each scheme converts it with 1 process and with N
processes (a gloo group, each rank on its own device), checks that the two outputs are byte for byte the same
(SHA-256 of every file) and reports the GB/s of source read and the N-to-1 speedup, as a table and as JSON.
Two wall times per run: inside the workers from a barrier (every rank started, CUDA initialized, transformers
imported, the kernels warmed up) to the end of rank 0's publish, and outside, from starting the processes to
their exit. It also reports the GB/s the disk takes for fsynced writes: every output shard is fsynced, so with
a large output (fp8) ranks sharing one disk can be bound by it. The synthetic files and the outputs are removed
at the end (``--keep`` keeps them).

On the 2-GPU machine (about 3 minutes for 20 GB on 2 H100s with 32 cores and a local disk)::

    PYTHONUNBUFFERED=1 python3 benchmarks/convert_throughput.py --size-gb 20 --devices 2 --out-json $OUT/convert.json

``--assign runs,interleaved`` adds a run on N devices per way of giving pieces to ranks (lowbit's contiguous runs,
or the earlier interleaving), each with its speedup over the one one-device run; ``--read-threads`` sets the
threads reading one weight.

On CPU (a model scaled down to the size; the CPU test runs it this way)::

    python benchmarks/convert_throughput.py --size-gb 0.05 --devices cpu,cpu --out-json /tmp/convert.json

The source is read from the page cache (it was just written, and the machine's memory holds it): the numbers
are conversion throughput (read, quantize, write), not the disk's read speed.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import functools
import json
import math
import os
import platform
import shutil
import sys
import tempfile
import threading
import time
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

LLAMA_70B = {"hidden_size": 8192, "intermediate_size": 28672, "num_attention_heads": 64, "num_key_value_heads": 8}
HEAD_DIM = 128
SCHEMA = "lowbit.convert_throughput/1"


def _importable() -> None:
    """lowbit from this checkout when it is not installed (the device machine runs the tree as copied);
    exported, so the spawned ranks find it too."""
    src = str(ROOT / "src")
    try:
        import lowbit  # noqa: F401
    except ImportError:
        sys.path.insert(0, src)
        os.environ["PYTHONPATH"] = os.pathsep.join([src, *filter(None, [os.environ.get("PYTHONPATH")])])


# ------------------------------------------------------------------------------------------- the source


def model_dims(size_bytes: float) -> dict:
    """Llama-3-70B's widths when at least two of its layers fit ``size_bytes``; else the hidden size halved
    (heads of 128, 8 query heads per KV head where there are 8) until at least four layers fit."""
    dims = dict(LLAMA_70B)
    while dims["hidden_size"] > 256:
        if size_bytes >= (2 if dims == LLAMA_70B else 4) * layer_bytes(dims):
            break
        h = dims["hidden_size"] // 2
        heads = h // HEAD_DIM
        dims = {"hidden_size": h, "intermediate_size": h * 7 // 2, "num_attention_heads": heads,
                "num_key_value_heads": max(1, heads // 8)}
    return dims


def layer_shapes(dims: dict) -> list[tuple[str, tuple[int, ...]]]:
    h, i = dims["hidden_size"], dims["intermediate_size"]
    kv = dims["num_key_value_heads"] * HEAD_DIM
    return [
        ("input_layernorm.weight", (h,)),
        ("self_attn.q_proj.weight", (h, h)),
        ("self_attn.k_proj.weight", (kv, h)),
        ("self_attn.v_proj.weight", (kv, h)),
        ("self_attn.o_proj.weight", (h, h)),
        ("post_attention_layernorm.weight", (h,)),
        ("mlp.gate_proj.weight", (i, h)),
        ("mlp.up_proj.weight", (i, h)),
        ("mlp.down_proj.weight", (h, i)),
    ]


def layer_bytes(dims: dict) -> int:
    return sum(2 * math.prod(s) for _, s in layer_shapes(dims))


def write_source(path: Path, size_gb: float, shard_gb: float | None, device: str, vocab: int) -> dict:
    """The synthetic checkpoint (config.json, shards, index); returns what it holds."""
    import torch
    from safetensors.torch import save_file

    t0 = time.perf_counter()
    size = size_gb * 1e9
    dims = model_dims(size)
    layers = max(1, round(size / layer_bytes(dims)))
    h = dims["hidden_size"]
    tensors = [("model.embed_tokens.weight", (vocab, h))]
    for n in range(layers):
        tensors += [(f"model.layers.{n}.{name}", shape) for name, shape in layer_shapes(dims)]
    tensors += [("model.norm.weight", (h,)), ("lm_head.weight", (vocab, h))]
    total = sum(2 * math.prod(s) for _, s in tensors)
    target = shard_gb * 1e9 if shard_gb else min(4e9, total / 4)
    shards: list[list[tuple[str, tuple[int, ...]]]] = [[]]
    filled = 0
    for name, shape in tensors:
        n = 2 * math.prod(shape)
        if shards[-1] and filled + n > target:
            shards.append([])
            filled = 0
        shards[-1].append((name, shape))
        filled += n
    path.mkdir(parents=True)
    names = [f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors" for k in range(len(shards))]
    wmap = {name: names[k] for k, shard in enumerate(shards) for name, _ in shard}

    def write(k: int) -> None:
        gen = torch.Generator(device=device).manual_seed(k)  # one per shard: the same bytes in any thread order
        data = {}
        for name, shape in shards[k]:
            if name.endswith("norm.weight"):
                data[name] = torch.ones(shape, dtype=torch.bfloat16)
            else:
                t = torch.randn(shape, generator=gen, device=device,
                                dtype=torch.float32 if device == "cpu" else torch.bfloat16)
                data[name] = (t * 0.02).to(torch.bfloat16).cpu()
        save_file(data, str(path / names[k]), metadata={"format": "pt"})

    # a few shards at a time: serializing and writing a shard is mostly host memory traffic
    with concurrent.futures.ThreadPoolExecutor(max_workers=min(4, len(shards))) as pool:
        list(pool.map(write, range(len(shards))))
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total},
                                                                   "weight_map": wmap}, indent=2))
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": vocab,
        "num_hidden_layers": layers, "head_dim": HEAD_DIM, "hidden_act": "silu", "max_position_embeddings": 8192,
        "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "tie_word_embeddings": False, "dtype": "bfloat16", **dims,
    }
    (path / "config.json").write_text(json.dumps(config, indent=2))
    t_sync = time.perf_counter()
    # the runs that follow must not pay for writing back the source's dirty pages (the first would)
    os.sync()
    files = sorted(path.glob("*.safetensors"))
    return {"layers": layers, **dims, "vocab_size": vocab, "shards": len(files), "sync_s": time.perf_counter() - t_sync,
            "shard_bytes": [f.stat().st_size for f in files], "bytes": sum(f.stat().st_size for f in files),
            "write_s": time.perf_counter() - t0, "generated_on": device}


# ------------------------------------------------------------------------------------------- the ranks


def interleaved(sizes, world_size: int) -> dict[str, int]:
    """The assignment before contiguous runs (``--assign interleaved``, for comparison): the largest piece
    first onto the least loaded rank, so that neighbouring pieces, and the files they write, alternate between
    ranks."""
    loads = [0] * world_size
    out = {}
    for name, n in sorted(sizes, key=lambda item: (-item[1], item[0])):
        r = min(range(world_size), key=lambda i: (loads[i], i))
        out[name] = r
        loads[r] += n
    return out


class Timers:
    """Timers around the calls of a conversion in this process (patched in by :meth:`install`): per (thread,
    call) the total seconds, the number of calls, the first call's and the longest call's seconds. The reader
    thread reads a source tensor and copies it to the GPU, the converting thread waits for it, quantizes and
    hands the outputs over, the writer copies them back and writes them; ``whole:`` rows are the conversion's
    phases, ``ranks:`` rows the waits for the other ranks."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.stats: dict[tuple[str, str], list[float]] = {}

    def wrap(self, label: str, fn):
        @functools.wraps(fn)
        def wrapper(*a, **kw):
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                dt = time.perf_counter() - t0
                key = (threading.current_thread().name.split(" ")[0].rstrip("_0123456789"), label)
                with self.lock:
                    st = self.stats.setdefault(key, [0.0, 0, dt, 0.0])
                    st[0] += dt
                    st[1] += 1
                    st[3] = max(st[3], dt)
        return wrapper

    def install(self) -> Timers:
        import lowbit.io.convert as conv
        import lowbit.io.convert_writer as writer
        from lowbit.io import distributed, files
        from lowbit.io.convert_plan import SharedScales

        w = self.wrap
        conv._Reader._load = w("reader: read a tensor (and copy it to the GPU)", conv._Reader._load)
        conv._Reader.take = w("convert: wait for the reader", conv._Reader.take)
        conv.quantize_target = w("convert: quantize", conv.quantize_target)
        conv.upload = w("reader: chunks read and copied to the GPU", conv.upload)
        writer.download = w("writer: chunks copied back and written", writer.download)
        writer.TensorWriter._submit = w("convert: hand over (waits when the writer is behind)",
                                        writer.TensorWriter._submit)
        writer.write_bytes = w("writer: pwrite", writer.write_bytes)
        writer.os = types.SimpleNamespace(**{**vars(os), "fsync": w("writer: fsync", os.fsync)})
        files.TensorSource.get = w("any: TensorSource.get", files.TensorSource.get)
        files.TensorSource.read_into = w("reader: positional reads into a buffer", files.TensorSource.read_into)
        conv.plan_conversion = w("whole: plan_conversion", conv.plan_conversion)
        conv._convert_pieces = w("whole: the pieces' loop", conv._convert_pieces)
        conv._finalize = w("whole: _finalize (publish included)", conv._finalize)
        conv.publish = w("whole: publish (fsync of the tree, rename)", conv.publish)
        conv.write_json = w("any: write_json (fsynced)", conv.write_json)
        conv._release_host_cache = w("whole: release the pinned host cache", conv._release_host_cache)
        SharedScales.amax = staticmethod(w("convert: global-scale amax", SharedScales.amax))
        for cls in (distributed.GroupSync, distributed.FileSync):
            cls.exchange = w("ranks: exchange statuses (waits for the others)", cls.exchange)
            cls.outcome = w("ranks: wait for rank 0's outcome", cls.outcome)
        return self

    def rows(self, clear: bool = True) -> list[dict]:
        """The rows, longest total first (and start over when ``clear``)."""
        with self.lock:
            rows = [{"thread": th, "what": lab, "s": st[0], "calls": st[1], "first_s": st[2], "longest_s": st[3]}
                    for (th, lab), st in self.stats.items()]
            if clear:
                self.stats.clear()
        return sorted(rows, key=lambda r: -r["s"])


def format_rows(rows: list[dict], most: int | None = None) -> str:
    lines = [f"  {'thread':24s} {'what':54s} {'total':>9s}  {'calls':>6s} {'first':>7s} {'longest':>7s}"]
    for r in rows[:most]:
        lines.append(f"  {r['thread']:24s} {r['what']:54s} {r['s']:7.2f} s  {r['calls']:6d} {r['first_s']:7.3f} "
                     f"{r['longest_s']:7.3f}")
    return "\n".join(lines)


def rank_main(rank: int, world_size: int, port: int, device: str, src: str, out: str, scheme: str,
              report: str, variant: dict) -> None:
    """One rank: join the group, warm up (CUDA, transformers, the scheme's kernels at every Linear shape of the
    source), meet the others, then time ``convert_checkpoint`` from the barrier to its return (rank 0: after
    publishing). ``variant``: the ``--assign`` and ``--read-threads`` of a comparison run, and ``profile``
    (per-rank :class:`Timers` in the rank's result)."""
    t_start = time.perf_counter()
    import torch
    import torch.distributed as dist

    import lowbit
    from lowbit.io import convert
    from lowbit.io.distributed import join_group, leave_group
    from lowbit.nn.schemes import get_scheme

    if variant.get("assign") == "interleaved":
        convert.assign_runs = interleaved
    if variant.get("read_threads"):
        convert.READ_THREADS = variant["read_threads"]

    result = {"rank": rank, "device": device, "ok": False}
    try:
        join_group(rank, world_size, port)
        dev = torch.device(device)
        if dev.type == "cuda":
            torch.cuda.set_device(dev)
        else:
            # ranks sharing the CPU split its cores rather than each running a thread per core
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
        s = get_scheme(scheme)
        # every distinct Linear shape of the source once, so that no run compiles a kernel variant inside its
        # timing (the first run after the source was written would otherwise pay for the later ones)
        dims = json.loads((Path(src) / "config.json").read_text())
        for shape in sorted({sh for _, sh in layer_shapes(dims) if len(sh) == 2}):
            w = torch.randn(shape, device=dev).to(torch.bfloat16)
            lowbit.quantize(w, s.weight_format, **s.weight_quantize_options(shape[1]))
            del w
        try:
            import transformers.models.llama.modeling_llama  # noqa: F401 - imported by the conversion otherwise
        except ImportError:
            pass
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        timers = Timers().install() if variant.get("profile") else None
        result["startup_s"] = time.perf_counter() - t_start
        dist.barrier()
        t0 = time.perf_counter()
        lowbit.convert_checkpoint(src, out, scheme, device=dev, rank=rank, world_size=world_size, progress=False)
        result["inner_s"] = time.perf_counter() - t0
        if timers is not None:
            result["profile"] = timers.rows()
        result["ok"] = True
        if dev.type == "cuda":
            result["max_memory_allocated"] = torch.cuda.max_memory_allocated(dev)
    except Exception as e:  # noqa: BLE001 - reported by the parent
        result["error"] = f"{type(e).__name__}: {e}"
    finally:
        leave_group()
    Path(f"{report}.rank{rank}.json").write_text(json.dumps(result))
    # leave without the interpreter's shutdown, which a rank does not need (before join_group imported the torch
    # modules that keep a group alive, a gloo thread there now and then ended the process with SIGABRT)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0 if result["ok"] else 1)


def run_conversion(src: Path, out: Path, scheme: str, devices: list[str], work: Path,
                   variant: dict | None = None) -> dict:
    from lowbit.io.distributed import host_store, spawn_workers, stop_workers

    world = len(devices)
    report = str(work / f"report-{scheme}-{world}")
    t0 = time.perf_counter()
    store = host_store(world)
    procs = spawn_workers(rank_main, range(world),
                          lambda r: (r, world, store.port, devices[r], str(src), str(out), scheme, report,
                                     variant or {}))
    codes = stop_workers(procs, wait_s=1800)
    outer = time.perf_counter() - t0
    ranks = []
    for r in range(world):
        p = Path(f"{report}.rank{r}.json")
        ranks.append(json.loads(p.read_text()) if p.exists() else {"rank": r, "ok": False,
                                                                    "error": f"exit code {codes[r]}"})
        p.unlink(missing_ok=True)
    ok = all(x["ok"] for x in ranks) and all(c == 0 for c in codes)
    inner = max(x.get("inner_s", 0.0) for x in ranks) if ok else None
    return {"scheme": scheme, "world_size": world, "devices": devices, "ok": ok, "inner_s": inner,
            "outer_s": outer, "ranks": ranks, "exit_codes": codes}


def disk_write_gbps(work: Path, nbytes: int) -> float:
    """GB/s of writing ``nbytes`` to ``work`` with an fsync, as the converter writes each output shard: the
    bound on a conversion whose output is large (fp8) when the ranks share one disk."""
    path = work / ".disk-probe"
    block = os.urandom(1 << 24)
    t0 = time.perf_counter()
    with open(path, "wb") as fh:
        for _ in range(max(1, nbytes >> 24)):
            fh.write(block)
        fh.flush()
        os.fsync(fh.fileno())
    seconds = time.perf_counter() - t0
    path.unlink()
    return max(1, nbytes >> 24) * len(block) / 1e9 / seconds


# -------------------------------------------------------------------------------------------- the run


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size-gb", type=float, default=20.0, help="source checkpoint size in GB (default 20)")
    p.add_argument("--devices", default=None,
                   help="N (cuda:0..N-1) or a device list (cuda:0,cuda:1; cpu,cpu); default: every GPU")
    p.add_argument("--schemes", default="w4a16-nvfp4,w8a8-fp8-block",
                   help="comma-separated schemes, in order (default w4a16-nvfp4,w8a8-fp8-block)")
    p.add_argument("--shard-gb", type=float, default=None, help="source shard size (default min(4, size/4) GB)")
    p.add_argument("--vocab", type=int, default=None, help="vocabulary size (default 1024; 256 below 1 GB)")
    p.add_argument("--workdir", default=None, help="where the synthetic checkpoint and outputs go (default: a "
                   "new directory under $TMPDIR or /tmp; it must have room for the source and two outputs)")
    p.add_argument("--out-json", default=None, help="write the results here")
    p.add_argument("--budget-s", type=float, default=330.0,
                   help="start no further scheme after this many seconds (default 330)")
    p.add_argument("--assign", default="runs",
                   help="pieces per rank: runs (lowbit's contiguous runs) or interleaved (the earlier assignment); "
                        "a comma list (runs,interleaved) adds a run on N devices per entry, with its own speedup")
    p.add_argument("--read-threads", type=int, default=None,
                   help="threads reading one Linear weight (default: lowbit's READ_THREADS)")
    p.add_argument("--keep", action="store_true", help="keep the synthetic checkpoint and the outputs")
    p.add_argument("--profile", action="store_true",
                   help="time the conversion's calls inside each rank (reader, converting thread, writer, waits for "
                        "the other ranks) and print each rank's table")
    args = p.parse_args(argv)
    args.assign = [a.strip() for a in args.assign.split(",") if a.strip()]
    if not args.assign or any(a not in ("runs", "interleaved") for a in args.assign) or len(set(args.assign)) < len(
            args.assign):
        p.error(f"--assign takes runs and/or interleaved, each once, got {','.join(args.assign) or 'nothing'}")
    if not (args.size_gb > 0 and math.isfinite(args.size_gb)):
        p.error(f"--size-gb must be a positive number, got {args.size_gb}")
    if args.shard_gb is not None and not args.shard_gb > 0:
        p.error(f"--shard-gb must be positive, got {args.shard_gb}")
    return args


def table(result: dict) -> str:
    gb = result["source"]["bytes"] / 1e9
    lines = [f"source {gb:.2f} GB, {result['source']['shards']} shards, {result['source']['layers']} layers "
             f"(hidden {result['source']['hidden_size']}); GB/s of source read; the disk writes "
             f"{result.get('disk_write_gbps', float('nan')):.2f} GB/s",
             f"{'scheme':16}{'devices':>8}{'inner s':>9}{'GB/s':>8}{'outer s':>9}{'GB/s':>8}  identical"]
    for r in result["runs"]:
        if r["ok"]:
            lines.append(f"{r['scheme']:16}{r['world_size']:>8}{r['inner_s']:>9.2f}{r['inner_gbps']:>8.2f}"
                         f"{r['outer_s']:>9.2f}{r['outer_gbps']:>8.2f}  {result['identical'].get(r['scheme'], '-')}"
                         + (f"  pieces {r['assign']}" if r.get("assign") and r["world_size"] > 1 else ""))
        else:
            errors = "; ".join(x.get("error", "?") for x in r["ranks"] if not x.get("ok"))
            lines.append(f"{r['scheme']:16}{r['world_size']:>8}  failed: {errors}")
    for scheme, s in result["speedup"].items():
        for assign, t in result.get("speedup_by_assign", {}).get(scheme, {None: s}).items():
            label = f" (pieces {assign})" if assign else ""
            lines.append(f"{scheme}: {t['world_size']} devices vs 1{label}: {t['inner']:.2f}x inside the workers, "
                         f"{t['outer']:.2f}x with process start-up")
    for s in result.get("skipped", []):
        lines.append(f"{s}: skipped (--budget-s)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    t_begin = time.perf_counter()
    args = parse_args(argv)
    _importable()
    import torch

    from lowbit.cli import parse_devices
    from lowbit.nn import SCHEMES
    from lowbit.testing import tree_digest

    if args.devices is None:
        n = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if n == 0:
            print("convert_throughput: no GPU here; give --devices (e.g. cpu,cpu)", file=sys.stderr)
            return 2
        devices = [f"cuda:{i}" for i in range(n)]
    else:
        try:
            devices = parse_devices(args.devices)
        except ValueError as e:
            print(f"convert_throughput: {e}", file=sys.stderr)
            return 2
    schemes = [s.strip() for s in args.schemes.split(",") if s.strip()]
    unknown = [s for s in schemes if s not in SCHEMES]
    if not schemes or unknown:
        print(f"convert_throughput: --schemes: unknown {unknown or 'empty'}; known: {', '.join(SCHEMES)}",
              file=sys.stderr)
        return 2
    if args.read_threads is not None and args.read_threads < 1:
        print("convert_throughput: --read-threads must be at least 1", file=sys.stderr)
        return 2
    variant = {"assign": args.assign[0], "read_threads": args.read_threads}
    if args.profile:
        variant["profile"] = True
    made = args.workdir is None
    work = Path(tempfile.mkdtemp(prefix="lowbit-convert-bench-")) if made else Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    src = work / "llama-synthetic"
    if src.exists():
        print(f"convert_throughput: {src} exists; remove it or choose another --workdir", file=sys.stderr)
        return 2
    gen_device = devices[0] if devices[0].startswith("cuda") else "cpu"
    vocab = args.vocab or (1024 if args.size_gb >= 1 else 256)
    result: dict = {
        "schema": SCHEMA, "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "argv": sys.argv[1:],
        "host": {"python": platform.python_version(), "torch": torch.__version__, "cpus": os.cpu_count(),
                 "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
                 if torch.cuda.is_available() else []},
        "devices": devices, "page_cache": "warm (the source was just written)", "runs": [], "identical": {},
        "speedup": {}, "skipped": [], "variant": variant,
    }
    failed = False
    try:
        print(f"writing a {args.size_gb:g} GB synthetic Llama checkpoint into {src} (on {gen_device}) ...", flush=True)
        result["source"] = write_source(src, args.size_gb, args.shard_gb, gen_device, vocab)
        gb = result["source"]["bytes"] / 1e9
        print(f"  {gb:.2f} GB in {result['source']['shards']} shards, {result['source']['write_s']:.1f} s", flush=True)
        result["disk_write_gbps"] = disk_write_gbps(work, int(min(2e9, result["source"]["bytes"] / 4)))
        print(f"  the disk takes {result['disk_write_gbps']:.2f} GB/s of fsynced writes", flush=True)
        # one device once; N devices once per --assign entry (the assignment matters only there)
        configs = [(devices[:1], args.assign[0])] + ([(devices, a) for a in args.assign] if len(devices) > 1 else [])
        for scheme in schemes:
            if time.perf_counter() - t_begin > args.budget_s:
                result["skipped"].append(scheme)
                continue
            outs = []
            for devs, assign in configs:
                out = work / f"out-{scheme}-{len(devs)}-{assign}"
                print(f"{scheme} on {len(devs)} device(s) {','.join(devs)}"
                      + (f", pieces {assign}" if len(devs) > 1 else "") + " ...", flush=True)
                run = run_conversion(src, out, scheme, devs, work, {**variant, "assign": assign})
                run["assign"] = assign
                if run["ok"]:
                    run["inner_gbps"] = gb / run["inner_s"]
                    run["outer_gbps"] = gb / run["outer_s"]
                    print(f"  {run['inner_s']:.2f} s inside ({run['inner_gbps']:.2f} GB/s), {run['outer_s']:.2f} s "
                          f"with start-up ({run['outer_gbps']:.2f} GB/s)", flush=True)
                    for rk in run["ranks"]:
                        if rk.get("profile"):
                            print(f"  rank {rk['rank']} ({rk['device']}), {rk['inner_s']:.2f} s inside:\n"
                                  + format_rows(rk["profile"], 14), flush=True)
                else:
                    failed = True
                    print(f"  failed: {[x.get('error') for x in run['ranks'] if not x.get('ok')]}", flush=True)
                result["runs"].append(run)
                outs.append((run, out))
            if len(outs) >= 2 and all(r["ok"] for r, _ in outs):
                a = tree_digest(outs[0][1])
                digests = [tree_digest(out) for _, out in outs[1:]]
                same = all(b == a for b in digests)
                result["identical"][scheme] = same
                if not same:
                    failed = True
                    result.setdefault("differing_files", {})[scheme] = sorted(
                        k for b in digests for k in set(a) | set(b) if a.get(k) != b.get(k))
                one = outs[0][0]
                by_assign = {many["assign"]: {"world_size": many["world_size"],
                                              "inner": one["inner_s"] / many["inner_s"],
                                              "outer": one["outer_s"] / many["outer_s"]} for many, _ in outs[1:]}
                result["speedup"][scheme] = by_assign[args.assign[0]]
                if len(by_assign) > 1:
                    result.setdefault("speedup_by_assign", {})[scheme] = by_assign
            if not args.keep:
                for _, out in outs:
                    shutil.rmtree(out, ignore_errors=True)
    finally:
        if not args.keep:
            shutil.rmtree(src, ignore_errors=True)
            if made:
                shutil.rmtree(work, ignore_errors=True)
        result["total_s"] = time.perf_counter() - t_begin
        if args.out_json:
            Path(args.out_json).parent.mkdir(parents=True, exist_ok=True)
            Path(args.out_json).write_text(json.dumps(result, indent=1) + "\n")
    if "source" in result:
        print()
        print(table(result))
    if args.out_json:
        print(f"results: {args.out_json}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
