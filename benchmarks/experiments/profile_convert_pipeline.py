"""Where one conversion process spends its time, per thread: the reader (source tensor read and copy to the GPU), the
converting thread (waiting for the reader, quantizing, handing over to the writer) and the writer
(copies back from the GPU, pwrite, fsync). One process, in-process timers around those calls; the synthetic source
of ``convert_throughput.py`` and its timers (``Timers``; ``convert_throughput.py --profile`` runs them in every
rank of a multi-GPU run).

    PYTHONUNBUFFERED=1 python3 benchmarks/experiments/profile_convert_pipeline.py --size-gb 10 \
        --workdir /dev/shm/pp --scheme w8a8-fp8-block --out-json $OUT/pipeline.json
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import shutil
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "src"))

_spec = importlib.util.spec_from_file_location("convert_throughput", ROOT / "benchmarks" / "convert_throughput.py")
ct = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ct)


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

    work = Path(args.workdir)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    src = work / "src"
    info = ct.write_source(src, args.size_gb, None, args.device, 1024 if args.size_gb >= 1 else 256)
    timers = ct.Timers().install()
    if args.device.startswith("cuda"):
        torch.cuda.init()
    runs = []
    for r in range(args.repeat):
        shutil.rmtree(work / "out", ignore_errors=True)
        timers.rows()  # start over
        t0 = time.perf_counter()
        lowbit.convert_checkpoint(src, work / "out", args.scheme, device=args.device, progress=False)
        wall = time.perf_counter() - t0
        out_bytes = sum(f.stat().st_size for f in (work / "out").glob("*.safetensors"))
        rows = timers.rows()
        print(f"run {r + 1}: {args.scheme}: {info['bytes'] / 1e9:.2f} GB source -> {out_bytes / 1e9:.2f} GB in "
              f"{wall:.2f} s ({info['bytes'] / 1e9 / wall:.2f} GB/s of source), workdir {work}")
        print(ct.format_rows(rows))
        runs.append({"wall_s": wall, "output_bytes": out_bytes, "rows": rows})
    if args.out_json:
        Path(args.out_json).write_text(json.dumps({
            "scheme": args.scheme, "source_bytes": info["bytes"], "workdir": str(work), "runs": runs}, indent=1))
    shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
