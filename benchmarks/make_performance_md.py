"""Regenerate docs/performance.md from the curated H100 results in benchmarks/results/ (no GPU needed).

    python benchmarks/make_performance_md.py            # writes docs/performance.md
    python benchmarks/make_performance_md.py --check    # exit 1 if docs/performance.md is not what it would write

Every number in the page comes from one of the JSON files below; each table names its file, GPU, date, git sha
and versions as the file records them. To refresh a table, replace that file with a newer run of the same
benchmark (same name) and rerun this script. The W4A16 decode and scaled_mm tables read either a ``lowbit bench``
result (``schema`` ``lowbit.bench/1``: ``lowbit bench --ops 'linear.*.decode'`` for h100_w4a16_gemv.json,
``--ops 'scaled_mm.*'`` for h100_scaled_mm_graph.json and h100_scaled_mm_decode.json) or the layout of the
scripts those ops replaced.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
OUT = ROOT / "docs" / "performance.md"

NA = "—"
BENCH_SCHEMA = "lowbit.bench/1"


def _load(name: str) -> dict:
    with open(RESULTS / name) as f:
        return json.load(f)


def _fmt(v, spec: str = ".2f", suffix: str = "") -> str:
    return NA if v is None else f"{v:{spec}}{suffix}"


def _table(head: list[str], rows: list[list[str]]) -> list[str]:
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    out += ["| " + " | ".join(r) + " |" for r in rows]
    return out


def _method(name: str, *, gpu=None, date=None, sha=None, torch=None, triton=None, cuda=None, extra="") -> str:
    parts = [f"`benchmarks/results/{name}`", gpu or "GPU not recorded", f"date {date or 'not recorded'}"]
    if sha:
        parts.append(f"git {sha}")
    vers = ", ".join(f"{k} {v}" for k, v in (("torch", torch), ("triton", triton), ("CUDA", cuda)) if v)
    if vers:
        parts.append(vers)
    return "Source: " + "; ".join(parts) + "." + (f" {extra}" if extra else "")


def _hdr_method(name: str, h: dict, extra: str = "") -> str:
    return _method(name, gpu=h.get("gpu"), date=h.get("date"), sha=h.get("git_sha"), torch=h.get("torch"),
                   triton=h.get("triton"), cuda=h.get("cuda"), extra=extra)


def _shape(n: int, k: int) -> str:
    return f"{n}×{k}"


# ------------------------------------------------------------------------------------------------ sections

E2E_MODES = [("eager", "eager"), ("graph", "CUDA graph"), ("compile", "compile"),
              ("compile-ro", "reduce-overhead"), ("prefill", "prefill"), ("generate", "`generate()`")]


def _e2e_cell(run: dict, row: dict, key: str) -> str | None:
    """One mode's value of one config in one run, with its ratio to bf16 in that run; None if not measured."""
    ratio = row.get("ratio") or {}
    if key == "host":
        host = row.get("host") or {}
        if host.get("us") is None:
            return None
        return f"{host['us']:.1f} µs ({_fmt(ratio.get('host_vs_f_linear'), '.2f', '×')})"
    v = row.get(key)
    if isinstance(v, dict):
        v = v.get("tok_s")
    if v is None:
        return None
    if key == "prefill":
        return f"{v:.1f} ms ({_fmt(ratio.get(key), '.2f', '×')})"
    return f"{v:.0f} ({_fmt(ratio.get(key), '.2f', '×')})"


def e2e() -> list[str]:
    """The newest measurement of every (config, mode) across the curated runs, each cell marked with its run
    (runs differ in host CPU, so a ratio is only comparable within its run, never across cells of a row)."""
    d = _load("h100_e2e.json")
    runs = d["runs"]
    keys = [("host", "host µs / linear call (× `F.linear`)")] + E2E_MODES
    cells: dict[str, dict[str, tuple[str, int]]] = {}
    weights: dict[str, float] = {}
    order: list[str] = []
    for i, run in enumerate(runs):
        for row in run["rows"]:
            c = row["config"]
            if c not in order:
                order.append(c)
            if row.get("weight_gb") is not None:
                weights[c] = row["weight_gb"]
            for k, _ in keys:
                v = _e2e_cell(run, row, k)
                if v is not None:
                    cells.setdefault(c, {})[k] = (v, i)
    used = sorted({i for c in cells.values() for _, i in c.values()})
    label = {i: chr(ord("a") + n) for n, i in enumerate(used)}
    head = ["config", "weights GB"] + [t for _, t in keys]
    rows = []
    for c in order:
        row = [f"`{c}`", _fmt(weights.get(c), ".1f")]
        for k, _ in keys:
            v = cells.get(c, {}).get(k)
            row.append(NA if v is None else f"{v[0]} ^{label[v[1]]}")
        rows.append(row)
    out = ["## End to end: a Llama-3-8B-shaped decoder (`lowbit e2e`)", "",
           ("Decode tokens/s (prefill: ms for the prompt) of a 32-layer Llama-3-8B-shaped decoder with random "
            "weights, static KV cache, every linear but `lm_head` quantized; in parentheses the ratio to bf16 "
            "in the same run (higher is better; prefill and host: lower time is better, the ratio is bf16's "
            "time over ours for prefill and ours over `F.linear` for host). Each cell is the newest "
            "measurement of that config and mode; its letter names the run. The lent machines' host CPUs "
            "differ from run to run, so compare ratios, and only within a run. "
            + _weight_gb_note(r["header"].get("date") for r in runs)), "",
           _hdr_method("h100_e2e.json", runs[-1]["header"], f"Newest of the {len(used)} runs the cells come from "
                       "(listed below the table)."), ""]
    out += _table(head, rows)
    out += ["", "Runs:", ""]
    for i in used:
        run = runs[i]
        s = run["settings"]
        out.append(f"- ^{label[i]} " + _hdr_method("h100_e2e.json", run["header"],
                   f"Batch {s['batch']}, {s['steps']} decode steps, prefill {s['prefill']} tokens, compile modes "
                   f"on {s['compile_layers']} of {run['shape']['layers']} layers. {run.get('note', '')}"))
    return out


def quant_kernels() -> list[str]:
    name = "h100_quant_kernels.json"
    d = _load(name)
    big = {}
    base = {}
    for r in d["rows"]:
        if r.get("status") != "ok":
            continue
        shape = tuple(r["shape"])
        if shape == (16384, 16384):
            big[r["op"]] = r
        if shape == (8192, 8192) and r.get("baselines"):
            base[r["op"]] = r["baselines"]
    rows = []
    for op, r in big.items():
        bl = base.get(op, {})
        best = ", ".join(f"{k} {v['speedup']:.2f}×" for k, v in bl.items() if v.get("speedup") is not None
                         and not k.startswith("lowbit"))
        rows.append([f"`{op}`", f"{r['pct_copy']:.0f} %", f"{r['GBps']:.0f}", best or NA])
    ref = d.get("reference", {})
    copy = ref.get("copy", {}).get("GBps")
    out = ["## Quantize and dequantize kernels (`lowbit bench`)", "",
           _hdr_method(name, d["header"], extra=f"Copy roof measured in the same run: {_fmt(copy, '.0f')} GB/s."),
           "",
           ("Bytes read and written by the kernel over its time, as a share of a device-to-device copy, at "
            "16384×16384 (bf16 in or out); speedup of lowbit over each baseline at 8192×8192. Every case is "
            "checked bit for bit against the CPU reference before it is timed."), ""]
    return out + _table(["op", "% of copy (16384²)", "GB/s", "lowbit ÷ baseline (8192²)"], rows)


GEMV_FORMATS = ["nvfp4", "mxfp4", "fp4_b32", "nf4", "nf4-dq", "int4_awq"]
CUBLAS = "cublas.bf16"  # the lowbit bench baseline name of cuBLAS bf16 F.linear
SCALED_MM_FP8 = "torch._scaled_mm[fp8]"


def _bench_rows(d: dict, kind: str, variant: str | None = None):
    """``(label, (M, N, K), row)`` for each timed row of a lowbit bench result whose op is
    ``<kind>.<label>[.<variant>]``."""
    for r in d["rows"]:
        parts = r["op"].split(".")
        if r.get("status") != "ok" or parts[0] != kind or (variant is not None and parts[-1] != variant):
            continue
        label = ".".join(parts[1:-1] if variant is not None else parts[1:])
        yield label, tuple(r["shape"]), r


def _graph_speedup(row: dict, baseline: str):
    """The speedup over ``baseline`` as CUDA-graph replays (eager where the run has no graph time)."""
    b = row.get("baselines", {}).get(baseline, {})
    return b.get("speedup_graph", b.get("speedup"))


def _bench_method(name: str, d: dict, command: str) -> str:
    copy = d.get("reference", {}).get("copy", {}).get("GBps")
    return _hdr_method(name, d["header"], extra=f"`{command}`; copy roof measured in the same run: "
                       f"{_fmt(copy, '.0f')} GB/s.")


def w4a16_gemv() -> list[str]:
    name = "h100_w4a16_gemv.json"
    d = _load(name)
    title = "## W4A16 decode: `lowbit.linear` GEMV (`lowbit bench --ops 'linear.*.decode'`)"
    cases = {}
    if d.get("schema") == BENCH_SCHEMA:
        for label, (m, n, k), r in _bench_rows(d, "linear", "decode"):
            cases.setdefault((n, k, m), {})[label.replace(".", "-")] = _graph_speedup(r, CUBLAS)
        method = _bench_method(name, d, "lowbit bench --ops 'linear.*.decode'")
        replays = "as CUDA-graph replays"
    else:
        for run in d["runs"]:
            for r in run["rows"]:
                cases.setdefault((r["n"], r["k"], r["m"]), {})[r["format"]] = r["speedup"]["graph"]
        r0 = d["runs"][0]
        method = _method(name, gpu=r0.get("device"), date=d.get("date"), sha=r0.get("git"), torch=r0.get("torch"),
                         triton=r0.get("triton"), extra=f"{d.get('note', '')} Copy roof {r0.get('copy_GBps', 0):.0f} "
                         "GB/s. Measured with `benchmarks/bench_w4a16.py --ms 1,16`, the script these ops replaced.")
        replays = f"as CUDA-graph replays of {r0.get('graph_calls')} calls"
    rows = [[_shape(n, k), str(m)] + [_fmt(cases[(n, k, m)].get(f)) for f in GEMV_FORMATS]
            for (n, k, m) in sorted(cases, key=lambda c: (c[2], c[0] * c[1], c[0]))]
    out = [title, "", method, "",
           (f"Speedup over cuBLAS bf16 `x @ w.T` on the same shape (N×K), both {replays} with the weights rotated "
            "out of L2; nf4-dq is NF4 with double quantization."), ""]
    return out + _table(["N×K", "M"] + GEMV_FORMATS, rows)


def prefill() -> list[str]:
    name = "h100_profile_prefill.json"
    d = _load(name)
    fmts, shapes, cell = [], [], {}
    for r in d["rows"]:
        s = (r["N"], r["K"])
        fmts += [r["format"]] if r["format"] not in fmts else []
        shapes += [s] if s not in shapes else []
        cell[(r["format"], s)] = (r.get("graph_ratio"), r.get("chunk64_ratio"))
    rows = [[f] + [f"{_fmt(cell.get((f, s), (None, None))[0])} ({_fmt(cell.get((f, s), (None, None))[1])})"
                   for s in shapes] for f in fmts]
    m = d["rows"][0]["M"]
    out = [(f"## W4A16 prefill: chunked dequantize + cuBLAS at M = {m} "
            "(`benchmarks/experiments/profile_prefill.py --graph --chunk-mb 64`)"), "",
           _hdr_method(name, d["header"]), "",
           ("Ratio to cuBLAS bf16 (higher is better): CUDA-graph replays, eager `do_bench` in parentheses "
            "(the small shapes are host-bound eagerly)."), ""]
    return out + _table(["format"] + [_shape(*s) for s in shapes], rows)


def scaled_mm_graph() -> list[str]:
    name = "h100_scaled_mm_graph.json"
    d = _load(name)
    shapes, pairs, cell = [], [], {}
    if d.get("schema") == BENCH_SCHEMA:
        for pair, s, r in _bench_rows(d, "scaled_mm", "prefill"):
            shapes += [s] if s not in shapes else []
            pairs += [pair] if pair not in pairs else []
            cell[(pair, s)] = (_graph_speedup(r, CUBLAS), _graph_speedup(r, SCALED_MM_FP8))
        method = _bench_method(name, d, "lowbit bench --ops 'scaled_mm.*.prefill'")
    else:
        for r in d["rows"]:
            s = (r["M"], r["N"], r["K"])
            shapes += [s] if s not in shapes else []
            pairs += [r["pair"]] if r["pair"] not in pairs else []
            cell[(r["pair"], s)] = (r.get("vs_cublas_bf16"), r.get("vs_scaled_mm_fp8"))
        method = _method(name, gpu=d.get("device"), date=d.get("date"), sha=d.get("git"), torch=d.get("torch"),
                         triton=d.get("triton"), extra="Measured with `benchmarks/bench_scaled_mm.py --graph`, the "
                         "script these ops replaced.")
    rows = []
    for p in pairs:
        cells = [f"`{p}`"]
        for s in shapes:
            c = cell.get((p, s))
            cells.append(NA if c is None else f"{_fmt(c[0])} / {_fmt(c[1])}")
        rows.append(cells)
    out = ["## Quantized × quantized GEMM at large M: `lowbit.scaled_mm` (`lowbit bench --ops 'scaled_mm.*.prefill'`)",
           "", method, "",
           ("Per pair and M×N×K: speedup over cuBLAS bf16 / over `torch._scaled_mm` per-tensor FP8, CUDA-graph "
            "replays. `w4a8_mxfp4` is FP8 per-token activations × MXFP4 weights."), ""]
    return out + _table(["pair"] + ["×".join(map(str, s)) for s in shapes], rows)


def scaled_mm_decode() -> list[str]:
    name = "h100_scaled_mm_decode.json"
    d = _load(name)
    shapes, keys, cell = [], [], {}
    if d.get("schema") == BENCH_SCHEMA:
        copy = d["reference"]["copy"]["GBps"]
        for pair, (m, n, k), r in _bench_rows(d, "scaled_mm", "decode"):
            s, key = (n, k), (pair, m)
            shapes += [s] if s not in shapes else []
            keys += [key] if key not in keys else []
            ms = r.get("ms_graph") or r["ms"]
            cell[(key, s)] = (_graph_speedup(r, CUBLAS), 100 * r["bytes"] / ms / 1e6 / copy)
        method = _bench_method(name, d, "lowbit bench --ops 'scaled_mm.*.decode'")
        what = "the bytes of both operands and the output"
    else:
        for r in d["rows"]:
            s = (r["N"], r["K"])
            key = (r["pair"], r["M"])
            shapes += [s] if s not in shapes else []
            keys += [key] if key not in keys else []
            cell[(key, s)] = (r["graph_vs_cublas_bf16"], r["pct_of_copy"])
        method = _method(name, gpu=d.get("device"), date=d.get("date"), sha=d.get("git"), torch=d.get("torch"),
                         triton=d.get("triton"), extra="Measured with `benchmarks/bench_scaled_mm.py --decode-graph`, "
                         "the script these ops replaced.")
        what = "the weight bytes"
    rows = []
    for key in keys:
        cells = [f"`{key[0]}`", str(key[1])]
        for s in shapes:
            c = cell.get((key, s))
            cells.append(NA if c is None else f"{_fmt(c[0])} ({c[1]:.0f} %)")
        rows.append(cells)
    out = ["## Quantized × quantized decode: `lowbit.scaled_mm` (`lowbit bench --ops 'scaled_mm.*.decode'`)",
           "", method, "",
           ("Speedup over cuBLAS bf16 as CUDA-graph replays over weight copies that do not fit in L2; in "
            f"parentheses {what} streamed per second as a share of the copy bandwidth."), ""]
    return out + _table(["pair", "M"] + [_shape(*s) for s in shapes], rows)


def layer_host() -> list[str]:
    name = "h100_profile_layer_host.json"
    d = _load(name)
    rows = [[f"`{r['scheme']}`", str(r["m"]), f"{r['host_us']:.1f}", f"{r['f_linear']['host_us']:.1f}",
             f"{r['gpu_us']:.1f}", f"{r['f_linear']['gpu_us']:.1f}"] for r in d["rows"]]
    out = [(f"## Host and GPU time of one `QuantLinear` call, K = N = {d['k']} "
            "(`benchmarks/experiments/profile_layer_host.py`)"), "",
           _method(name, gpu=d.get("device"), extra=f"Note: {d.get('note', NA)}"), "",
           ("Microseconds per call: host (Python and launch, calls issued back to back) and GPU (kernel time), "
            "against `F.linear` with the bf16 weight measured in the same run."), ""]
    return out + _table(["scheme", "M", "host µs", "`F.linear` host µs", "GPU µs", "`F.linear` GPU µs"], rows)


def tensor_parallel(name: str = "h100x2_tp.json") -> list[str]:
    d = _load(name)
    compiled = any("compiled_graph_ms" in r for r in d["rows"])
    h = d["header"]
    rows = []
    for r in d["rows"]:
        variant = "—" if r["world"] == 1 else r["all_reduce"] + (", exact" if r.get("exact") else "")
        rows.append([f"`{r['config']}`", str(r["world"]), variant, _fmt(r.get("decode_graph_ms"), ".3f"),
                     _fmt(r.get("projections_graph_ms"), ".3f")]
                    + ([_fmt(r.get("compiled_graph_ms"), ".3f")] if compiled else [])
                    + [_fmt(r.get("decode_eager_ms"), ".2f"),
                       _fmt(r.get("prefill_ms"), ".1f"), _fmt(r.get("weight_gb_per_rank"), ".2f"),
                       _fmt(r.get("rel_err_vs_1gpu_layer0"), ".1e")])
    ratios = []
    for e in d["ratios"]:
        variant = e["all_reduce"] + (", exact" if e.get("exact") else "")
        ratios.append([f"`{e['config']}`", variant] + [
            _fmt(e.get(m), ".3f") + ("" if m not in ("decode_graph", "prefill") else
                                     " (met)" if e.get(f"{m}_meets") else " (missed)")
            for m in ("decode_graph", "projections_graph", *(("compiled_graph",) if compiled else ()),
                      "decode_eager", "prefill")])
    gpu = d["header"]["gpu"].removeprefix("NVIDIA ").split()[0]
    out = [(f"## Tensor parallel on {gpu}: {d['args']['layers']} Llama-3-70B-shaped layers on 1 and {d['tp']} "
            "GPUs (`lowbit bench tp`)"), "",
           _hdr_method(name, h, extra=d.get("note", "")), "",
           ("Milliseconds per decode step at batch 1 replayed from a CUDA graph (all-reduces captured), the same "
            "for the projections alone (norms, the seven projections with their all-reduces, residual adds: no "
            "attention or RoPE)"
            + (", the `torch.compile`d decode step replayed from a CUDA graph (compiled)" if compiled else "")
            + ", eager decode, and eager prefill of "
            f"{d['args']['prefill']} tokens; the slowest rank. `err L0`: relative difference of the first "
            "layer's output from one GPU's."), ""]
    out += _table(["config", "GPUs", "row-parallel sum", "decode graph ms", "projections ms",
                   *(["compiled ms"] if compiled else []), "eager ms", "prefill ms", "GB per GPU", "err L0"], rows)
    out += ["", f"Time on {d['tp']} GPUs over time on 1 (targets: decode graph <= 0.6, prefill <= 0.55):", ""]
    out += _table(["config", "variant", "decode graph", "projections graph",
                   *(["compiled graph"] if compiled else []), "eager decode", "prefill"], ratios)
    return out


def convert_throughput(name: str = "h100x2_convert.json") -> list[str]:
    d = _load(name)
    src = d["source"]
    rows = [[f"`{r['scheme']}`", str(r["world_size"]), _fmt(r["inner_s"], ".1f"), _fmt(r["inner_gbps"], ".2f"),
             _fmt(r["outer_s"], ".1f"), _fmt(r["outer_gbps"], ".2f")] for r in d["runs"]]
    speed = [[f"`{s}`", _fmt(v.get("inner"), ".2f"), _fmt(v.get("outer"), ".2f"), str(d["identical"].get(s))]
             for s, v in d["speedup"].items()]
    gpu = d["host"]["gpus"][0].removeprefix("NVIDIA ").split()[0]
    argv = d.get("argv", [])
    workdir = argv[argv.index("--workdir") + 1] if "--workdir" in argv[:-1] else ""
    where = "the work directory, on /dev/shm (tmpfs)," if workdir.startswith("/dev/shm") else "the disk"
    out = [f"## Checkpoint conversion on 1 and 2 {gpu} GPUs (`benchmarks/convert_throughput.py`)", "",
           _method(name, gpu=", ".join(d["host"]["gpus"]), date=d["date"][:10], torch=d["host"]["torch"],
                   extra=f"A synthetic Llama-3-70B-shaped checkpoint of {src['bytes'] / 1e9:.1f} GB in "
                         f"{src['shards']} shards, read from the page cache; {where} takes "
                         f"{d['disk_write_gbps']:.2f} GB/s of fsynced writes."), "",
           ("Seconds and GB/s of source read, inside the workers (from a barrier to the end of rank 0's publish) "
            "and with process start-up."), ""]
    out += _table(["scheme", "GPUs", "inner s", "inner GB/s", "outer s", "outer GB/s"], rows)
    out += ["", "Speedup of 2 GPUs over 1 (target: >= 1.8) and byte-identical outputs:", ""]
    out += _table(["scheme", "inside", "with start-up", "identical"], speed)
    if d.get("note"):
        out += ["", f"Note: {d['note']}"]
    for label, other in d.get("other_runs", {}).items():
        out += ["", f"Speedup of 2 GPUs over 1 in the `{label}` run "
                    f"(disk: {other['disk_write_gbps']:.2f} GB/s of fsynced writes):", ""]
        out += _table(["scheme", "1 GPU inner s", "2 GPUs inner s", "inside", "with start-up", "identical"], [
            [f"`{s}`"] + [_fmt(next((r["inner_s"] for r in other["runs"] if r["scheme"] == s
                                     and r["world_size"] == w), None), ".2f") for w in (1, 2)]
            + [_fmt(v.get("inner"), ".2f"), _fmt(v.get("outer"), ".2f"), str(other["identical"].get(s))]
            for s, v in other["speedup"].items()])
    return out


def dit() -> list[str]:
    name = "h100_dit.json"
    d = _load(name)
    s, st = d["shape"], d["settings"]
    tokens = [str(t) for t in st["tokens"]]
    modes = st["modes"] if isinstance(st["modes"], list) else [m for m in st["modes"].split(",") if m]
    rows = []
    for r in d["rows"]:
        q = r.get("quality") or {}
        cells = [f"`{r['config']}`", _fmt(r.get("weight_gb"), ".3f"), _fmt(q.get("cosine"), ".5f"),
                 _fmt(q.get("sqnr_db"), ".1f")]
        for t in tokens:
            for m in modes:
                v = r.get("tokens", {}).get(t, {}).get(m)
                v = v.get("ms") if isinstance(v, dict) else v
                ratio = r.get("ratio", {}).get(t, {}).get(m)
                if not isinstance(v, float):
                    cells.append("error" if f"{t}/{m}" in r.get("errors", {}) else NA)
                else:
                    cells.append(f"{v:.2f}" + ("" if ratio is None or r["config"] == "bf16" else f" ({ratio:.2f}×)"))
        rows.append(cells)
    labels = {"eager": "eager", "graph": "CUDA graph", "compile": "compile"}
    head = ["config", "weights GB", "cosine", "SQNR dB"] + [f"{labels.get(m, m)} ms, M = {t}" for t in tokens
                                                             for m in modes]
    out = [f"## DiT block: one Wan2.1-14B-shaped block at {' and '.join(tokens)} tokens (`lowbit bench dit`)", "",
           _hdr_method(name, d["header"], extra=f"Best of {st['repeats']} calls (or graph replays) per mode, "
                       f"batch {st['batch']}."), "",
           (f"Milliseconds per forward of {s['blocks']} block (hidden {s['hidden']}, {s['heads']} heads of "
            f"{s['head_dim']}, FFN {s['ffn']}, {s['text_len']} text tokens; random weights, its 10 Linear layers "
            "quantized, attention in bf16) at M tokens; in parentheses bf16's time over the config's in the same run "
            "(above 1 is faster). Cosine and SQNR: the block's output against bf16's on the same input at "
            f"M = {tokens[0]}. " + _weight_gb_note([d["header"].get("date")])), ""]
    return out + _table(head, rows)


WEIGHT_GB_FIXED = "2026-11-30"
"""Runs dated before this counted every parameter twice in their weight bytes (fixed in
``lowbit.bench.common.weight_bytes`` on 2026-11-29; no run of that day is rendered here)."""


def _weight_gb_note(dates) -> str:
    if not any((d or "") < WEIGHT_GB_FIXED for d in dates):
        return ""
    return ("Weights GB of runs dated before " + WEIGHT_GB_FIXED + " counts every parameter twice (a "
            "bench defect, fixed since): the bf16 rows are twice the model's bytes, and the other rows hold their "
            "unquantized parameters (embeddings, norms, `lm_head`, biases) twice and their quantized buffers once.")


# h100_offload.json records no date, git sha or versions; its date is that of the commit that added it
# (git log -- benchmarks/results/h100_offload.json). A newer run that records a header replaces this.
OFFLOAD_DATE = "2026-11-25 (not in the file: the date of commit 58d9ac9, which added it)"


def offload(name: str = "h100_offload.json") -> list[str]:
    d = _load(name)
    h = d.get("header") or {}
    s = d["shapes"]
    on, off = d["all_on_device"], d["offload"]
    gb = 1e9
    over = off["peak_bytes"] - d["peak_target_bytes"]
    peak_met = over <= 0
    time_met = d["time_ratio"] <= 1.1
    method = _method(name, gpu=h.get("gpu") or d.get("device"), date=h.get("date") or d.get("date") or OFFLOAD_DATE,
                     sha=h.get("git_sha"), torch=h.get("torch"), triton=h.get("triton"), cuda=h.get("cuda"),
                     extra=("" if h else "The file records no git sha or versions. ")
                     + f"Median of {len(off['times_s'])} forwards per run, prefetch {d['prefetch']}; "
                       f"block Linear layers: {'bf16' if s['scheme'] in (None, 'none') else s['scheme']}.")
    rows = [
        ["median forward s", f"{on['median_s']:.3f}", f"{off['median_s']:.3f}",
         f"time ratio {d['time_ratio']:.3f} <= 1.1", "yes" if time_met else "no"],
        ["peak GB", f"{on['peak_bytes'] / gb:.3f}", f"{off['peak_bytes'] / gb:.3f}",
         f"<= {d['peak_target_bytes'] / gb:.3f} (non-block + {d['prefetch'] + 1} blocks + activation peak)",
         "yes" if peak_met else f"no ({over / 2**20:+.1f} MiB)"],
        ["steady GB", f"{on['steady_bytes'] / gb:.3f}", f"{off['steady_bytes'] / gb:.3f}", NA, NA],
        ["blocks resident", str(s["n_blocks"]), str(off.get("max_resident_blocks", NA)), NA, NA],
    ]
    met = d.get("meets_targets")
    out = [(f"## Block offload: {s['n_blocks']} Wan2.1-14B-shaped blocks at {s['tokens']} tokens "
            "(`lowbit bench offload`)"), "", method, "",
           f"The same stack of {s['n_blocks']} blocks (dim {s['dim']}, FFN {s['ffn_dim']}, {s['heads']} heads, "
           f"{s['ctx']} text tokens; {d['weights_bytes'] / gb:.2f} GB of weights, {d['block_bytes'] / gb:.3f} GB "
           f"per block, {d['nonblock_bytes'] / gb:.3f} GB outside the blocks) all on the GPU and through "
           "`enable_block_offload`: forward time, peak (`torch.cuda.max_memory_allocated`) and steady-state device "
           f"memory. Targets met: {'yes' if met else 'no' if met is not None else NA}"
           + ("" if met is not False else " (what is known: [perf_notes.md](perf_notes.md))") + ".", ""]
    return out + _table(["measure", "all on GPU", "offloaded", "bound / target", "met"], rows)


def gptq(name: str = "h100_gptq.json") -> list[str]:
    d = _load(name)
    if "runs" in d:  # a curated file of runs: the newest
        d = d["runs"][0]
    a = d["args"]
    target = 10.0  # lowbit.bench.gptq.TARGET_S
    rows = []
    for r in d["rows"]:
        if "error" in r:
            rows.append([f"`{r['scheme']}`", r["mode"], f"error: {r['error']}"] + [NA] * 5)
            continue
        rows.append([f"`{r['scheme']}`", r["mode"], f"{r['total_s']:.2f}", f"{r['forward_s']:.2f}",
                     f"{r['rtn_s']:.2f}", f"{r['gptq_rel_err']:.4f}", f"{r['rtn_rel_err']:.4f}",
                     "yes" if r.get("meets_target") else "no"])
    settings = ("the settings of `lowbit quantize --algorithm gptq` (act-order, scale search, 4 refinement sweeps, "
                "the asymmetric objective)" if a.get("cli_defaults") else f"act_order {a['act_order']}")
    out = [f"## GPTQ of one decoder layer, shape `{a['shape']}` (`lowbit bench gptq`, {d['header'].get('gpu', '?')})",
           "",
           _hdr_method(name, d["header"], extra=f"{a['calib']} calibration sequences of {a['seq']} tokens, "
                       f"{settings}."), "",
           ("Seconds per layer: the whole `quantize_model(..., algorithm=GPTQ(...))` call (calibration pass with "
            "the projections' Hessians, then GPTQ of the seven projections; siblings on one input share theirs), "
            "the float layer's forward over the "
            "calibration set alone, and round-to-nearest `quantize_model` of the same layer; relative output error "
            "of the layer on held-out sequences, GPTQ against round-to-nearest. Modes: `graphs` replays each lazy "
            f"block's column loop from CUDA graphs, `eager` launches it op by op. Target: a layer in <= {target:g} s."),
           ""]
    return out + _table(["scheme", "mode", "GPTQ s", "forward s", "RTN s", "rel err GPTQ", "rel err RTN",
                         f"<= {target:g} s"], rows)


def offload_h200() -> list[str]:
    return offload("h200_offload.json")


SECTIONS = [e2e, dit, w4a16_gemv, prefill, scaled_mm_graph, scaled_mm_decode, layer_host, quant_kernels,
            tensor_parallel, lambda: tensor_parallel("h200x2_tp.json"), offload, offload_h200, gptq,
            lambda: gptq("h200_gptq.json"), convert_throughput, lambda: convert_throughput("h200x2_convert.json")]


def render() -> str:
    lines = ["# Performance (H100)", "",
             ("<!-- generated by `python benchmarks/make_performance_md.py` from benchmarks/results/h100_*.json"
              ", h200_{offload,gptq}.json and h200x2_{tp,convert}.json;"
              " do not edit by hand -->"), "",
             ("One table per benchmark, each from the newest curated run of that benchmark on an H100 "
              "(`benchmarks/results/h100_<benchmark>.json`). Each table states its source file, GPU, date, git "
              "sha and versions. Runs on different days ran on different machines and code, so compare numbers "
              "within a table only. The H200 runs are in `benchmarks/results/h200_*.json` (the block offload "
              "table of the H200 is here too: its bound was first met there, and so are the H200's GPTQ table and "
              "the 2 x H200 tensor-parallel and conversion tables); the history of how "
              "each kernel got here is in [perf_notes.md](perf_notes.md) and [history.md](history.md)."), "",
             ("Method: every benchmark checks its outputs against lowbit's CPU reference (bit for bit, or the "
              "stated relative error) before timing; times are medians (`triton.testing.do_bench`) or CUDA-graph "
              "replays as each table says. Reproduce on a GPU with `PYTHONPATH=src python "
              "benchmarks/gpu_check.py tests bench ops` (GPU tests and `lowbit bench`'s ops) and the suites "
              "(`lowbit bench e2e`, `dit`, `offload`, `gptq`, each as its table names it); `lowbit bench "
              "compare NEW.json BASELINE.json` sets a new run's ratios next to a curated file's."), ""]
    for section in SECTIONS:
        lines += section() + [""]
    return "\n".join(lines).rstrip() + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="compare with docs/performance.md instead of writing")
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args(argv)
    text = render()
    if args.check:
        current = args.out.read_text(encoding="utf-8") if args.out.exists() else ""
        if current != text:
            print(f"{args.out} is stale: run python benchmarks/make_performance_md.py", file=sys.stderr)
            return 1
        return 0
    args.out.write_text(text, encoding="utf-8")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
