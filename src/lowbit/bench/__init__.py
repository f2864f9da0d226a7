"""lowbit.bench: the benchmark harness (``lowbit bench`` / ``python -m lowbit.bench``).

One registry, one timer:

- ops: a named ``setup(shape, ctx) -> Case`` (``Case``: fn, bytes, flops, baselines, check) registered with
  the shapes it runs at: quantize/dequantize of every format (:mod:`~lowbit.bench.quant`), W4A16
  ``lowbit.linear`` and ``QuantLinear`` (:mod:`~lowbit.bench.linear`), ``lowbit.scaled_mm`` /
  ``scaled_linear`` (:mod:`~lowbit.bench.scaled_mm`). The runner checks each case against the reference, times
  it (``triton.testing.do_bench`` medians; CUDA-graph replays for launch-bound cases), reports GB/s, % of a
  device-to-device copy and TFLOPS measured in the same run, and the speedup over each baseline (cuBLAS, the
  peers of :mod:`~lowbit.bench.peers`, a compiled reference), each a callable or the reason it was skipped;
- suites: the model-level benchmarks with their own options, ``lowbit bench e2e|dit|offload ...``
  (``lowbit e2e`` and ``lowbit dit`` are the same commands);
- ``lowbit bench compare NEW.json BASELINE.json`` (or ``lowbit bench ... --compare BASELINE.json``): the
  ratios of a run next to a curated baseline's (:mod:`~lowbit.bench.comparison`).

A new op registers the same way::

    from lowbit.bench import Case, Op, register
    register(Op("gemv.nvfp4", setup=my_setup, shapes=((1, 4096, 4096),)))

Importing this package does no GPU work and does not import triton.
"""

from . import linear, quant, scaled_mm
from .registry import (
    REGISTRY,
    SUITES,
    Case,
    Context,
    Op,
    Shape,
    Skip,
    Suite,
    matches,
    parse_shapes,
    register,
    register_suite,
    select,
    shape_str,
)
from .runner import SCHEMA, compare, default_json_name, format_table, plan, ratios, run, validate

quant.register_all()
linear.register_all()
scaled_mm.register_all()
for _suite in (
    Suite("e2e", "lowbit.bench.e2e", "Llama-3-8B-shaped decoder: decode/prefill/generate tokens/s per config and "
          "run mode, ratios to bf16 (lowbit bench e2e --help)"),
    Suite("dit", "lowbit.bench.dit", "Wan2.1-14B-shaped DiT block: bf16 vs every scheme at 8190 and 32760 tokens "
          "(lowbit bench dit --help)"),
    Suite("offload", "lowbit.bench.offload", "block offload of a Wan-shaped block stack: peak memory and time "
          "against all on the GPU (lowbit bench offload --help)"),
    Suite("tp", "lowbit.bench.tp", "Llama-3-70B-shaped layer stack on 1 and N GPUs (tensor parallel): decode "
          "and prefill time ratios (lowbit bench tp --help)"),
    Suite("gptq", "lowbit.bench.gptq", "GPTQ of a Llama-3-8B-shaped decoder layer: time per scheme and run mode, "
          "error against round-to-nearest (lowbit bench gptq --help)"),
):
    register_suite(_suite, replace=True)

__all__ = [
    "REGISTRY",
    "SCHEMA",
    "SUITES",
    "Case",
    "Context",
    "Op",
    "Shape",
    "Skip",
    "Suite",
    "compare",
    "default_json_name",
    "format_table",
    "matches",
    "parse_shapes",
    "plan",
    "ratios",
    "register",
    "register_suite",
    "run",
    "select",
    "shape_str",
    "validate",
]
