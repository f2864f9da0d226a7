"""Block-scaled GEMMs on quantized operands: ``alpha * dequant(a) @ dequant(b).T + bias``.

Public entry points (re-exported as ``lowbit.scaled_mm``, ``lowbit.ops.scaled_linear``):

- :func:`scaled_mm` multiplies two QTensors: ``a`` ``[M, K]`` (the activation) and ``b`` ``[N, K]`` (the
  weight, PyTorch's ``[out, in]``); ``scaled_mm_reference`` (:mod:`lowbit.ops.scaled_mm_dispatch`) is THE
  reference every test and benchmark compares against (each operand dequantized to fp32 by the format reference, fp32 matmul, times alpha,
  plus the fp32 bias, one cast to ``out_dtype`` at the end).
- :func:`scaled_linear` is the fused "quantize the activation, then GEMM" entry a ``QuantLinear`` calls.
- ``plan_scaled_mm`` / ``explain_scaled_mm`` (:mod:`lowbit.ops.scaled_mm_dispatch`) say which path runs and why.

The argument checks are :mod:`lowbit.ops.scaled_mm_checks`, the custom ops :mod:`lowbit.ops.scaled_mm_op`.

Supported ``(a.fmt, b.fmt)`` pairs (:data:`PAIRS`; docs/scaled_mm.md has the full rules):

======================  =============================================  ===========================================
pair                    a (activation)                                 b (weight)
======================  =============================================  ===========================================
``fp8_block`` (W8A8)    ``fp8_block`` block (1, 128), fp32 or ue8m0     ``fp8_block`` block (128, 128)
                        scales, ``linear`` or ``column_major`` scales
``nvfp4`` (W4A4)        ``nvfp4``                                      ``nvfp4``
``mxfp4`` (W4A4)        ``mxfp4``                                      ``mxfp4``
``mxfp8`` (W8A8)        ``mxfp8_e4m3`` / ``mxfp8_e5m2``                ``mxfp8_e4m3`` / ``mxfp8_e5m2``
``mxfp6_mxfp8``         ``mxfp6_e2m3`` / ``mxfp6_e3m2``                ``mxfp8_e4m3`` / ``mxfp8_e5m2``
                        or ``mxfp8_*`` (LightX2V's W6A8 order)         or ``mxfp6_*``
``w4a8``                ``fp8_rowwise`` (per token) or ``fp8_block``   ``nvfp4`` or ``mxfp4``
                        block (1, 128)
======================  =============================================  ===========================================

Block-scaled operands (nvfp4, MX) take ``linear`` or 128x4 ``swizzled`` scales, each operand its own.

``alpha``: an extra fp32 multiplier of the product (default 1). ``dequant`` already includes everything a
QTensor carries, in particular an nvfp4 operand's ``1/global_scale``, so for two nvfp4 QTensors made by
``lowbit.quantize`` the right alpha is 1. (LightX2V's ``cutlass_scaled_nvfp4_mm`` gets raw block scales and
``alpha = 1/(gs_a * gs_w)``; ``lowbit.compat.lightx2v`` passes those scales as single-level QTensors,
``global_scale=None``, and forwards its alpha unchanged.)

Dispatch (``plan_scaled_mm``), as for ``lowbit.linear``:

1. ``backend="torch"`` (or ``$LOWBIT_BACKEND=torch``): the reference, on any device.
2. Operands not on CUDA: the reference with ``backend="auto"``; ``backend="triton"`` is a ValueError.
3. CUDA (``"auto"`` and ``"triton"`` alike, no silent fallback): ``M``, ``N`` or ``K`` equal to 0 launches
   nothing (the result is ``alpha * 0 + bias``, computed like the reference); otherwise
   ``lowbit.kernels.scaled_mm`` if the module exists and its ``supports(a, b)`` returns None; else
   :func:`scaled_mm` raises RuntimeError naming the reason (pass ``backend="torch"`` for the reference).
   :func:`lowbit.ops.policy.scaled_route` picks the module's route: the W4A16 GEMV on the exactly decoded
   activation (decode), the exact E4M3 re-encoding of mxfp4 onto the FP8 tensor cores (large M), cuBLASLt's
   block-scaled FP8 GEMM (fp8_block), or lowbit's block-scaled GEMM kernels; the plan's reason names it.

Kernel contract (``lowbit.kernels.scaled_mm``): ``supports(a, b) -> str | None`` (called on every call, keep it
cheap), the capability checks :mod:`lowbit.ops.policy` routes with, and ``scaled_mm(a, b, alpha, bias,
out_dtype, route) -> Tensor [M, N]`` in ``out_dtype``, where ``a``/``b``
passed every check of :mod:`lowbit.ops.scaled_mm_checks` (shapes, dtypes, layouts, devices), ``alpha`` is None or a float32 CUDA tensor of
shape ``[1]`` (a Python number is turned into one; 1.0 into None), ``bias`` is None or a contiguous ``[N]``
tensor of bfloat16, float16 or float32, and ``out_dtype`` is bfloat16, float16 or float32. Under
torch.compile the QTensors a kernel receives are rebuilt by the op from the same tensor objects on every
call (see ``lowbit.ops.linear``): per-weight caches must key on a tensor such as ``b.data``.

torch.compile: :func:`scaled_mm` emits the custom op ``torch.ops.lowbit.scaled_mm`` (with a fake
implementation) while compiling, and calls its implementation directly in eager mode, as ``lowbit.linear``
does. Inference only: no autograd formula.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from ..api import resolve_backend
from ..formats.qtensor import QTensor
from . import op_common, policy
from .scaled_mm_checks import PAIRS, check_arguments, check_bias, check_out_dtype, normalize_alpha, pairs_for
from .scaled_mm_dispatch import run_checked, run_scaled_linear
from .scaled_mm_op import encode, flatten

X_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
"""Activation dtypes :func:`scaled_linear` quantizes."""
KERNEL_MODULE = policy.SCALED_MM_MODULE
"""Launcher module under ``lowbit.kernels``: ``supports(a, b) -> str | None`` and ``scaled_mm(a, b, alpha,
bias, out_dtype) -> [M, N]``."""


def scaled_mm(
    a: QTensor,
    b: QTensor,
    alpha: torch.Tensor | float | None = None,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype = torch.bfloat16,
    *,
    backend: str | None = None,
) -> torch.Tensor:
    """Block-scaled GEMM ``alpha * dequant(a) @ dequant(b).T + bias`` with fp32 accumulation.

    Args:
        a: QTensor ``[M, K]``, the activation operand (see :data:`PAIRS` and the module docstring).
        b: QTensor ``[N, K]``, the weight operand.
        alpha: None (1), a Python float, or a 0-d / 1-element float32 tensor on the operands' device: an
            extra multiplier of the product. ``dequant`` already applies an nvfp4 ``global_scale``, so
            QTensors from ``lowbit.quantize`` need no alpha.
        bias: None or ``[N]`` bfloat16/float16/float32 on the operands' device, added in fp32 after alpha.
        out_dtype: torch.bfloat16 (default), torch.float16 or torch.float32.
        backend: ``"auto"`` (default, or ``$LOWBIT_BACKEND``): the Triton kernel on CUDA, the reference on
            CPU; ``"triton"``: the kernel only (ValueError off CUDA); ``"torch"``:
            :func:`scaled_mm_reference` on any device. :func:`explain_scaled_mm` says what runs and why.

    Returns:
        ``[M, N]`` tensor in ``out_dtype``. Inputs are never modified.

    Raises:
        TypeError: an operand is not a QTensor; a data/scale tensor has the wrong dtype; alpha is not None,
            a number or a 1-element float32 tensor; bias or out_dtype dtype.
        ValueError: unsupported ``(a.fmt, b.fmt)`` pair, operand not 2-D, K mismatch, K not a multiple of
            the format's block, data/scale shape or scale layout that does not match the format, fp8_block
            blocks the wrong way round, bias shape, devices differ, bad backend.
        RuntimeError: on CUDA, no kernel covers the call (no silent fallback; use ``backend="torch"``).
    """
    alpha_t = check_arguments(a, b, alpha, bias, out_dtype)[4]
    chosen = resolve_backend(backend)
    if torch.compiler.is_compiling():
        a_t, a_meta = flatten(a)
        b_t, b_meta = flatten(b)
        return torch.ops.lowbit.scaled_mm(
            *a_t,
            a.fmt,
            list(a.shape),
            a_meta,
            *b_t,
            b.fmt,
            list(b.shape),
            b_meta,
            alpha_t,
            bias,
            out_dtype,
            chosen,
        )
    return run_checked(a, b, alpha_t, bias, out_dtype, chosen)


# ---------------------------------------------------------------------------------------------- fused entry


def scaled_linear(
    x: torch.Tensor,
    w: QTensor,
    act_format: str,
    *,
    act_options: Mapping[str, Any] | None = None,
    act_global_scale: torch.Tensor | float | None = None,
    bias: torch.Tensor | None = None,
    alpha: torch.Tensor | float | None = None,
    out_dtype: torch.dtype | None = None,
    backend: str | None = None,
) -> torch.Tensor:
    """Quantize the activation, then :func:`scaled_mm`: ``alpha * dequant(quant(x)) @ dequant(w).T + bias``.

    Args:
        x: ``[..., K]`` bfloat16/float16/float32 activations, any leading dims and strides.
        w: QTensor weight ``[N, K]`` (``[out, in]``) of a format that pairs with ``act_format``.
        act_format: the activation format: ``"nvfp4"``, ``"mxfp4"``, ``"mxfp8_e4m3"``/``"mxfp8_e5m2"``,
            ``"mxfp6_*"``, ``"fp8_block"`` (block (1, 128), the default) or ``"fp8_rowwise"``; the pair
            ``(act_format, w.fmt)`` must be in :data:`PAIRS`.
        act_options: options for ``lowbit.quantize(x2d, act_format, **act_options)`` (e.g. fp8_block
            ``scale_fmt="ue8m0"``, MX ``scale_rounding``, ``scale_layout``).
        act_global_scale: nvfp4 only: a static (calibrated) global scale multiplier ``2688/amax`` (as
            compressed-tensors' ``input_global_scale``); None quantizes with the dynamic per-tensor scale.
        bias, alpha: as :func:`scaled_mm`.
        out_dtype: result dtype; None means x's dtype.
        backend: used for both the activation quantization and the GEMM (``lowbit.quantize`` /
            :func:`scaled_mm` rules).

    Returns:
        ``[..., N]`` tensor in ``out_dtype``. x is never modified.
    """
    if not isinstance(w, QTensor):
        raise TypeError(f"lowbit.scaled_linear: w must be a lowbit QTensor, got {type(w).__name__}")
    if len(w.shape) != 2:
        raise ValueError(
            f"lowbit.scaled_linear: w must be a 2-D weight [N, K], got logical shape {tuple(w.shape)}"
        )
    n, k = w.shape
    op_common.check_x(x, w, "lowbit.scaled_linear", X_DTYPES, "bfloat16, float16 or float32")
    if not isinstance(act_format, str) or (act_format, w.fmt) not in PAIRS:
        allowed = pairs_for(w.fmt, "a")
        raise ValueError(
            f"lowbit.scaled_linear: act_format {act_format!r} does not pair with weight format {w.fmt!r}; "
            + (
                f"allowed: {', '.join(allowed)}"
                if allowed
                else f"no scaled_mm pair has weight format {w.fmt!r}"
            )
        )
    if act_options is not None and not isinstance(act_options, Mapping):
        raise TypeError(
            f"lowbit.scaled_linear: act_options must be None or a dict, got {type(act_options).__name__}"
        )
    options = dict(act_options or {})
    if act_global_scale is not None:
        if act_format != "nvfp4":
            raise ValueError(
                f"lowbit.scaled_linear: act_global_scale is for nvfp4 activations only, act_format is "
                f"{act_format!r}"
            )
        if "global_scale" in options:
            raise ValueError(
                "lowbit.scaled_linear: give the global scale either as act_global_scale or in "
                "act_options, not both"
            )
        options["global_scale"] = act_global_scale
    out_dtype = x.dtype if out_dtype is None else out_dtype
    check_out_dtype(out_dtype)
    alpha_t = normalize_alpha(alpha, x.device)
    check_bias(bias, n, x.device)
    chosen = resolve_backend(backend)
    flat = x.dim() == 2
    x2 = x if flat and x.is_contiguous() else x.reshape(-1, k).contiguous()
    if torch.compiler.is_compiling():
        # lowbit.quantize is not traceable (it picks kernels through importlib): the whole fused call is
        # one opaque op in the graph, quantization included
        w_t, w_meta = flatten(w)
        act_tensors: list[torch.Tensor] = []
        act_meta = ";".join(encode(key, options[key], act_tensors) for key in sorted(options))
        out = torch.ops.lowbit.scaled_linear(
            x2,
            *w_t,
            w.fmt,
            list(w.shape),
            w_meta,
            act_format,
            act_meta,
            act_tensors,
            alpha_t,
            bias,
            out_dtype,
            chosen,
        )
    else:
        out = run_scaled_linear(x2, w, act_format, options, alpha_t, bias, out_dtype, chosen)
    return out if flat else out.reshape(*x.shape[:-1], n)
