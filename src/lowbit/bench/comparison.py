"""Compare a new run with a curated baseline run: ratios only, side by side.

Runs on different days ran on different machines (the lent GPU machines' host CPUs differ, and host time is
part of every eager number), so absolute times do not compare across runs; ratios measured within one run do
(lowbit against cuBLAS, against a peer, against bf16, against the copy roof). Every benchmark with a
``--compare`` (``lowbit bench``, ``lowbit e2e``) extracts its ratios per case and prints them with
:func:`table`.

A baseline file is one result, or a curated file ``{"runs": [result, ...]}``: for each case the newest run
that has it counts (:func:`newest`).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

Ratios = dict[str, dict[str, float]]
"""case -> ratio name -> value (higher is better, or as each benchmark defines it)."""


class CompareError(ValueError):
    """A file given to compare is missing, not JSON, or not a result of the expected benchmark."""


def load(path: str | Path, what: str) -> dict[str, Any]:
    """The JSON object in ``path``; CompareError (one line) if it cannot be read or is not a JSON object."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError) as e:
        raise CompareError(f"{path}: not a readable JSON result ({e})") from None
    if not isinstance(data, dict):
        raise CompareError(f"{path}: not a {what} result")
    return data


def runs_of(baseline: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    """The runs of a baseline: ``baseline["runs"]`` for a curated file of runs, else ``[baseline]``."""
    runs = baseline.get("runs", [baseline])
    return [r for r in runs if isinstance(r, Mapping)] if isinstance(runs, list) else []


def newest(baseline: Mapping[str, Any], ratios_of: Callable[[Mapping[str, Any]], Ratios]) -> Ratios:
    """Each case's ratios, each from the newest run of ``baseline`` that has it (later runs override earlier
    ones ratio by ratio: a run that measured only some modes keeps the others' older values)."""
    merged: Ratios = {}
    for run in runs_of(baseline):
        for case, ratios in ratios_of(run).items():
            merged.setdefault(case, {}).update(ratios)
    return merged


def table(new: Ratios, old: Ratios, key: str = "case",
          skip: Callable[[str, str], bool] | None = None, summary: bool = False) -> str:
    """``key | ratio | new | baseline | change`` rows, one per ratio of each new case (in ``new``'s order,
    ratios sorted by name); ``change`` is new / baseline, ``-`` where the baseline lacks the case or ratio.
    ``skip(case, ratio)`` leaves a row out (e.g. bf16's own ratio to bf16). ``summary`` adds the geometric
    mean of the changes per ratio name, and the baseline's cases the new run lacks."""
    lines = [f"{key} | ratio | new | baseline | change", "--- | --- | --- | --- | ---"]
    changes: dict[str, list[float]] = {}
    for case, ratios in new.items():
        before = old.get(case)
        for name, value in sorted(ratios.items()):
            if skip is not None and skip(case, name):
                continue
            was = None if before is None else before.get(name)
            if isinstance(was, (int, float)) and was > 0 and value > 0:
                change = f"{value / was:.2f}x"
                changes.setdefault(name, []).append(value / was)
            else:
                change = "-"
            shown = "-" if not isinstance(was, (int, float)) else f"{was:.3f}"
            lines.append(f"{case} | {name} | {value:.3f} | {shown} | {change}")
    if summary:
        lines.append("")
        for name, values in sorted(changes.items()):
            gm = math.exp(sum(math.log(v) for v in values) / len(values))
            lines.append(f"geomean change of {name}: {gm:.3f}x over {len(values)} cases "
                         f"(min {min(values):.2f}x, max {max(values):.2f}x)")
        if not changes:
            lines.append("no ratio of the new run is in the baseline")
        missing = [c for c in old if c not in new]
        if missing:
            lines.append(f"in the baseline, not in the new run ({len(missing)}): " + ", ".join(missing[:20])
                         + (", ..." if len(missing) > 20 else ""))
    return "\n".join(lines)
