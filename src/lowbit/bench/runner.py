"""Run registered ops over their shapes: time, count bytes, compare with the copy roof and the baselines.

Two passes: first every lowbit case (so a run cut short still has them: the JSON is rewritten after every
case), then the baselines, which may spend most of the time in ``torch.compile``, within the time budget.
Every time comes from the one timer (:class:`~lowbit.bench.timing.CudaTimer`): ``do_bench`` medians, and
CUDA-graph replays for small or graph-bound cases, the baselines of such a case timed both ways too.
"""

from __future__ import annotations

import json
import math
import time
import traceback
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

from . import envinfo
from .registry import Case, Context, Op, Shape, Skip, shape_str
from .timing import Stats

SCHEMA = "lowbit.bench/1"
GRAPH_MAX_BYTES = 16 << 20  # cases moving less than this are also timed under a CUDA graph
ROW_KEYS = (
    "op",
    "shape",
    "status",
    "reason",
    "ms",
    "ms_p20",
    "ms_p80",
    "ms_graph",
    "bytes",
    "flops",
    "GBps",
    "pct_copy",
    "TFLOPS",
    "check",
    "baselines",
    "gpu",
    "git_sha",
)
STATUSES = ("ok", "skipped", "failed", "check_failed")
BASELINE_MODES = ("one", "all", "none")


def _reason(e: BaseException) -> str:
    msg = str(e).strip().splitlines()
    return f"{type(e).__name__}: {msg[0] if msg else ''}"[:400]


def plan(
    ops: list[Op], shapes: list[Shape] | None = None, quick: bool = False, baselines: str = "one"
) -> list[tuple[Op, Shape, bool]]:
    """``(op, shape, with_baselines)`` for every case to run, in order.

    ``shapes`` replaces each op's own shapes; ``quick`` uses ``op.quick_shapes``. Baselines run at every
    shape (``"all"``), none (``"none"``) or one per op (``"one"``): ``op.baseline_shape`` when it is
    among the shapes run, else the last of them; every shape for an op with ``baselines_everywhere``.
    """
    if baselines not in BASELINE_MODES:
        raise ValueError(f"baselines must be one of {BASELINE_MODES}, got {baselines!r}")
    cases = []
    for op in ops:
        chosen = list(shapes) if shapes else list(op.quick_shapes if quick else op.shapes)
        at = op.baseline_shape if op.baseline_shape in chosen else chosen[-1]
        for s in chosen:
            one = op.baselines_everywhere or tuple(s) == tuple(at)
            cases.append((op, tuple(s), baselines == "all" or (baselines == "one" and one)))
    return cases


def _row(op: Op, shape: Shape, header: dict[str, Any]) -> dict[str, Any]:
    row: dict[str, Any] = dict.fromkeys(ROW_KEYS)
    row.update(
        op=op.name,
        shape=list(shape),
        status="failed",
        baselines={},
        gpu=header.get("gpu"),
        git_sha=header.get("git_sha"),
        flops=0,
    )
    if op.nbytes is not None:
        row["bytes"] = op.nbytes(shape)
    return row


def _fill_times(row: dict[str, Any], st: Stats, copy_gbps: float | None) -> None:
    row.update(ms=st.ms, ms_p20=st.p20, ms_p80=st.p80)
    if row["bytes"]:
        row["GBps"] = row["bytes"] / st.ms / 1e6
        if copy_gbps:
            row["pct_copy"] = 100.0 * row["GBps"] / copy_gbps
    if row["flops"]:
        row["TFLOPS"] = row["flops"] / st.ms / 1e9


def run_case(
    op: Op,
    shape: Shape,
    ctx: Context,
    timer: Any,
    header: dict[str, Any],
    copy_gbps: float | None,
    check_max_numel: int = 1 << 28,
    graph_max_bytes: int = GRAPH_MAX_BYTES,
) -> dict[str, Any]:
    """Set up, check and time ``op`` at ``shape`` (no baselines); returns the row. Never raises for the op."""
    row = _row(op, shape, header)
    try:
        reason = op.unavailable(ctx) if op.unavailable is not None else None
        if reason:
            row.update(status="skipped", reason=reason)
            return row
        case = op.setup(shape, ctx)
    except Skip as e:
        row.update(status="skipped", reason=str(e))
        return row
    except Exception as e:  # noqa: BLE001 - reported in the row, the run goes on
        row.update(status="failed", reason="setup: " + _reason(e), traceback=traceback.format_exc(limit=6))
        return row
    try:
        if op.nbytes is not None and case.bytes != row["bytes"]:
            raise AssertionError(
                f"byte count: setup moved {case.bytes}, the op's formula says {row['bytes']}"
            )
        row.update(bytes=case.bytes, flops=case.flops)
        if case.note:
            row["note"] = case.note
        if case.check is None or not ctx.check:
            row["check"] = "not run"
        elif (case.check_numel if case.check_numel is not None else math.prod(shape)) > check_max_numel:
            row["check"] = f"not run (more than {check_max_numel} elements)"
        else:
            try:
                said = case.check()
                row["check"] = said if isinstance(said, str) and said else "bitexact"
            except AssertionError as e:
                # the gate: a case that does not match the reference reports no numbers
                row.update(status="check_failed", check="FAILED", reason=str(e)[:800])
                return row
        _fill_times(row, timer.time(case.fn), copy_gbps)
        want_graph = case.graph if case.graph is not None else case.bytes < graph_max_bytes
        if want_graph:
            try:
                row["ms_graph"] = timer.time_graph(case.fn)
            except Exception as e:  # noqa: BLE001 - a capture failure only loses the graph column
                row["graph_error"] = _reason(e)
        row["status"] = "ok"
    except Exception as e:  # noqa: BLE001
        row.update(status="failed", reason=_reason(e), traceback=traceback.format_exc(limit=6))
    return row


def time_baselines(case: Case, row: dict[str, Any], timer: Any, deadline: float | None) -> None:
    """Time each of ``case.baselines`` into ``row["baselines"]`` (first call, e.g. compilation, untimed).

    Where the lowbit case has a CUDA-graph time, each baseline is also replayed from a CUDA graph
    (``ms_graph``, ``speedup_graph``); a baseline that cannot be captured keeps its eager numbers and says why
    in ``graph_error``."""
    for name, fn in case.baselines.items():
        entry: dict[str, Any]
        if isinstance(fn, str):
            entry = {"skipped": fn}
        elif deadline is not None and time.monotonic() > deadline:
            entry = {"skipped": "time budget spent"}
        else:
            try:
                t0 = time.monotonic()
                with warnings.catch_warnings():
                    # torch.compile's graph-break chatter would bury the results in the log
                    warnings.filterwarnings("ignore", module=r"torch\._(dynamo|inductor)")
                    fn()
                entry = {"first_call_s": round(time.monotonic() - t0, 2)}
                st = timer.time(fn)
                entry.update(ms=st.ms, ms_p20=st.p20, ms_p80=st.p80)
                if row.get("bytes"):
                    entry["GBps"] = row["bytes"] / st.ms / 1e6
                if row.get("ms"):
                    entry["speedup"] = st.ms / row["ms"]
                if row.get("ms_graph"):
                    try:
                        entry["ms_graph"] = timer.time_graph(fn)
                        entry["speedup_graph"] = entry["ms_graph"] / row["ms_graph"]
                    except Exception as e:  # noqa: BLE001 - a capture failure only loses the graph numbers
                        entry["graph_error"] = _reason(e)
            except Exception as e:  # noqa: BLE001 - a failing baseline is reported, the run goes on
                entry = {"failed": _reason(e)}
        row["baselines"][name] = entry


def run(
    ops: list[Op],
    *,
    shapes: list[Shape] | None = None,
    quick: bool = False,
    baselines: str = "one",
    check: bool = True,
    timer: Any = None,
    device: str = "cuda",
    backend: str = "triton",
    budget_s: float | None = None,
    json_path: str | Path | None = None,
    progress: Callable[[str], None] | None = print,
    header: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Benchmark ``ops``; returns the result dict (see :func:`validate`) and writes it to ``json_path``.

    Args:
        ops: from :func:`lowbit.bench.select`.
        shapes: replaces each op's shapes; quick: each op's quick shapes.
        baselines: ``"one"`` (one shape per op), ``"all"`` or ``"none"``.
        check: compare each case with the torch reference first (bit for bit); a mismatch withholds its
            numbers.
        timer: a :class:`~lowbit.bench.timing.CudaTimer` (default) or any object with its methods.
        device, backend: where lowbit runs (``"cuda"``/``"triton"``; the CPU tests use ``"cpu"``/``"torch"``).
        budget_s: seconds after which baselines not yet timed are skipped (lowbit cases always run).
        json_path: written after the lowbit pass and again at the end.
        progress: called with one line per case; None for quiet.
    """
    t_start = time.monotonic()
    deadline = t_start + budget_s if budget_s is not None else None
    say = progress or (lambda s: None)
    if timer is None:
        from .timing import CudaTimer

        timer = CudaTimer()
    header = header if header is not None else envinfo.header()
    copy = timer.copy_bandwidth()
    launch = timer.launch_overhead()
    say(
        f"copy {copy['GBps']:.0f} GB/s; empty triton launch {launch['eager_us']:.1f} us eager, "
        f"{launch['graph_us']:.2f} us graph"
    )
    cases = plan(ops, shapes, quick, baselines)
    result: dict[str, Any] = {
        "schema": SCHEMA,
        "header": header,
        "reference": {"copy": copy, "empty_triton_launch": launch},
        "config": {
            "ops": [op.name for op in ops],
            "shapes": [list(s) for s in shapes] if shapes else None,
            "quick": quick,
            "baselines": baselines,
            "check": check,
            "device": device,
            "backend": backend,
            "budget_s": budget_s,
        },
        "rows": [],
        "complete": False,
        "elapsed_s": None,
    }

    def dump() -> None:
        result["elapsed_s"] = round(time.monotonic() - t_start, 1)
        if json_path is not None:
            Path(json_path).parent.mkdir(parents=True, exist_ok=True)
            Path(json_path).write_text(json.dumps(result, indent=1, default=str) + "\n")

    rows = {}
    for op, shape, _ in cases:
        ctx = Context(device=device, backend=backend, baselines=False, check=check)
        row = run_case(op, shape, ctx, timer, header, copy["GBps"])
        rows[(op.name, shape)] = row
        result["rows"].append(row)
        dump()  # a run killed by a time limit keeps every case measured so far
        say(_progress_line(row))
    if hasattr(timer, "cleanup"):
        timer.cleanup()
    dump()

    # baselines: external peers first, then lowbit's own compiled reference (the slowest to compile), so a
    # time budget cuts the least informative ones
    groups = (
        ("external", lambda n: not n.startswith("lowbit.")),
        ("lowbit", lambda n: n.startswith("lowbit.")),
    )
    pending = [
        (op, shape) for op, shape, with_b in cases if with_b and rows[(op.name, shape)]["status"] == "ok"
    ]
    for group, keep in groups:
        later = []
        for op, shape in pending:
            row = rows[(op.name, shape)]
            try:
                case = op.setup(shape, Context(device=device, backend=backend, baselines=True, check=False))
                wanted = {n: b for n, b in case.baselines.items() if keep(n)}
                if any(not keep(n) for n in case.baselines):
                    later.append((op, shape))
                if wanted:
                    case.baselines = wanted
                    time_baselines(case, row, timer, deadline)
                    say(
                        f"baselines {row['op']} {shape_str(shape)}: "
                        + _baseline_text({n: row["baselines"][n] for n in wanted})[:300]
                    )
                del case
            except Exception as e:  # noqa: BLE001
                row["baselines"][f"*{group}"] = {"failed": "setup: " + _reason(e)}
            if hasattr(timer, "cleanup"):
                timer.cleanup()
            dump()
        pending = later
    result["complete"] = True
    dump()
    return result


def _progress_line(row: dict[str, Any]) -> str:
    if row["status"] == "ok":
        graph = f" (graph {row['ms_graph'] * 1e3:.1f})" if row.get("ms_graph") else ""
        tflops = f" {row['TFLOPS']:6.1f} TFLOPS" if row.get("TFLOPS") else ""
        return (
            f"{row['op']:34} {shape_str(row['shape']):16} {row['ms'] * 1e3:9.1f} us{graph} "
            f"{row['GBps']:7.0f} GB/s{tflops}"
        )
    return f"{row['op']:34} {shape_str(row['shape']):12} {row['status']}: {row['reason']}"


_SHORT = (
    ("bitsandbytes.", "bnb."),
    ("torchao.", "ao."),
    ("lowbit.formats[compiled]", "ref[compiled]"),
    ("torch._scaled_mm", "_scaled_mm"),
)


def _short(name: str) -> str:
    for long, short in _SHORT:
        name = name.replace(long, short)
    return name


def _baseline_text(baselines: dict[str, Any], short: bool = False) -> str:
    """``name 274.1us 3.20x; name skipped (...)``; ``short`` names and leaves reasons to the notes."""
    parts = []
    for name, b in baselines.items():
        label = _short(name) if short else name
        if "ms" in b:
            sp = f" {b['speedup']:.2f}x" if b.get("speedup") else ""
            if b.get("speedup_graph"):
                sp += f" (graph {b['speedup_graph']:.2f}x)"
            parts.append(f"{label} {b['ms'] * 1e3:.1f}us{sp}")
        else:
            what = "skipped" if "skipped" in b else "failed"
            parts.append(f"{label} {what}" if short else f"{label} {what} ({b.get(what)})")
    return "; ".join(parts)


def validate(result: dict[str, Any]) -> None:
    """Raise ValueError unless ``result`` has the ``lowbit.bench/1`` layout."""

    def need(cond: bool, what: str) -> None:
        if not cond:
            raise ValueError(f"bench result: {what}")

    need(result.get("schema") == SCHEMA, f"schema must be {SCHEMA!r}")
    for key in ("header", "reference", "config", "rows", "complete", "elapsed_s"):
        need(key in result, f"missing {key!r}")
    for key in ("date", "gpu", "driver", "cuda", "torch", "triton", "lowbit", "git_sha"):
        need(key in result["header"], f"header lacks {key!r}")
    copy = result["reference"].get("copy", {})
    need(all(isinstance(copy.get(k), (int, float)) for k in ("bytes", "ms", "GBps")), "reference.copy")
    need(copy["bytes"] >= 2 * (1 << 30), "the copy must move >= 1 GiB each way")
    launch = result["reference"].get("empty_triton_launch", {})
    need(
        all(isinstance(launch.get(k), (int, float)) for k in ("eager_us", "graph_us")), "empty_triton_launch"
    )
    need(isinstance(result["rows"], list), "rows must be a list")
    for row in result["rows"]:
        name = f"row {row.get('op')} {row.get('shape')}"
        need(all(k in row for k in ROW_KEYS), f"{name} lacks {[k for k in ROW_KEYS if k not in row]}")
        need(row["status"] in STATUSES, f"{name}: status {row['status']!r}")
        need(
            isinstance(row["shape"], list) and all(isinstance(d, int) for d in row["shape"]), f"{name}: shape"
        )
        need(isinstance(row["baselines"], dict), f"{name}: baselines")
        if row["status"] == "ok":
            for k in ("ms", "GBps", "pct_copy"):
                need(isinstance(row[k], (int, float)) and row[k] > 0, f"{name}: {k}")
            need(isinstance(row["bytes"], int) and row["bytes"] > 0, f"{name}: bytes")
        else:
            need(
                isinstance(row["reason"], str) and row["reason"],
                f"{name}: a {row['status']} row needs a reason",
            )
            need(row["ms"] is None, f"{name}: a {row['status']} row must not carry a time")
        for bname, b in row["baselines"].items():
            need(
                isinstance(b, dict) and ("ms" in b or "skipped" in b or "failed" in b),
                f"{name}: baseline {bname}",
            )


def format_table(result: dict[str, Any]) -> str:
    """The header line, the roofs, one line per timed case, then the skipped/failed cases and baselines with
    their reasons (each reason once)."""
    h = result["header"]
    ref = result["reference"]
    copy, launch = ref["copy"], ref["empty_triton_launch"]
    title = (
        f"lowbit bench | {h.get('gpu')} | driver {h.get('driver')} | CUDA {h.get('cuda')} "
        f"| torch {h.get('torch')} | triton {h.get('triton')} | lowbit {h.get('lowbit')} "
        f"| git {h.get('git_sha')} | {h.get('date')}"
    )
    roofs = (
        f"copy roof {copy['GBps']:.0f} GB/s ({copy['bytes'] / 2**30:.0f} GiB read+write); empty triton "
        f"launch {launch['eager_us']:.1f} us eager, {launch['graph_us']:.2f} us graph. us = median; "
        "baselines: speedup = baseline us / lowbit us (graph: both as CUDA-graph replays); check: exact = "
        "bit for bit, tol = within the op's relative error bound"
    )
    columns = (
        f"{'op':30} {'shape':15} {'us':>8} {'p20-p80':>13} {'graph':>7} {'GB/s':>5} {'%copy':>5} "
        f"{'TF/s':>6} {'check':5} baselines"
    )
    lines = [title, roofs, columns]
    notes: dict[str, list[str]] = {}
    for row in result["rows"]:
        case = f"{row['op']}[{shape_str(row['shape'])}]"
        if row["status"] == "ok":
            spread = f"{row['ms_p20'] * 1e3:.1f}-{row['ms_p80'] * 1e3:.1f}"
            graph = f"{row['ms_graph'] * 1e3:7.2f}" if row.get("ms_graph") else f"{'-':>7}"
            check = {"bitexact": "exact", "not run": "-"}.get(row["check"], "-")
            if check == "-" and str(row["check"]).startswith("rel_"):
                check = "tol"
            tflops = f"{row['TFLOPS']:6.1f}" if row.get("TFLOPS") else f"{'-':>6}"
            lines.append(
                f"{row['op']:30} {shape_str(row['shape']):15} {row['ms'] * 1e3:8.1f} {spread:>13} {graph} "
                f"{row['GBps']:5.0f} {row['pct_copy']:5.1f} {tflops} {check:5} "
                f"{_baseline_text(row['baselines'], short=True)}"
            )
            for name, b in row["baselines"].items():
                if "ms" not in b:
                    what = "skipped" if "skipped" in b else "failed"
                    notes.setdefault(f"baseline {name} {what}: {b[what]}", []).append(case)
        else:
            notes.setdefault(f"{row['status']}: {row['reason']}", []).append(case)
    for key, cases in notes.items():
        lines.append(f"{key.splitlines()[0][:220]}\n    {', '.join(cases)}")
    lines.append(
        f"{sum(r['status'] == 'ok' for r in result['rows'])} ok / {len(result['rows'])} cases, "
        f"{result['elapsed_s']} s{'' if result['complete'] else ' (incomplete)'}"
    )
    return "\n".join(lines)


def default_json_name(header: dict[str, Any], stem: str = "quant_kernels") -> str:
    """``<stem>_<date>.json`` (the date the results file must carry)."""
    return f"{stem}_{header['date']}.json"


def ratios(result: dict[str, Any]) -> dict[str, dict[str, float]]:
    """The ratios of a result that compare across runs, per ``"<op> <shape>"`` of each timed case:
    ``vs <baseline>`` (its speedup: baseline time / lowbit time, eager), ``vs <baseline> [graph]`` (the same
    as CUDA-graph replays) and ``of_copy`` (the GB/s as a share of the copy roof measured in the same run)."""
    out: dict[str, dict[str, float]] = {}
    for row in result.get("rows", []):
        if not isinstance(row, dict) or row.get("status") != "ok":
            continue
        r: dict[str, float] = {}
        if isinstance(row.get("pct_copy"), (int, float)):
            r["of_copy"] = row["pct_copy"] / 100.0
        for name, b in (row.get("baselines") or {}).items():
            if isinstance(b, dict) and isinstance(b.get("speedup"), (int, float)):
                r[f"vs {name}"] = b["speedup"]
            if isinstance(b, dict) and isinstance(b.get("speedup_graph"), (int, float)):
                r[f"vs {name} [graph]"] = b["speedup_graph"]
        out[f"{row.get('op')} {shape_str(row.get('shape') or [])}"] = r
    return out


def _any_ratios(run: dict[str, Any]) -> dict[str, dict[str, float]]:
    from . import legacy

    return ratios(run) if run.get("schema") == SCHEMA else legacy.ratios(run)


def compare(result: dict[str, Any], baseline: dict[str, Any]) -> str:
    """Each ratio of ``result`` (:func:`ratios`) next to the same ratio in ``baseline`` (a ``lowbit bench``
    result, or a curated file of them under ``"runs"``: for each case its newest run that has it), with the
    change and a geometric-mean summary per ratio. Baseline runs in the layouts of the scripts the matmul ops
    replaced are read too (:mod:`lowbit.bench.legacy`). Raises
    :class:`~lowbit.bench.comparison.CompareError` when the new run is not a ``lowbit bench`` result or the
    baseline holds no run of either kind."""
    from .comparison import CompareError, newest, runs_of, table

    if result.get("schema") != SCHEMA or not isinstance(result.get("rows"), list):
        raise CompareError(f"the new run is not a lowbit bench result (schema {SCHEMA!r} with rows)")
    runs = runs_of(baseline)
    if not runs or not all(r.get("schema") == SCHEMA and isinstance(r.get("rows"), list) or _any_ratios(r)
                           for r in runs):
        raise CompareError(f"the baseline is not a lowbit bench result (schema {SCHEMA!r} with rows), nor a "
                           "result of the W4A16 GEMV or scaled_mm scripts its ops replaced")
    return table(ratios(result), newest(baseline, _any_ratios), key="case", summary=True)
