"""The ratios of results in the layouts of the W4A16 GEMV and scaled_mm scripts the registry's ops replaced, keyed
as :func:`lowbit.bench.runner.ratios` keys a ``lowbit bench`` result, so that ``lowbit bench compare`` reads a
curated file recorded before the ops existed.

Only ratios measured the same way map: the speedups over cuBLAS bf16, ``torch._scaled_mm`` and the peers, eager
or as CUDA-graph replays. The share of the copy roof does not (those scripts counted the weight bytes only);
neither do the W4A16 GEMM script's ratios (it timed the Triton GEMM directly, where ``lowbit.linear`` picks its
path by M).

- W4A16 GEMV rows: ``format`` (``nf4-dq`` for double-quantized NF4), ``n``, ``k``, ``m``, ``speedup`` and
  ``speedup_vs`` (peer -> ``{"eager", "graph"}``) -> ``linear.<format>.decode MxNxK``;
- scaled_mm rows: ``pair``, ``M``, ``N``, ``K`` with ``vs_cublas_bf16``, ``vs_scaled_mm_fp8`` and
  ``fused_vs_cublas_bf16`` (eager, or graph replays where the run says ``"timing": "cuda_graph_replay"``)
  -> ``scaled_mm.<pair>.prefill`` / ``.decode`` (M <= 64) and ``scaled_linear.<pair>``; decode rows with
  ``graph_vs_cublas_bf16`` -> ``scaled_mm.<pair>.decode``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

CUBLAS = "cublas.bf16"
SCALED_MM_FP8 = "torch._scaled_mm[fp8]"
PEERS = {
    "bitsandbytes_nf4": "bitsandbytes.matmul_4bit",
    "gemlite_int4": "gemlite.A16Wn[int4]",
    "gemlite_mxfp4": "gemlite.A16W4_MXFP",
}
DECODE_MAX_M = 64


def _num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0


def _gemv(row: Mapping[str, Any]) -> tuple[str, dict[str, float]]:
    label = str(row["format"]).replace("-", ".")
    key = f"linear.{label}.decode {row['m']}x{row['n']}x{row['k']}"
    r: dict[str, float] = {}
    for mode, suffix in (("eager", ""), ("graph", " [graph]")):
        if _num((row.get("speedup") or {}).get(mode)):
            r[f"vs {CUBLAS}{suffix}"] = row["speedup"][mode]
        for peer, by_mode in (row.get("speedup_vs") or {}).items():
            if peer in PEERS and _num((by_mode or {}).get(mode)):
                r[f"vs {PEERS[peer]}{suffix}"] = by_mode[mode]
    return key, r


def _scaled(row: Mapping[str, Any], graph: bool) -> list[tuple[str, dict[str, float]]]:
    shape = f"{row['M']}x{row['N']}x{row['K']}"
    suffix = " [graph]" if graph else ""
    variant = "decode" if row["M"] <= DECODE_MAX_M else "prefill"
    out = []
    if _num(row.get("graph_vs_cublas_bf16")):
        out.append((f"scaled_mm.{row['pair']}.{variant} {shape}", {f"vs {CUBLAS} [graph]": row["graph_vs_cublas_bf16"]}))
    mm = {f"vs {CUBLAS}{suffix}": row.get("vs_cublas_bf16"), f"vs {SCALED_MM_FP8}{suffix}": row.get("vs_scaled_mm_fp8")}
    mm = {k: v for k, v in mm.items() if _num(v)}
    if mm:
        out.append((f"scaled_mm.{row['pair']}.{variant} {shape}", mm))
    if _num(row.get("fused_vs_cublas_bf16")):
        out.append((f"scaled_linear.{row['pair']} {shape}", {f"vs {CUBLAS}{suffix}": row["fused_vs_cublas_bf16"]}))
    return out


def ratios(run: Mapping[str, Any]) -> dict[str, dict[str, float]]:
    """The ratios of one run in a replaced script's layout (empty if it is none of them)."""
    out: dict[str, dict[str, float]] = {}
    rows = run.get("rows")
    if not isinstance(rows, list):
        return out
    graph = run.get("timing") == "cuda_graph_replay"
    for row in rows:
        if not isinstance(row, Mapping) or "error" in row:
            continue
        if {"format", "n", "k", "m"} <= row.keys() and isinstance(row.get("speedup"), Mapping):
            found = [_gemv(row)]
        elif {"pair", "M", "N", "K"} <= row.keys() and not isinstance(row.get("config"), (Mapping, str)):
            found = _scaled(row, graph)
        else:
            continue
        for key, r in found:
            if key and r:
                out.setdefault(key, {}).update(r)
    return out
