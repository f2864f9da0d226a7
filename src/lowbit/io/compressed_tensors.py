"""compressed-tensors (llm-compressor) checkpoint tensors <-> QTensor, one module at a time.

Pure layout transforms: bits are moved, never re-quantized. Tensor names are the module-local ones
(prefix them with ``"model.layers.0.mlp.down_proj."`` to place them in a state dict). Per compression
format of compressed-tensors 0.20.0 (``compressors/``, formats.md sections 1.5 and 2.4):

======================  ==========  ====================================================================
CT format               lowbit      tensors
======================  ==========  ====================================================================
nvfp4-pack-quantized    nvfp4       ``weight_packed`` uint8 ``[out, in/2]`` (element 2i in the low nibble),
                                    ``weight_scale`` float8_e4m3fn ``[out, in/16]`` (linear),
                                    ``weight_global_scale`` fp32 ``[1]`` (multiplier: W = e2m1 * sf / g),
                                    optional ``input_global_scale`` fp32 ``[1]`` (multiplier)
mxfp4-pack-quantized    mxfp4       ``weight_packed`` uint8 ``[out, in/2]``,
                                    ``weight_scale`` uint8 ``[out, in/32]``
mxfp6-pack-quantized    mxfp6_e2m3  ``weight_packed`` uint8 ``[out, 3*in/4]`` (little-endian 6-bit stream),
                                    ``weight_scale`` uint8 ``[out, in/32]``
mxfp8-quantized         mxfp8_e4m3  ``weight`` float8_e4m3fn ``[out, in]``,
                                    ``weight_scale`` uint8 ``[out, in/32]``
pack-quantized          int4_awq    see ``lowbit.io._ct_int4``
======================  ==========  ====================================================================

MX scale bytes are E8M0 exponents (``2^(s-127)``). compressed-tensors computes them with its own
EVEN-like rule (formats.md 2.2), so a CT checkpoint and ``lowbit.quantize`` of the same weight can hold
different scales; either decodes the same through both libraries. compressed-tensors decodes 0xFF as
``2^128`` (Inf in bf16) where lowbit decodes NaN; no finite block produces 0xFF. CT has no compressor for
mxfp6_e3m2 or mxfp8_e5m2.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from ..formats.packing import unswizzle_scales
from ..formats.checks import positive_fp32_scalar
from ..formats.qtensor import QTensor

_CT_FORMAT = {
    "nvfp4": "nvfp4-pack-quantized",
    "mxfp4": "mxfp4-pack-quantized",
    "mxfp6_e2m3": "mxfp6-pack-quantized",
    "mxfp8_e4m3": "mxfp8-quantized",
    "int4_awq": "pack-quantized",
}
_BLOCK = {"nvfp4": 16, "mxfp4": 32, "mxfp6_e2m3": 32, "mxfp8_e4m3": 32}
_KNOWN_NAMES = (
    "weight",
    "weight_packed",
    "weight_scale",
    "weight_global_scale",
    "input_global_scale",
    "weight_zero_point",
    "weight_shape",
    "weight_g_idx",
)


def ct_compression_format(fmt: str) -> str:
    """The compressed-tensors ``format`` string (``quantization_config.format``) for a lowbit format name.

    Args:
        fmt: ``"nvfp4"``, ``"mxfp4"``, ``"mxfp6_e2m3"``, ``"mxfp8_e4m3"`` or ``"int4_awq"``.

    Returns:
        e.g. ``"nvfp4-pack-quantized"``.
    """
    if fmt not in _CT_FORMAT:
        raise ValueError(f"fmt: compressed-tensors 0.20.0 stores only {sorted(_CT_FORMAT)}, got {fmt!r}")
    return _CT_FORMAT[fmt]


def _packed_cols(fmt: str, in_features: int) -> int:
    if fmt in ("nvfp4", "mxfp4"):
        return in_features // 2
    if fmt == "mxfp6_e2m3":
        return in_features * 3 // 4
    return in_features


def _linear_scale_bytes(q: QTensor, block: int) -> torch.Tensor:
    rows, cols = q.shape[0], q.shape[1] // block
    if q.scale_layout == "swizzled":
        scale = unswizzle_scales(q.scale, rows, cols)
    elif q.scale_layout == "linear":
        scale = q.scale.reshape(rows, cols)
    else:
        raise ValueError(f"q.scale_layout must be 'linear' or 'swizzled', got {q.scale_layout!r}")
    return scale.contiguous()


def _check_qtensor(q: QTensor) -> tuple[int, int]:
    if not isinstance(q, QTensor):
        raise TypeError(f"q must be a QTensor, got {type(q).__name__}")
    ct_compression_format(q.fmt)
    if len(q.shape) != 2:
        raise ValueError(
            f"q must be a 2-D weight [out, in] (CT stores per-module matrices), got shape {tuple(q.shape)}"
        )
    out_features, in_features = q.shape
    block = _BLOCK[q.fmt]
    if in_features % block:
        raise ValueError(f"q.shape[1]={in_features} must be a multiple of the {q.fmt} block {block}")
    want = (out_features, _packed_cols(q.fmt, in_features))
    data_dtype = torch.float8_e4m3fn if q.fmt == "mxfp8_e4m3" else torch.uint8
    if q.data.dtype != data_dtype or tuple(q.data.shape) != want:
        raise ValueError(
            f"q.data must be {data_dtype} {want} for {q.fmt} of shape {tuple(q.shape)}, "
            f"got {q.data.dtype} {tuple(q.data.shape)}"
        )
    if q.scale.element_size() != 1:
        raise TypeError(f"q.scale must have a 1-byte dtype, got {q.scale.dtype}")
    return out_features, in_features


def to_compressed_tensors(
    q: QTensor, input_global_scale: torch.Tensor | None = None
) -> dict[str, torch.Tensor]:
    """The compressed-tensors checkpoint tensors of one quantized weight.

    Args:
        q: a 2-D weight ``[out, in]`` QTensor of format nvfp4, mxfp4, mxfp6_e2m3, mxfp8_e4m3 or int4_awq
            (int4_awq goes to ``lowbit.io._ct_int4.to_ct_pack_quantized``). Swizzled scales are
            unswizzled. A single-level nvfp4 tensor (no global scale) is written with global scale 1.0,
            which decodes identically.
        input_global_scale: nvfp4 only: the activation multiplier, fp32 with one value; written as
            ``input_global_scale`` fp32 ``[1]``.

    Returns:
        Module-local name -> tensor, contiguous (ready for safetensors; may share storage with ``q``):
        nvfp4 ``weight_packed`` uint8 ``[out, in/2]``, ``weight_scale`` float8_e4m3fn ``[out, in/16]``,
        ``weight_global_scale`` fp32 ``[1]`` (+ ``input_global_scale``); mxfp4 / mxfp6_e2m3
        ``weight_packed`` uint8 ``[out, in/2]`` / ``[out, 3*in/4]`` and ``weight_scale`` uint8
        ``[out, in/32]``; mxfp8_e4m3 ``weight`` float8_e4m3fn ``[out, in]`` and ``weight_scale`` uint8.

    A torchao-convention nvfp4 tensor is written with ``g = 1/p``; compressed-tensors then decodes
    ``sf / g``, which can differ in the last bit from torchao's ``p * sf``.
    """
    if isinstance(q, QTensor) and q.fmt == "int4_awq":
        if input_global_scale is not None:
            raise ValueError("input_global_scale is only stored for nvfp4 (int4 pack-quantized has none)")
        from ._ct_int4 import to_ct_pack_quantized

        return to_ct_pack_quantized(q)
    _check_qtensor(q)
    if input_global_scale is not None and q.fmt != "nvfp4":
        raise ValueError(
            f"input_global_scale is only stored for nvfp4, not {q.fmt} (MX activations are dynamic)"
        )
    scale = _linear_scale_bytes(q, _BLOCK[q.fmt])
    if q.fmt == "nvfp4":
        if q.scale.dtype != torch.float8_e4m3fn:
            raise TypeError(f"nvfp4 q.scale must be float8_e4m3fn, got {q.scale.dtype}")
        if q.global_scale is None:
            g = torch.ones(1, dtype=torch.float32, device=q.data.device)
        else:
            g = positive_fp32_scalar(q.global_scale, "q.global_scale").reshape(1)
        out = {"weight_packed": q.data.contiguous(), "weight_scale": scale, "weight_global_scale": g}
        if input_global_scale is not None:
            out["input_global_scale"] = positive_fp32_scalar(input_global_scale, "input_global_scale").reshape(1)
        return out
    scale = scale.view(torch.uint8)
    if q.fmt == "mxfp8_e4m3":
        return {"weight": q.data.contiguous(), "weight_scale": scale}
    return {"weight_packed": q.data.contiguous(), "weight_scale": scale}


def _local_names(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    if not isinstance(tensors, Mapping):
        raise TypeError(f"tensors must be a mapping of name -> tensor, got {type(tensors).__name__}")
    if any(k in _KNOWN_NAMES for k in tensors):
        return dict(tensors)
    prefixes = {str(k).rpartition(".")[0] for k in tensors}
    if len(prefixes) != 1:
        raise ValueError(
            f"tensors must hold one module's tensors; found module prefixes {sorted(prefixes)[:4]}"
        )
    return {str(k).rpartition(".")[2]: v for k, v in tensors.items()}


def _get(tensors: Mapping[str, torch.Tensor], key: str, fmt: str) -> torch.Tensor:
    if key not in tensors:
        raise ValueError(
            f"tensors is missing {key!r}, which {_CT_FORMAT[fmt]} needs (keys: {sorted(tensors)})"
        )
    t = tensors[key]
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"tensors[{key!r}] must be a torch.Tensor, got {type(t).__name__}")
    return t


def _detect(t: Mapping[str, torch.Tensor]) -> str:
    packed = t.get("weight_packed")
    scale = t.get("weight_scale")
    if isinstance(packed, torch.Tensor):
        if packed.dtype == torch.int32:
            return "int4_awq"
        e4m3_scale = isinstance(scale, torch.Tensor) and scale.dtype == torch.float8_e4m3fn
        if "weight_global_scale" in t or e4m3_scale:
            return "nvfp4"
        if isinstance(scale, torch.Tensor) and scale.dim() == 2 and packed.dim() == 2:
            in_features = scale.shape[1] * 32
            if packed.shape[1] == in_features // 2:
                return "mxfp4"
            if packed.shape[1] == in_features * 3 // 4:
                return "mxfp6_e2m3"
        raise ValueError(
            "cannot tell the format of weight_packed "
            f"{packed.dtype} {tuple(packed.shape)} with weight_scale "
            f"{getattr(scale, 'dtype', None)} {tuple(getattr(scale, 'shape', ()))}; pass fmt="
        )
    weight = t.get("weight")
    if isinstance(weight, torch.Tensor) and weight.dtype == torch.float8_e4m3fn:
        return "mxfp8_e4m3"
    raise ValueError(
        "tensors hold no compressed weight: expected 'weight_packed' (nvfp4, mxfp4, mxfp6, int4) or a "
        f"float8_e4m3fn 'weight' with a uint8 'weight_scale' (mxfp8); got keys {sorted(t)}"
    )


def from_compressed_tensors(
    tensors: Mapping[str, torch.Tensor],
    fmt: str | None = None,
    *,
    dtype: torch.dtype = torch.bfloat16,
) -> QTensor:
    """A QTensor from one module's compressed-tensors checkpoint tensors.

    Args:
        tensors: the module's tensors, with module-local names (``weight_packed``, ``weight_scale``, ...)
            or all under one module prefix (``"model.layers.0.mlp.down_proj.weight_packed"``, ...).
            Extra entries (``input_global_scale``) are ignored.
        fmt: ``"nvfp4"``, ``"mxfp4"``, ``"mxfp6_e2m3"``, ``"mxfp8_e4m3"`` or ``"int4_awq"``; None infers
            it from the names, dtypes and shapes.
        dtype: the dtype recorded as the tensor's original dtype (a CT checkpoint does not store it; CT
            decompresses these formats to bfloat16). int4 keeps the dtype of ``weight_scale``.

    Returns:
        QTensor of shape ``[out, in]`` with linear scales: nvfp4 ``data`` uint8 ``[out, in/2]``,
        ``scale`` float8_e4m3fn ``[out, in/16]``, ``global_scale`` fp32 ``[1]`` (= ``weight_global_scale``);
        MX ``scale`` float8_e8m0fnu ``[out, in/32]``. The tensors are shared, not copied.
    """
    t = _local_names(tensors)
    if fmt is None:
        fmt = _detect(t)
    else:
        ct_compression_format(fmt)
    if fmt == "int4_awq":
        from ._ct_int4 import from_ct_pack_quantized

        return from_ct_pack_quantized(t)
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise TypeError(f"dtype must be float32, bfloat16 or float16, got {dtype}")

    data = _get(t, "weight" if fmt == "mxfp8_e4m3" else "weight_packed", fmt)
    scale = _get(t, "weight_scale", fmt)
    data_name = "weight" if fmt == "mxfp8_e4m3" else "weight_packed"
    data_dtype = torch.float8_e4m3fn if fmt == "mxfp8_e4m3" else torch.uint8
    if data.dtype != data_dtype or data.dim() != 2:
        raise TypeError(
            f"{data_name} must be a 2-D {data_dtype} tensor for {fmt}, got {data.dtype} {tuple(data.shape)}"
        )
    scale_dtypes = (torch.float8_e4m3fn,) if fmt == "nvfp4" else (torch.uint8, torch.float8_e8m0fnu)
    if scale.dtype not in scale_dtypes or scale.dim() != 2:
        raise TypeError(
            f"weight_scale must be a 2-D {' or '.join(map(str, scale_dtypes))} tensor for {fmt}, "
            f"got {scale.dtype} {tuple(scale.shape)}"
        )
    block = _BLOCK[fmt]
    out_features, in_features = scale.shape[0], scale.shape[1] * block
    want = (out_features, _packed_cols(fmt, in_features))
    if tuple(data.shape) != want:
        raise ValueError(
            f"{data_name} must be {want} for weight_scale {tuple(scale.shape)} ({fmt}: one scale per {block} "
            f"elements), got {tuple(data.shape)}"
        )
    if fmt == "nvfp4":
        g = positive_fp32_scalar(_get(t, "weight_global_scale", fmt), "weight_global_scale").reshape(1)
        return QTensor(
            data=data,
            scale=scale,
            fmt=fmt,
            shape=torch.Size((out_features, in_features)),
            dtype=dtype,
            global_scale=g,
        )
    return QTensor(
        data=data,
        scale=scale.view(torch.float8_e8m0fnu),
        fmt=fmt,
        shape=torch.Size((out_features, in_features)),
        dtype=dtype,
    )
