"""Validation of ``lowbit.scaled_mm``'s arguments: the supported ``(a.fmt, b.fmt)`` pairs (:data:`PAIRS`), each
operand's structure (data and scale dtypes, shapes and layouts for its format, devices), alpha, bias and the
output dtype. Every check raises TypeError / ValueError naming the broken rule; none synchronizes with the host.
"""

from __future__ import annotations

from typing import Any

import torch

from ..formats.fp8_block import BLOCKS as _FP8_BLOCKS
from ..formats.fp8_block import expected_scale_shape as _fp8_block_scale_shape
from ..formats.packing import swizzled_scale_shape
from ..formats.qtensor import QTensor
from ..formats.spec import FORMATS

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

_BLOCKSCALED = {
    "nvfp4": (16, torch.float8_e4m3fn),
    **{f: (32, torch.float8_e8m0fnu) for f in ("mxfp4", *MXFP6, *MXFP8)},
}
_FIELDS = ("data", "scale", "global_scale", "zeros", "nested_scale", "nested_offset")
_WHO = {"a": "a (activation, [M, K])", "b": "b (weight, [N, K])"}


def pairs_for(fmt: str, side: str) -> list[str]:
    return sorted({p[0] if side == "a" else p[1] for p in PAIRS if p[1 if side == "a" else 0] == fmt})


def _check_pair(a: Any, b: Any) -> str:
    for name, q in (("a", a), ("b", b)):
        if not isinstance(q, QTensor):
            raise TypeError(f"lowbit.scaled_mm: {name} must be a lowbit QTensor, got {type(q).__name__}")
    kind = PAIRS.get((a.fmt, b.fmt))
    if kind is None:
        hint = pairs_for(b.fmt, "a")
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


def normalize_alpha(alpha: Any, device: torch.device) -> torch.Tensor | None:
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


def check_bias(bias: Any, n: int, device: torch.device) -> None:
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


def check_out_dtype(out_dtype: Any) -> None:
    if out_dtype not in OUT_DTYPES:
        raise TypeError(
            f"lowbit.scaled_mm: out_dtype must be torch.bfloat16, torch.float16 or torch.float32, "
            f"got {out_dtype!r}"
        )


def check_arguments(
    a: Any, b: Any, alpha: Any, bias: Any, out_dtype: Any
) -> tuple[str, int, int, int, torch.Tensor | None]:
    """Every check of :func:`scaled_mm`; returns ``(kind, M, N, K, alpha as float32 [1] or None)``."""
    kind, m, n, k = check_operands(a, b)
    device = a.data.device
    alpha_t = normalize_alpha(alpha, device)
    check_bias(bias, n, device)
    check_out_dtype(out_dtype)
    return kind, m, n, k, alpha_t
