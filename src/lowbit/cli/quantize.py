"""``lowbit quantize``: convert a model with each scheme and, unless it converts only, report the quality
lost.

Checks the flags against each other before any work starts (a run on several devices or ranks converts only,
so calibration and algorithm flags are refused there), then hands over to :mod:`lowbit.eval.convert_only` or
:func:`lowbit.eval.run`.
"""

from __future__ import annotations

import argparse
import json
import sys

from .algorithm_flags import algorithm_from_args, gptq_flags
from .devices import parse_devices, torchrun_world
from .errors import fail


def _schemes_help() -> str:
    """``--scheme list``: one line per scheme, its name and description."""
    from ..nn import SCHEMES

    return "\n".join(f"{name:16} {s.description}" for name, s in SCHEMES.items())


def _quiet_third_party_logs() -> None:
    """transformers imports torchao's quantizer when torchao is installed; torchao then logs warnings about
    its CUDA-only extensions and torch's pytree about enum registration. They say nothing about this run."""
    import logging

    for name in ("torchao", "torch.utils._pytree"):
        logger = logging.getLogger(name)
        if logger.level == logging.NOTSET:
            logger.setLevel(logging.ERROR)


def cmd_quantize(args: argparse.Namespace) -> int:
    """``lowbit quantize``: 0 when every scheme converted (and was evaluated), 1 when one failed, 2 on bad
    input."""
    from .. import eval as lbeval

    if args.scheme in ("list", "help"):
        print(_schemes_help())
        return 0
    _quiet_third_party_logs()
    try:
        from ..eval.encoder import quiet_transformers

        quiet_transformers()
    except ImportError:
        pass  # no transformers: lbeval.run says what to install
    log = (lambda s: print(s, file=sys.stderr, flush=True)) if args.json else (lambda s: print(s, flush=True))
    if args.device is not None:
        import torch

        try:
            device = torch.device(args.device)
        except (RuntimeError, ValueError) as e:
            return fail("quantize", f"bad --device {args.device!r}: not a torch device ({e})")
        if device.type == "meta":
            # meta tensors hold shapes only: nothing could be evaluated or written
            return fail("quantize", "bad --device meta: meta tensors hold no values to quantize or evaluate; "
                                    "use cpu or cuda (lowbit.quantize_model builds a shape-only skeleton on meta "
                                    "in Python)")
    from ..eval.convert_only import convert_only, source_kind

    try:
        world = torchrun_world()
        devices = None if args.devices is None else parse_devices(args.devices)
    except ValueError as e:
        return fail("quantize", str(e))
    if devices is not None and world is not None:
        return fail("quantize", "--devices starts one process per device; under torchrun every process is one "
                                "rank already (on cuda:LOCAL_RANK, or --device): leave --devices out")
    if devices is not None and args.device is not None:
        return fail("quantize", "--device and --devices exclude each other: --devices names every device "
                                "(cuda:0,cuda:1), --device the one device of a single process")
    several = devices is not None or world is not None
    if several or args.no_eval:
        why = "--devices" if devices is not None else ("torchrun" if world is not None else "--no-eval")
        given = [flag for flag, on in (("--calib", args.calib is not None), ("--calib-file", args.calib_file),
                                       ("--algorithm", args.algorithm != "rtn"),
                                       ("--smooth-alpha", args.smooth_alpha is not None),
                                       ("--smooth-online", args.smooth_online),
                                       ("--rotate-block", args.rotate_block is not None),
                                       *((flag, True) for flag in gptq_flags(args))) if on]
        if given:
            verb = "applies" if len(given) == 1 else "apply"
            return fail("quantize", f"{', '.join(given)} {verb} to evaluated runs; with {why} lowbit quantize "
                                    "converts only (round to nearest, dynamic activation scales)")
    if args.model_dir is not None and source_kind(args.model_dir) is not None or several or args.no_eval:
        rank = world[0] if world is not None else 0
        if rank != 0:
            log = lambda s: None  # noqa: E731 - rank 0 speaks for all ranks
        try:
            model_dir = args.model_dir if args.model_dir is not None else lbeval.bundled_model_dir()
            report = convert_only(model_dir, lbeval.resolve_schemes(args.scheme), args.out,
                                  include=args.include, exclude=args.exclude, fmt=args.layout, device=args.device,
                                  log=log, progress=args.progress, overwrite=args.overwrite, transformers=True,
                                  devices=devices, world=world)
        except (lbeval.ModelDirError, ValueError, FileExistsError) as e:
            return fail("quantize", f"rank {rank}: {e}" if rank else str(e))
        except RuntimeError as e:  # the other ranks' processes could not start
            return fail("quantize", f"--devices: {e}" if devices else str(e))
        if args.json and rank == 0:
            print(json.dumps(report, indent=1))
        return 1 if any(r["status"] != "ok" for r in report["schemes"]) else 0
    if args.include or args.exclude or args.layout != "auto":
        return fail("quantize", "--include, --exclude and --format apply to diffusers or bare safetensors folders "
                                "(converted without evaluation) and to runs with --no-eval or --devices; this is an "
                                "evaluated run of a transformers model directory")
    try:
        algorithm = algorithm_from_args(args)
    except ValueError as e:
        return fail("quantize", str(e))
    try:
        report = lbeval.run(
            args.model_dir,
            args.scheme,
            args.out,
            calib=args.calib,
            calib_file=args.calib_file,
            algorithm=algorithm,
            device=args.device,
            log=log,
            convert_progress=args.progress,
            overwrite=args.overwrite,
        )
    except (lbeval.ModelDirError, lbeval.CheckpointError, ValueError, FileExistsError, ImportError) as e:
        return fail("quantize", str(e))
    if args.json:
        from ..eval.report import json_safe

        print(json.dumps(json_safe(report), indent=1))
    else:
        print()
        print(report["table"])
        files = report["files"]
        print()
        print(f"report: {files['txt']}, {files['json']}" + (f", {files['png']}" if files["png"] else ""))
        if report.get("png_skipped"):
            print(f"no PNG: {report['png_skipped']}")
    return 1 if any(r["status"] != "ok" for r in report["schemes"]) else 0
