"""What ``lowbit.scaled_mm`` runs: THE reference (:func:`scaled_mm_reference`), the plan of a call (which path and
why: :func:`plan_scaled_mm`, :func:`explain_scaled_mm`; the rules are :mod:`lowbit.ops.policy`'s) and the run of
a checked call on its path (:func:`run_checked`, :func:`run_scaled_linear`), which eager calls and the custom ops
share.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ..api import dequantize, quantize, resolve_backend
from ..formats.qtensor import QTensor
from . import op_common, policy
from .scaled_mm_checks import check_arguments, check_operands


def _epilogue(
    acc: torch.Tensor, alpha: torch.Tensor | None, bias: torch.Tensor | None, out_dtype
) -> torch.Tensor:
    if alpha is not None:
        acc = acc * alpha
    if bias is not None:
        acc = acc + bias.float()
    return acc.to(out_dtype)


def scaled_mm_reference(
    a: QTensor,
    b: QTensor,
    alpha: torch.Tensor | float | None = None,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype = torch.bfloat16,
    *,
    dequant_backend: str | None = None,
) -> torch.Tensor:
    """THE reference: ``(dequant(a) @ dequant(b).T) * alpha + bias``, all in fp32, one cast to ``out_dtype``.

    Each operand is decoded to fp32 with ``lowbit.dequantize`` (the format reference, or its bit-identical
    Triton kernel per ``dequant_backend``), multiplied with torch's fp32 matmul (keep TF32 off, torch's
    default, for a true fp32 product), scaled by ``alpha`` in fp32 and offset by ``bias.float()``.

    Args and checks: as :func:`scaled_mm`.

    Returns:
        ``[M, N]`` tensor in ``out_dtype``. Inputs are never modified.
    """
    _, _, _, _, alpha_t = check_arguments(a, b, alpha, bias, out_dtype)
    acc = (
        dequantize(a, torch.float32, backend=dequant_backend)
        @ dequantize(b, torch.float32, backend=dequant_backend).T
    )
    return _epilogue(acc, alpha_t, bias, out_dtype)


# ---------------------------------------------------------------------------------------------- dispatch


@dataclass(frozen=True)
class ScaledMMPlan(op_common.Plan):
    """What :func:`lowbit.ops.scaled_mm.scaled_mm` does for one call: the fields every plan has (path, reason,
    backend, device, m, n, k; ``lowbit.ops.op_common.Plan``), then the pair and the exception class.

    ``path`` is ``"reference"``, ``"scaled_mm"`` (the Triton kernel module), ``"empty"`` (M, N or K is 0: nothing
    launched) or ``"unavailable"`` (``scaled_mm`` raises ``error`` with ``reason``); m, n, k are the rows of a,
    the rows of b and the shared K.

    Attributes:
        pair: ``"<a.fmt> x <b.fmt>"``; kind: the pair kind (a value of ``lowbit.ops.PAIRS``).
        error: the exception class ``scaled_mm`` raises (only for ``"unavailable"``).
    """

    pair: str
    kind: str
    error: type[Exception] | None = None

    def __str__(self) -> str:
        return op_common.plan_str("scaled_mm", self.pair, self)


def _plan(kind: str, m: int, n: int, k: int, a: QTensor, b: QTensor, backend: str) -> ScaledMMPlan:
    device = a.data.device
    path, target, facts = policy.scaled_decide(m, n, k, device, a, b, backend)
    error = target if path == "unavailable" else None
    return ScaledMMPlan(
        path,
        policy.scaled_reason(path, facts, device, a, b),
        backend,
        str(device),
        m,
        n,
        k,
        f"{a.fmt} x {b.fmt}",
        kind,
        error,
    )


def plan_scaled_mm(a: QTensor, b: QTensor, backend: str | None = None) -> ScaledMMPlan:
    """Which path :func:`scaled_mm` takes for these operands, and why (the structured :func:`explain_scaled_mm`).

    Raises only for invalid arguments (bad backend, unsupported pair, K mismatch, malformed operands); a
    call that cannot run comes back as ``path == "unavailable"``.
    """
    kind, m, n, k = check_operands(a, b)
    return _plan(kind, m, n, k, a, b, resolve_backend(backend))


def explain_scaled_mm(a: QTensor, b: QTensor, backend: str | None = None) -> str:
    """One line saying which path :func:`scaled_mm` runs for ``a`` and ``b``, and why.

    Example (CPU): ``"lowbit.scaled_mm fp8_block x fp8_block [M=4, K=256] x [N=128, K=256] on cpu,
    backend='auto': reference (operands are on cpu, no kernels there: scaled_mm_reference)"``.
    """
    return str(plan_scaled_mm(a, b, backend))


def run_checked(
    a: QTensor,
    b: QTensor,
    alpha: torch.Tensor | None,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
    backend: str,
) -> torch.Tensor:
    """The implementation behind :func:`scaled_mm` and the custom op (arguments already checked)."""
    m, k = a.shape
    n = b.shape[0]
    device = a.data.device
    path, target, facts = policy.scaled_decide(m, n, k, device, a, b, backend)
    if path == "scaled_mm":
        bias = bias if bias is None else bias.contiguous()
        return target(a, b, alpha, bias, out_dtype, policy.scaled_route(a, b, bias, out_dtype, facts[0]))
    if path == "reference":
        return scaled_mm_reference(a, b, alpha, bias, out_dtype, dequant_backend=backend)
    if path == "empty":
        acc = torch.zeros((m, n), dtype=torch.float32, device=device)
        return _epilogue(acc, alpha, bias, out_dtype)
    raise target(f"lowbit.scaled_mm: {policy.scaled_reason(path, facts, device, a, b)}")


def run_scaled_linear(
    x2: torch.Tensor,
    w: QTensor,
    act_format: str,
    options: dict[str, Any],
    alpha: torch.Tensor | None,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
    backend: str,
) -> torch.Tensor:
    """The implementation behind :func:`scaled_linear` and its custom op: ``x2`` is ``[M, K]`` contiguous."""
    a = quantize(x2, act_format, backend=backend, **options)
    check_operands(a, w)  # the options may have made an operand that does not pair (e.g. block (128, 128))
    return run_checked(a, w, alpha, bias, out_dtype, backend)
