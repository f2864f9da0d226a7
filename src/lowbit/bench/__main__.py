"""``python -m lowbit.bench [options]`` is ``lowbit bench [options]``."""

import sys

from lowbit.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", *sys.argv[1:]]))
