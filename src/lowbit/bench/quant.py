"""quantize / dequantize ops for every format, their byte counts, correctness checks and baselines.

Bytes are what the op must move: the input read once plus the output written once. quantize reads the bf16
input and writes every tensor of the QTensor (packed data, block scales, global scale, nf4 nested scales);
dequantize is the reverse with a bf16 output. The nf4 code tables (16 + 256 fp32 values) are not counted.
"""

from __future__ import annotations

import functools
import math
import types
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

import lowbit
from lowbit.formats import blockscaled, bnb_fp4, fp8_block, int4_awq, nf4
from lowbit.formats.packing import swizzled_scale_shape
from lowbit.formats.spec import FORMATS
from lowbit.testing import assert_bitexact

from .common import compiled
from .common import optional as _optional
from .registry import Baseline, Case, Context, Op, Shape, Skip, register

MX = ("mxfp4", "mxfp6_e2m3", "mxfp6_e3m2", "mxfp8_e4m3", "mxfp8_e5m2")
SQUARES: tuple[Shape, ...] = ((4096, 4096), (8192, 8192), (16384, 16384))
# DeepSeek-V3 activation quantization: M tokens x K = 7168 (decode, small batch, prefill)
ACT_SHAPES: tuple[Shape, ...] = ((1, 7168), (16, 7168), (4096, 7168))
CALIBRATED = "calibrated"  # nvfp4 option value: a global scale computed once in setup and passed in
IN_DTYPE = torch.bfloat16
OUT_DTYPE = torch.bfloat16

# format -> (reference quantize, reference dequantize) in lowbit.formats: the compiled-reference baseline
_REFERENCE: dict[str, tuple[Callable[..., Any], Callable[..., Any]]] = {
    "nvfp4": (blockscaled.quantize_nvfp4, blockscaled.dequantize_nvfp4),
    **{f: (functools.partial(blockscaled.quantize_mx, fmt=f), blockscaled.dequantize_mx) for f in MX},
    "fp4_b32": (blockscaled.quantize_fp4_b32, blockscaled.dequantize_fp4_b32),
    "fp8_block": (fp8_block.quantize_fp8_block, fp8_block.dequantize_fp8_block),
    "nf4": (nf4.quantize_nf4, nf4.dequantize_nf4),
    "bnb_fp4": (bnb_fp4.quantize_bnb_fp4, bnb_fp4.dequantize_bnb_fp4),
    "int4_awq": (int4_awq.quantize_int4_awq, int4_awq.dequantize_int4_awq),
}


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def qtensor_nbytes(fmt: str, shape: Shape, **options: Any) -> int:
    """Bytes of every tensor of the QTensor that ``lowbit.quantize(x, fmt, **options)`` returns.

    Computed from the format alone (no allocation); equals ``QTensor.nbytes``.
    """
    n = math.prod(shape)
    k = shape[-1]
    rows = n // k
    layout = options.get("scale_layout", "linear")
    if fmt == "nvfp4" or fmt in MX:
        group = 16 if fmt == "nvfp4" else 32
        bits = 4 if fmt == "nvfp4" else FORMATS[fmt].element.bits
        scales = math.prod(swizzled_scale_shape(rows, k // group)) if layout == "swizzled" else n // group
        gscale = 4 if fmt == "nvfp4" and options.get("global_scale") != "none" else 0
        return n * bits // 8 + scales + gscale
    if fmt == "fp4_b32":
        return n // 2 + (n // 32) * 4
    if fmt == "fp8_rowwise":  # E4M3 values, one fp32 scale per row
        return n + rows * 4
    if fmt == "fp8_block":
        block = tuple(options.get("block", (1, 128)))
        if block == (1, 128):
            return n + rows * _cdiv(k, 128) * 4
        return n + _cdiv(shape[0], 128) * _cdiv(k, 128) * 4
    if fmt in ("nf4", "bnb_fp4"):  # one layout, two 16-entry tables
        nblocks = _cdiv(n, options.get("blocksize", 64))
        if options.get("double_quant", False):
            return _cdiv(n, 2) + nblocks + _cdiv(nblocks, nf4.NESTED_BLOCKSIZE) * 4 + 4
        return _cdiv(n, 2) + nblocks * 4
    if fmt == "int4_awq":
        out_f, in_f = shape
        groups = in_f // options.get("group_size", 128)
        return in_f * out_f // 8 * 4 + groups * out_f // 8 * 4 + groups * out_f * 2
    raise ValueError(f"unknown format {fmt!r}")


def quantize_nbytes(fmt: str, shape: Shape, **options: Any) -> int:
    """bf16 input read once + the QTensor written once."""
    return math.prod(shape) * IN_DTYPE.itemsize + qtensor_nbytes(fmt, shape, **options)


def dequantize_nbytes(fmt: str, shape: Shape, **options: Any) -> int:
    """The QTensor read once + the bf16 output written once."""
    return qtensor_nbytes(fmt, shape, **options) + math.prod(shape) * OUT_DTYPE.itemsize


# ---------------------------------------------------------------------------------------------- helpers


def _randn(shape: Shape, device: str, seed: int = 0) -> torch.Tensor:
    g = torch.Generator(device=device).manual_seed(seed)
    return torch.randn(shape, generator=g, device=device, dtype=torch.float32).to(IN_DTYPE)


def _resolve(options: dict[str, Any], x: torch.Tensor) -> dict[str, Any]:
    """Runtime options: a CALIBRATED global scale becomes the default one for ``x`` (an fp32 tensor)."""
    out = dict(options)
    if out.get("global_scale") == CALIBRATED:
        out["global_scale"] = blockscaled.nvfp4_default_global_scale(x)
    return out


def _same_bits(got: torch.Tensor | None, want: torch.Tensor | None, what: str) -> None:
    if got is None or want is None:
        assert got is None and want is None, f"{what}: got {got is not None}, want {want is not None}"
        return
    if got.shape == want.shape and got.dtype == want.dtype:
        views = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[got.element_size()]
        if torch.equal(got.contiguous().view(views), want.contiguous().view(views)):
            return
    assert_bitexact(got, want, what)  # raises with the first differing elements


def _same_qtensor(q: lowbit.QTensor, r: lowbit.QTensor) -> None:
    assert (q.fmt, tuple(q.shape), q.scale_layout) == (r.fmt, tuple(r.shape), r.scale_layout), (q, r)
    names = set(q.tensors()) | set(r.tensors())
    for name in sorted(names):
        _same_bits(getattr(q, name), getattr(r, name), name)


def _quantize_kernel_reason(fmt: str, options: dict[str, Any]) -> str | None:
    from lowbit import kernels

    found = kernels.quantize_kernel(fmt, options)
    return found if isinstance(found, str) else None


def _dequantize_kernel_reason(fmt: str, q: Any) -> str | None:
    from lowbit import kernels

    found = kernels.dequantize_kernel(fmt, q)
    return found if isinstance(found, str) else None


# -------------------------------------------------------------------------------------- external baselines


def _torchao_nvfp4(x: torch.Tensor, options: dict[str, Any]) -> Callable[[], Any]:
    from torchao.prototype.mx_formats.nvfp4_tensor import NVFP4Tensor, per_tensor_amax_to_scale

    swizzled = options.get("scale_layout") == "swizzled"
    gs = options.get("global_scale")
    if isinstance(gs, torch.Tensor):
        pts = (1.0 / gs.float()).reshape(())  # torchao's per_tensor_scale is the divisor 1/S

        def f(x):
            return NVFP4Tensor.to_nvfp4(x, per_tensor_scale=pts, is_swizzled_scales=swizzled)
    else:

        def f(x):
            # amax included, as in lowbit's default: the computed global scale
            return NVFP4Tensor.to_nvfp4(
                x,
                per_tensor_scale=per_tensor_amax_to_scale(torch.max(torch.abs(x))),
                is_swizzled_scales=swizzled,
            )

    cf = compiled(f)
    return lambda: cf(x)


def _torchao_to_mx(x: torch.Tensor, fmt: str, options: dict[str, Any]) -> Callable[[], Any]:
    from torchao.prototype.mx_formats.config import ScaleCalculationMode
    from torchao.prototype.mx_formats.constants import DTYPE_FP6_E2M3, DTYPE_FP6_E3M2
    from torchao.prototype.mx_formats.mx_tensor import to_mx

    elem = {
        "mxfp4": torch.float4_e2m1fn_x2,
        "mxfp6_e2m3": DTYPE_FP6_E2M3,
        "mxfp6_e3m2": DTYPE_FP6_E3M2,
        "mxfp8_e4m3": torch.float8_e4m3fn,
        "mxfp8_e5m2": torch.float8_e5m2,
    }[fmt]
    mode = {"rceil": ScaleCalculationMode.RCEIL, "floor": ScaleCalculationMode.FLOOR}[
        options.get("scale_rounding", "rceil")
    ]
    cf = compiled(
        functools.partial(
            to_mx,
            elem_dtype=elem,
            block_size=32,
            scaling_mode=mode,
            is_swizzled_scales=options.get("scale_layout") == "swizzled",
        )
    )
    return lambda: cf(x)


def _torchao_fp8_quant(x: torch.Tensor, block: tuple[int, int]) -> Callable[[], Any]:
    from torchao.kernel import blockwise_quantization as bq

    fn = bq.fp8_blockwise_act_quant if block == (1, 128) else bq.fp8_blockwise_weight_quant
    return lambda: fn(x, 128)


def _torchao_fp8_dequant(q: lowbit.QTensor) -> Callable[[], Any]:
    from torchao.kernel import blockwise_quantization as bq

    data, scale = q.data.contiguous(), q.scale.contiguous()
    return lambda: bq.fp8_blockwise_weight_dequant(data, scale, 128)


def _bnb_nf4_dequant(x: torch.Tensor, options: dict[str, Any]) -> Callable[[], Any]:
    import bitsandbytes.functional as bnbf

    packed, state = bnbf.quantize_4bit(
        x,
        blocksize=options.get("blocksize", 64),
        compress_statistics=options.get("double_quant", False),
        quant_type="nf4",
    )
    out = bnbf.dequantize_4bit(packed, state)
    if out.dtype != OUT_DTYPE:
        raise TypeError(f"dequantize_4bit returned {out.dtype}, expected {OUT_DTYPE}")
    return lambda: bnbf.dequantize_4bit(packed, state)


def _external_quantize(fmt: str, x: torch.Tensor, options: dict[str, Any]) -> dict[str, Baseline]:
    if fmt == "nvfp4":
        return {"torchao.to_nvfp4[compiled]": _optional(lambda: _torchao_nvfp4(x, options), "torchao")}
    if fmt in MX:
        return {"torchao.to_mx[compiled]": _optional(lambda: _torchao_to_mx(x, fmt, options), "torchao")}
    if fmt == "fp8_block":
        block = tuple(options.get("block", (1, 128)))
        name = (
            "torchao.fp8_blockwise_act_quant" if block == (1, 128) else "torchao.fp8_blockwise_weight_quant"
        )
        return {name: _optional(lambda: _torchao_fp8_quant(x, block), "torchao")}
    return {}


def _external_dequantize(
    fmt: str, x: torch.Tensor, q: lowbit.QTensor, options: dict[str, Any]
) -> dict[str, Baseline]:
    if fmt == "nf4":
        return {
            "bitsandbytes.dequantize_4bit": _optional(lambda: _bnb_nf4_dequant(x, options), "bitsandbytes")
        }
    if fmt == "fp8_block" and tuple(options.get("block", (1, 128))) == (128, 128):
        return {"torchao.fp8_blockwise_weight_dequant": _optional(lambda: _torchao_fp8_dequant(q), "torchao")}
    return {}


# ------------------------------------------------------------------------------------------------ setups


def _quantize_setup(fmt: str, options: dict[str, Any]) -> Callable[[Shape, Context], Case]:
    def setup(shape: Shape, ctx: Context) -> Case:
        x = _randn(shape, ctx.device)
        opts = _resolve(options, x)
        if ctx.backend == "triton":
            reason = _quantize_kernel_reason(fmt, opts)
            if reason:
                raise Skip(reason)

        def fn():
            return lowbit.quantize(x, fmt, backend=ctx.backend, **opts)

        q = fn()  # also compiles the kernel
        check = None
        if ctx.check:

            def check():
                _same_qtensor(fn(), lowbit.quantize(x, fmt, backend="torch", **opts))

        baselines: dict[str, Baseline] = {}
        if ctx.baselines:
            cref = compiled(functools.partial(_REFERENCE[fmt][0], **opts))
            baselines["lowbit.formats[compiled]"] = lambda: cref(x)
            baselines.update(_external_quantize(fmt, x, opts))
        return Case(fn=fn, bytes=x.numel() * x.element_size() + q.nbytes, check=check, baselines=baselines)

    return setup


def _dequantize_setup(fmt: str, options: dict[str, Any]) -> Callable[[Shape, Context], Case]:
    def setup(shape: Shape, ctx: Context) -> Case:
        x = _randn(shape, ctx.device)
        opts = _resolve(options, x)
        # the input QTensor: from the quantize kernel where there is one (same bits), else the reference
        qb = "torch"
        if ctx.backend == "triton" and not _quantize_kernel_reason(fmt, opts):
            qb = "triton"
        q = lowbit.quantize(x, fmt, backend=qb, **opts)
        if ctx.backend == "triton":
            reason = _dequantize_kernel_reason(fmt, q)
            if reason:
                raise Skip(reason)

        def fn():
            return lowbit.dequantize(q, OUT_DTYPE, backend=ctx.backend)

        out = fn()
        check = None
        if ctx.check:

            def check():
                _same_bits(fn(), lowbit.dequantize(q, OUT_DTYPE, backend="torch"), "output")

        baselines: dict[str, Baseline] = {}
        if ctx.baselines:
            cref = compiled(_REFERENCE[fmt][1])
            baselines["lowbit.formats[compiled]"] = lambda: cref(q, OUT_DTYPE)
            baselines.update(_external_dequantize(fmt, x, q, opts))
        return Case(
            fn=fn, bytes=q.nbytes + out.numel() * out.element_size(), check=check, baselines=baselines
        )

    return setup


def _unavailable(kind: str, fmt: str, options: dict[str, Any]) -> Callable[[Context], str | None]:
    """Cheap pre-check (no allocation): the kernel table's reason when no triton kernel covers the op."""

    def check(ctx: Context) -> str | None:
        if ctx.backend != "triton":
            return None
        if kind == "quantize":
            return _quantize_kernel_reason(fmt, {k: v for k, v in options.items() if v != CALIBRATED})
        # dequantize predicates read q.params and the scale dtype; lowbit's defaults for these options
        params = {"convention": "vllm"} if fmt == "nvfp4" else dict(options)
        return _dequantize_kernel_reason(fmt, types.SimpleNamespace(params=params,
                                                                    scale=torch.empty(0, dtype=torch.float16)))

    return check


@dataclass(frozen=True)
class QuantOp:
    """One registered (kind, format, options) combination; ``name`` is the registry name."""

    kind: str  # "quantize" or "dequantize"
    fmt: str
    variant: str = ""
    options: dict[str, Any] = field(default_factory=dict)
    shapes: tuple[Shape, ...] = SQUARES
    quick_shapes: tuple[Shape, ...] = ()
    baseline_shape: Shape | None = None

    @property
    def name(self) -> str:
        return ".".join(p for p in (self.kind, self.fmt, self.variant) if p)

    def nbytes(self, shape: Shape) -> int:
        count = quantize_nbytes if self.kind == "quantize" else dequantize_nbytes
        return count(self.fmt, shape, **self.options)

    def to_op(self) -> Op:
        setup = (_quantize_setup if self.kind == "quantize" else _dequantize_setup)(self.fmt, self.options)
        opts = ", ".join(f"{k}={v}" for k, v in self.options.items())
        return Op(
            name=self.name,
            setup=setup,
            shapes=self.shapes,
            quick_shapes=self.quick_shapes,
            baseline_shape=self.baseline_shape,
            nbytes=self.nbytes,
            unavailable=_unavailable(self.kind, self.fmt, self.options),
            doc=f"lowbit.{self.kind}(bf16, {self.fmt!r}{', ' + opts if opts else ''})",
        )


_FP8_ACT = {
    "shapes": ACT_SHAPES + SQUARES,
    "quick_shapes": ((1, 7168), (4096, 7168)),
    "baseline_shape": (4096, 7168),
}

QUANT_OPS: tuple[QuantOp, ...] = (
    QuantOp("quantize", "nvfp4"),
    QuantOp("quantize", "nvfp4", "gs", {"global_scale": CALIBRATED}),
    QuantOp("quantize", "nvfp4", "swizzled", {"scale_layout": "swizzled"}),
    *(QuantOp("quantize", f) for f in MX),
    QuantOp("quantize", "fp4_b32"),
    QuantOp("quantize", "fp8_block", "1x128", {"block": (1, 128)}, **_FP8_ACT),
    QuantOp("quantize", "fp8_block", "128x128", {"block": (128, 128)}),
    QuantOp("dequantize", "nvfp4"),
    *(QuantOp("dequantize", f) for f in MX),
    QuantOp("dequantize", "fp4_b32"),
    QuantOp("dequantize", "fp8_block", "1x128", {"block": (1, 128)}),
    QuantOp("dequantize", "fp8_block", "128x128", {"block": (128, 128)}),
    QuantOp("dequantize", "nf4", "dq", {"blocksize": 64, "double_quant": True}),
    QuantOp("dequantize", "bnb_fp4", "dq", {"blocksize": 64, "double_quant": True}),
    QuantOp("dequantize", "int4_awq", "", {"group_size": 128}),
)


def register_all() -> None:
    for qop in QUANT_OPS:
        register(qop.to_op(), replace=True)
