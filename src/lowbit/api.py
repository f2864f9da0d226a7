"""Public entry points: ``quantize`` / ``dequantize`` over every named format."""

from __future__ import annotations

import os
import warnings
import weakref
from typing import Any, Callable

import torch

from .formats.qtensor import QTensor
from .formats.registry import CHANGES as REGISTRY_CHANGES
from .formats.registry import REGISTRY
from .formats.spec import FORMATS, FormatSpec

_DEQUANT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
BACKENDS = ("auto", "triton", "torch")
_warned: set[str] = set()


def resolve_backend(backend: str | None) -> str:
    """``backend`` if given, else ``$LOWBIT_BACKEND``, else ``"auto"``; anything else is a ValueError."""
    chosen = backend if backend is not None else os.environ.get("LOWBIT_BACKEND", "auto")
    if chosen not in BACKENDS:
        source = "backend" if backend is not None else "LOWBIT_BACKEND"
        raise ValueError(f"{source} must be one of {BACKENDS}, got {chosen!r}")
    return chosen


def _pick(backend: str | None, tensor: torch.Tensor, kernel: Callable[..., Any] | str, reference, what: str):
    """The function to run: the triton kernel or the torch reference, per the backend rules.

    auto: the kernel for CUDA tensors when one covers the format and options; the reference on CPU.
    On CUDA, a combination no kernel covers runs the reference with a one-time warning; a kernel that
    exists but cannot run (no triton) is an error, never a silent fallback.
    """
    chosen = resolve_backend(backend)
    if chosen == "torch":
        return reference
    if chosen == "triton" or tensor.is_cuda:
        if chosen == "triton" and not tensor.is_cuda:
            raise ValueError(f"backend='triton' needs CUDA tensors; {what} got a tensor on {tensor.device}")
        if callable(kernel):
            return kernel
        if chosen == "triton" or kernel.startswith("triton cannot be imported"):
            raise RuntimeError(f"{what}: cannot run the triton backend: {kernel}")
        if kernel not in _warned:
            _warned.add(kernel)
            warnings.warn(f"lowbit: {kernel}; {what} runs the torch reference on {tensor.device}", stacklevel=3)
    return reference


def _resolve(fmt: str | FormatSpec) -> tuple[str, dict[str, Any]]:
    if isinstance(fmt, FormatSpec):
        if fmt.name not in FORMATS:
            raise ValueError(f"unknown format spec {fmt.name!r}; known formats: {sorted(FORMATS)}")
        return fmt.name, dict(fmt.options)
    if not isinstance(fmt, str):
        raise TypeError(f"fmt must be a format name or a FormatSpec, got {type(fmt).__name__}")
    if fmt not in FORMATS:
        raise ValueError(f"unknown format {fmt!r}; known formats: {sorted(FORMATS)}")
    return fmt, {}


def quantize(x: torch.Tensor, fmt: str | FormatSpec, *, backend: str | None = None, **options: Any) -> QTensor:
    """Quantize ``x`` to ``fmt``.

    Args:
        x: float32/bfloat16/float16 tensor; blocks run along the last dim (nf4, bnb_fp4: over the flattened
            tensor; int4_awq: ``x`` is a weight ``[out, in]`` grouped along ``in``).
        fmt: a name from ``lowbit.formats.FORMATS`` (``nvfp4``, ``mxfp4``, ``mxfp6_e2m3``, ``mxfp6_e3m2``,
            ``mxfp8_e4m3``, ``mxfp8_e5m2``, ``fp4_b32``, ``fp8_block``, ``fp8_rowwise``, ``nf4``,
            ``bnb_fp4``, ``int4_awq``) or a ``FormatSpec`` (its options are the defaults).
        **options: per format: nvfp4 ``global_scale``, ``convention``, ``scale_layout``; MX
            ``scale_rounding``, ``scale_layout``; fp8_block ``block``, ``scale_fmt``; nf4 and bnb_fp4
            ``blocksize``, ``double_quant``; int4_awq ``group_size``.
        backend: ``"auto"`` (default, or ``$LOWBIT_BACKEND``): triton kernels for CUDA tensors where one
            covers the format, the torch reference otherwise; ``"triton"`` (error where no kernel can
            run); ``"torch"`` (the reference, on any device).

    Returns:
        A :class:`QTensor`. ``x`` is never modified.
    """
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    key = _resolution_key(fmt, backend, options, x)
    hit = _RESOLVED.get(key) if key is not None else None
    if hit is None:
        fn, kwargs = quantizer(fmt, x, backend=backend, **options)
        if key is not None:
            if len(_RESOLVED) >= _MAX_RESOLVED:
                _RESOLVED.clear()
            _RESOLVED[key] = (fn, {k: v for k, v in kwargs.items() if k not in options})
        return fn(x, **kwargs)
    fn, defaults = hit
    return fn(x, **defaults, **options)


_RESOLVED: dict[tuple, tuple[Callable[..., QTensor], dict[str, Any]]] = {}
"""``quantize``'s decisions (function, defaults) by format name, backend, device type and options: what
:func:`quantizer` decides once, kept so that a repeated call does not decide again. Option values that are
tensors enter the key by name only (the decision reads their presence, not their values)."""
_MAX_RESOLVED = 256
_SCALAR_OPTION = (str, int, float, bool, type(None))


def _resolution_key(fmt: Any, backend: str | None, options: dict[str, Any], x: torch.Tensor) -> tuple | None:
    """The key of ``_RESOLVED`` for this call, or None where the call is not kept (a FormatSpec, whose options
    do not enter its hash; an option value of another kind)."""
    if type(fmt) is not str:
        return None
    opts = []
    for k, v in options.items():
        if isinstance(v, torch.Tensor):
            opts.append((k, torch.Tensor))
        elif isinstance(v, _SCALAR_OPTION) or (type(v) is tuple and all(isinstance(e, _SCALAR_OPTION) for e in v)):
            opts.append((k, type(v), v))
        else:  # tensors inside a tuple, lists, ...: decided per call
            return None
    return (fmt, backend, os.environ.get("LOWBIT_BACKEND"), x.device.type, tuple(opts), REGISTRY_CHANGES[0])


def quantizer(fmt: str | FormatSpec, like: torch.Tensor, *, backend: str | None = None,
              **options: Any) -> tuple[Callable[..., QTensor], dict[str, Any]]:
    """``(fn, kwargs)`` with ``fn(x, **kwargs) == quantize(x, fmt, backend=backend, **options)`` for every ``x``
    on ``like``'s device: the format, options, backend and kernel decided once (what a prepared layer keeps
    for its activations). Raises as :func:`quantize` does."""
    name, defaults = _resolve(fmt)
    entry = REGISTRY[name]
    allowed = entry.options
    unknown = [k for k in options if k not in allowed]
    if unknown:
        raise ValueError(f"unknown option(s) {sorted(unknown)} for format {name!r}; valid options: {list(allowed)}")
    kwargs = {k: v for k, v in defaults.items() if k in allowed}
    kwargs.update(options)
    if entry.takes_fmt:
        kwargs["fmt"] = name
    kernel = _kernels().quantize_kernel(name, kwargs) if resolve_backend(backend) != "torch" else "unused"
    return _pick(backend, like, kernel, entry.quantize, f"quantize({name!r})"), kwargs


def dequantize(q: QTensor, dtype: torch.dtype = torch.float32, *, backend: str | None = None) -> torch.Tensor:
    """Decode ``q`` to a dense tensor of its logical shape in ``dtype`` (float32, bfloat16 or float16).

    ``backend`` as for :func:`quantize`.
    """
    if not isinstance(q, QTensor):
        raise TypeError(f"q must be a QTensor, got {type(q).__name__}")
    if dtype not in _DEQUANT_DTYPES:
        raise TypeError(f"dtype must be float32, bfloat16 or float16, got {dtype}")
    key = (dtype, backend, os.environ.get("LOWBIT_BACKEND"), REGISTRY_CHANGES[0])
    kept = _DEQUANT_CALLS.get(q)
    if kept is not None:
        call = kept.get(key)
        if call is not None:
            return call()
    entry = REGISTRY.get(q.fmt)
    if entry is None:
        raise ValueError(f"unknown format {q.fmt!r}; known formats: {sorted(FORMATS)}")
    kernel = _kernels().dequantize_kernel(q.fmt, q) if resolve_backend(backend) != "torch" else "unused"
    fn = _pick(backend, q.data, kernel, entry.dequantize, f"dequantize({q.fmt!r})")
    if fn is kernel and q.data.is_cuda:
        make = _kernels().dequantize_call(q)
        if make is not None:
            call = make(q, dtype)
            if not call.copies:
                _DEQUANT_CALLS.setdefault(q, {})[key] = call
            return call()
    return fn(q, dtype)


_DEQUANT_CALLS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
"""The kernel call that decodes a QTensor, kept while the QTensor lives (by output dtype, backend and
registry state): a repeated ``dequantize`` of one weight launches the compiled kernel with no argument
binding. Only calls that read the QTensor's own memory are kept, so in-place updates of it are seen."""


def _kernels():
    # imported on use: lowbit.kernels is light, but keeps `import lowbit` free of any kernel module
    from . import kernels

    return kernels
