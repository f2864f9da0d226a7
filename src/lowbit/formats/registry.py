"""The format registry: one :class:`Format` per format name, and every per-format list derived from it.

A format declares here its :class:`FormatSpec`, its torch reference quantize/dequantize functions, the
options its quantize function takes, the triton kernels that cover it (named by module and launcher under
``lowbit.kernels``; ``lowbit.kernels`` loads them on first CUDA use, so this module never imports triton)
and the roles it plays in the matmul ops. ``lowbit.quantize`` / ``lowbit.dequantize``, the kernel lookup and
the format lists of ``lowbit.ops`` and ``lowbit.kernels`` all read :data:`REGISTRY`.

A new format is one :func:`register_format` call (or one entry below) plus its reference module.

Checkpoint layouts are the one capability declared on the other side: ``formats`` sits below ``io``, so each
layout of :mod:`lowbit.io.layouts` lists the weight formats it stores, and
``lowbit.io.layouts.layouts_storing(name)`` answers for a format (the lowbit-native layout stores every
registered format, a new one included).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from . import blockscaled, bnb_fp4, fp8_block, fp8_rowwise, int4_awq, nf4
from .spec import (
    BNB_FP4_FORMAT,
    FORMATS,
    FP4_B32_FORMAT,
    FP8_BLOCK_FORMAT,
    FP8_ROWWISE_FORMAT,
    INT4_AWQ_FORMAT,
    MXFP4_FORMAT,
    MXFP6_E2M3_FORMAT,
    MXFP6_E3M2_FORMAT,
    MXFP8_E4M3_FORMAT,
    MXFP8_E5M2_FORMAT,
    NF4_FORMAT,
    NVFP4_FORMAT,
    FormatSpec,
    NVFP4Convention,
)

ROLES = ("gemv_w4", "gemm_w4", "linear_weight", "scaled_mm")
"""What a format can be in the matmul ops: ``gemv_w4`` / ``gemm_w4``: a weight of the W4A16 GEMV / GEMM kernels;
``linear_weight``: a weight :func:`lowbit.linear` accepts; ``scaled_mm``: an operand of the scaled_mm kernel
(which pairs: ``lowbit.ops.scaled_mm.PAIRS``)."""


def covers_all(arg: Any) -> bool:
    """The ``covers`` predicate of a kernel that covers every option set / QTensor of its format."""
    return True


@dataclass(frozen=True)
class Kernel:
    """A triton launcher: ``lowbit.kernels.<module>.<launcher>``, used where ``covers`` (of the quantize options
    dict, or of the QTensor to dequantize) is true. Loaded on first use by ``lowbit.kernels``."""

    module: str
    launcher: str
    covers: Callable[[Any], bool] = covers_all


@dataclass(frozen=True)
class Format:
    """One quantization format.

    Attributes:
        name: the format name (``QTensor.fmt``, the ``fmt`` of ``lowbit.quantize``).
        spec: element, block and scale, and the option defaults a ``FormatSpec`` argument passes.
        quantize: reference ``quantize(x, **options) -> QTensor`` (torch only, any device).
        dequantize: reference ``dequantize(q, dtype) -> Tensor``.
        options: option names ``lowbit.quantize`` accepts for this format (keyword arguments of ``quantize``).
        takes_fmt: ``quantize`` also takes ``fmt=name`` (one function serving several formats).
        quantize_kernel / dequantize_kernel: the triton kernels, or None where the reference always runs.
        roles: a subset of :data:`ROLES`.
    """

    name: str
    spec: FormatSpec
    quantize: Callable[..., Any]
    dequantize: Callable[..., Any]
    options: tuple[str, ...] = ()
    takes_fmt: bool = False
    quantize_kernel: Kernel | None = None
    dequantize_kernel: Kernel | None = None
    roles: frozenset[str] = field(default_factory=frozenset)

    @property
    def defaults(self) -> dict[str, Any]:
        """Option defaults from the spec (what ``lowbit.quantize(x, spec)`` passes), limited to :attr:`options`."""
        return {k: v for k, v in self.spec.options.items() if k in self.options}


REGISTRY: dict[str, Format] = {}
"""Format name -> :class:`Format`, in registration order (the order of every derived list)."""
CHANGES = [0]
"""How many times :data:`REGISTRY` changed: callers that keep decisions made from it compare this count."""


def register_format(fmt: Format) -> Format:
    """Add ``fmt`` to :data:`REGISTRY` (and its spec to ``lowbit.formats.FORMATS``); ValueError on a bad entry."""
    if not isinstance(fmt, Format):
        raise ValueError(f"register_format: expected a Format, got {type(fmt).__name__}")
    if not isinstance(fmt.name, str) or not fmt.name:
        raise ValueError(f"register_format: name must be a non-empty str, got {fmt.name!r}")
    if fmt.name in REGISTRY:
        raise ValueError(f"register_format: format names are unique; {fmt.name!r} is already registered")
    if not isinstance(fmt.spec, FormatSpec) or fmt.spec.name != fmt.name:
        raise ValueError(f"register_format({fmt.name!r}): spec must be a FormatSpec named {fmt.name!r}")
    for what in ("quantize", "dequantize"):
        if not callable(getattr(fmt, what)):
            raise ValueError(f"register_format({fmt.name!r}): a format needs a reference {what} function")
    unknown = set(fmt.roles) - set(ROLES)
    if unknown:
        raise ValueError(f"register_format({fmt.name!r}): roles must be among {ROLES}, got {sorted(unknown)}")
    for kernel in (fmt.quantize_kernel, fmt.dequantize_kernel):
        if kernel is not None and not (isinstance(kernel, Kernel) and callable(kernel.covers)):
            raise ValueError(f"register_format({fmt.name!r}): kernels must be Kernel entries with a callable covers")
    REGISTRY[fmt.name] = fmt
    CHANGES[0] += 1
    FORMATS[fmt.name] = fmt.spec
    return fmt


def unregister_format(name: str) -> None:
    """Remove a format :func:`register_format` added (a KeyError for an unknown name)."""
    del REGISTRY[name]
    CHANGES[0] += 1
    FORMATS.pop(name, None)


def formats_with(role: str) -> tuple[str, ...]:
    """Names of the registered formats with ``role`` (one of :data:`ROLES`), in registration order."""
    if role not in ROLES:
        raise ValueError(f"role must be one of {ROLES}, got {role!r}")
    return tuple(name for name, f in REGISTRY.items() if role in f.roles)


def _nvfp4_kernel_convention(options: dict) -> bool:
    return NVFP4Convention(options.get("convention", "vllm")) in (NVFP4Convention.VLLM, NVFP4Convention.LIGHTX2V)


def _no_per_tensor_scale(q: Any) -> bool:
    return "per_tensor_scale" not in q.params


_W4 = frozenset({"gemv_w4", "gemm_w4", "linear_weight"})
_MX_OPTIONS = ("scale_rounding", "scale_layout")

for _f in (
    Format("nvfp4", NVFP4_FORMAT, blockscaled.quantize_nvfp4, blockscaled.dequantize_nvfp4,
           options=("global_scale", "convention", "scale_layout"),
           quantize_kernel=Kernel("blockscaled", "quantize_nvfp4", _nvfp4_kernel_convention),
           dequantize_kernel=Kernel("blockscaled", "dequantize_nvfp4", _no_per_tensor_scale),
           roles=_W4 | {"scaled_mm"}),
    Format("mxfp4", MXFP4_FORMAT, blockscaled.quantize_mx, blockscaled.dequantize_mx,
           options=_MX_OPTIONS, takes_fmt=True,
           quantize_kernel=Kernel("blockscaled", "quantize_mx"),
           dequantize_kernel=Kernel("blockscaled", "dequantize_mx"),
           roles=_W4 | {"scaled_mm"}),
    *(Format(spec.name, spec, blockscaled.quantize_mx, blockscaled.dequantize_mx,
             options=_MX_OPTIONS, takes_fmt=True,
             quantize_kernel=Kernel("blockscaled", "quantize_mx"),
             dequantize_kernel=Kernel("blockscaled", "dequantize_mx"),
             roles=frozenset({"scaled_mm"}))
      for spec in (MXFP6_E2M3_FORMAT, MXFP6_E3M2_FORMAT, MXFP8_E4M3_FORMAT, MXFP8_E5M2_FORMAT)),
    Format("fp4_b32", FP4_B32_FORMAT, blockscaled.quantize_fp4_b32, blockscaled.dequantize_fp4_b32,
           quantize_kernel=Kernel("blockscaled", "quantize_fp4_b32"),
           dequantize_kernel=Kernel("blockscaled", "dequantize_fp4_b32"),
           roles=_W4),
    Format("fp8_block", FP8_BLOCK_FORMAT, fp8_block.quantize_fp8_block, fp8_block.dequantize_fp8_block,
           options=("block", "scale_fmt", "scale_layout"),
           quantize_kernel=Kernel("fp8_block", "quantize_fp8_block"),
           dequantize_kernel=Kernel("fp8_block", "dequantize_fp8_block"),
           roles=frozenset({"scaled_mm"})),
    Format("fp8_rowwise", FP8_ROWWISE_FORMAT, fp8_rowwise.quantize_fp8_rowwise,
           fp8_rowwise.dequantize_fp8_rowwise,
           quantize_kernel=Kernel("fp8_rowwise", "quantize_fp8_rowwise"),
           roles=frozenset({"scaled_mm"})),
    Format("nf4", NF4_FORMAT, nf4.quantize_nf4, nf4.dequantize_nf4,
           options=("blocksize", "double_quant"),
           dequantize_kernel=Kernel("nf4", "dequantize_nf4"),
           roles=_W4),
    # bnb_fp4 has no kernel module of its own: the nf4 kernel takes the 16-entry table as an argument
    Format("bnb_fp4", BNB_FP4_FORMAT, bnb_fp4.quantize_bnb_fp4, bnb_fp4.dequantize_bnb_fp4,
           options=("blocksize", "double_quant"),
           dequantize_kernel=Kernel("nf4", "dequantize_bnb_fp4"),
           roles=frozenset({"linear_weight"})),
    # the kernel decodes in float16 (AutoAWQ); bf16/fp32-scaled compressed-tensors weights use the reference
    Format("int4_awq", INT4_AWQ_FORMAT, int4_awq.quantize_int4_awq, int4_awq.dequantize_int4_awq,
           options=("group_size",),
           dequantize_kernel=Kernel("int4_awq", "dequantize_int4_awq", int4_awq.decodes_in_fp16),
           roles=_W4),
):
    register_format(_f)
del _f

__all__ = ["REGISTRY", "ROLES", "Format", "Kernel", "covers_all", "formats_with", "register_format",
           "unregister_format"]
