"""Weight-only 4-bit linear (W4A16): ``act(x @ dequant(w).T + bias)``.

Public entry points (re-exported as ``lowbit.linear``, ``lowbit.explain``):

- :func:`linear` computes the layer; :func:`linear_reference` is THE reference every test and benchmark
  compares against (dequantize to fp32, fp32 matmul, fp32 bias and activation, one cast at the end).
- :func:`plan_linear` / :func:`explain` say which path runs and why. The rules and every threshold live in
  :mod:`lowbit.ops.policy` (``linear_decide``, ``GEMV_MAX_M``, ``DEQUANT_GEMM_MIN_M``).

Dispatch, with ``M = x.numel() // K`` rows:

1. ``backend="torch"`` (or ``$LOWBIT_BACKEND=torch``): the reference, on any device.
2. x not on CUDA: the reference with ``backend="auto"``; ``backend="triton"`` is a ValueError.
3. CUDA (``"auto"`` and ``"triton"`` alike; there is no silent fallback on CUDA), by ``policy.linear_decide``:
   the register-operand Gluon GEMM (``gemm_w4.gemm_w4_rf``, or ``gemm_w4_ra`` per
   ``policy.REGISTER_OPERAND_FRAGMENTS``) where ``policy.register_operand_config`` takes the call;
   ``M >= policy.dequant_gemm_min_m(fmt)``: :func:`linear_dequant_gemm` (the weight dequantized by the Triton
   kernels in chunks of at most 64 MB, then cuBLAS); ``M <= GEMV_MAX_M``: ``lowbit.kernels.gemv_w4``
   (split-K GEMV) if the module exists and its ``supports(w)`` returns None, else ``lowbit.kernels.gemm_w4``
   likewise; ``M > GEMV_MAX_M``: ``gemm_w4``. Where no kernel can run, :func:`linear` raises RuntimeError
   naming each reason (pass ``backend="torch"`` for the reference). ``M == 0`` launches nothing and returns an
   empty result.

torch.compile and CUDA graphs: the custom op ``torch.ops.lowbit.linear_w4a16`` (``torch.library.custom_op``
with a fake implementation) takes the QTensor flattened into its tensors plus plain metadata, because a
QTensor is not a tensor. Under ``torch.compile`` (``torch.compiler.is_compiling()``) :func:`linear` emits
that op for every backend and device, so compiled graphs hold one opaque node whose dispatch runs when the
graph runs (dynamic ``M`` needs no recompile, CPU and ``backend="torch"`` compile the same way). In eager
mode :func:`linear` calls the op's implementation directly: going through the custom-op dispatcher cost
about 25 us of host time per call on the H200 machine, against about 6 us for the direct call (empty
stand-in kernel), more than a decode GEMV takes on the GPU. Both run the same function
(:func:`_run`), so eager, compiled and CUDA-graph-captured calls take the same path. Nothing on the CUDA
path synchronizes with the host, so it can be captured in a CUDA graph (given capturable kernels).

Kernel contract: ``gemv_w4`` / ``gemm_w4`` get ``x`` ``[M, K]`` contiguous, the QTensor, bias and activation,
and return a new ``[M, N]`` tensor in x's dtype; ``supports(w)`` is called on every call, so keep it cheap.
Under torch.compile the QTensor a kernel receives is rebuilt by the op on every call from the same tensor
objects (checked: dynamo/inductor pass the weight's own tensors), so a per-weight cache in a kernel module
must key on a tensor such as ``w.data``, never on the QTensor object, or it misses on every call.

Inference only: the op has no autograd formula.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, fields, replace
from typing import Any

import torch
import torch.nn.functional as F

from .. import kernels as _kernels
from ..api import dequantize, resolve_backend
from ..formats.qtensor import QTensor
from ..formats.registry import formats_with
from ..formats.rows import nf4_slices_keep_double_quant, nf4_without_double_quant, slice_rows
from . import op_common, policy
from .policy import GEMV_MAX_M  # noqa: F401 - re-exported (lowbit.ops.GEMV_MAX_M)

SUPPORTED_FORMATS = formats_with("linear_weight")  # nvfp4, mxfp4, fp4_b32, nf4, bnb_fp4, int4_awq
"""Weight formats :func:`linear` accepts."""
ACTIVATIONS = (None, "gelu", "gelu_tanh", "silu", "gelu_and_mul", "gelu_tanh_and_mul", "silu_and_mul")
"""``"gelu"`` is the exact (erf) GELU, ``"gelu_tanh"`` its tanh approximation. The ``*_and_mul`` forms are
gated (vLLM's ``SiluAndMul``): the weight is ``[gate; up]``, stacked along its rows, and the result
``act(gate) * up`` has half its rows as columns (a fused gate/up projection of a Llama-style MLP)."""
GATED_ACTIVATIONS = {"gelu_and_mul": "gelu", "gelu_tanh_and_mul": "gelu_tanh", "silu_and_mul": "silu"}
"""Gated activation -> the activation applied to its gate half."""


def gated_why_not(activation: str | None, weight_only: bool, rows: int) -> str | None:
    """None unless ``activation`` is gated and a layer of ``rows`` weight rows (weight-only or not) cannot take
    it; then the reason, for the ValueError of whoever builds the layer."""
    if activation not in GATED_ACTIVATIONS or (weight_only and rows % 2 == 0):
        return None
    return (f"activation {activation!r} (act(gate) * up over the [gate; up] rows of the weight) needs a "
            f"weight-only scheme and an even number of rows, got {'weight-only' if weight_only else 'activations quantized'}"
            f" and {rows} rows")
X_DTYPES = (torch.bfloat16, torch.float16)
"""Activation dtypes; the output has x's dtype."""
DEQUANT_CHUNK_BYTES = 64 << 20
"""Largest dequantized chunk :func:`linear_dequant_gemm` materializes (bytes of x's dtype)."""
KERNEL_MODULES = ("gemv_w4", "gemm_w4")
"""Launcher modules under ``lowbit.kernels``; each exposes ``supports(w) -> str | None`` and a function of
its own name ``(x [M, K] contiguous, w, bias, activation) -> [M, N]``."""
_WEIGHT_FIELDS = ("data", "scale", "global_scale", "zeros", "nested_scale", "nested_offset")


# ---------------------------------------------------------------------------------------------- checks


def _check(x: torch.Tensor, w: QTensor, bias: torch.Tensor | None, activation: str | None) -> tuple[int, int]:
    """Raise TypeError/ValueError naming the broken rule; returns ``(N, K)``. Runs on every call: kept cheap."""
    n, k = check_weight(w)
    op_common.check_x(x, w, "lowbit.linear", X_DTYPES, "bfloat16 or float16 (W4A16)")
    if not (activation is None or isinstance(activation, str)) or activation not in ACTIVATIONS:
        raise ValueError(f"lowbit.linear: activation must be one of {ACTIVATIONS}, got {activation!r}")
    why = gated_why_not(activation, True, n)
    if why is not None:
        raise ValueError(f"lowbit.linear: {why}")
    device = x.device
    for name in _WEIGHT_FIELDS:
        t = getattr(w, name)
        if t is not None and t.device != device:
            raise ValueError(f"lowbit.linear: devices differ: x is on {device}, w.{name} on {t.device}")
    if bias is not None:
        if not isinstance(bias, torch.Tensor):
            raise TypeError(f"lowbit.linear: bias must be None or a torch.Tensor, got {type(bias).__name__}")
        if bias.dim() != 1 or bias.shape[0] != n:
            raise ValueError(f"lowbit.linear: bias must have shape [N] = ({n},), got {tuple(bias.shape)}")
        if bias.dtype != x.dtype:
            raise TypeError(f"lowbit.linear: bias dtype must equal x's ({x.dtype}), got {bias.dtype}")
        if bias.device != device:
            raise ValueError(f"lowbit.linear: devices differ: x is on {device}, bias on {bias.device}")
    return n, k


def check_weight(w: QTensor) -> tuple[int, int]:
    if not isinstance(w, QTensor):
        raise TypeError(f"lowbit.linear: w must be a lowbit QTensor, got {type(w).__name__}")
    if w.fmt not in SUPPORTED_FORMATS:
        raise ValueError(
            f"lowbit.linear: unsupported weight format {w.fmt!r}; supported: {', '.join(SUPPORTED_FORMATS)}"
        )
    if len(w.shape) != 2:
        raise ValueError(f"lowbit.linear: w must be a 2-D weight [N, K], got logical shape {tuple(w.shape)}")
    return w.shape[0], w.shape[1]


# ---------------------------------------------------------------------------------------------- reference


def apply_activation(y: torch.Tensor, activation: str | None, inplace: bool = False) -> torch.Tensor:
    """``activation`` of ``y``; ``inplace`` overwrites ``y`` (a buffer of ours, never a user's tensor). A gated
    activation returns ``act(y[..., :N/2]) * y[..., N/2:]``, a new tensor of half the width."""
    if activation is None:
        return y
    base = GATED_ACTIVATIONS.get(activation)
    if base is not None:
        half = y.shape[-1] // 2
        return apply_activation(y[..., :half], base) * y[..., half:]
    if activation in ("gelu", "gelu_tanh"):
        approximate = "tanh" if activation == "gelu_tanh" else "none"
        return torch.ops.aten.gelu_(y, approximate=approximate) if inplace else F.gelu(y, approximate=approximate)
    if activation == "silu":
        return F.silu(y, inplace=inplace)
    raise ValueError(f"lowbit.linear: activation must be one of {ACTIVATIONS}, got {activation!r}")


def linear_reference(
    x: torch.Tensor,
    w: QTensor,
    bias: torch.Tensor | None = None,
    activation: str | None = None,
    *,
    out_dtype: torch.dtype | None = None,
    dequant_backend: str | None = None,
) -> torch.Tensor:
    """THE reference: ``act(x.float() @ lowbit.dequantize(w, float32).T + bias.float())`` cast to x's dtype.

    Everything after the dequantization is fp32 (the matmul follows torch's fp32 matmul settings; keep
    TF32 off, torch's default, for a true fp32 product).

    Args:
        x: ``[..., K]`` bfloat16/float16.
        w: QTensor of a format in :data:`SUPPORTED_FORMATS`, logical shape ``[N, K]``.
        bias: None or ``[N]`` in x's dtype.
        activation: one of :data:`ACTIVATIONS`.
        out_dtype: dtype of the result; None means x's dtype (float32 gives the un-rounded reference).
        dequant_backend: backend of the dequantization (``lowbit.dequantize``'s rules; its Triton kernels
            are bit-identical to the torch reference).

    Returns:
        ``[..., N]`` tensor. Inputs are never modified.
    """
    _check(x, w, bias, activation)
    y = x.float() @ dequantize(w, torch.float32, backend=dequant_backend).T
    if bias is not None:
        y = y + bias.float()
    return apply_activation(y, activation).to(x.dtype if out_dtype is None else out_dtype)


# ---------------------------------------------------------------------------------------------- dispatch


@dataclass(frozen=True)
class LinearPlan(op_common.Plan):
    """What :func:`linear` does for one call: the fields every plan has (path, reason, backend, device, m, n, k;
    ``lowbit.ops.op_common.Plan``), then the weight format and the exception class.

    ``path`` is ``"reference"``, ``"gemv_w4"``, ``"gemm_w4"``, ``"gemm_w4_ra"``, ``"dequant_gemm"``, ``"empty"``
    (M == 0: nothing launched) or ``"unavailable"`` (:func:`linear` raises ``error`` with ``reason`` as its
    message); ``device`` is x's; m, n, k are the rows of x, the output features and the input features.

    Attributes:
        fmt: the weight format.
        error: the exception class :func:`linear` raises (only for ``"unavailable"``).
    """

    fmt: str
    error: type[Exception] | None = None

    def __str__(self) -> str:
        return op_common.plan_str("linear", self.fmt, self)


def _reason(path: str, facts: tuple, m: int, device: torch.device, w: QTensor) -> str:
    return policy.linear_reason(path, facts, m, device, w, _chunk_rows(w, 2, None) if path == "dequant_gemm" else 0)


def _plan(m: int, n: int, k: int, device: torch.device, w: QTensor, backend: str,
          x_dtype: torch.dtype | None = None) -> LinearPlan:
    path, target, facts = policy.linear_decide(m, device, w, backend, x_dtype)
    error = target if path == "unavailable" else None
    return LinearPlan(path, _reason(path, facts, m, device, w), backend, str(device), m, n, k, w.fmt, error)


def _chunk_rows(w: QTensor, element_size: int, chunk_bytes: int | None) -> int:
    """Rows of ``w`` per dequantized chunk: the whole weight where its decoded matrix fits ``chunk_bytes``
    (one decode launch and one BLAS call: on an H200 at M = 256 ... 1024 that halved the eager host time of
    4096-wide projections and took 5-35 % off their GPU time against two half-size chunks), else the most
    rows that fit, a multiple of 128 (at least 128)."""
    n, k = w.shape
    budget = (chunk_bytes or DEQUANT_CHUNK_BYTES) // (element_size * k)
    if budget >= n:
        return n
    return max(128, budget // 128 * 128)


def linear_dequant_gemm(
    x2: torch.Tensor,
    w: QTensor,
    bias: torch.Tensor | None = None,
    activation: str | None = None,
    *,
    chunk_bytes: int | None = None,
    dequant_backend: str | None = None,
) -> torch.Tensor:
    """``act(x2 @ dequant(w).T + bias)`` for ``x2`` ``[M, K]``: ``w`` is dequantized to x's dtype a chunk of
    rows at a time (at most ``chunk_bytes``, default :data:`DEQUANT_CHUNK_BYTES`, of the dequantized matrix exist
    at once; a weight that fits is one chunk), each chunk multiplied by the BLAS of x's device (cuBLAS on CUDA)
    with the bias, then the activation. Dequantization is exact in bf16 for the FP4 formats' element x scale
    products; nvfp4's global scale, nf4 and int4 values round once to x's dtype (relative error <= 2^-9),
    inside the stated tolerance.

    On CUDA with the default backend and chunk size, the chunks and their decode launches are made once per
    weight and x dtype and kept while the weight's tensors live unchanged (:func:`kept_chunks`): the same
    kernels, so the same bits, without re-slicing the weight and re-dispatching each dequantize per call."""
    if dequant_backend is None and chunk_bytes is None and x2.is_cuda:
        chunks = kept_chunks(w, x2.dtype)
        if chunks:
            return chunked_gemm(x2, chunks, w.shape[0], bias, activation)
    chunks = [(n0, n1, lambda q=q: dequantize(q, x2.dtype, backend=dequant_backend))
              for n0, n1, q in weight_chunks(w, x2.element_size(), chunk_bytes)]
    return chunked_gemm(x2, chunks, w.shape[0], bias, activation)


_KEPT_CHUNKS: dict[int, tuple] = {}


def kept_chunks(w: QTensor, dtype: torch.dtype) -> list | None:
    """``[(n0, n1, decode)]`` of :func:`linear_dequant_gemm` on CUDA, each ``decode`` a kept launch of the
    Triton dequantize kernel (``lowbit.kernels.dequantize_call``) writing rows n0:n1 of ``w`` in ``dtype``;
    made on the first call for a weight and dtype and kept while ``w.data`` lives and no tensor of ``w`` is
    replaced or changed in place (the rule of the GEMV layouts, ``lowbit.kernels.gemv_prepack``). None where
    nothing is kept: no kernel covers ``w``, or a CUDA-graph capture or custom-op call is running (their
    allocations must not outlive them)."""
    from ..kernels.gemv_prepack import layout_signature, no_caching

    if no_caching():
        return None
    data = w.data
    sig = layout_signature(w)
    hit = _KEPT_CHUNKS.get(id(data))
    if hit is not None and hit[0]() is data and hit[1] == sig:
        chunks = hit[2].get(dtype)
        if chunks is not None:
            return chunks
    else:
        key = id(data)

        def drop(_ref):
            _KEPT_CHUNKS.pop(key, None)

        hit = _KEPT_CHUNKS[key] = (weakref.ref(data, drop), sig, {})
    # the launches hold aliases of w's storage, not views of its tensors: a view keeps its base tensor, and
    # with it w.data, alive, and the entry would never be dropped
    chunks = hit[2][dtype] = decode_chunks(_storage_aliases(w), dtype)
    return chunks or None


def _storage_aliases(q: QTensor) -> QTensor:
    """``q`` with each tensor field replaced by a tensor over the same memory that is not a view of it (no
    reference to the original tensor object)."""
    changes = {}
    for f in fields(q):
        t = getattr(q, f.name)
        if isinstance(t, torch.Tensor):
            alias = torch.empty(0, dtype=t.dtype, device=t.device)
            changes[f.name] = alias.set_(t.untyped_storage(), t.storage_offset(), t.shape, t.stride())
    return replace(q, **changes)


def decode_chunks(w: QTensor, dtype: torch.dtype) -> list:
    """``[(n0, n1, KernelCall decoding rows n0:n1 of w to dtype)]``: the chunks of :func:`linear_dequant_gemm`
    with their launches made, or [] where no Triton dequantize kernel covers ``w``."""
    call = _kernels.dequantize_call(w)
    if call is None:
        return []
    size = torch.empty((), dtype=dtype).element_size()
    return [(n0, n1, call(q, dtype)) for n0, n1, q in weight_chunks(w, size)]


def weight_chunks(w: QTensor, element_size: int, chunk_bytes: int | None = None) -> list[tuple[int, int, QTensor]]:
    """``[(n0, n1, rows n0:n1 of w)]``: the chunks :func:`linear_dequant_gemm` decodes (the whole weight when
    one chunk holds it; nf4 double quantization decoded once when the chunks would split nested blocks)."""
    n = w.shape[0]
    rows = _chunk_rows(w, element_size, chunk_bytes)
    if rows >= n:
        return [(0, n, w)]
    wq = w
    if w.fmt in ("nf4", "bnb_fp4") and not nf4_slices_keep_double_quant(w, rows):
        wq = nf4_without_double_quant(w)  # decode the absmax once, not per chunk
    return [(n0, min(n, n0 + rows), slice_rows(wq, n0, min(n, n0 + rows))) for n0 in range(0, n, rows)]


def chunked_gemm(x2: torch.Tensor, chunks: Sequence[tuple[int, int, Any]], n: int, bias: torch.Tensor | None,
                 activation: str | None) -> torch.Tensor:
    """``act(x2 @ W.T + bias)`` from ``chunks`` ``[(n0, n1, decode)]``, ``decode()`` giving rows n0:n1 of W in
    x2's dtype: one chunk is one ``F.linear``; several are BLAS calls writing their column blocks of the output."""
    if len(chunks) == 1:
        return apply_activation(F.linear(x2, chunks[0][2](), bias), activation)
    if activation in GATED_ACTIVATIONS:  # the gate and up halves of a row come from different chunks
        return apply_activation(chunked_gemm(x2, chunks, n, bias, None), activation)
    out = torch.empty((x2.shape[0], n), dtype=x2.dtype, device=x2.device)
    for n0, n1, decode in chunks:
        wc = decode()
        # the column block of ``out`` is a row-major matrix with leading dimension N, which the BLAS writes
        # directly (no temporary chunk output and copy)
        dst = out[:, n0:n1]
        if bias is None:
            torch.mm(x2, wc.t(), out=dst)
        else:
            torch.addmm(bias[n0:n1], x2, wc.t(), out=dst)
        apply_activation(dst, activation, inplace=True)  # on the chunk while it is still in L2
    return out


def _rows(x_shape_or_tensor: torch.Tensor | Sequence[int], w: QTensor) -> tuple[int, int, int, torch.device]:
    n, k = check_weight(w)
    if isinstance(x_shape_or_tensor, torch.Tensor):
        shape, device = tuple(x_shape_or_tensor.shape), x_shape_or_tensor.device
    else:
        shape, device = tuple(int(d) for d in x_shape_or_tensor), w.device
    if len(shape) < 1 or shape[-1] != k:
        raise ValueError(
            f"lowbit.linear: K mismatch: x.shape[-1] must equal w.shape[-1] = {k} (w is [N, K] = "
            f"{tuple(w.shape)}), got x.shape = {shape}"
        )
    m = 1
    for d in shape[:-1]:
        m *= d
    return m, n, k, device


def plan_linear(
    x_shape_or_tensor: torch.Tensor | Sequence[int], w: QTensor, backend: str | None = None
) -> LinearPlan:
    """Which path :func:`linear` takes for an x of this shape (or this tensor) and weight ``w``, and why.

    The structured form of :func:`explain`; the rules are in this module's docstring. Given a shape, the
    device and the x dtype are ``w``'s. Raises only for invalid arguments (bad backend, K mismatch, unsupported ``w``); a
    call that cannot run comes back as ``path == "unavailable"``.
    """
    m, n, k, device = _rows(x_shape_or_tensor, w)
    x_dtype = x_shape_or_tensor.dtype if isinstance(x_shape_or_tensor, torch.Tensor) else None
    return _plan(m, n, k, device, w, resolve_backend(backend), x_dtype)


def explain(x_shape_or_tensor: torch.Tensor | Sequence[int], w: QTensor, backend: str | None = None) -> str:
    """One line saying which path :func:`linear` runs for this x (tensor or shape) and ``w``, and why.

    Example: ``lowbit.explain((1, 4096), w)`` on CUDA gives ``"lowbit.linear nvfp4 [M=1, K=4096] x
    [N=4096, K=4096] on cuda:0, backend='auto': gemv_w4 (M=1 <= GEMV_MAX_M=16: split-K CUDA-core FMA GEMV)"``.
    """
    return str(plan_linear(x_shape_or_tensor, w, backend))


# ---------------------------------------------------------------------------------------------- execution


def _run(
    x2: torch.Tensor, w: QTensor, bias: torch.Tensor | None, activation: str | None, backend: str
) -> torch.Tensor:
    """The implementation behind :func:`linear` and the custom op: ``x2`` is ``[M, K]`` contiguous."""
    m = x2.shape[0]
    path, target, facts = policy.linear_decide(m, x2.device, w, backend, x2.dtype)
    if path == "gemm_w4_ra":
        if x2.data_ptr() % 16:
            x2 = x2.clone()  # the kernel reads x by TMA: a fresh allocation is aligned
        target = functools.partial(target, config=facts[0])
    if target is not None and path != "unavailable":
        if activation in GATED_ACTIVATIONS and not (path == "gemv_w4" and _gated_gemv(w)):
            return apply_activation(target(x2, w, bias, None), activation)
        return target(x2, w, bias, activation)
    if path == "dequant_gemm":
        return linear_dequant_gemm(x2, w, bias, activation)
    if path == "reference":
        return linear_reference(x2, w, bias, activation, dequant_backend=backend)
    if path == "empty":
        return x2.new_empty((0, w.shape[0] // 2 if activation in GATED_ACTIVATIONS else w.shape[0]))
    raise target(f"lowbit.linear: {_reason(path, facts, m, x2.device, w)}")


def _gated_gemv(w: QTensor) -> bool:
    """Whether the GEMV runs a gated activation on ``w`` itself (else the product, then the gating in torch)."""
    from ..kernels.gemv_prepack import gated_why_not, prepare_w4

    return gated_why_not(prepare_w4(w)) is None


def linear(
    x: torch.Tensor,
    w: QTensor,
    bias: torch.Tensor | None = None,
    activation: str | None = None,
    *,
    backend: str | None = None,
) -> torch.Tensor:
    """Weight-only 4-bit linear layer: ``act(x @ dequant(w).T + bias)`` with fp32 accumulation.

    Args:
        x: ``[..., K]`` bfloat16 or float16 activations, any leading dims and strides.
        w: QTensor weight ``[N, K]`` (PyTorch's ``[out, in]``; for int4_awq too) in one of
            :data:`SUPPORTED_FORMATS`: ``nvfp4`` (global scale folded in), ``mxfp4``, ``nf4`` (plain or
            double-quantized absmax), ``int4_awq`` (any group size dividing K), ``fp4_b32``, ``bnb_fp4`` (on CUDA
            always the Triton dequantize kernel + cuBLAS: ``policy.DEQUANT_ONLY_FORMATS``).
        bias: None or ``[N]`` in x's dtype, on x's device.
        activation: None, ``"gelu"`` (erf), ``"gelu_tanh"`` or ``"silu"``, applied after the bias; or a
            gated form of :data:`ACTIVATIONS` (``"silu_and_mul"`` ...): ``w`` is ``[gate; up]`` and the result
            ``act(gate) * up`` has N / 2 columns.
        backend: ``"auto"`` (default, or ``$LOWBIT_BACKEND``): Triton kernels on CUDA, the reference on
            CPU; ``"triton"``: kernels only (ValueError off CUDA); ``"torch"``: :func:`linear_reference`
            on any device. :func:`explain` says what runs and why.

    Returns:
        ``[..., N]`` tensor in x's dtype (``[..., N / 2]`` for a gated activation). Inputs are never modified.

    Raises:
        TypeError: x or bias dtype, w not a QTensor.
        ValueError: K mismatch, w not 2-D, unsupported format or activation, bias shape, devices differ,
            bad backend.
        RuntimeError: on CUDA, no kernel covers the call (no silent fallback; use ``backend="torch"``).
    """
    n, k = _check(x, w, bias, activation)
    chosen = resolve_backend(backend)
    flat = x.dim() == 2
    x2 = x if flat and x.is_contiguous() else x.reshape(-1, k).contiguous()  # no extra dispatch when 2-D
    if torch.compiler.is_compiling():
        tensors, meta = _flatten(w)
        out = torch.ops.lowbit.linear_w4a16(x2, *tensors, bias, w.fmt, [n, k], meta, activation, chosen)
    else:
        out = _run(x2, w, bias, activation, chosen)
    return out if flat else out.reshape(*x.shape[:-1], out.shape[-1])


# ---------------------------------------------------------------------------------------------- custom op
#
# Schema: linear_w4a16(Tensor x, Tensor data, Tensor scale, Tensor? global_scale, Tensor? zeros,
#     Tensor? nested_scale, Tensor? nested_offset, Tensor[] param_tensors, Tensor? bias, str fmt,
#     int[] shape, str meta, str? activation, str backend) -> Tensor
# x is [M, K] contiguous; shape is the weight's logical [N, K]. ``meta`` encodes the QTensor's non-tensor
# fields as ``key=T:value`` items joined by ';' (lowbit.ops.op_common; here T is one of b bool, i int,
# f float, s str, t index into param_tensors); the keys ``@dtype`` and ``@scale_layout`` are the QTensor
# fields, the others its params. It is a plain string so that dynamo builds it at trace time and the graph
# holds it as a constant.

_OPTIONAL_FIELDS = ("global_scale", "zeros", "nested_scale", "nested_offset")


def _encode(key: str, value: Any, tensors: list[torch.Tensor]) -> str:
    return op_common.encode(key, value, tensors, op="lowbit.linear", what="QTensor param", extended=False)


def _flatten(w: QTensor) -> tuple[list[Any], str]:
    """``[data, scale, global_scale, zeros, nested_scale, nested_offset, param_tensors]`` and ``meta``."""
    param_tensors, meta = op_common.flatten_meta(w, _encode)
    return [w.data, w.scale, *(getattr(w, f) for f in _OPTIONAL_FIELDS), param_tensors], meta


def _unflatten(
    data: torch.Tensor,
    scale: torch.Tensor,
    optional: Sequence[torch.Tensor | None],
    param_tensors: Sequence[torch.Tensor],
    fmt: str,
    shape: Sequence[int],
    meta: str,
) -> QTensor:
    optional_fields = dict(zip(_OPTIONAL_FIELDS, optional))
    return op_common.unflatten(data, scale, param_tensors, fmt, shape, meta, **optional_fields)


@torch.library.custom_op("lowbit::linear_w4a16", mutates_args=())
def linear_w4a16(
    x: torch.Tensor,
    data: torch.Tensor,
    scale: torch.Tensor,
    global_scale: torch.Tensor | None,
    zeros: torch.Tensor | None,
    nested_scale: torch.Tensor | None,
    nested_offset: torch.Tensor | None,
    param_tensors: list[torch.Tensor],
    bias: torch.Tensor | None,
    fmt: str,
    shape: list[int],
    meta: str,
    activation: str | None,
    backend: str,
) -> torch.Tensor:
    """``lowbit.linear`` on a flattened QTensor (see the schema comment above); x is ``[M, K]``."""
    w = _unflatten(data, scale, (global_scale, zeros, nested_scale, nested_offset), param_tensors, fmt, shape, meta)
    with _kernels.per_call_scratch():
        return _run(x.contiguous(), w, bias, activation, backend)


@linear_w4a16.register_fake
def _linear_w4a16_fake(
    x, data, scale, global_scale, zeros, nested_scale, nested_offset, param_tensors, bias, fmt, shape, meta,
    activation, backend,
):
    torch._check(x.dim() == 2, lambda: f"lowbit::linear_w4a16: x must be 2-D [M, K], got {x.dim()}-D")
    torch._check(len(shape) == 2, lambda: "lowbit::linear_w4a16: shape must be the weight's [N, K]")
    torch._check(x.shape[1] == shape[1], lambda: "lowbit::linear_w4a16: K mismatch between x and the weight")
    return x.new_empty((x.shape[0], shape[0] // 2 if activation in GATED_ACTIVATIONS else shape[0]))
