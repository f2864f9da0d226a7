"""Where a conversion rank's time goes: the host copies, the quantize, the write, on one and on two GPUs.

Writes a ~4 GB synthetic Llama-3-70B-shaped shard (``convert_throughput.write_source``), then times each
phase of converting it, per tensor, summed: reading the source tensor (safetensors' mmap-backed tensor copied
to the GPU, against ``preadv`` into a pinned buffer and an asynchronous copy), quantizing it, copying the
outputs back, and writing them (safetensors' ``save_file`` with an fsync, against writing the tensors' bytes
straight from their memory). The same phases run in one process and in two processes at once (one per GPU,
each on the whole shard), to show which of them share a resource. Last, a cProfile of one single-process
``convert_checkpoint`` of the shard (main thread). Prints JSON lines; ``--out-json`` collects them::

    PYTHONPATH=src python3 benchmarks/experiments/profile_convert_io.py --out-json $OUT/convert_io.json
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import multiprocessing as mp
import os
import pstats
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/


def _header(path: Path) -> tuple[int, dict]:
    with open(path, "rb") as fh:
        n = int.from_bytes(fh.read(8), "little")
        return 8 + n, json.loads(fh.read(n))


def phases(path: str, device: str, scheme: str, out_dir: str, label: str) -> dict:
    import torch
    from safetensors import safe_open

    import lowbit
    from lowbit.io.files import save_safetensors
    from lowbit.nn.schemes import get_scheme

    dev = torch.device(device)
    cuda = dev.type == "cuda"
    if cuda:
        torch.cuda.set_device(dev)

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize(dev)

    s = get_scheme(scheme)
    base, hdr = _header(Path(path))
    keys = [k for k in hdr if k != "__metadata__"]
    big = max(hdr[k]["data_offsets"][1] - hdr[k]["data_offsets"][0] for k in keys)
    res: dict = {"label": label, "device": device, "scheme": scheme, "bytes": 0}
    w = torch.randn(256, 256, device=dev).to(torch.bfloat16)
    lowbit.quantize(w, s.weight_format, **s.weight_quantize_options(256))
    sync()

    t = time.perf_counter()
    gpu = {}
    with safe_open(path, framework="pt") as f:
        for k in keys:
            gpu[k] = f.get_tensor(k).to(dev)
            res["bytes"] += gpu[k].numel() * gpu[k].element_size()
    sync()
    res["mmap_to_gpu_s"] = time.perf_counter() - t
    del gpu

    pinned = torch.empty(big, dtype=torch.uint8)
    pinned = pinned.pin_memory() if cuda else pinned
    t = time.perf_counter()
    fd = os.open(path, os.O_RDONLY)
    gpu = {}
    for k in keys:
        a, b = hdr[k]["data_offsets"]
        view = pinned[: b - a]
        got = os.preadv(fd, [memoryview(view.numpy())], base + a)
        assert got == b - a
        g = torch.empty(b - a, dtype=torch.uint8, device=dev)
        g.copy_(view, non_blocking=True)
        sync()  # the buffer is reused by the next read
        gpu[k] = g
    os.close(fd)
    res["pread_pinned_to_gpu_s"] = time.perf_counter() - t
    t = time.perf_counter()
    fd = os.open(path, os.O_RDONLY)
    for k in keys:
        a, b = hdr[k]["data_offsets"]
        os.preadv(fd, [memoryview(pinned[: b - a].numpy())], base + a)
    os.close(fd)
    res["pread_only_s"] = time.perf_counter() - t

    dt = {"BF16": torch.bfloat16, "F32": torch.float32}
    outs = {}
    t = time.perf_counter()
    for k in keys:
        x = gpu[k].view(dt[hdr[k]["dtype"]]).view(hdr[k]["shape"])
        if x.dim() == 2 and "embed" not in k and "lm_head" not in k:
            q = lowbit.quantize(x, s.weight_format, **s.weight_quantize_options(x.shape[1]))
            for name, v in q.tensors().items():
                outs[f"{k}.{name}"] = v
        else:
            outs[k] = x
    sync()
    res["quantize_s"] = time.perf_counter() - t
    del gpu

    t = time.perf_counter()
    cpu = {k: v.to("cpu") for k, v in outs.items()}
    res["d2h_pageable_s"] = time.perf_counter() - t
    res["out_bytes"] = sum(v.numel() * v.element_size() for v in cpu.values())
    del outs

    p = Path(out_dir) / f"out-{label}.safetensors"
    t = time.perf_counter()
    save_safetensors(cpu, p)
    res["save_file_fsync_s"] = time.perf_counter() - t
    p.unlink()
    t = time.perf_counter()
    with open(p, "wb") as fh:
        for v in cpu.values():
            fh.write(memoryview(v.contiguous().view(torch.uint8).numpy()))
        fh.flush()
        t1 = time.perf_counter()
        os.fsync(fh.fileno())
    res["raw_write_s"] = t1 - t
    res["raw_write_fsync_s"] = time.perf_counter() - t
    p.unlink()
    print(json.dumps(res), flush=True)
    return res


def _worker(args, q) -> None:
    try:
        q.put(phases(*args))
    except Exception as e:  # noqa: BLE001
        q.put({"label": args[-1], "error": f"{type(e).__name__}: {e}"})


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size-gb", type=float, default=4.0)
    ap.add_argument("--schemes", default="w4a16-nvfp4,w8a8-fp8-block")
    ap.add_argument("--out-json", default=None)
    ap.add_argument("--workdir", default=None)
    a = ap.parse_args()
    import torch
    from convert_throughput import _importable, write_source

    _importable()
    work = Path(tempfile.mkdtemp(prefix="lowbit-convert-io-", dir=a.workdir))
    src = work / "src"
    info = write_source(src, a.size_gb, a.size_gb * 1.01, "cuda:0", 1024)
    shard = str(min(src.glob("*.safetensors")))
    results: list = [{"source": info}]
    print(json.dumps(results[0]), flush=True)
    ctx = mp.get_context("spawn")
    ngpu = torch.cuda.device_count()
    for scheme in a.schemes.split(","):
        for world in ([1, 2] if ngpu >= 2 else [1]):
            q = ctx.Queue()
            procs = [ctx.Process(target=_worker, args=((shard, f"cuda:{r}", scheme, str(work), f"{scheme}-w{world}-r{r}"), q))
                     for r in range(world)]
            for p in procs:
                p.start()
            for _ in procs:
                results.append(q.get(timeout=600))
            for p in procs:
                p.join()
    import lowbit

    for scheme in a.schemes.split(","):
        prof = cProfile.Profile()
        t = time.perf_counter()
        prof.enable()
        lowbit.convert_checkpoint(src, work / f"conv-{scheme}", scheme, device="cuda:0", progress=False)
        prof.disable()
        wall = time.perf_counter() - t
        sio = io.StringIO()
        pstats.Stats(prof, stream=sio).sort_stats("cumulative").print_stats(30)
        text = sio.getvalue()
        print(f"convert_checkpoint {scheme}: {wall:.2f} s\n{text}", flush=True)
        results.append({"convert": scheme, "wall_s": wall, "profile": text})
    if a.out_json:
        Path(a.out_json).write_text(json.dumps(results, indent=1))
    import shutil

    shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
