"""The custom ops of ``lowbit.scaled_mm`` and ``lowbit.ops.scaled_linear`` (``torch.ops.lowbit.scaled_mm``,
``torch.ops.lowbit.scaled_linear``), with fake implementations so that a dynamic M does not recompile. A QTensor
is not a tensor: each op takes its operands flattened into their tensors plus a metadata string
(:func:`flatten`; the schemas are in the comments below). Inference only: no autograd formula.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from .. import kernels as _kernels
from ..formats.qtensor import QTensor
from . import op_common
from .scaled_mm_dispatch import run_checked, run_scaled_linear


# Schema: scaled_mm(Tensor a_data, Tensor a_scale, Tensor? a_global_scale, Tensor[] a_param_tensors,
#     str a_fmt, SymInt[] a_shape, str a_meta, <the same seven for b>, Tensor? alpha, Tensor? bias,
#     ScalarType out_dtype, str backend) -> Tensor
# ``meta`` (lowbit.ops.op_common) encodes a QTensor's non-tensor fields as ``key=T:value`` items joined by
# ';' (T: b bool, i int, f float, s str, n None, p a tuple of ints "1,128", t an index into the param
# tensors); ``@dtype`` and ``@scale_layout`` are the QTensor fields, the other keys its params. A plain
# string, so dynamo builds it at trace time and the graph holds it as a constant.


def encode(key: str, value: Any, tensors: list[torch.Tensor]) -> str:
    return op_common.encode(
        key, value, tensors, op="lowbit.scaled_mm", what="the QTensor param or option", extended=True
    )


def flatten(q: QTensor) -> tuple[list[Any], str]:
    """``[data, scale, global_scale, param_tensors]`` and ``meta`` of a QTensor (the formats here have no
    zeros or nested scales)."""
    param_tensors, meta = op_common.flatten_meta(q, encode)
    return [q.data, q.scale, q.global_scale, param_tensors], meta


def _unflatten(
    data: torch.Tensor,
    scale: torch.Tensor,
    global_scale: torch.Tensor | None,
    param_tensors: Sequence[torch.Tensor],
    fmt: str,
    shape: Sequence[int],
    meta: str,
) -> QTensor:
    return op_common.unflatten(data, scale, param_tensors, fmt, shape, meta, global_scale=global_scale)


@torch.library.custom_op("lowbit::scaled_mm", mutates_args=())
def scaled_mm_op(
    a_data: torch.Tensor,
    a_scale: torch.Tensor,
    a_global_scale: torch.Tensor | None,
    a_param_tensors: list[torch.Tensor],
    a_fmt: str,
    a_shape: list[int],
    a_meta: str,
    b_data: torch.Tensor,
    b_scale: torch.Tensor,
    b_global_scale: torch.Tensor | None,
    b_param_tensors: list[torch.Tensor],
    b_fmt: str,
    b_shape: list[int],
    b_meta: str,
    alpha: torch.Tensor | None,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
    backend: str,
) -> torch.Tensor:
    """``lowbit.scaled_mm`` on two flattened QTensors (see the schema comment above)."""
    a = _unflatten(a_data, a_scale, a_global_scale, a_param_tensors, a_fmt, a_shape, a_meta)
    b = _unflatten(b_data, b_scale, b_global_scale, b_param_tensors, b_fmt, b_shape, b_meta)
    with _kernels.per_call_scratch():
        return run_checked(a, b, alpha, bias, out_dtype, backend)


@scaled_mm_op.register_fake
def _scaled_mm_fake(
    a_data,
    a_scale,
    a_global_scale,
    a_param_tensors,
    a_fmt,
    a_shape,
    a_meta,
    b_data,
    b_scale,
    b_global_scale,
    b_param_tensors,
    b_fmt,
    b_shape,
    b_meta,
    alpha,
    bias,
    out_dtype,
    backend,
):
    torch._check(len(a_shape) == 2 and len(b_shape) == 2, lambda: "lowbit::scaled_mm: a and b must be 2-D")
    torch._check(a_shape[1] == b_shape[1], lambda: "lowbit::scaled_mm: K mismatch between a and b")
    # M and N from the data tensors (their first dim is the logical one for every format), so a dynamic M
    # stays symbolic
    return a_data.new_empty((a_data.shape[0], b_data.shape[0]), dtype=out_dtype)


# Schema: scaled_linear(Tensor x, Tensor w_data, Tensor w_scale, Tensor? w_global_scale, Tensor[] w_param_tensors,
#     str w_fmt, SymInt[] w_shape, str w_meta, str act_format, str act_meta, Tensor[] act_tensors, Tensor? alpha,
#     Tensor? bias, ScalarType out_dtype, str backend) -> Tensor
# x is [M, K] contiguous; act_meta encodes the activation quantize options like a QTensor's params.


@torch.library.custom_op("lowbit::scaled_linear", mutates_args=())
def scaled_linear_op(
    x: torch.Tensor,
    w_data: torch.Tensor,
    w_scale: torch.Tensor,
    w_global_scale: torch.Tensor | None,
    w_param_tensors: list[torch.Tensor],
    w_fmt: str,
    w_shape: list[int],
    w_meta: str,
    act_format: str,
    act_meta: str,
    act_tensors: list[torch.Tensor],
    alpha: torch.Tensor | None,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
    backend: str,
) -> torch.Tensor:
    """``lowbit.ops.scaled_linear`` on a flattened weight (see the schema comment above)."""
    w = _unflatten(w_data, w_scale, w_global_scale, w_param_tensors, w_fmt, w_shape, w_meta)
    options = dict(op_common.decode_items(act_meta, act_tensors))
    with _kernels.per_call_scratch():
        return run_scaled_linear(x.contiguous(), w, act_format, options, alpha, bias, out_dtype, backend)


@scaled_linear_op.register_fake
def _scaled_linear_fake(
    x,
    w_data,
    w_scale,
    w_global_scale,
    w_param_tensors,
    w_fmt,
    w_shape,
    w_meta,
    act_format,
    act_meta,
    act_tensors,
    alpha,
    bias,
    out_dtype,
    backend,
):
    torch._check(x.dim() == 2, lambda: f"lowbit::scaled_linear: x must be 2-D [M, K], got {x.dim()}-D")
    torch._check(len(w_shape) == 2, lambda: "lowbit::scaled_linear: w_shape must be the weight's [N, K]")
    torch._check(
        x.shape[1] == w_shape[1], lambda: "lowbit::scaled_linear: K mismatch between x and the weight"
    )
    return x.new_empty((x.shape[0], w_data.shape[0]), dtype=out_dtype)
