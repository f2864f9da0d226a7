"""Triton kernels. This package's __init__ never imports triton: launchers load on first CUDA use.

``quantize_kernel`` / ``dequantize_kernel`` say which (format, options) combinations have a kernel: the
``quantize_kernel`` / ``dequantize_kernel`` entries of ``lowbit.formats.registry.REGISTRY``.

How the package is laid out. Each kernel family is two files: ``_<family>.py`` holds its ``@triton.jit`` (or
Gluon) kernels and what they embed when compiled (inline-asm text, code tables), ``<family>.py`` its host launchers (validation, layout, grid, launch) and
``compile_variants()``, which CI compiles for sm_90 on a CPU:

- block-scaled quantize/dequantize (NVFP4, MX, fp4_b32): ``_blockscaled`` -> ``blockscaled``; MXFP4 re-encoded
  as fp8_block: ``_mx_fold`` -> ``blockscaled``;
- fp8_block quantize/dequantize: ``_fp8_block`` -> ``fp8_block``; fp8_rowwise quantize: ``_fp8_block`` ->
  ``fp8_rowwise``;
- NF4 and bitsandbytes FP4 dequantize: ``_nf4`` -> ``nf4``; AutoAWQ INT4 dequantize: ``_int4_awq`` -> ``int4_awq``;
- W4A16 GEMV (M <= 16; the tensor-core one to M = 64): ``_gemv_w4``, ``_gemv_mma`` -> ``gemv_w4`` (prepared-layer
  calls in ``gemv_runners``);
- W4A16 GEMM (prefill): ``_gemm_w4`` -> ``gemm_w4`` (tile tables in ``gemm_w4_tiles``);
- quantized x quantized GEMM: ``_scaled_mm`` and the Gluon ``_fp8_block_ws`` -> ``scaled_mm`` with
  ``scaled_mm_launch`` (tiles, launches) and ``scaled_mm_routes`` (fold, dequant, cuBLASLt via
  ``cublas_fp8_block``, DeepGEMM where installed via ``deep_gemm_fp8``).

Shared by every family: ``device`` (the Triton device functions: code and scale decoding, packing, scale
math), ``_launch`` (a launch fixed once and run directly), ``scratch`` (split-K workspaces and counters),
``w4_checks`` (what the W4A16 kernels require of a weight). The GEMV's weight side has its own modules:
``gemv_prepack`` (the prepacked layout and its cache) and ``gemv_mma_layout`` (the tensor-core layout).
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.util
import os
from collections.abc import Callable
from typing import Any

from ..formats.registry import REGISTRY, Kernel

# launcher modules; each exposes compile_variants() -> iterable of (jit kernel, signature, constexprs)
# covering every code path it can launch, which CI compiles for sm_90
KERNEL_MODULES = ("blockscaled", "fp8_block", "fp8_rowwise", "nf4", "int4_awq", "gemv_w4", "gemm_w4", "scaled_mm",
                  "gptq")


def interpreting() -> bool:
    """True under ``TRITON_INTERPRET`` (the CPU interpreter): kernels then skip inline asm and GPU-only tricks."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


_per_call_scratch_depth = 0


@contextlib.contextmanager
def per_call_scratch():
    """Within this context kernels allocate their scratch buffers (split-K partials, counters) on every call
    instead of reusing cached ones. The custom ops enter it: torch.compile's CUDA graphs (cudagraph trees) run
    the op's first calls with allocations routed into the graph's memory pool, and a buffer cached across
    calls from there is an untracked live allocation in that pool (an error); per-call buffers are not."""
    global _per_call_scratch_depth
    _per_call_scratch_depth += 1
    try:
        yield
    finally:
        _per_call_scratch_depth -= 1


def scratch_per_call() -> bool:
    return _per_call_scratch_depth > 0


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for the launchers' host arithmetic (``triton.cdiv`` is a constexpr function: microseconds per
    host call, several per launch)."""
    return -(-a // b)


def tensor_version(t) -> int:
    """``t._version``, or -1 for an inference tensor (``torch.inference_mode``), which has no version counter:
    caches of layouts derived from a tensor key on it to notice in-place updates."""
    return -1 if t.is_inference() else t._version  # no try/except: a raised error costs ~10 us per call


@functools.cache
def triton_available() -> str | None:
    """None if triton imports, else the reason it does not."""
    try:
        importlib.import_module("triton")
    except Exception as e:  # noqa: BLE001 - any import failure means no triton backend
        return f"triton cannot be imported ({type(e).__name__}: {e})"
    return None


@functools.cache
def _launcher(module: str, name: str) -> Callable[..., Any] | None:
    # cached: module lookups cost microseconds, which small launches cannot afford on every call
    if importlib.util.find_spec(f"lowbit.kernels.{module}") is None:
        return None
    return getattr(importlib.import_module(f"lowbit.kernels.{module}"), name, None)


def _lookup(entry: Kernel | None, fmt: str, arg: Any, what: str) -> Callable[..., Any] | str:
    if entry is None:
        return f"no triton {what} kernel for format {fmt!r} yet"
    reason = triton_available()
    if reason:
        return reason
    launcher = _launcher(entry.module, entry.launcher)
    if launcher is None:
        return f"no triton {what} kernel for format {fmt!r} yet"
    if not entry.covers(arg):
        return f"the triton {what} kernel for {fmt!r} does not cover these options"
    return launcher


def _kernel(fmt: str, which: str) -> Kernel | None:
    entry = REGISTRY.get(fmt)
    return None if entry is None else getattr(entry, which)


def quantize_kernel(fmt: str, options: dict) -> Callable[..., Any] | str:
    """The launcher for (fmt, options), or a string saying why there is none."""
    return _lookup(_kernel(fmt, "quantize_kernel"), fmt, options, "quantize")


def dequantize_kernel(fmt: str, q: Any) -> Callable[..., Any] | str:
    return _lookup(_kernel(fmt, "dequantize_kernel"), fmt, q, "dequantize")


def dequantize_call(q: Any) -> Callable[..., Any] | None:
    """``fn(q, dtype) -> KernelCall`` of the module whose kernel dequantizes ``q`` (a launch to keep and run
    again), or None where no kernel covers it or its module offers no such call."""
    if not callable(dequantize_kernel(q.fmt, q)):
        return None
    return _launcher(_kernel(q.fmt, "dequantize_kernel").module, "dequantize_call")
