"""NVIDIA ModelOpt NVFP4 checkpoint tensors <-> nvfp4 QTensor, one module at a time.

A ModelOpt (TensorRT Model Optimizer) unified HF checkpoint stores per linear module (formats.md 1.5,
ModelOpt ``NVFP4QTensor``):

- ``weight`` uint8 ``[out, in/2]``: E2M1 codes, element 2i in the low nibble (as every NVFP4 producer);
- ``weight_scale`` float8_e4m3fn ``[out, in/16]``: linear block scales;
- ``weight_scale_2`` fp32 scalar: the per-tensor **divisor** ``amax / (448*6)``;
  ModelOpt decodes ``W = e2m1 * (fp32(weight_scale) * weight_scale_2)``;
- ``input_scale`` fp32 scalar: the activation divisor ``act_amax / (448*6)``.

lowbit's ``global_scale`` is the multiplier, so ``global_scale = 1 / weight_scale_2`` in fp32, exactly as
compressed-tensors' ``ModelOptNvfp4Converter`` converts (``weight -> weight_packed``,
``1/weight_scale_2 -> weight_global_scale``, ``1/input_scale -> input_global_scale``). The divisor read
from the checkpoint is also kept in ``params["per_tensor_scale"]`` so that lowbit decodes ModelOpt's own
product ``sf * weight_scale_2`` and writing the tensor back returns the same bits.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from ..formats.packing import unswizzle_scales
from ..formats.checks import positive_fp32_scalar
from ..formats.qtensor import QTensor

_NAMES = ("weight", "weight_scale", "weight_scale_2", "input_scale")


def _check_qtensor(q: QTensor) -> tuple[int, int]:
    if not isinstance(q, QTensor):
        raise TypeError(f"q must be a QTensor, got {type(q).__name__}")
    if q.fmt != "nvfp4":
        raise ValueError(f"q must be an nvfp4 QTensor (ModelOpt NVFP4), got {q.fmt!r}")
    if len(q.shape) != 2 or q.shape[1] % 16:
        raise ValueError(f"q must be a 2-D weight [out, in] with in % 16 == 0, got shape {tuple(q.shape)}")
    out_features, in_features = q.shape
    if q.data.dtype != torch.uint8 or tuple(q.data.shape) != (out_features, in_features // 2):
        raise ValueError(
            f"q.data must be uint8 {(out_features, in_features // 2)}, "
            f"got {q.data.dtype} {tuple(q.data.shape)}"
        )
    if q.scale.dtype != torch.float8_e4m3fn:
        raise TypeError(f"q.scale must be float8_e4m3fn, got {q.scale.dtype}")
    return out_features, in_features


def to_modelopt_nvfp4(q: QTensor, input_global_scale: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """The ModelOpt NVFP4 checkpoint tensors of one quantized weight.

    Args:
        q: nvfp4 QTensor of shape ``[out, in]``; swizzled scales are unswizzled.
        input_global_scale: the activation multiplier (fp32, one value), written as its reciprocal
            ``input_scale``; None writes no ``input_scale``.

    Returns:
        ``{"weight": uint8 [out, in/2], "weight_scale": float8_e4m3fn [out, in/16],
        "weight_scale_2": fp32 scalar, "input_scale": fp32 scalar}`` (contiguous; may share storage with
        ``q``). ``weight_scale_2`` is ``params["per_tensor_scale"]`` when ``q`` carries an exact divisor
        (torchao convention, or read from ModelOpt), else ``1 / global_scale`` in fp32, and 1.0 for a
        single-level tensor.
    """
    out_features, in_features = _check_qtensor(q)
    cols = in_features // 16
    if q.scale_layout == "swizzled":
        scale = unswizzle_scales(q.scale, out_features, cols)
    else:
        scale = q.scale.reshape(out_features, cols)
    pts = q.params.get("per_tensor_scale")
    if pts is not None:
        ws2 = positive_fp32_scalar(torch.as_tensor(pts), "q.params['per_tensor_scale']")
    elif q.global_scale is not None:
        ws2 = 1.0 / positive_fp32_scalar(q.global_scale, "q.global_scale")
    else:
        ws2 = torch.ones((), dtype=torch.float32, device=q.data.device)
    out = {"weight": q.data.contiguous(), "weight_scale": scale.contiguous(), "weight_scale_2": ws2}
    if input_global_scale is not None:
        out["input_scale"] = 1.0 / positive_fp32_scalar(input_global_scale, "input_global_scale")
    return out


def from_modelopt_nvfp4(
    tensors: Mapping[str, torch.Tensor], *, dtype: torch.dtype = torch.bfloat16
) -> QTensor:
    """An nvfp4 QTensor from one module's ModelOpt NVFP4 tensors.

    Args:
        tensors: ``weight`` uint8 ``[out, in/2]``, ``weight_scale`` float8_e4m3fn ``[out, in/16]`` and
            ``weight_scale_2`` fp32 (one value), with module-local names or all under one module prefix;
            ``input_scale`` (activations) is ignored.
        dtype: the original dtype to record (the checkpoint does not store it).

    Returns:
        QTensor ``[out, in]`` with ``global_scale = 1 / weight_scale_2`` (fp32 ``[1]``) and
        ``params["per_tensor_scale"] = weight_scale_2``; ``data`` and ``scale`` share storage with the input.
    """
    if not isinstance(tensors, Mapping):
        raise TypeError(f"tensors must be a mapping of name -> tensor, got {type(tensors).__name__}")
    if not any(k in _NAMES for k in tensors):
        prefixes = {str(k).rpartition(".")[0] for k in tensors}
        if len(prefixes) != 1:
            raise ValueError(
                f"tensors must hold one module's tensors; found module prefixes {sorted(prefixes)[:4]}"
            )
        tensors = {str(k).rpartition(".")[2]: v for k, v in tensors.items()}
    for key in _NAMES[:3]:
        if key not in tensors:
            raise ValueError(
                f"tensors is missing {key!r} (ModelOpt NVFP4 needs weight, weight_scale, weight_scale_2)"
            )
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise TypeError(f"dtype must be float32, bfloat16 or float16, got {dtype}")
    weight, scale = tensors["weight"], tensors["weight_scale"]
    if not isinstance(weight, torch.Tensor) or weight.dtype != torch.uint8 or weight.dim() != 2:
        raise TypeError(
            "weight must be a 2-D uint8 tensor of packed E2M1 codes, got "
            f"{getattr(weight, 'dtype', type(weight).__name__)} {tuple(getattr(weight, 'shape', ()))}"
        )
    if not isinstance(scale, torch.Tensor) or scale.dtype != torch.float8_e4m3fn or scale.dim() != 2:
        raise TypeError(
            "weight_scale must be a 2-D float8_e4m3fn tensor [out, in/16], got "
            f"{getattr(scale, 'dtype', type(scale).__name__)} {tuple(getattr(scale, 'shape', ()))}"
        )
    out_features, in_features = scale.shape[0], scale.shape[1] * 16
    if tuple(weight.shape) != (out_features, in_features // 2):
        raise ValueError(
            f"weight must be [out, in/2] = {(out_features, in_features // 2)} for weight_scale "
            f"{tuple(scale.shape)}, got {tuple(weight.shape)}"
        )
    ws2 = positive_fp32_scalar(tensors["weight_scale_2"], "weight_scale_2")
    return QTensor(
        data=weight,
        scale=scale,
        fmt="nvfp4",
        shape=torch.Size((out_features, in_features)),
        dtype=dtype,
        global_scale=(1.0 / ws2).reshape(1),
        params={"per_tensor_scale": ws2},
    )
