"""``python -m lowbit ...`` is the ``lowbit`` command (so ``torchrun -m lowbit quantize ...`` runs it on each
rank)."""

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
