"""AutoAWQ GEMM checkpoints (``WQLinear_GEMM``: ``qweight``, ``qzeros``, ``scales``) <-> int4_awq QTensors.

The int4_awq QTensor already stores AutoAWQ's GEMM layout, so both directions copy tensors and check
them; nothing is repacked. The layout is described in :mod:`lowbit.formats.int4_awq`.
"""

from __future__ import annotations

import torch

from ..formats.int4_awq import FMT, check_int4_awq, require_fp16_decode
from ..formats.checks import check_2d
from ..formats.qtensor import QTensor


def to_autoawq(q: QTensor) -> dict[str, torch.Tensor]:
    """The tensors AutoAWQ's ``WQLinear_GEMM`` holds for ``q`` (what a ``quant_method: awq``,
    ``version: gemm`` checkpoint stores under ``<module>.qweight`` etc.).

    Args:
        q: int4_awq QTensor of logical shape ``[out, in]`` and group size ``g``.

    Returns:
        ``{"qweight": int32 [in, out/8], "qzeros": int32 [in/g, out/8] (raw zero points),
        "scales": float16 [in/g, out]}``, fresh contiguous copies.
    """
    check_int4_awq(q)
    require_fp16_decode(q, "AutoAWQ")
    return {
        "qweight": q.data.contiguous().clone(),
        "qzeros": q.zeros.contiguous().clone(),
        "scales": q.scale.contiguous().clone(),
    }


def infer_group_size(in_features: int, n_groups: int, group_size: int | None, what: str) -> int:
    """The group size implied by ``n_groups`` groups over ``in_features`` channels (checked against
    ``group_size`` when that is given; ``-1`` means one group).

    Args:
        in_features: number of input channels.
        n_groups: number of scale rows (or columns) the checkpoint has.
        group_size: the size the caller expects, or None to infer it.
        what: name of the tensor that carries the group count, for error messages.

    Returns:
        The group size ``g`` with ``in_features == g * n_groups``.
    """
    if group_size is not None:
        if isinstance(group_size, bool) or not isinstance(group_size, int):
            raise TypeError(f"group_size must be an int or None, got {type(group_size).__name__}")
        if group_size == -1:
            group_size = in_features
        if group_size <= 0:
            raise ValueError(f"group_size must be positive or -1, got {group_size}")
        if in_features % group_size or in_features // group_size != n_groups:
            raise ValueError(
                f"group_size={group_size} does not match {what}: in_features={in_features} needs "
                f"in_features/group_size groups, {what} has {n_groups}"
            )
        return group_size
    if n_groups == 0:
        if in_features == 0:
            raise ValueError("group_size cannot be inferred from empty tensors; pass group_size")
        raise ValueError(f"{what} has 0 groups but in_features={in_features}")
    if in_features % n_groups:
        raise ValueError(
            f"in_features={in_features} is not a multiple of the {n_groups} groups in {what}; "
            "the AWQ layout needs equal groups"
        )
    return in_features // n_groups


def from_autoawq(
    qweight: torch.Tensor,
    qzeros: torch.Tensor,
    scales: torch.Tensor,
    group_size: int | None = None,
) -> QTensor:
    """Wrap AutoAWQ GEMM tensors as an int4_awq QTensor.

    Args:
        qweight: int32 ``[in, out/8]``, AutoAWQ nibble order ``[0, 2, 4, 6, 1, 3, 5, 7]``.
        qzeros: int32 ``[in/g, out/8]``, raw zero points, same order.
        scales: float16 ``[in/g, out]``.
        group_size: the checkpoint's ``q_group_size`` (``-1`` = ``in``); None infers ``in / scales.shape[0]``.

    Returns:
        int4_awq QTensor, logical shape ``[out, in]``, ``dtype`` float16 (AutoAWQ quantizes fp16 weights);
        the tensors are copied.
    """
    check_2d(qweight, "qweight", torch.int32)
    check_2d(qzeros, "qzeros", torch.int32)
    check_2d(scales, "scales", torch.float16)
    in_features, out_features = qweight.shape[0], scales.shape[1]
    if qweight.shape[1] * 8 != out_features:
        raise ValueError(
            f"qweight [in, out/8] = {tuple(qweight.shape)} does not match scales [in/g, out] = "
            f"{tuple(scales.shape)}"
        )
    if tuple(qzeros.shape) != (scales.shape[0], out_features // 8):
        raise ValueError(
            f"qzeros must be [in/g, out/8] = {(scales.shape[0], out_features // 8)} to match scales "
            f"{tuple(scales.shape)}, got {tuple(qzeros.shape)}"
        )
    g = infer_group_size(in_features, scales.shape[0], group_size, "scales")
    return QTensor(
        data=qweight.contiguous().clone(),
        scale=scales.contiguous().clone(),
        fmt=FMT,
        shape=torch.Size((out_features, in_features)),
        dtype=torch.float16,
        zeros=qzeros.contiguous().clone(),
        params={"group_size": g},
    )
