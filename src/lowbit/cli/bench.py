"""``lowbit bench``: the registered ops, the model-level suites and ``lowbit bench compare``.

``lowbit bench <suite> ...`` and ``lowbit bench compare ...`` bypass the main parser: each suite parses its
own arguments, so :func:`run_subcommand` hands it the rest of the command line untouched.
"""

from __future__ import annotations

import argparse
import sys

from .errors import fail

ALIASES = ("e2e", "dit")
"""``lowbit <suite>`` is ``lowbit bench <suite>`` for these suites."""


def run_subcommand(name: str, argv: list[str]) -> int:
    """``lowbit bench NAME ARGV...``: ``compare`` or a registered suite."""
    from ..bench import SUITES

    if name == "compare":
        return cmd_bench_compare(argv)
    if name in SUITES:
        return SUITES[name].main(argv)
    return fail("bench", f"unknown subcommand {name!r}: use compare, {', '.join(SUITES)}, or options "
                         "(lowbit bench --help)")


def _list_ops(ops, suites=None) -> str:
    """``lowbit bench --list``: each op's shapes and where its baselines are timed, then the suites."""
    from ..bench import shape_str

    lines = []
    for op in ops:
        shapes = ", ".join(shape_str(s) for s in op.shapes)
        quick = ", ".join(shape_str(s) for s in op.quick_shapes)
        at = "every shape" if op.baselines_everywhere else shape_str(op.baseline_shape)
        lines.append(f"{op.name:32} {shapes}  (quick: {quick}; baselines at {at})")
        if op.doc:
            lines.append(f"{'':32} {op.doc}")
    if suites:
        lines.append("")
        lines.append("suites (lowbit bench <suite> [options]):")
        lines += [f"  {suite.name:30} {suite.doc}" for suite in suites]
    return "\n".join(lines)


def cmd_bench(args: argparse.Namespace) -> int:
    """``lowbit bench [options]``: 0, 1 when an op failed or its check did, 2 on bad input or without CUDA."""
    from pathlib import Path

    from .. import bench
    from ..bench import envinfo

    try:
        ops = bench.select([p.strip() for p in args.ops.split(",") if p.strip()] if args.ops else None)
        shapes = bench.parse_shapes(args.shapes) if args.shapes else None
    except ValueError as e:
        print(f"lowbit bench: {e}", file=sys.stderr)
        return 2
    if args.list:
        print(_list_ops(ops, None if args.ops else list(bench.SUITES.values())))
        return 0
    baseline = None
    if args.compare is not None:
        from ..bench.comparison import CompareError, load

        try:
            baseline = load(args.compare, "lowbit bench")
            bench.compare({"schema": bench.SCHEMA, "rows": []}, baseline)  # the baseline's layout, before the run
        except CompareError as e:
            return fail("bench", f"--compare {e}")
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
        quant_only = all(op.name.split(".")[0] in ("quantize", "dequantize") for op in ops)
        path = str(Path(path) / bench.default_json_name(header, "quant_kernels" if quant_only else "bench"))
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
    if baseline is not None:
        print(f"\nagainst {args.compare}:\n" + bench.compare(result, baseline), flush=True)
    return 1 if any(r["status"] in ("failed", "check_failed") for r in result["rows"]) else 0


def _compare_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="lowbit bench compare",
        description="Print each ratio of a new run (speedups over the baselines measured in the same run, share "
        "of the copy roof; for lowbit e2e results, ratios to bf16) next to the same ratio in a baseline run, with "
        "the change. Ratios, not times: runs on different machines differ in host CPU.",
    )
    p.add_argument("new", metavar="NEW.json", help="a lowbit bench (or lowbit e2e) result")
    p.add_argument("baseline", metavar="BASELINE.json",
                   help="a result of the same benchmark, or a curated file of them under \"runs\" (for each case "
                   "its newest run counts)")
    return p


def cmd_bench_compare(argv: list[str]) -> int:
    """``lowbit bench compare NEW BASELINE``: the ratios of both runs side by side; 2 if a file is unreadable."""
    from ..bench import SCHEMA, compare
    from ..bench.comparison import CompareError, load

    args = _compare_parser().parse_args(argv)
    try:
        new = load(args.new, "lowbit bench")
        baseline = load(args.baseline, "lowbit bench")
        if new.get("schema") != SCHEMA and _is_e2e(new):
            from ..bench import e2e

            text = e2e.compare(new, baseline)
        else:
            text = compare(new, baseline)
    except CompareError as e:
        return fail("bench compare", str(e))
    print(text)
    return 0


def _is_e2e(result: dict) -> bool:
    """Whether a result file is a ``lowbit e2e`` run (rows per config, settings with steps)."""
    rows = result.get("rows")
    return (isinstance(rows, list) and isinstance(result.get("settings"), dict) and "steps" in result["settings"]
            and all(isinstance(r, dict) and "config" in r for r in rows))
