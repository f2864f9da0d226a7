"""One device call: carried wheels, the GPU tests, then the benchmark harness (``lowbit bench``); results in $OUT.

Run on the GPU machine from the repository root, with a wheel folder carried (``.whl`` or ``$WHEELS``:
pytest, hypothesis, bitsandbytes, torchao; see /work/.library/device/README.md) and the git sha passed in,
since the machine has no git history::

    GIT_SHA=<sha> PYTHONUNBUFFERED=1 python3 benchmarks/gpu_check.py              # tests + harness
    GIT_SHA=<sha> python3 benchmarks/gpu_check.py bench --quick --ops 'quantize.*'
    GIT_SHA=<sha> python3 benchmarks/gpu_check.py tests ops                        # GPU tests + linear/scaled_mm ops
    GIT_SHA=<sha> python3 benchmarks/gpu_check.py e2e --e2e-args "--configs bf16,lowbit:w4a16-nvfp4"
    GIT_SHA=<sha> python3 benchmarks/gpu_check.py dit offload                      # DiT block, block offload
    GIT_SHA=<sha> python3 benchmarks/gpu_check.py tests tp --tests tests/parallel   # 2+ GPUs: tensor parallel
    GIT_SHA=<sha> python3 benchmarks/gpu_check.py convert                          # 2+ GPUs: conversion speed

Writes ``$OUT/gpu_tests_<path>.xml`` (one pytest and report per test path), ``$OUT/quant_kernels_<date>.json``
(the quantize/dequantize ops), ``$OUT/w4a16_gemv.json``, ``w4a16_gemm.json``, ``scaled_mm.json``,
``qlinear.json`` (the ``ops`` step: the other registered ops, one ``python -m lowbit.bench`` each) and
``$OUT/e2e.json`` / ``dit.json`` / ``offload.json`` / ``tp.json`` / ``gptq.json`` (the suites, ``lowbit bench
e2e|dit|offload|tp|gptq``), ``$OUT/convert.json`` (``benchmarks/convert_throughput.py``); the
results tables are printed last. Every one is a ``lowbit bench`` result that ``lowbit bench compare`` reads.
Keeps to about 8 minutes on an H100: the harness skips the baselines not timed by ``--deadline-s`` after the
start (lowbit's own cases always run and are written to the JSON before any baseline).
"""

from __future__ import annotations

import argparse
import glob
import os
import subprocess
import sys
import time
import xml.etree.ElementTree as ET

T0 = time.monotonic()
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SITE = "/tmp/site"


def install_wheels() -> None:
    """pip-install the carried wheels (no index, no deps) into /tmp/site, as the device README says."""
    folder = os.environ.get("WHEELS", os.path.join(ROOT, ".whl"))
    wheels = sorted(glob.glob(os.path.join(folder, "*.whl")))
    if not wheels:
        print("no .whl/ wheels carried: bitsandbytes/torchao baselines use what is installed, if anything")
        return
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "install",
        "-q",
        "--no-index",
        "--no-deps",
        "--no-compile",
        "--no-cache-dir",
        "--upgrade",
        "--target",
        SITE,
        *wheels,
    ]
    rc = subprocess.call(cmd)
    print(
        f"installed {len(wheels)} wheels into {SITE} (pip exit code {rc}): "
        + ", ".join(os.path.basename(w) for w in wheels),
        flush=True,
    )


def setup_paths() -> None:
    paths = [os.path.join(ROOT, "src")] + ([SITE] if os.path.isdir(SITE) else [])
    for p in reversed(paths):
        if p not in sys.path:
            sys.path.insert(0, p)
    os.environ["PYTHONPATH"] = os.pathsep.join(
        paths + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and p not in paths]
    )


def _xml_summary(xml: str) -> str:
    try:
        root = ET.parse(xml).getroot()
        s = root.find("testsuite")
        s = root if s is None else s
        return (f"{s.get('tests')} tests, {s.get('failures')} failures, {s.get('errors')} errors, "
                f"{s.get('skipped')} skipped, {float(s.get('time', 0)):.0f} s")
    except (OSError, ET.ParseError):
        return "no junit xml"


def run_tests(out_dir: str, timeout_s: float, paths: list[str], select: str = "") -> str:
    """One pytest per path, each with its own junit report (``gpu_tests_<path>.xml``), within ``timeout_s`` in
    all: a path that runs out of time loses only its own report (one pytest over every path, killed by its
    time limit, wrote no report at all). The first calls on a fresh machine compile every kernel variant."""
    deadline = time.monotonic() + timeout_s
    lines = []
    for path in paths:
        name = path.strip("/").replace("/", "_").removesuffix(".py")
        left = deadline - time.monotonic()
        if left < 10:
            lines.append(f"{path}: not run (time limit)")
            continue
        xml = os.path.join(out_dir, f"gpu_tests_{name}.xml")
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "gpu", "--maxfail=8", path,
               f"--junitxml={xml}", *(["-k", select] if select else [])]
        try:
            rc = subprocess.call(cmd, cwd=ROOT, timeout=left)
        except subprocess.TimeoutExpired:
            rc = "timeout"
        lines.append(f"{path}: exit code {rc}; {_xml_summary(xml)}")
        print(lines[-1], flush=True)
    summary = "gpu tests:\n  " + "\n  ".join(lines)
    print(summary, flush=True)
    return summary


# the `ops` step: (lowbit bench arguments, results file in $OUT, timeout in seconds), one `python -m lowbit.bench`
# each. The runner rewrites the JSON after every case, so a timeout keeps what was measured; baselines not yet
# timed BUDGET_MARGIN_S before the timeout are skipped.
OPS_BENCHES = [
    (["--ops", "linear.*.decode"], "w4a16_gemv.json", 240),
    (["--ops", "linear.*.prefill", "--quick"], "w4a16_gemm.json", 200),
    (["--ops", "scaled_mm.*,scaled_linear.*", "--quick"], "scaled_mm.json", 240),
    (["--ops", "qlinear", "--quick"], "qlinear.json", 120),
]
BUDGET_MARGIN_S = 40


def ops_command(args: list[str], json_path: str, timeout_s: float) -> list[str]:
    """The ``python -m lowbit.bench`` command line of one `ops` entry."""
    budget = max(0, int(timeout_s - BUDGET_MARGIN_S))
    return [sys.executable, "-m", "lowbit.bench", *args, "--budget-s", str(budget), "--json", json_path]


def run_ops_benches(out_dir: str) -> None:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    for args, name, timeout in OPS_BENCHES:
        cmd = ops_command(args, os.path.join(out_dir, name), timeout)
        try:
            rc = subprocess.call(cmd, cwd=ROOT, env=env, timeout=timeout)
        except subprocess.TimeoutExpired:
            rc = "timeout (partial JSON kept)"
        print(f"lowbit bench {' '.join(args)}: exit {rc}", flush=True)


# every file with GPU tests, one pytest each (see run_tests); the quick ones first
GPU_TEST_PATHS = [
    "tests/test_api_gpu.py",
    "tests/kernels/test_gemv_mma_gpu.py", "tests/ops/test_linear_gpu.py", "tests/kernels/test_gemv_w4_gpu.py",
    "tests/kernels/test_nf4_int4_gpu.py", "tests/kernels/test_gemm_w4_gpu.py", "tests/kernels/test_blockscaled_gpu.py",
    "tests/kernels/test_fp8_block_gpu.py", "tests/kernels/test_fp8_rowwise_gpu.py", "tests/ops/test_scaled_mm_gpu.py",
    "tests/nn/test_prepared_gpu.py", "tests/kernels/test_int4_conventions.py", "tests/integrations/test_diffusers_gpu.py",
    "tests/nn/test_offload.py", "tests/nn/test_fuse_gpu.py", "tests/nn/test_fp8_compute_gpu.py",
    "tests/algorithms/test_gptq_gpu.py", "tests/kernels/test_gemm_w4_ws_gpu.py", "tests/kernels/test_gemm_w4_ra_gpu.py",
    "tests/kernels/test_gemm_w4_rf_gpu.py", "tests/io/test_convert_gpu.py", "tests/io/test_staging_gpu.py",
    "tests/bench",
]
"""tests/parallel needs two GPUs: ``tests tp --tests tests/parallel`` on a 2-GPU machine."""


def suite_command(name: str, json_path: str, extra: str) -> list[str]:
    """The ``python -m lowbit.bench <suite>`` command line of a suite step."""
    import shlex

    return [sys.executable, "-m", "lowbit.bench", name, "--json", json_path, *shlex.split(extra)]


def run_module(name: str, out_dir: str, extra: str, timeout_s: float) -> None:
    """``lowbit bench <name>`` (the suites e2e, dit, offload) with ``extra`` arguments, JSON to
    ``$OUT/<name>.json`` (e2e and dit write it after every config)."""
    call_step(f"lowbit {name}", suite_command(name, os.path.join(out_dir, f"{name}.json"), extra), timeout_s,
              "timeout (what finished is in the JSON)")


def call_step(label: str, cmd: list[str], timeout_s: float, on_timeout: str) -> None:
    """Run a step's command from the repository root, unbuffered, and print its exit status."""
    try:
        rc = subprocess.call(cmd, cwd=ROOT, env=dict(os.environ, PYTHONUNBUFFERED="1"), timeout=timeout_s)
    except subprocess.TimeoutExpired:
        rc = on_timeout
    print(f"{label}: exit {rc}", flush=True)


CONVERT_ARGS = "--size-gb 20 --assign runs,interleaved --workdir /dev/shm/lowbit-convert-bench --budget-s 150"
"""The convert step's default: 20 GB from tmpfs, two GPUs once per way of giving pieces to ranks, no scheme
started after 150 s (the step's time limit, --bench-timeout-s, would lose the JSON written at the end)."""


def convert_command(json_path: str, extra: str) -> list[str]:
    """The ``benchmarks/convert_throughput.py`` command line of the convert step (2+ GPUs)."""
    import shlex

    return [sys.executable, os.path.join(ROOT, "benchmarks", "convert_throughput.py"), "--out-json", json_path,
            *shlex.split(extra)]


def run_convert(out_dir: str, extra: str, timeout_s: float) -> None:
    call_step("convert_throughput", convert_command(os.path.join(out_dir, "convert.json"), extra), timeout_s,
              "timeout (the JSON is written at the end: nothing)")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", nargs="*", help="tests, bench (the quantize/dequantize ops), ops (the W4A16 linear, "
                    "QuantLinear and scaled_mm ops), e2e, dit, offload (the suites); default tests + bench; "
                    "install: wheels only")
    ap.add_argument("--tests", default=",".join(GPU_TEST_PATHS),
                    help="comma-separated test paths for the tests step (one pytest and report each)")
    ap.add_argument("--tests-k", default="", help="pytest -k expression for the tests step (default: every test)")
    ap.add_argument("--quick", action="store_true", help="harness: each op's quick shapes")
    ap.add_argument("--ops", default=None, help="harness: op patterns, as `lowbit bench --ops` (default: the "
                    "quantize and dequantize ops; the others are the `ops` step's)")
    ap.add_argument("--shapes", default=None, help="harness: shapes, as `lowbit bench --shapes`")
    ap.add_argument("--baselines", choices=("one", "all", "none"), default="one")
    ap.add_argument(
        "--deadline-s",
        type=float,
        default=400.0,
        help="seconds after the script's start past which baselines are skipped (default 400)",
    )
    ap.add_argument("--tests-timeout-s", type=float, default=240.0)
    ap.add_argument("--e2e-args", default="", help="arguments of `lowbit e2e` for the e2e step")
    ap.add_argument("--e2e-timeout-s", type=float, default=420.0)
    ap.add_argument("--dit-args", default="", help="arguments of `lowbit dit` for the dit step")
    ap.add_argument("--offload-args", default="", help="arguments of `lowbit bench offload`")
    ap.add_argument("--tp-args", default="", help="arguments of `lowbit bench tp` (needs 2+ GPUs)")
    ap.add_argument("--gptq-args", default="", help="arguments of `lowbit bench gptq`")
    ap.add_argument("--convert-args", default=CONVERT_ARGS,
                    help=f"arguments of benchmarks/convert_throughput.py (2+ GPUs; default: {CONVERT_ARGS})")
    ap.add_argument("--bench-timeout-s", type=float, default=300.0, help="time limit of the dit and offload steps")
    args = ap.parse_args()
    what = set(args.what or ["tests", "bench"])
    steps = {"tests", "bench", "ops", "install", "e2e", "dit", "offload", "tp", "gptq", "convert"}
    if what - steps:
        ap.error(f"unknown step(s) {sorted(what - steps)}: use tests, bench, ops, e2e, dit, offload, tp, gptq, "
                 "convert or install")

    out_dir = os.environ.get("OUT") or os.path.join(ROOT, "benchmarks", "results", "tmp")
    os.makedirs(out_dir, exist_ok=True)
    install_wheels()
    setup_paths()
    if what == {"install"}:
        return 0

    tests_summary = run_tests(out_dir, args.tests_timeout_s, args.tests.split(","), args.tests_k) if "tests" in what else None
    if "ops" in what:
        run_ops_benches(out_dir)
    if "e2e" in what:
        run_module("e2e", out_dir, args.e2e_args, args.e2e_timeout_s)
    if "dit" in what:
        run_module("dit", out_dir, args.dit_args, args.bench_timeout_s)
    if "offload" in what:
        run_module("offload", out_dir, args.offload_args, args.bench_timeout_s)
    if "tp" in what:
        run_module("tp", out_dir, args.tp_args, args.bench_timeout_s)
    if "gptq" in what:
        run_module("gptq", out_dir, args.gptq_args, args.bench_timeout_s)
    if "convert" in what:
        run_convert(out_dir, args.convert_args, args.bench_timeout_s)
    if "bench" not in what:
        if tests_summary:
            print(tests_summary)
        return 0

    from lowbit import bench
    from lowbit.bench import envinfo

    print(envinfo.format_env(envinfo.env_info()), flush=True)
    header = envinfo.header()
    path = os.path.join(out_dir, bench.default_json_name(header))
    ops = bench.select([p for p in args.ops.split(",") if p] if args.ops else ["quantize", "dequantize"])
    shapes = bench.parse_shapes(args.shapes) if args.shapes else None
    budget = max(0.0, args.deadline_s - (time.monotonic() - T0))
    result = bench.run(
        ops,
        shapes=shapes,
        quick=args.quick,
        baselines=args.baselines,
        budget_s=budget,
        json_path=path,
        header=header,
        progress=lambda s: print(s, flush=True),
    )
    if tests_summary:
        print(tests_summary)
    print(f"results: {path} (script {time.monotonic() - T0:.0f} s)")
    print(bench.format_table(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
