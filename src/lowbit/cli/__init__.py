"""The ``lowbit`` command.

- ``lowbit quantize [MODEL_DIR] --scheme S``: convert a model (default: the bundled all-MiniLM-L6-v2) and
  report the quality each scheme lost (:mod:`lowbit.eval`); ``--no-eval`` converts only, ``--devices
  cuda:0,cuda:1`` (or ``torchrun --nproc-per-node N -m lowbit quantize ...``) converts on several devices at
  once (:mod:`lowbit.eval.convert_only`).
- ``lowbit inspect PATH``: formats, shapes, bytes and producer of a checkpoint, from its headers.
- ``lowbit bench``: the benchmark harness (:mod:`lowbit.bench`): the registered ops (quantize/dequantize,
  W4A16 linear, scaled_mm) by default, the suites as ``lowbit bench e2e|dit|offload [options]``, and
  ``lowbit bench compare NEW.json BASELINE.json`` (or ``--compare BASELINE.json`` after a run).
- ``lowbit e2e``: ``lowbit bench e2e``, the end-to-end decoder benchmark (:mod:`lowbit.bench.e2e`).
- ``lowbit dit``: ``lowbit bench dit``, the diffusion-transformer block benchmark (:mod:`lowbit.bench.dit`).
- ``lowbit env``: versions, GPU, which backends and kernels can run.

Thin over the library; importing this package does no GPU work and imports neither transformers nor
matplotlib. Bad input (unknown scheme, missing or already quantized model directory, corrupt checkpoint, an
``--out`` that is inside the source or holds files lowbit did not write) prints one line and exits 2. Output
cut short by a closed pipe (``lowbit ... | head``) exits 141 without a traceback.

One module per concern: :mod:`~lowbit.cli.parser` declares the options, :mod:`~lowbit.cli.quantize`,
:mod:`~lowbit.cli.inspect`, :mod:`~lowbit.cli.bench` and :mod:`~lowbit.cli.env` run the subcommands,
:mod:`~lowbit.cli.algorithm_flags` turns ``--algorithm`` and its flags into algorithm objects,
:mod:`~lowbit.cli.devices` reads ``--devices`` and torchrun's ranks, and :mod:`~lowbit.cli.errors` prints the
one-line failures. This module routes a command line to its subcommand.
"""

from __future__ import annotations

import sys

from .algorithm_flags import ALGORITHM_NAMES, GPTQ_DEFAULTS, algorithm_from_args
from .bench import ALIASES, cmd_bench, cmd_bench_compare, run_subcommand
from .devices import parse_devices
from .env import cmd_env
from .inspect import cmd_inspect
from .parser import build_parser
from .quantize import cmd_quantize

__all__ = [
    "ALGORITHM_NAMES",
    "ALIASES",
    "GPTQ_DEFAULTS",
    "algorithm_from_args",
    "build_parser",
    "cmd_bench",
    "cmd_bench_compare",
    "cmd_env",
    "cmd_inspect",
    "cmd_quantize",
    "main",
    "parse_devices",
]


def _dispatch(argv: list[str]) -> int:
    # the suites and ``compare`` parse their own arguments: route them before the main parser sees them
    if argv[:1] and argv[0] in ALIASES:
        argv = ["bench", *argv]
    if argv[:1] == ["bench"] and len(argv) > 1 and not argv[1].startswith("-"):
        return run_subcommand(argv[1], argv[2:])
    args = build_parser().parse_args(argv)
    commands = {"bench": cmd_bench, "env": cmd_env, "quantize": cmd_quantize, "inspect": cmd_inspect}
    return commands[args.command](args)


def main(argv: list[str] | None = None) -> int:
    """The ``lowbit`` command (``argv`` defaults to ``sys.argv[1:]``); returns its exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        rc = _dispatch(argv)
        sys.stdout.flush()  # a closed pipe shows here, inside the handler, not at interpreter exit
    except BrokenPipeError:
        # `lowbit ... | head`: the reader left. Python's documented pattern: point stdout at devnull so the
        # flush at exit does not raise again, and exit as a process killed by SIGPIPE would (128 + 13).
        import os

        devnull = os.open(os.devnull, os.O_WRONLY)
        try:
            os.dup2(devnull, sys.stdout.fileno())
        except (OSError, ValueError):  # stdout is not a real file (redirected in-process)
            pass
        return 141
    return rc
