"""GPTQ "v1" checkpoints (AutoGPTQ ``qlinear_cuda_old`` / exllama layout) <-> int4_awq QTensors.

Layout (AutoGPTQ ``QuantLinear.pack``, formats.md section 5), for a weight ``[out, in]`` with group size g:

- ``qweight`` int32 ``[in/8, out]``: nibble ``k`` (bits ``4k..4k+3``) of ``qweight[r, j]`` is
  ``W[j, 8r + k]``.
- ``qzeros`` int32 ``[in/g, out/8]``: zero points packed LSB-first along ``out``, stored minus one ("v1";
  a symmetric 4-bit checkpoint has ``z = 8`` -> ``0x77777777``).
- ``scales`` float16 ``[in/g, out]``; ``g_idx`` int32 ``[in]``, ``g_idx[i] = i // g`` unless act-order.

Dequantization is ``(q - (z_stored + 1)) * s``: the same integers and scales as AWQ, so conversion is
lossless for every zero point from 1 to 15.

The zero-minus-one overflow. A raw zero point of 0 (a group with no negative weight) has no v1 encoding.
We store ``qzeros`` as the word ``packed(z) - 0x11111111 (mod 2^32)``, the arithmetic of AutoAWQ's own
AWQ->GPTQ converter (``packing_utils.unpack_reorder_pack``) and GPTQModel's ``convert_gptq_v2_to_v1_format``.
Without a zero of 0 this is exactly ``z - 1`` in every nibble. A zero of 0 stores nibble 0xF and borrows 1
from the next nibble up (that neighbour stores ``z - 2``). Readers then differ:

- GPTQModel (what transformers/optimum use) converts v1 to v2 with ``qzeros += 0x11111111`` (word
  arithmetic, carries included): it recovers every zero exactly. :func:`from_gptq` does the same.
- AutoGPTQ (torch path, CUDA kernels), exllama and vLLM's ``gptq_gemm`` (``zero_offset = 1``) read each
  nibble and add 1 without wrapping: the 0 zero becomes 16 and the neighbour below its true value by 1, so
  those groups dequantize wrongly. Pass ``strict=True`` to refuse such tensors instead.
- AutoGPTQ's own ``pack`` ORs the unmasked ``uint32(-1) << 4k`` into the word, so nibbles ``k..7`` all
  become 0xF; its checkpoints cannot represent a zero of 0 either.
"""

from __future__ import annotations

import torch

from ..formats.int4_awq import (
    FMT,
    check_int4_awq,
    int4_awq_codes,
    require_fp16_decode,
    pack_awq,
    pack_int4_sequential,
    unpack_int4_sequential,
)
from ..formats.checks import check_2d
from ..formats.qtensor import QTensor
from .awq import infer_group_size

V1_OFFSET = 0x11111111
_WORD = 1 << 32


def word_add(words: torch.Tensor, delta: int) -> torch.Tensor:
    """``words + delta (mod 2^32)`` on int32 words, in int64 so nothing relies on signed overflow."""
    u = (words.to(torch.int64) + delta) % _WORD
    return torch.where(u >= 1 << 31, u - _WORD, u).to(torch.int32)


def to_gptq(q: QTensor, *, strict: bool = False) -> dict[str, torch.Tensor]:
    """GPTQ v1 tensors for an int4_awq QTensor.

    Args:
        q: int4_awq QTensor of logical shape ``[out, in]``, group size ``g``; ``in % 8 == 0``.
        strict: raise ValueError when a raw zero point is 0 (see the module docstring: v1 nibble readers
            such as vLLM and AutoGPTQ misread it). False stores it with the word-arithmetic borrow.

    Returns:
        ``{"qweight": int32 [in/8, out], "qzeros": int32 [in/g, out/8] (zero - 1),
        "scales": float16 [in/g, out], "g_idx": int32 [in] (i // g)}``.
    """
    out_features, in_features, group_size = check_int4_awq(q)
    require_fp16_decode(q, "GPTQ")
    if not isinstance(strict, bool):
        raise TypeError(f"strict must be a bool, got {type(strict).__name__}")
    if in_features % 8:
        raise ValueError(
            f"GPTQ packs 8 input channels per int32: in_features={in_features} must be a multiple of 8"
        )
    intweight, zeros = int4_awq_codes(q)
    if strict and bool((zeros == 0).any()):
        raise ValueError(
            "a raw zero point is 0, which GPTQ v1 cannot store (it stores zero - 1); v1 readers such as "
            "vLLM and AutoGPTQ would decode it as 16. Use strict=False to store it with a borrow"
        )
    qzeros = word_add(pack_int4_sequential(zeros, dim=1), -V1_OFFSET)
    g_idx = torch.arange(in_features, dtype=torch.int32, device=q.data.device) // group_size
    return {
        "qweight": pack_int4_sequential(intweight, dim=0),
        "qzeros": qzeros,
        "scales": q.scale.contiguous().clone(),
        "g_idx": g_idx,
    }


def _group_size_from_g_idx(g_idx: torch.Tensor, in_features: int, n_groups: int) -> int | None:
    if not isinstance(g_idx, torch.Tensor):
        raise TypeError(f"g_idx must be a torch.Tensor or None, got {type(g_idx).__name__}")
    if g_idx.dtype.is_floating_point or g_idx.dtype.is_complex or g_idx.dtype == torch.bool:
        raise TypeError(f"g_idx must be an integer tensor, got {g_idx.dtype}")
    if tuple(g_idx.shape) != (in_features,):
        raise ValueError(f"g_idx must have shape [in] = ({in_features},), got {tuple(g_idx.shape)}")
    if in_features == 0:
        return None
    group_size = int((g_idx == 0).sum())
    trivial = torch.arange(in_features, device=g_idx.device) // max(group_size, 1)
    if group_size == 0 or not torch.equal(g_idx.to(torch.int64), trivial):
        raise ValueError(
            "g_idx is not the trivial i // group_size (act-order / desc_act checkpoint): its input "
            "channels are permuted across groups, which the AWQ layout cannot express"
        )
    if in_features % group_size or in_features // group_size != n_groups:
        raise ValueError(
            f"g_idx implies group_size={group_size}, which must divide in_features={in_features} into the "
            f"{n_groups} groups of scales (the AWQ layout has no partial last group)"
        )
    return group_size


def from_gptq(
    qweight: torch.Tensor,
    qzeros: torch.Tensor,
    scales: torch.Tensor,
    g_idx: torch.Tensor | None = None,
) -> QTensor:
    """Convert GPTQ v1 4-bit tensors to an int4_awq QTensor (AutoAWQ GEMM layout).

    Args:
        qweight: int32 ``[in/8, out]``, LSB-first along ``in``.
        qzeros: int32 ``[in/g, out/8]``, zero points minus one (v1); decoded as ``qzeros + 0x11111111
            (mod 2^32)`` per word, so a 0xF nibble written with a borrow decodes to 0 (module docstring).
        scales: float16 ``[in/g, out]``.
        g_idx: int ``[in]``; None or ``i // g`` is accepted. Act-order (any other) g_idx raises ValueError.

    Returns:
        int4_awq QTensor of logical shape ``[out, in]``, ``dtype`` float16, group size ``in / n_groups``.
    """
    check_2d(qweight, "qweight", torch.int32)
    check_2d(qzeros, "qzeros", torch.int32)
    check_2d(scales, "scales", torch.float16)
    in_features, out_features = qweight.shape[0] * 8, qweight.shape[1]
    n_groups = scales.shape[0]
    if scales.shape[1] != out_features:
        raise ValueError(
            f"scales [in/g, out] = {tuple(scales.shape)} does not match qweight [in/8, out] = "
            f"{tuple(qweight.shape)}"
        )
    if out_features % 8:
        raise ValueError(f"out_features={out_features} must be a multiple of 8 (qzeros packs 8 per int32)")
    if tuple(qzeros.shape) != (n_groups, out_features // 8):
        raise ValueError(
            f"qzeros must be [in/g, out/8] = {(n_groups, out_features // 8)}, got {tuple(qzeros.shape)}"
        )
    group_size = None if g_idx is None else _group_size_from_g_idx(g_idx, in_features, n_groups)
    group_size = infer_group_size(in_features, n_groups, group_size, "scales")

    intweight = unpack_int4_sequential(qweight, in_features, dim=0)
    zeros = unpack_int4_sequential(word_add(qzeros, V1_OFFSET), out_features, dim=1)
    return QTensor(
        data=pack_awq(intweight),
        scale=scales.contiguous().clone(),
        fmt=FMT,
        shape=torch.Size((out_features, in_features)),
        dtype=torch.float16,
        zeros=pack_awq(zeros),
        params={"group_size": group_size},
    )
