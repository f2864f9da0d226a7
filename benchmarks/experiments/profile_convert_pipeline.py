"""Where one conversion process spends its time, per thread: the reader (source tensor read and copy to the
GPU), the converting thread (waiting for the reader, quantizing, copying back, handing over to the writer) and
the writer (pwrite, fsync). One process, in-process timers around those calls; the synthetic source of
``convert_throughput.py``.

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
    return wrapper


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--size-gb", type=float, default=10.0)
    p.add_argument("--workdir", default="/tmp/pp")
    p.add_argument("--scheme", default="w8a8-fp8-block")
    p.add_argument("--device", default="cuda:0")
    p.add_argument("--out-json", default=None)
    args = p.parse_args()
    import torch

    import lowbit
    import lowbit.io.convert as conv
    import lowbit.io.convert_writer as writer
    from lowbit.io import files

    work = Path(args.workdir)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    src = work / "src"
    info = ct.write_source(src, args.size_gb, None, args.device, 1024 if args.size_gb >= 1 else 256)
    conv._Reader._load = timed("reader: get + copy to GPU", conv._Reader._load)
    conv._Reader.take = timed("convert: wait for the reader", conv._Reader.take)
    conv.quantize_target = timed("convert: quantize", conv.quantize_target)
    conv._to_host = timed("convert: copy back to pinned", conv._to_host)
    writer.TensorWriter._submit = timed("convert: hand over (waits when the writer is behind)",
                                        writer.TensorWriter._submit)
    writer.write_bytes = timed("writer: pwrite", writer.write_bytes)
    writer.os = types.SimpleNamespace(**{**vars(os), "fsync": timed("writer: fsync", os.fsync)})
    files.TensorSource.get = timed("any: TensorSource.get", files.TensorSource.get)
    conv.plan_conversion = timed("whole: plan_conversion", conv.plan_conversion)
    conv._convert_pieces = timed("whole: the pieces' loop", conv._convert_pieces)
    conv._finalize = timed("whole: _finalize (publish included)", conv._finalize)
    conv.publish = timed("whole: publish (fsync of the tree, rename)", conv.publish)
    conv.write_json = timed("any: write_json (fsynced)", conv.write_json)
    if args.device.startswith("cuda"):
        torch.cuda.init()
    t0 = time.perf_counter()
    lowbit.convert_checkpoint(src, work / "out", args.scheme, device=args.device, progress=False)
    wall = time.perf_counter() - t0
    out_bytes = sum(f.stat().st_size for f in (work / "out").glob("*.safetensors"))
    rows = sorted(((t, lab, th, COUNTS[(th, lab)]) for (th, lab), t in TIMES.items()), reverse=True)
    print(f"{args.scheme}: {info['bytes'] / 1e9:.2f} GB source -> {out_bytes / 1e9:.2f} GB in {wall:.2f} s "
          f"({info['bytes'] / 1e9 / wall:.2f} GB/s of source), workdir {work}")
    for t, lab, th, n in rows:
        print(f"  {th:28s} {lab:52s} {t:7.2f} s  {n:6d} calls")
    if args.out_json:
        Path(args.out_json).write_text(json.dumps({
            "scheme": args.scheme, "source_bytes": info["bytes"], "output_bytes": out_bytes, "wall_s": wall,
            "workdir": str(work), "rows": [{"thread": th, "what": lab, "s": t, "calls": n} for t, lab, th, n in rows],
        }, indent=1))
    shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
