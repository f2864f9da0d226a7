"""lowbit.bench: the benchmark harness (``lowbit bench`` / ``python -m lowbit.bench``).

An op is a named ``setup(shape, ctx) -> Case`` (``Case``: fn, bytes, flops, baselines, check) registered
with the shapes it runs at; the runner times each case with ``triton.testing.do_bench`` (median; CUDA graphs
for tiny launches), reports GB/s and % of a device-to-device copy measured in the same run, and the speedup
over each baseline. Later ops (GEMV, GEMM) register the same way::

    from lowbit.bench import Case, Op, register
    register(Op("gemv.nvfp4", setup=my_setup, shapes=((1, 4096, 4096),)))

Importing this package does no GPU work and does not import triton.
"""

from . import quant
from .registry import (
    REGISTRY,
    Case,
    Context,
    Op,
    Shape,
    Skip,
    matches,
    parse_shapes,
    register,
    select,
    shape_str,
)
from .runner import SCHEMA, default_json_name, format_table, plan, run, validate

quant.register_all()

__all__ = [
    "REGISTRY",
    "SCHEMA",
    "Case",
    "Context",
    "Op",
    "Shape",
    "Skip",
    "default_json_name",
    "format_table",
    "matches",
    "parse_shapes",
    "plan",
    "register",
    "run",
    "select",
    "shape_str",
    "validate",
]
