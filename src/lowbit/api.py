"""Public entry points: ``quantize`` / ``dequantize`` over every named format."""

from __future__ import annotations

import importlib
import inspect
from typing import Any, Callable

import torch

from .formats.qtensor import QTensor
from .formats.spec import FORMATS, FormatSpec

# format name -> (module, quantize function, dequantize function); the quantize function's keyword
# arguments are the format's options, so validation reads them from its signature
_IMPLS: dict[str, tuple[str, str, str]] = {
    "nvfp4": ("blockscaled", "quantize_nvfp4", "dequantize_nvfp4"),
    "mxfp4": ("blockscaled", "quantize_mx", "dequantize_mx"),
    "mxfp6_e2m3": ("blockscaled", "quantize_mx", "dequantize_mx"),
    "mxfp6_e3m2": ("blockscaled", "quantize_mx", "dequantize_mx"),
    "mxfp8_e4m3": ("blockscaled", "quantize_mx", "dequantize_mx"),
    "mxfp8_e5m2": ("blockscaled", "quantize_mx", "dequantize_mx"),
    "fp4_b32": ("blockscaled", "quantize_fp4_b32", "dequantize_fp4_b32"),
    "fp8_block": ("fp8_block", "quantize_fp8_block", "dequantize_fp8_block"),
    "nf4": ("nf4", "quantize_nf4", "dequantize_nf4"),
    "int4_awq": ("int4_awq", "quantize_int4_awq", "dequantize_int4_awq"),
}
_DEQUANT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _impl(name: str, which: int) -> Callable[..., Any]:
    module, *fns = _IMPLS[name]
    return getattr(importlib.import_module(f"lowbit.formats.{module}"), fns[which])


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


def _option_names(fn: Callable[..., Any]) -> list[str]:
    params = list(inspect.signature(fn).parameters.values())[1:]
    return [p.name for p in params if p.name != "fmt"]


def quantize(x: torch.Tensor, fmt: str | FormatSpec, **options: Any) -> QTensor:
    """Quantize ``x`` to ``fmt``.

    Args:
        x: float32/bfloat16/float16 tensor; blocks run along the last dim (nf4: over the flattened
            tensor; int4_awq: ``x`` is a weight ``[out, in]`` grouped along ``in``).
        fmt: a name from ``lowbit.formats.FORMATS`` (``nvfp4``, ``mxfp4``, ``mxfp6_e2m3``, ``mxfp6_e3m2``,
            ``mxfp8_e4m3``, ``mxfp8_e5m2``, ``fp4_b32``, ``fp8_block``, ``nf4``, ``int4_awq``) or a
            ``FormatSpec`` (its options are the defaults).
        **options: per format: nvfp4 ``global_scale``, ``convention``, ``scale_layout``; MX
            ``scale_rounding``, ``scale_layout``; fp8_block ``block``, ``scale_fmt``; nf4 ``blocksize``,
            ``double_quant``; int4_awq ``group_size``.

    Returns:
        A :class:`QTensor`. ``x`` is never modified.
    """
    name, defaults = _resolve(fmt)
    fn = _impl(name, 0)
    allowed = _option_names(fn)
    unknown = sorted(set(options) - set(allowed))
    if unknown:
        raise ValueError(f"unknown option(s) {unknown} for format {name!r}; valid options: {allowed}")
    kwargs = {k: v for k, v in defaults.items() if k in allowed}
    kwargs.update(options)
    if "fmt" in inspect.signature(fn).parameters:
        kwargs["fmt"] = name
    return fn(x, **kwargs)


def dequantize(q: QTensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Decode ``q`` to a dense tensor of its logical shape in ``dtype`` (float32, bfloat16 or float16)."""
    if not isinstance(q, QTensor):
        raise TypeError(f"q must be a QTensor, got {type(q).__name__}")
    if dtype not in _DEQUANT_DTYPES:
        raise TypeError(f"dtype must be float32, bfloat16 or float16, got {dtype}")
    if q.fmt not in _IMPLS:
        raise ValueError(f"unknown format {q.fmt!r}; known formats: {sorted(FORMATS)}")
    return _impl(q.fmt, 1)(q, dtype)
