"""fp4_b32 (pure PyTorch reference): the ``nvfp4_packed`` GEMV plugin's format, E2M1 values in 32-element
blocks with an fp32 scale ``amax/6`` per block."""

from __future__ import annotations

import torch

from .blockscaled_generic import check_input, quantize_blockscaled
from .codecs import canonical_nan, decode_minifloat
from .packing import pack_fp4, unpack_fp4
from .qtensor import QTensor
from .spec import E2M1


def quantize_fp4_b32(x: torch.Tensor) -> QTensor:
    """fp4_b32 (the ``nvfp4_packed`` GEMV plugin's format): E2M1, 32-element blocks, fp32 scale ``amax/6``.

    Codes are ``e2m1(x / s)`` with IEEE fp32 division; a zero block has ``s = 0`` and codes 0.

    Args:
        x: ``[..., K]`` float32/bfloat16/float16, ``K % 32 == 0``.

    Returns:
        QTensor: ``data`` uint8 ``[..., K/2]``, ``scale`` fp32 ``[..., K/32]``.
    """
    check_input(x, 32, "fp4_b32")
    codes, scale = quantize_blockscaled(x, E2M1, 32, "fp32")
    return QTensor(
        data=pack_fp4(codes),
        scale=scale.reshape(*x.shape[:-1], x.shape[-1] // 32),
        fmt="fp4_b32",
        shape=x.shape,
        dtype=x.dtype,
    )


def dequantize_fp4_b32(q: QTensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Decode an fp4_b32 QTensor: ``e2m1 * s`` in fp32, cast to ``dtype``.

    Args:
        q: fp4_b32 QTensor.
        dtype: output dtype.

    Returns:
        Tensor of shape ``q.shape``.
    """
    values = decode_minifloat(unpack_fp4(q.data), E2M1).reshape(q.shape[:-1].numel(), q.shape[-1] // 32, 32)
    scale = q.scale.reshape(q.shape[:-1].numel(), q.shape[-1] // 32, 1).float()
    return canonical_nan((values * scale).reshape(q.shape), dtype)


__all__ = ["dequantize_fp4_b32", "quantize_fp4_b32"]
