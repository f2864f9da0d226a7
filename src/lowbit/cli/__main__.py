"""``python -m lowbit.cli ...`` is the ``lowbit`` command, as ``python -m lowbit ...`` is."""

import sys

from . import main

if __name__ == "__main__":
    sys.exit(main())
