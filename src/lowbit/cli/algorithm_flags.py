"""``lowbit quantize --algorithm`` and the flags that tune it: ``--smooth-*``, ``--rotate-block``,
``--gptq-*``.

Turns the parsed flags into what :func:`lowbit.eval.run` takes as ``algorithm``: a name, a tuple of names, or
configured :mod:`lowbit.algorithms` objects. Every error is a ValueError naming the flag at fault, so the
command can print it as one line.
"""

from __future__ import annotations

import argparse
import math

ALGORITHM_NAMES = ("rtn", "gptq", "smoothquant", "rotate")

GPTQ_DEFAULTS = {"act_order": True, "damp": 0.01, "scale_search": (0.95, 0.9, 0.85, 0.8), "refine_sweeps": 4,
                 "asymmetric": True}
"""What ``--algorithm gptq`` runs unless its flags say otherwise: the settings that measured best on the bundled
model (docs/quality.md, "GPTQ on the w4a16 schemes"); ``lowbit.algorithms.GPTQ()``'s own defaults are the
plain algorithm."""


def algorithm_arg(text: str) -> str:
    """``--algorithm``: names of :data:`ALGORITHM_NAMES` joined by commas (argparse reports a bad one)."""
    names = [p.strip() for p in text.replace("+", ",").split(",")]
    bad = [n for n in names if n not in ALGORITHM_NAMES]
    if bad or not names:
        raise argparse.ArgumentTypeError(
            f"invalid choice {text!r}: give one or more of {', '.join(ALGORITHM_NAMES)} joined by commas"
        )
    if len(set(names)) != len(names):
        raise argparse.ArgumentTypeError(f"invalid choice {text!r}: a name is repeated")
    return ",".join(names)


def algorithm_from_args(args: argparse.Namespace):
    """``--algorithm`` and its options -> what ``lowbit.eval.run`` takes (ValueError naming the flag)."""
    names = args.algorithm.split(",")
    if (args.smooth_alpha is not None or args.smooth_online) and "smoothquant" not in names:
        raise ValueError("--smooth-alpha and --smooth-online apply to --algorithm smoothquant")
    if args.rotate_block is not None and "rotate" not in names:
        raise ValueError("--rotate-block applies to --algorithm rotate")
    if gptq_flags(args) and "gptq" not in names:
        flags = gptq_flags(args)
        raise ValueError(f"{', '.join(flags)} appl{'ies' if len(flags) == 1 else 'y'} to --algorithm gptq")
    if (args.smooth_alpha is None and not args.smooth_online and args.rotate_block is None
            and "gptq" not in names):
        return args.algorithm if len(names) == 1 else tuple(names)
    from ..algorithms import GPTQ, Rotate, SmoothQuant

    out = []
    for n in names:
        if n == "smoothquant":
            opts: dict = {"online": args.smooth_online}
            if args.smooth_alpha is not None:
                try:
                    alphas = [float(a) for a in args.smooth_alpha.split(",")]
                except ValueError:
                    raise ValueError(f"--smooth-alpha {args.smooth_alpha!r}: not a number or comma-separated "
                                     "numbers") from None
                if len(alphas) == 1:
                    opts["alpha"] = alphas[0]
                else:
                    opts["alphas"] = tuple(alphas)
            try:
                out.append(SmoothQuant(**opts))
            except ValueError as e:
                raise ValueError(f"--smooth-alpha: {e}") from None
        elif n == "rotate":
            try:
                out.append(Rotate(block_size=args.rotate_block))
            except ValueError as e:
                raise ValueError(f"--rotate-block: {e}") from None
        elif n == "gptq":
            out.append(GPTQ(**gptq_options(args)))
        else:
            out.append(n)
    return tuple(out)


def gptq_flags(args: argparse.Namespace) -> list[str]:
    """The ``--gptq-*`` flags given."""
    return [flag for flag, value in (("--gptq-act-order", args.gptq_act_order), ("--gptq-damp", args.gptq_damp),
                                     ("--gptq-scale-search", args.gptq_scale_search),
                                     ("--gptq-refine-sweeps", args.gptq_refine_sweeps),
                                     ("--gptq-scale-refits", getattr(args, "gptq_scale_refits", None)),
                                     ("--gptq-asymmetric", getattr(args, "gptq_asymmetric", None)))
            if value is not None]


def gptq_options(args: argparse.Namespace) -> dict:
    """``GPTQ`` keyword arguments: :data:`GPTQ_DEFAULTS` with the ``--gptq-*`` flags given (ValueError naming
    the flag)."""
    from ..algorithms.grids import check_scale_search

    opts = dict(GPTQ_DEFAULTS)
    if args.gptq_act_order is not None:
        opts["act_order"] = args.gptq_act_order
    if args.gptq_damp is not None:
        if not (args.gptq_damp > 0 and math.isfinite(args.gptq_damp)):
            raise ValueError(f"--gptq-damp must be a positive number, got {args.gptq_damp}")
        opts["damp"] = args.gptq_damp
    if getattr(args, "gptq_asymmetric", None) is not None:
        opts["asymmetric"] = args.gptq_asymmetric
    if args.gptq_refine_sweeps is not None:
        if args.gptq_refine_sweeps < 0:
            raise ValueError(f"--gptq-refine-sweeps must be >= 0, got {args.gptq_refine_sweeps}")
        opts["refine_sweeps"] = args.gptq_refine_sweeps
    refits = getattr(args, "gptq_scale_refits", None)
    if refits is not None:
        if refits < 0:
            raise ValueError(f"--gptq-scale-refits must be >= 0, got {refits}")
        opts["scale_refits"] = refits
    if args.gptq_scale_search is not None:
        text = args.gptq_scale_search.strip()
        if text.lower() == "none":
            opts["scale_search"] = ()
        else:
            try:
                factors = [float(f) for f in text.split(",")]
            except ValueError:
                raise ValueError(f"--gptq-scale-search {text!r}: not 'none' or comma-separated numbers") from None
            try:
                opts["scale_search"] = check_scale_search(factors)
            except ValueError as e:
                raise ValueError(f"--gptq-scale-search: {e}") from None
    return opts
