"""The ``lowbit`` command: ``lowbit bench`` (the benchmark harness) and ``lowbit env`` (what can run here).

Thin over :mod:`lowbit.bench` and :mod:`lowbit.bench.envinfo`; importing this module does no GPU work.
"""

from __future__ import annotations

import argparse
import json
import sys


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="lowbit", description="lowbit low-bit tensor formats")
    sub = parser.add_subparsers(dest="command", required=True)

    b = sub.add_parser(
        "bench",
        help="time quantize/dequantize (and later GEMV/GEMM) ops on the GPU",
        description="Median do_bench times, GB/s, %% of the copy bandwidth measured in the same "
        "run, and speedups over baselines. Needs CUDA (except --list).",
    )
    b.add_argument(
        "--ops",
        default=None,
        help="comma-separated globs or name parts: 'quantize.mx*,nf4' (default: every op)",
    )
    b.add_argument(
        "--shapes",
        default=None,
        help="comma-separated shapes replacing each op's own: '4096x4096,1x7168' (a lone N is NxN)",
    )
    b.add_argument(
        "--json",
        dest="json_path",
        default=None,
        metavar="PATH",
        help="write the results here (a directory gets quant_kernels_<date>.json)",
    )
    b.add_argument("--quick", action="store_true", help="each op's quick shapes only")
    b.add_argument(
        "--baselines",
        choices=("one", "all", "none"),
        default="one",
        help="time baselines at one shape per op (default), at every shape, or not at all",
    )
    b.add_argument(
        "--no-check",
        dest="check",
        action="store_false",
        help="skip the bit-exact comparison with the torch reference before timing",
    )
    b.add_argument(
        "--budget-s",
        type=float,
        default=None,
        help="after this many seconds, skip the baselines not yet timed",
    )
    b.add_argument("--list", action="store_true", help="list the registered ops and their shapes, then exit")
    b.add_argument("--quiet", action="store_true", help="no per-case progress lines")

    e = sub.add_parser("env", help="versions, GPU, which backends and kernels can run, LOWBIT_* variables")
    e.add_argument("--json", action="store_true", help="print JSON")
    return parser


def _list_ops(ops) -> str:
    from .bench import shape_str

    lines = []
    for op in ops:
        shapes = ", ".join(shape_str(s) for s in op.shapes)
        quick = ", ".join(shape_str(s) for s in op.quick_shapes)
        lines.append(f"{op.name:32} {shapes}  (quick: {quick}; baselines at {shape_str(op.baseline_shape)})")
        if op.doc:
            lines.append(f"{'':32} {op.doc}")
    return "\n".join(lines)


def cmd_bench(args: argparse.Namespace) -> int:
    from pathlib import Path

    from . import bench
    from .bench import envinfo

    try:
        ops = bench.select([p.strip() for p in args.ops.split(",") if p.strip()] if args.ops else None)
        shapes = bench.parse_shapes(args.shapes) if args.shapes else None
    except ValueError as e:
        print(f"lowbit bench: {e}", file=sys.stderr)
        return 2
    if args.list:
        print(_list_ops(ops))
        return 0
    import torch

    if not torch.cuda.is_available():
        print(
            "lowbit bench: needs a CUDA GPU (torch.cuda.is_available() is False); "
            "`lowbit bench --list` shows the registry, `lowbit env` what can run here",
            file=sys.stderr,
        )
        return 2
    header = envinfo.header()
    path = args.json_path
    if path is not None and Path(path).is_dir():
        path = str(Path(path) / bench.default_json_name(header))
    result = bench.run(
        ops,
        shapes=shapes,
        quick=args.quick,
        baselines=args.baselines,
        check=args.check,
        budget_s=args.budget_s,
        json_path=path,
        header=header,
        progress=None if args.quiet else (lambda s: print(s, flush=True)),
    )
    print(bench.format_table(result), flush=True)
    if path is not None:
        print(f"results: {path}")
    return 1 if any(r["status"] in ("failed", "check_failed") for r in result["rows"]) else 0


def cmd_env(args: argparse.Namespace) -> int:
    from .bench import envinfo

    info = envinfo.env_info()
    print(json.dumps(info, indent=1) if args.json else envinfo.format_env(info))
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return {"bench": cmd_bench, "env": cmd_env}[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
