"""QTensor: a quantized tensor as plain data (packed payload, scales, and what is needed to decode them)."""

from __future__ import annotations

import functools
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from .packing import swizzled_scale_shape
from .spec import FORMATS, FormatSpec

_TENSOR_FIELDS = ("data", "scale", "global_scale", "zeros", "nested_scale", "nested_offset")
_OPTIONAL = ("global_scale", "zeros", "nested_scale", "nested_offset")
_SCALE_DTYPES = {"e4m3": torch.float8_e4m3fn, "e8m0": torch.float8_e8m0fnu, "fp32": torch.float32}
# the optional tensors each format carries (the others must be None); formats not listed are not restricted
_ALLOWED_OPTIONAL = {
    "nvfp4": ("global_scale",), "int4_awq": ("zeros",), "nf4": ("nested_scale", "nested_offset"),
    "bnb_fp4": ("nested_scale", "nested_offset"),
    **{f: () for f in ("mxfp4", "mxfp6_e2m3", "mxfp6_e3m2", "mxfp8_e4m3", "mxfp8_e5m2", "fp4_b32", "fp8_block",
                       "fp8_rowwise")},
}


def _layouts(spec: FormatSpec) -> tuple[str, ...]:
    """Scale layouts the decoders and kernels of a format read (anything else would be read as linear)."""
    if spec.kind == "blockscaled" and spec.scale != "fp32":
        return ("linear", "swizzled")
    if spec.name == "fp8_block":
        return ("linear", "column_major")
    return ("linear",)


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _describe(t: torch.Tensor) -> str:
    return f"{_name(t.dtype)} {tuple(t.shape)}"


@functools.lru_cache(maxsize=512)
def _blockscaled_layout(
    fmt: str, shape: torch.Size, scale_layout: str
) -> tuple[torch.dtype, torch.Size, torch.dtype, torch.Size, str, str]:
    """(data dtype, data shape, scale dtype, scale shape, data rule, scale rule) of a block-scaled format, or a
    ValueError for a logical shape it cannot have. Cached: activations of one shape are quantized per call."""
    spec = FORMATS[fmt]
    block, elem = spec.block, spec.element
    if len(shape) == 0:
        raise ValueError(f"QTensor({fmt}): shape must have at least 1 dimension (blocks run along the last)")
    k = shape[-1]
    if k % block:
        raise ValueError(
            f"QTensor({fmt}): shape[-1] (K = {k}) must be a multiple of {block} (one scale per {block} elements)"
        )
    lead = tuple(shape[:-1])
    if elem.torch_dtype is not None:
        data = (elem.torch_dtype, torch.Size((*lead, k)), f"one {elem.name} code per element")
    else:
        data = (torch.uint8, torch.Size((*lead, k * elem.bits // 8)), f"{elem.bits}-bit codes packed into bytes")
    cols = k // block
    if scale_layout == "swizzled":
        rows = 1
        for d in lead:
            rows *= d
        scale = (torch.Size(swizzled_scale_shape(rows, cols)), f"swizzled: [round_up(rows, 128), round_up(K/{block}, 4)]")
    else:
        scale = (torch.Size((*lead, cols)), f"linear: [..., K/{block}]")
    return data[0], data[1], _SCALE_DTYPES[spec.scale], scale[0], data[2], scale[1]


def _check_blockscaled(q: QTensor) -> None:
    """nvfp4 / MX / fp4_b32: the packed codes and block scales must match the logical shape exactly."""
    try:
        ddt, dshape, sdt, sshape, drule, srule = _blockscaled_layout(q.fmt, q.shape, q.scale_layout)
    except TypeError:  # a symbolic size (torch.compile tracing) is not hashable: same rules, uncached
        ddt, dshape, sdt, sshape, drule, srule = _blockscaled_layout.__wrapped__(q.fmt, q.shape, q.scale_layout)
    for name, t, dtype, shape, rule in (("data", q.data, ddt, dshape, drule), ("scale", q.scale, sdt, sshape, srule)):
        if t.dtype != dtype or t.shape != shape:
            exc = TypeError if t.dtype != dtype else ValueError
            raise exc(
                f"QTensor({q.fmt}): {name} must be {_name(dtype)} {tuple(shape)} ({rule}) for shape "
                f"{tuple(q.shape)}, got {_describe(t)}"
            )
    for name, t in (("global_scale", q.global_scale), ("params['per_tensor_scale']", q.params.get("per_tensor_scale"))):
        if isinstance(t, torch.Tensor) and (t.dtype != torch.float32 or t.numel() != 1):
            exc = TypeError if t.dtype != torch.float32 else ValueError
            raise exc(f"QTensor({q.fmt}): {name} must be None or one float32 value, got {_describe(t)}")


def _check_fp8_block(q: QTensor) -> None:
    from .fp8_block import check_qtensor  # imported on use: the format modules import this one

    block = check_qtensor(q)
    if q.scale_layout == "column_major" and block != (1, 128):
        raise ValueError(f"QTensor(fp8_block): scale_layout 'column_major' needs block (1, 128), got {block}")
    scale_fmt = q.params.get("scale_fmt")
    if scale_fmt not in (None, "ue8m0"):
        raise ValueError(f"QTensor(fp8_block): params['scale_fmt'] must be None or 'ue8m0', got {scale_fmt!r}")


def _check_fp8_rowwise(q: QTensor) -> None:
    from .fp8_rowwise import check_qtensor

    check_qtensor(q)


def _check_nf4(q: QTensor) -> None:
    from .nf4 import check_nf4_qtensor

    check_nf4_qtensor(q)


def _check_bnb_fp4(q: QTensor) -> None:
    from .bnb_fp4 import check_bnb_fp4_qtensor

    check_bnb_fp4_qtensor(q)


def _check_int4_awq(q: QTensor) -> None:
    from .int4_awq import check_int4_awq

    check_int4_awq(q)


_FORMAT_CHECKS = {"fp8_block": _check_fp8_block, "fp8_rowwise": _check_fp8_rowwise, "nf4": _check_nf4,
                  "bnb_fp4": _check_bnb_fp4, "int4_awq": _check_int4_awq}


# formats whose rules read no params (nvfp4 with a tensor params['per_tensor_scale'] excepted): a layout that
# passed once passes again, so the structure of a valid QTensor is remembered and a kernel quantizing
# activations of one shape per call pays one lookup, not the full check
_STRUCTURE_CACHED = frozenset(
    ("nvfp4", "mxfp4", "mxfp6_e2m3", "mxfp6_e3m2", "mxfp8_e4m3", "mxfp8_e5m2", "fp4_b32", "fp8_rowwise")
)
_VALID_STRUCTURES: set[tuple] = set()
_MAX_STRUCTURES = 4096


def validate(q: QTensor) -> None:
    """Raise TypeError/ValueError unless ``q``'s tensors fit its format, logical shape and scale layout.

    Reads only types, dtypes and shapes (never tensor data: no device sync, and meta tensors are fine).
    Every QTensor is checked when it is built, so decoders and kernels may rely on a consistent layout.
    """
    key = None
    params = q.params
    if q.fmt in _STRUCTURE_CACHED and type(params) is dict and "per_tensor_scale" not in params:
        d, s, g = q.data, q.scale, q.global_scale
        # plain tensors only: subclasses (fake tensors under tracing) and wrong types take the full check
        if type(d) is torch.Tensor and type(s) is torch.Tensor and (g is None or type(g) is torch.Tensor):
            key = (q.fmt, q.shape, q.scale_layout, q.dtype, d.dtype, d.shape, s.dtype, s.shape,
                   None if g is None else (g.dtype, g.shape),
                   q.zeros is None and q.nested_scale is None and q.nested_offset is None)
            try:
                if key in _VALID_STRUCTURES:
                    return
            except TypeError:  # unhashable (a symbolic size)
                key = None
    _validate(q)
    if key is not None:
        if len(_VALID_STRUCTURES) >= _MAX_STRUCTURES:
            _VALID_STRUCTURES.clear()
        _VALID_STRUCTURES.add(key)


def _validate(q: QTensor) -> None:
    fmt = q.fmt
    if not isinstance(fmt, str):
        raise TypeError(f"QTensor: fmt must be a format name (str), got {type(fmt).__name__}")
    spec = FORMATS.get(fmt)
    if spec is None:
        raise ValueError(f"QTensor: unknown fmt {fmt!r}; known formats: {sorted(FORMATS)}")
    for name in _TENSOR_FIELDS:
        t = getattr(q, name)
        if not isinstance(t, torch.Tensor) and (t is not None or name in ("data", "scale")):
            need = "a torch.Tensor" if name in ("data", "scale") else "None or a torch.Tensor"
            raise TypeError(f"QTensor({fmt}): {name} must be {need}, got {type(t).__name__}")
    allowed = _ALLOWED_OPTIONAL.get(fmt)
    if allowed is not None:
        for name in _OPTIONAL:
            if name not in allowed and getattr(q, name) is not None:
                raise ValueError(f"QTensor({fmt}): {name} must be None for {fmt} (it carries only {list(allowed)})")
    if not isinstance(q.dtype, torch.dtype) or not q.dtype.is_floating_point:
        raise TypeError(f"QTensor({fmt}): dtype must be the floating dtype that was quantized, got {q.dtype!r}")
    if not isinstance(q.params, dict):
        raise TypeError(f"QTensor({fmt}): params must be a dict, got {type(q.params).__name__}")
    if any(d < 0 for d in q.shape):
        raise ValueError(f"QTensor({fmt}): shape must not have negative sizes, got {tuple(q.shape)}")
    layouts = _layouts(spec)
    if q.scale_layout not in layouts:
        raise ValueError(f"QTensor({fmt}): scale_layout must be one of {layouts}, got {q.scale_layout!r}")
    if spec.kind == "blockscaled":
        _check_blockscaled(q)
    else:
        check = _FORMAT_CHECKS.get(fmt)
        if check is not None:
            check(q)


@dataclass(frozen=True, eq=False)
class QTensor:
    """A quantized tensor.

    Attributes:
        data: packed payload, dtype as the producers store it (uint8 for FP4/FP6/NF4, float8 for
            MXFP8/fp8_block, int32 ``qweight`` for int4_awq).
        scale: block scales; linear layout ``[..., K/block]`` unless ``scale_layout == "swizzled"``
            (then 2-D ``[round_up(rows,128), round_up(K/block,4)]``). For nf4 with double quantization
            these are the uint8 codes of the absmax.
        fmt: format name (a key of ``lowbit.formats.FORMATS``).
        shape: logical (unquantized) shape.
        dtype: dtype of the tensor that was quantized.
        global_scale: fp32 per-tensor multiplier (dequant = value * block scale / global_scale), or None.
        zeros: packed zero points (int4_awq ``qzeros``), or None.
        scale_layout: ``"linear"`` or ``"swizzled"``.
        params: the format options this tensor was made with (convention, rounding, block, ...).
        nested_scale: nf4 double quantization: fp32 absmax of each 256-block of absmax values.
        nested_offset: nf4 double quantization: fp32 scalar mean subtracted from absmax before coding.
    """

    data: torch.Tensor
    scale: torch.Tensor
    fmt: str
    shape: torch.Size
    dtype: torch.dtype = torch.float32
    global_scale: torch.Tensor | None = None
    zeros: torch.Tensor | None = None
    scale_layout: str = "linear"
    params: dict[str, Any] = field(default_factory=dict)
    nested_scale: torch.Tensor | None = None
    nested_offset: torch.Tensor | None = None

    def __post_init__(self) -> None:
        try:
            shape = torch.Size(self.shape)
        except (TypeError, ValueError):
            raise TypeError(f"QTensor: shape must be a sequence of ints, got {self.shape!r}") from None
        object.__setattr__(self, "shape", shape)
        # checked here, where every QTensor is built (hand-made ones included), so that a decoder or kernel
        # never meets inconsistent sizes as a bare reshape error; shapes and dtypes only, no data reads
        validate(self)

    @classmethod
    def _unchecked(cls, data: torch.Tensor, scale: torch.Tensor, fmt: str, shape: torch.Size, dtype: torch.dtype,
                   global_scale: torch.Tensor | None, scale_layout: str, params: dict[str, Any]) -> QTensor:
        """A QTensor built without ``__post_init__``'s checks, for a kernel launcher that made one with the
        same format, shapes and dtypes before (that one was checked): ``shape`` must be a ``torch.Size``; the
        fields it does not take are None."""
        q = object.__new__(cls)
        q.__dict__.update(data=data, scale=scale, fmt=fmt, shape=shape, dtype=dtype, global_scale=global_scale,
                          zeros=None, scale_layout=scale_layout, params=params, nested_scale=None,
                          nested_offset=None)
        return q

    @property
    def spec(self) -> FormatSpec:
        return FORMATS[self.fmt]

    @property
    def device(self) -> torch.device:
        return self.data.device

    def tensors(self) -> dict[str, torch.Tensor]:
        """Every tensor this QTensor holds, by attribute name (None entries left out)."""
        names = ("data", "scale", "global_scale", "zeros", "nested_scale", "nested_offset")
        return {n: getattr(self, n) for n in names if getattr(self, n) is not None}

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors().values())

    def to(self, device: torch.device | str) -> QTensor:
        return replace(self, **{n: t.to(device) for n, t in self.tensors().items()})

    def __repr__(self) -> str:
        g = self.global_scale
        # a meta tensor has no value to show (and reading one from a GPU would sync)
        extra = "" if g is None else ", global_scale=" + (
            "<meta>" if g.is_meta else f"{g.detach().float().reshape(-1)[0].item():.6g}")
        opts = ", ".join(f"{k}={v}" for k, v in self.params.items())
        return (
            f"QTensor(fmt={self.fmt}, shape={tuple(self.shape)}, dtype={self.dtype}, "
            f"data={self.data.dtype}{tuple(self.data.shape)}, scale={self.scale.dtype}{tuple(self.scale.shape)}"
            f"{extra}, scale_layout={self.scale_layout}{', ' + opts if opts else ''})"
        )
