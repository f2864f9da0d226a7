"""How a ``lowbit`` subcommand reports bad input: one line on stderr, exit status 2."""

from __future__ import annotations

import sys


def fail(command: str, message: str) -> int:
    """Print ``lowbit COMMAND: MESSAGE`` on one line to stderr; return the exit status of bad input (2)."""
    # one line: messages quoted from transformers or torch may span several
    message = " ".join(part.strip() for part in message.splitlines() if part.strip())
    print(f"lowbit {command}: {message}", file=sys.stderr)
    return 2
