"""``lowbit inspect``: what a checkpoint holds, read from its headers without loading the weights."""

from __future__ import annotations

import argparse
import json

from .errors import fail


def cmd_inspect(args: argparse.Namespace) -> int:
    """``lowbit inspect``: 0, or 2 for a path that is not a readable checkpoint."""
    from ..eval.checkpoint_info import CheckpointError, format_inspect, inspect_checkpoint

    try:
        info = inspect_checkpoint(args.path)
    except CheckpointError as e:
        return fail("inspect", str(e))
    if args.json:
        from ..eval.report import json_safe

        print(json.dumps(json_safe(info), indent=1))
    else:
        print(format_inspect(info, layers=args.layers))
    return 0
