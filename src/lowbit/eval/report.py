"""The quality report of ``lowbit quantize``: a text table, JSON and a PNG of per-layer SQNR by scheme."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any


def json_safe(obj: Any) -> Any:
    """Replaces non-finite floats (an error-free layer has SQNR +inf) by strings JSON can hold."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return "inf" if obj > 0 else ("-inf" if obj < 0 else "nan")
    if isinstance(obj, dict):
        return {k: json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_safe(v) for v in obj]
    return obj


def report_json(report: dict) -> str:
    return json.dumps(json_safe(report), indent=1) + "\n"


def write_json(report: dict, path: str | os.PathLike) -> None:
    Path(path).write_text(report_json(report))


def _f(x: float | None, fmt: str) -> str:
    if x is None:
        return "-"
    if isinstance(x, float) and math.isinf(x):
        return "inf"
    return format(x, fmt)


COLUMNS = (
    ("scheme", 15),
    ("algorithm", 9),
    ("MB", 6),
    ("bits/w", 6),
    ("cos mean", 8),
    ("cos min", 7),
    ("NN@1", 5),
    ("NN@5", 5),
    ("topic@1", 7),
    ("SQNR dB min/med", 15),
    ("isolated", 8),
    ("time s", 6),
)


def _columns(report: dict) -> tuple[tuple[str, int], ...]:
    """:data:`COLUMNS` with the algorithm column as wide as its longest label."""
    width = max([len(r.get("algorithm_label") or "rtn") for r in report["schemes"]] + [COLUMNS[1][1]])
    return tuple((name, width if name == "algorithm" else w) for name, w in COLUMNS)


def format_table(report: dict) -> str:
    """The table ``lowbit quantize`` prints (one row per scheme, fp32 first)."""
    columns = _columns(report)
    head = "  ".join(f"{name:<{w}}" if i < 2 else f"{name:>{w}}" for i, (name, w) in enumerate(columns))
    lines = [
        (
            f"model {report['model']} ({report['n_sentences']} sentences, {report['n_tokens']} tokens, "
            f"calibration {report['calibration_sentences']} sentences, "
            f"algorithm {report.get('algorithm', 'rtn')}, device {report['device']})"
        ),
        head,
        "-" * len(head),
    ]
    ref = report["fp32"]
    cells = [
        "fp32",
        "",
        _f(ref["bytes"] / 1e6, ".1f"),
        "32",
        "1",
        "1",
        "1",
        "1",
        _f(ref["topic_top1"], ".3f"),
        "",
        "",
        "",
    ]
    lines.append(
        "  ".join(c.ljust(w) if i < 2 else c.rjust(w) for i, (c, (_, w)) in enumerate(zip(cells, columns)))
    )
    for r in report["schemes"]:
        if r.get("status") != "ok":
            lines.append(f"{r['scheme']:<15}  FAILED: {r.get('error', '?')}")
            continue
        layers = r["layers"]
        net = sorted(x["sqnr_db"] for x in layers)
        iso = [x["isolated_sqnr_db"] for x in layers if x["isolated_sqnr_db"] is not None]
        sqnr = f"{_f(net[0], '.1f')}/{_f(net[len(net) // 2], '.1f')}" if net else "-"
        cells = [
            r["scheme"],
            r.get("algorithm_label") or "rtn",
            _f(r["bytes"] / 1e6 if r.get("bytes") else None, ".1f"),
            _f(r.get("bits_per_weight"), ".2f"),
            _f(r["cosine"]["mean"], ".4f"),
            _f(r["cosine"]["min"], ".4f"),
            _f(r["retrieval"]["top1"], ".3f"),
            _f(r["retrieval"]["top5"], ".3f"),
            _f(r["topic_top1"], ".3f"),
            sqnr,
            _f(min(iso) if iso else None, ".1f"),
            _f(r["time_s"]["convert"] + r["time_s"]["eval"], ".1f"),
        ]
        lines.append(
            "  ".join(
                c.ljust(w) if i < 2 else c.rjust(w) for i, (c, (_, w)) in enumerate(zip(cells, columns))
            )
        )
    lines += [
        "",
        "algorithm: rtn round-to-nearest, gptq (-act: act-order, -clip: scale search), sq SmoothQuant smoothing",
        "(-online: online scales where no producer can take them), rot Hadamard rotation; rows with online",
        "transforms are measured in memory, and their layers (as every smoothed or rotated layer) are compared",
        "with the transformed float layer.",
        "MB: checkpoint size (embeddings and norms stay fp32); bits/w: bits per weight of the quantized Linear",
        "layers, scales included. cos: cosine similarity of each sentence embedding to fp32's. NN@1: the nearest",
        "neighbour among the sentences is fp32's; NN@5: overlap of the 5 nearest. topic@1: the nearest neighbour",
        "has the same topic label. SQNR: per quantized Linear output vs fp32 in the quantized network (min and",
        "median over layers); isolated: min over layers fed the fp32 input (the layer's own error).",
    ]
    if report.get("total_time_s") is not None:
        lines.append(f"time s: convert + load + evaluate; whole run {report['total_time_s']:.0f} s.")
    return "\n".join(lines)


def plot_png(report: dict, path: str | os.PathLike) -> str | None:
    """Per-layer SQNR by scheme (in network and isolated). Returns None, or why no PNG was written."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed (pip install 'lowbit[demo]')"
    rows = [r for r in report["schemes"] if r.get("status") == "ok" and r["layers"]]
    if not rows:
        return "no scheme produced per-layer results"
    names = [x["name"] for x in rows[0]["layers"]]
    short = [n.replace("encoder.layer.", "L").replace("attention.", "").replace("self.", "") for n in names]
    fig, axes = plt.subplots(2, 1, figsize=(max(10, 0.32 * len(names) + 3), 9), sharex=True)
    cmap = plt.get_cmap("tab10")
    for i, r in enumerate(rows):
        by_name = {x["name"]: x for x in r["layers"]}
        for ax, key in zip(axes, ("sqnr_db", "isolated_sqnr_db")):
            ys = [
                by_name[n][key] if n in by_name and by_name[n][key] is not None else math.nan for n in names
            ]
            ys = [y if math.isfinite(y) else math.nan for y in ys]
            style = "--" if r.get("act_format") else "-"  # dashed: activations quantized too
            ax.plot(
                range(len(names)), ys, style, marker="o", ms=3, lw=1.2, color=cmap(i % 10), label=r["scheme"]
            )
    axes[0].set_title(
        f"{report['model']}: per-layer output SQNR vs fp32 in the quantized network (dashed: activations quantized)"
    )
    axes[1].set_title("isolated: each quantized layer fed the fp32 layer's input")
    for ax in axes:
        ax.set_ylabel("SQNR (dB), higher is better")
        ax.grid(True, alpha=0.3)
    axes[0].legend(fontsize=8, ncol=2, loc="lower left")
    axes[1].set_xticks(range(len(names)))
    axes[1].set_xticklabels(short, rotation=90, fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None
