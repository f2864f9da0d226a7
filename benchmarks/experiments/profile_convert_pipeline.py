"""Where one conversion process spends its time, per thread: the reader (source tensor read and copy to the GPU), the
converting thread (waiting for the reader, quantizing, handing over to the writer) and the writer
(copies back from the GPU, pwrite, fsync). One process, in-process timers around those calls; the synthetic source
of ``convert_throughput.py``.

    PYTHONUNBUFFERED=1 python3 benchmarks/experiments/profile_convert_pipeline.py --size-gb 10 \
        --workdir /dev/shm/pp --scheme w8a8-fp8-block --out-json $OUT/pipeline.json
"""

from __future__ import annotations

import argparse
import collections
import functools
import importlib.util
import json
import os
import shutil
import sys
import threading
import time
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "src"))

_spec = importlib.util.spec_from_file_location("convert_throughput", ROOT / "benchmarks" / "convert_throughput.py")
ct = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ct)

TIMES: dict[tuple[str, str], float] = collections.defaultdict(float)
COUNTS: dict[tuple[str, str], int] = collections.defaultdict(int)
FIRST: dict[tuple[str, str], float] = {}
LONGEST: dict[tuple[str, str], float] = collections.defaultdict(float)
LOCK = threading.Lock()


def timed(label: str, fn):
    @functools.wraps(fn)
    def wrapper(*a, **kw):
        t0 = time.perf_counter()
        try:
            return fn(*a, **kw)
        finally:
            dt = time.perf_counter() - t0
            key = (threading.current_thread().name.split(" ")[0].rstrip("_0123456789"), label)
            with LOCK:
                TIMES[key] += dt
                COUNTS[key] += 1
                FIRST.setdefault(key, dt)
                LONGEST[key] = max(LONGEST[key], dt)
    return wrapper


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--size-gb", type=float, default=10.0)
    p.add_argument("--workdir", default="/tmp/pp")
    p.add_argument("--scheme", default="w8a8-fp8-block")
    p.add_argument("--device", default="cuda:0")
    p.add_argument("--out-json", default=None)
    p.add_argument("--repeat", type=int, default=1,
                   help="conversions in this one process, each with its own table (the later ones find the kernels "
                        "compiled and the libraries imported)")
    args = p.parse_args()
    import torch

    import lowbit
    import lowbit.io.convert as conv
    import lowbit.io.convert_writer as writer
    from lowbit.io import files
    from lowbit.io.convert_plan import SharedScales

    work = Path(args.workdir)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    src = work / "src"
    info = ct.write_source(src, args.size_gb, None, args.device, 1024 if args.size_gb >= 1 else 256)
    conv._Reader._load = timed("reader: get + copy to GPU", conv._Reader._load)
    conv._Reader.take = timed("convert: wait for the reader", conv._Reader.take)
    conv.quantize_target = timed("convert: quantize", conv.quantize_target)
    conv.upload = timed("reader: chunks read and copied to the GPU", conv.upload)
    writer.download = timed("writer: chunks copied back and written", writer.download)
    writer.TensorWriter._submit = timed("convert: hand over (waits when the writer is behind)",
                                        writer.TensorWriter._submit)
    writer.write_bytes = timed("writer: pwrite", writer.write_bytes)
    writer.os = types.SimpleNamespace(**{**vars(os), "fsync": timed("writer: fsync", os.fsync)})
    files.TensorSource.get = timed("any: TensorSource.get", files.TensorSource.get)
    files.TensorSource.read_into = timed("reader: positional reads into the buffer", files.TensorSource.read_into)
    conv.plan_conversion = timed("whole: plan_conversion", conv.plan_conversion)
    conv._convert_pieces = timed("whole: the pieces' loop", conv._convert_pieces)
    conv._finalize = timed("whole: _finalize (publish included)", conv._finalize)
    conv.publish = timed("whole: publish (fsync of the tree, rename)", conv.publish)
    conv.write_json = timed("any: write_json (fsynced)", conv.write_json)
    conv._release_host_cache = timed("whole: release the pinned host cache", conv._release_host_cache)
    SharedScales.amax = staticmethod(timed("convert: global-scale amax", SharedScales.amax))
    if args.device.startswith("cuda"):
        torch.cuda.init()
    runs = []
    for r in range(args.repeat):
        TIMES.clear(), COUNTS.clear(), FIRST.clear(), LONGEST.clear()
        shutil.rmtree(work / "out", ignore_errors=True)
        t0 = time.perf_counter()
        lowbit.convert_checkpoint(src, work / "out", args.scheme, device=args.device, progress=False)
        wall = time.perf_counter() - t0
        out_bytes = sum(f.stat().st_size for f in (work / "out").glob("*.safetensors"))
        rows = sorted(((t, lab, th, COUNTS[(th, lab)], FIRST[(th, lab)], LONGEST[(th, lab)])
                       for (th, lab), t in TIMES.items()), reverse=True)
        print(f"run {r + 1}: {args.scheme}: {info['bytes'] / 1e9:.2f} GB source -> {out_bytes / 1e9:.2f} GB in "
              f"{wall:.2f} s ({info['bytes'] / 1e9 / wall:.2f} GB/s of source), workdir {work}")
        print(f"  {'thread':28s} {'what':52s} {'total':>9s}  {'calls':>6s} {'first':>7s} {'longest':>7s}")
        for t, lab, th, n, first, longest in rows:
            print(f"  {th:28s} {lab:52s} {t:7.2f} s  {n:6d} {first:7.3f} {longest:7.3f}")
        runs.append({"wall_s": wall, "output_bytes": out_bytes,
                     "rows": [{"thread": th, "what": lab, "s": t, "calls": n, "first_s": f, "longest_s": lg}
                              for t, lab, th, n, f, lg in rows]})
    if args.out_json:
        Path(args.out_json).write_text(json.dumps({
            "scheme": args.scheme, "source_bytes": info["bytes"], "workdir": str(work), "runs": runs}, indent=1))
    shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
