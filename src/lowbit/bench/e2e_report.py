"""The end-to-end benchmark's report: every number as a ratio to bf16 measured in the same run
(:func:`ratios`), the table (:func:`format_table`) and those ratios against a baseline run's
(:func:`compare`)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

def ratios(rows: list[dict]) -> None:
    """Adds ``ratio`` (to bf16 in the same run) to every row: decode and generate tokens/s over bf16's,
    bf16's prefill ms over the row's, host time over F.linear's."""
    base = next((r for r in rows if r["config"] == "bf16"), None)
    for r in rows:
        rr: dict[str, float] = {}
        if "host" in r:
            rr["host_vs_f_linear"] = r["host"]["us"] / r["host"]["f_linear_us"]
        if base is not None:
            for k in ("eager", "graph", "generate"):
                if isinstance(r.get(k), float) and isinstance(base.get(k), float):
                    rr[k] = r[k] / base[k]
            for k in ("compile", "compile-ro"):
                if isinstance(r.get(k), dict) and isinstance(base.get(k), dict):
                    rr[k] = r[k]["tok_s"] / base[k]["tok_s"]
            if isinstance(r.get("prefill"), float) and isinstance(base.get("prefill"), float):
                rr["prefill"] = base["prefill"] / r["prefill"]
        r["ratio"] = rr



def _ratios_of(run: Mapping[str, Any]) -> dict[str, dict[str, float]]:
    return {row["config"]: row.get("ratio", {}) for row in run.get("rows", []) if "config" in row}



def compare(result: dict, baseline: dict) -> str:
    """A table of each config's ratios to bf16 in ``result`` against the same ratios in ``baseline`` (a result
    dict, or a curated file holding ``{"runs": [...]}``: each ratio from the newest run that has it). Ratios,
    not tokens/s, since the two runs may have had different host CPUs (:mod:`lowbit.bench.comparison`)."""
    from .comparison import newest, table

    return table(_ratios_of(result), newest(baseline, _ratios_of), key="config",
                 skip=lambda config, key: config == "bf16" and key != "host_vs_f_linear")  # bf16: 1.0 by definition



def format_table(result: dict) -> str:
    rows = result["rows"]
    head = ("config", "GB", "host us (xF.lin)", "eager tok/s", "graph tok/s", "compile tok/s",
            "compile-ro tok/s", "prefill ms", "generate tok/s")
    lines = [" | ".join(head), " | ".join("---" for _ in head)]

    def cell(r, k, fmt="{:.1f}"):
        if k in r["errors"]:
            return "error"
        v = r.get(k)
        if v is None:
            return "-"
        val = v["tok_s"] if isinstance(v, dict) else v
        ratio = r.get("ratio", {}).get(k)
        return fmt.format(val) + (f" ({ratio:.2f}x)" if ratio is not None and r["config"] != "bf16" else "")

    for r in rows:
        host = "-"
        if "host" in r:
            host = f"{r['host']['us']:.1f} ({r['ratio']['host_vs_f_linear']:.2f}x)"
        elif "host" in r["errors"]:
            host = "error"
        gb = f"{r['weight_gb']:.2f}" if "weight_gb" in r else "-"
        lines.append(" | ".join([r["config"], gb, host, cell(r, "eager"), cell(r, "graph"), cell(r, "compile"),
                                 cell(r, "compile-ro"), cell(r, "prefill", "{:.2f}"), cell(r, "generate")]))
    errs = [f"- {r['config']} {k}: {v}" for r in rows for k, v in r["errors"].items()]
    return "\n".join(lines + (["", "errors:"] + errs if errs else []))


__all__ = ["compare", "format_table", "ratios"]
