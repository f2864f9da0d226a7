"""Block-scaled GEMMs on quantized operands: ``alpha * dequant(a) @ dequant(b).T + bias``.

Public entry points (re-exported as ``lowbit.scaled_mm``, ``lowbit.ops.scaled_linear``):

- :func:`scaled_mm` multiplies two QTensors: ``a`` ``[M, K]`` (the activation) and ``b`` ``[N, K]`` (the
  weight, PyTorch's ``[out, in]``); :func:`scaled_mm_reference` is THE reference every test and benchmark
  compares against (each operand dequantized to fp32 by the format reference, fp32 matmul, times alpha,
  plus the fp32 bias, one cast to ``out_dtype`` at the end).
- :func:`scaled_linear` is the fused "quantize the activation, then GEMM" entry a ``QuantLinear`` calls.
- :func:`plan_scaled_mm` / :func:`explain_scaled_mm` say which path runs and why.

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

Dispatch (:func:`plan_scaled_mm`), as for ``lowbit.linear``:

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
passed every check below (shapes, dtypes, layouts, devices), ``alpha`` is None or a float32 CUDA tensor of
shape ``[1]`` (a Python number is turned into one; 1.0 into None), ``bias`` is None or a contiguous ``[N]``
tensor of bfloat16, float16 or float32, and ``out_dtype`` is bfloat16, float16 or float32. Under
torch.compile the QTensors a kernel receives are rebuilt by the op from the same tensor objects on every
call (see ``lowbit.ops.linear``): per-weight caches must key on a tensor such as ``b.data``.

torch.compile: :func:`scaled_mm` emits the custom op ``torch.ops.lowbit.scaled_mm`` (with a fake
implementation) while compiling, and calls its implementation directly in eager mode, as ``lowbit.linear``
does. Inference only: no autograd formula.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..api import dequantize, quantize, resolve_backend
from ..formats.fp8_block import BLOCKS as _FP8_BLOCKS
from ..formats.fp8_block import expected_scale_shape as _fp8_block_scale_shape
from ..formats.packing import swizzled_scale_shape
from ..formats.qtensor import QTensor
from ..formats.spec import FORMATS
from .. import kernels as _kernels
from . import _plumbing, policy

MXFP8 = ("mxfp8_e4m3", "mxfp8_e5m2")
MXFP6 = ("mxfp6_e2m3", "mxfp6_e3m2")
FP8_ACTIVATIONS = ("fp8_rowwise", "fp8_block")
PAIRS: dict[tuple[str, str], str] = {
    ("fp8_block", "fp8_block"): "fp8_block",
    ("nvfp4", "nvfp4"): "nvfp4",
    ("mxfp4", "mxfp4"): "mxfp4",
    **{(x, y): "mxfp8" for x in MXFP8 for y in MXFP8},
    **{(x, y): "mxfp6_mxfp8" for x in MXFP6 for y in MXFP8},
    **{(y, x): "mxfp6_mxfp8" for x in MXFP6 for y in MXFP8},
    **{(x, w): "w4a8" for x in FP8_ACTIVATIONS for w in ("nvfp4", "mxfp4")},
}
"""``(a.fmt, b.fmt) -> pair kind``: every combination :func:`scaled_mm` accepts."""
OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
"""Result dtypes (and the dtypes a bias may have)."""
X_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
"""Activation dtypes :func:`scaled_linear` quantizes."""
KERNEL_MODULE = policy.SCALED_MM_MODULE
"""Launcher module under ``lowbit.kernels``: ``supports(a, b) -> str | None`` and ``scaled_mm(a, b, alpha,
bias, out_dtype) -> [M, N]``."""

_BLOCKSCALED = {
    "nvfp4": (16, torch.float8_e4m3fn),
    **{f: (32, torch.float8_e8m0fnu) for f in ("mxfp4", *MXFP6, *MXFP8)},
}
_FIELDS = ("data", "scale", "global_scale", "zeros", "nested_scale", "nested_offset")
_WHO = {"a": "a (activation, [M, K])", "b": "b (weight, [N, K])"}


# ---------------------------------------------------------------------------------------------- checks


def _pairs_for(fmt: str, side: str) -> list[str]:
    return sorted({p[0] if side == "a" else p[1] for p in PAIRS if p[1 if side == "a" else 0] == fmt})


def _check_pair(a: Any, b: Any) -> str:
    for name, q in (("a", a), ("b", b)):
        if not isinstance(q, QTensor):
            raise TypeError(f"lowbit.scaled_mm: {name} must be a lowbit QTensor, got {type(q).__name__}")
    kind = PAIRS.get((a.fmt, b.fmt))
    if kind is None:
        hint = _pairs_for(b.fmt, "a")
        extra = f"; with b.fmt {b.fmt!r}, a.fmt may be {', '.join(hint)}" if hint else ""
        raise ValueError(
            f"lowbit.scaled_mm: unsupported pair (a.fmt, b.fmt) = ({a.fmt!r}, {b.fmt!r}){extra}; supported "
            "pairs: fp8_block x fp8_block, nvfp4 x nvfp4, mxfp4 x mxfp4, mxfp8_* x mxfp8_*, mxfp6_* x mxfp8_* "
            "(either order), fp8_rowwise/fp8_block x nvfp4/mxfp4 (W4A8)"
        )
    for name, q in (("a", a), ("b", b)):
        if len(q.shape) != 2:
            raise ValueError(
                f"lowbit.scaled_mm: {name} must be a 2-D QTensor ({_WHO[name]}), got logical shape "
                f"{tuple(q.shape)}"
            )
    if a.shape[1] != b.shape[1]:
        raise ValueError(
            f"lowbit.scaled_mm: K mismatch: a.shape[1] must equal b.shape[1] (a is [M, K] = {tuple(a.shape)}, "
            f"b is [N, K] = {tuple(b.shape)})"
        )
    return kind


def _check_tensor(
    t: Any, what: str, dtype: torch.dtype | tuple[torch.dtype, ...], shape: tuple[int, ...]
) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"lowbit.scaled_mm: {what} must be a torch.Tensor, got {type(t).__name__}")
    dtypes = dtype if isinstance(dtype, tuple) else (dtype,)
    if t.dtype not in dtypes:
        want = " or ".join(str(d).removeprefix("torch.") for d in dtypes)
        raise TypeError(f"lowbit.scaled_mm: {what} must be {want}, got {t.dtype}")
    if tuple(t.shape) != shape:
        raise ValueError(f"lowbit.scaled_mm: {what} must have shape {shape}, got {tuple(t.shape)}")


def _check_blockscaled(q: QTensor, name: str, rows: int, k: int) -> None:
    block, scale_dtype = _BLOCKSCALED[q.fmt]
    if k % block:
        raise ValueError(
            f"lowbit.scaled_mm: {name}: K = {k} must be a multiple of {block} ({q.fmt} has one scale per "
            f"{block} elements along K)"
        )
    elem = FORMATS[q.fmt].element
    if elem.torch_dtype is not None:
        data_dtype, data_cols = elem.torch_dtype, k
    else:
        data_dtype, data_cols = torch.uint8, k * elem.bits // 8
    _check_tensor(
        q.data,
        f"{name}.data ({q.fmt} {'codes' if elem.bits == 8 else 'packed codes'})",
        data_dtype,
        (rows, data_cols),
    )
    cols = k // block
    if q.scale_layout == "linear":
        want = (rows, cols)
    elif q.scale_layout == "swizzled":
        want = swizzled_scale_shape(rows, cols)
    else:
        raise ValueError(
            f"lowbit.scaled_mm: {name}.scale_layout must be 'linear' or 'swizzled' for {q.fmt}, got "
            f"{q.scale_layout!r}"
        )
    what = f"{name}.scale ({q.fmt}, {q.scale_layout} layout: " + (
        f"[rows, K/{block}])"
        if q.scale_layout == "linear"
        else f"[round_up(rows, 128), round_up(K/{block}, 4)])"
    )
    _check_tensor(q.scale, what, scale_dtype, want)
    if q.fmt == "nvfp4":
        g = q.global_scale
        if g is not None:
            if not isinstance(g, torch.Tensor) or g.dtype != torch.float32:
                raise TypeError(
                    f"lowbit.scaled_mm: {name}.global_scale must be None or a float32 tensor, got "
                    f"{getattr(g, 'dtype', type(g).__name__)}"
                )
            if g.numel() != 1:
                raise ValueError(
                    f"lowbit.scaled_mm: {name}.global_scale must hold one value, got shape {tuple(g.shape)}"
                )
        pts = q.params.get("per_tensor_scale")
        if isinstance(pts, torch.Tensor) and (pts.dtype != torch.float32 or pts.numel() != 1):
            raise TypeError(
                f"lowbit.scaled_mm: {name}.params['per_tensor_scale'] must be a 1-element float32 "
                f"tensor, got {pts.dtype} of shape {tuple(pts.shape)}"
            )
    elif q.global_scale is not None:
        raise ValueError(f"lowbit.scaled_mm: {name}.global_scale must be None for {q.fmt}")


def _check_fp8_block(q: QTensor, name: str, rows: int, k: int) -> None:
    block = q.params.get("block")
    block = tuple(block) if isinstance(block, (tuple, list)) else block
    if block not in _FP8_BLOCKS:
        raise ValueError(
            f"lowbit.scaled_mm: {name}.params['block'] must be (1, 128) or (128, 128), got {block!r}"
        )
    want_block = (1, 128) if name == "a" else (128, 128)
    if block != want_block:
        raise ValueError(
            f"lowbit.scaled_mm: {name} is fp8_block with block {block}: the activation a needs block (1, 128) "
            "(DeepSeek act_quant) and the weight b block (128, 128) (weight_scale_inv)"
        )
    _check_tensor(q.data, f"{name}.data (fp8_block values)", torch.float8_e4m3fn, (rows, k))
    layouts = ("linear", "column_major") if name == "a" else ("linear",)
    if q.scale_layout not in layouts:
        raise ValueError(
            f"lowbit.scaled_mm: {name}.scale_layout must be {' or '.join(map(repr, layouts))} for fp8_block "
            f"block {block}, got {q.scale_layout!r}"
        )
    shape = tuple(_fp8_block_scale_shape((rows, k), block))
    rule = "[M, ceil(K/128)]" if name == "a" else "[ceil(N/128), ceil(K/128)]"
    _check_tensor(q.scale, f"{name}.scale (fp8_block block {block}: {rule})", torch.float32, shape)
    if q.global_scale is not None:
        raise ValueError(f"lowbit.scaled_mm: {name}.global_scale must be None for fp8_block")


def _check_fp8_rowwise(q: QTensor, name: str, rows: int, k: int) -> None:
    _check_tensor(q.data, f"{name}.data (fp8_rowwise values)", torch.float8_e4m3fn, (rows, k))
    if q.scale_layout != "linear":
        raise ValueError(
            f"lowbit.scaled_mm: {name}.scale_layout must be 'linear' for fp8_rowwise, got {q.scale_layout!r}"
        )
    _check_tensor(
        q.scale, f"{name}.scale (fp8_rowwise: one fp32 scale per row, [M, 1])", torch.float32, (rows, 1)
    )
    if q.global_scale is not None:
        raise ValueError(f"lowbit.scaled_mm: {name}.global_scale must be None for fp8_rowwise")


def check_operands(a: Any, b: Any) -> tuple[str, int, int, int]:
    """Validate the pair and both QTensors' structure; returns ``(kind, M, N, K)``. No host syncs."""
    kind = _check_pair(a, b)
    m, k = a.shape
    n = b.shape[0]
    for name, q, rows in (("a", a, m), ("b", b, n)):
        if q.fmt in _BLOCKSCALED:
            _check_blockscaled(q, name, rows, k)
        elif q.fmt == "fp8_block":
            _check_fp8_block(q, name, rows, k)
        else:
            _check_fp8_rowwise(q, name, rows, k)
    device = a.data.device
    for name, q in (("a", a), ("b", b)):
        for field in _FIELDS:
            t = getattr(q, field)
            if t is not None and t.device != device:
                raise ValueError(
                    f"lowbit.scaled_mm: devices differ: a.data is on {device}, {name}.{field} on {t.device}"
                )
    return kind, m, n, k


def _normalize_alpha(alpha: Any, device: torch.device) -> torch.Tensor | None:
    """None, a Python number or a 1-element float32 tensor on ``device`` -> None or float32 ``[1]``."""
    if alpha is None:
        return None
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float, torch.Tensor)):
        raise TypeError(
            "lowbit.scaled_mm: alpha must be None, a Python float or a 1-element float32 tensor, got "
            f"{type(alpha).__name__}"
        )
    if not isinstance(alpha, torch.Tensor):
        if float(alpha) == 1.0:
            return None
        return torch.full((1,), float(alpha), dtype=torch.float32, device=device)
    if alpha.dtype != torch.float32:
        raise TypeError(f"lowbit.scaled_mm: alpha must be a float32 scalar tensor, got dtype {alpha.dtype}")
    if alpha.numel() != 1:
        raise TypeError(
            f"lowbit.scaled_mm: alpha must be a scalar (0-d or 1-element) float32 tensor, got shape "
            f"{tuple(alpha.shape)}"
        )
    if alpha.device != device:
        raise ValueError(f"lowbit.scaled_mm: devices differ: a.data is on {device}, alpha on {alpha.device}")
    return alpha.reshape(1)


def _check_bias(bias: Any, n: int, device: torch.device) -> None:
    if bias is None:
        return
    if not isinstance(bias, torch.Tensor):
        raise TypeError(f"lowbit.scaled_mm: bias must be None or a torch.Tensor, got {type(bias).__name__}")
    if bias.dim() != 1 or bias.shape[0] != n:
        raise ValueError(f"lowbit.scaled_mm: bias must have shape [N] = ({n},), got {tuple(bias.shape)}")
    if bias.dtype not in OUT_DTYPES:
        raise TypeError(f"lowbit.scaled_mm: bias must be bfloat16, float16 or float32, got {bias.dtype}")
    if bias.device != device:
        raise ValueError(f"lowbit.scaled_mm: devices differ: a.data is on {device}, bias on {bias.device}")


def _check_out_dtype(out_dtype: Any) -> None:
    if out_dtype not in OUT_DTYPES:
        raise TypeError(
            f"lowbit.scaled_mm: out_dtype must be torch.bfloat16, torch.float16 or torch.float32, "
            f"got {out_dtype!r}"
        )


def _check(
    a: Any, b: Any, alpha: Any, bias: Any, out_dtype: Any
) -> tuple[str, int, int, int, torch.Tensor | None]:
    """Every check of :func:`scaled_mm`; returns ``(kind, M, N, K, alpha as float32 [1] or None)``."""
    kind, m, n, k = check_operands(a, b)
    device = a.data.device
    alpha_t = _normalize_alpha(alpha, device)
    _check_bias(bias, n, device)
    _check_out_dtype(out_dtype)
    return kind, m, n, k, alpha_t


# ---------------------------------------------------------------------------------------------- reference


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
    _, _, _, _, alpha_t = _check(a, b, alpha, bias, out_dtype)
    acc = (
        dequantize(a, torch.float32, backend=dequant_backend)
        @ dequantize(b, torch.float32, backend=dequant_backend).T
    )
    return _epilogue(acc, alpha_t, bias, out_dtype)


# ---------------------------------------------------------------------------------------------- dispatch


@dataclass(frozen=True)
class ScaledMMPlan:
    """What :func:`scaled_mm` does for one call.

    Attributes:
        path: ``"reference"``, ``"scaled_mm"`` (the Triton kernel module), ``"empty"`` (M, N or K is 0:
            nothing launched) or ``"unavailable"`` (:func:`scaled_mm` raises ``error`` with ``reason``).
        reason: one sentence saying why.
        backend: the resolved backend.
        device: the operands' device (as a string).
        m, n, k: rows of a, rows of b, shared K.
        pair: ``"<a.fmt> x <b.fmt>"``; kind: the pair kind (a value of :data:`PAIRS`).
        error: the exception class :func:`scaled_mm` raises (only for ``"unavailable"``).
    """

    path: str
    reason: str
    backend: str
    device: str
    m: int
    n: int
    k: int
    pair: str
    kind: str
    error: type[Exception] | None = None

    def __str__(self) -> str:
        return _plumbing.plan_str("scaled_mm", self.pair, self)


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


# ---------------------------------------------------------------------------------------------- execution


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
    alpha_t = _check(a, b, alpha, bias, out_dtype)[4]
    chosen = resolve_backend(backend)
    if torch.compiler.is_compiling():
        a_t, a_meta = _flatten(a)
        b_t, b_meta = _flatten(b)
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
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"lowbit.scaled_linear: x must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in X_DTYPES:
        raise TypeError(f"lowbit.scaled_linear: x must be bfloat16, float16 or float32, got {x.dtype}")
    if x.dim() < 1 or x.shape[-1] != k:
        raise ValueError(
            f"lowbit.scaled_linear: K mismatch: x.shape[-1] must equal w.shape[-1] = {k} (w is [N, K] = "
            f"{tuple(w.shape)}), got x.shape = {tuple(x.shape)}"
        )
    if not isinstance(act_format, str) or (act_format, w.fmt) not in PAIRS:
        allowed = _pairs_for(w.fmt, "a")
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
    _check_out_dtype(out_dtype)
    alpha_t = _normalize_alpha(alpha, x.device)
    _check_bias(bias, n, x.device)
    chosen = resolve_backend(backend)
    flat = x.dim() == 2
    x2 = x if flat and x.is_contiguous() else x.reshape(-1, k).contiguous()
    if torch.compiler.is_compiling():
        # lowbit.quantize is not traceable (it picks kernels through importlib): the whole fused call is
        # one opaque op in the graph, quantization included
        w_t, w_meta = _flatten(w)
        act_tensors: list[torch.Tensor] = []
        act_meta = ";".join(_encode(key, options[key], act_tensors) for key in sorted(options))
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
        out = _scaled_linear_run(x2, w, act_format, options, alpha_t, bias, out_dtype, chosen)
    return out if flat else out.reshape(*x.shape[:-1], n)


def _scaled_linear_run(
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


# ---------------------------------------------------------------------------------------------- custom op
#
# Schema: scaled_mm(Tensor a_data, Tensor a_scale, Tensor? a_global_scale, Tensor[] a_param_tensors,
#     str a_fmt, SymInt[] a_shape, str a_meta, <the same seven for b>, Tensor? alpha, Tensor? bias,
#     ScalarType out_dtype, str backend) -> Tensor
# ``meta`` (lowbit.ops._plumbing) encodes a QTensor's non-tensor fields as ``key=T:value`` items joined by
# ';' (T: b bool, i int, f float, s str, n None, p a tuple of ints "1,128", t an index into the param
# tensors); ``@dtype`` and ``@scale_layout`` are the QTensor fields, the other keys its params. A plain
# string, so dynamo builds it at trace time and the graph holds it as a constant.


def _encode(key: str, value: Any, tensors: list[torch.Tensor]) -> str:
    return _plumbing.encode(
        key, value, tensors, op="lowbit.scaled_mm", what="the QTensor param or option", extended=True
    )


def _flatten(q: QTensor) -> tuple[list[Any], str]:
    """``[data, scale, global_scale, param_tensors]`` and ``meta`` of a QTensor (the formats here have no
    zeros or nested scales)."""
    param_tensors, meta = _plumbing.flatten_meta(q, _encode)
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
    return _plumbing.unflatten(data, scale, param_tensors, fmt, shape, meta, global_scale=global_scale)


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
    options = dict(_plumbing.decode_items(act_meta, act_tensors))
    with _kernels.per_call_scratch():
        return _scaled_linear_run(x.contiguous(), w, act_format, options, alpha, bias, out_dtype, backend)


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
