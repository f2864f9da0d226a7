"""Tensor parallelism for lowbit models on ``torch.distributed`` (DeviceMesh, NCCL or gloo).

``parallelize(model, mesh, plan)`` shards every QuantLinear a plan names (column-parallel: output features;
row-parallel: input features, outputs summed across ranks), with torch's plan vocabulary; lowbit's
``ColwiseParallel`` / ``RowwiseParallel`` are torch's styles that also take QuantLinear, so
``torch.distributed.tensor.parallel.parallelize_module`` works with them too. ``lowbit.load_quantized(...,
device_mesh=, tp_plan=)`` reads only each rank's shard from a checkpoint.

Importing this package imports ``torch.distributed.tensor`` (not at ``import lowbit``).
"""

from .api import PLAN_STRINGS, model_plan, parallelize, resolve_plan, style_of
from .layers import ColwiseQuantLinear, RowwiseQuantLinear, TensorParallel, parallelize_quant_linear
from .styles import ColwiseParallel, RowwiseParallel

__all__ = [
    "PLAN_STRINGS",
    "ColwiseParallel",
    "ColwiseQuantLinear",
    "RowwiseParallel",
    "RowwiseQuantLinear",
    "TensorParallel",
    "model_plan",
    "parallelize",
    "parallelize_quant_linear",
    "resolve_plan",
    "style_of",
]
