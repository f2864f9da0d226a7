"""What the W4A16 kernels (the GEMV behind ``gemv_w4``, the GEMM behind ``gemm_w4``) require of nf4 and int4_awq
weights besides what their launchers' tiles need: a well-formed QTensor of the format and, for int4_awq, scales
whose ``(q - z) * s`` decodes in float16, the arithmetic both kernels use. Each returns ``(value, None)`` or
``(None, why not)`` for the launchers' ``supports``.
"""

from __future__ import annotations

from ..formats import int4_awq as ref_awq
from ..formats import nf4 as ref_nf4
from ..formats.qtensor import QTensor


def nf4_blocksize(w: QTensor) -> tuple[int | None, str | None]:
    """(absmax blocksize, None) for a well-formed nf4 QTensor, else (None, why not)."""
    try:
        _, blocksize, _ = ref_nf4.check_nf4_qtensor(w)
    except (TypeError, ValueError) as e:
        return None, str(e)
    return blocksize, None


def int4_awq_group(w: QTensor) -> tuple[int | None, str | None]:
    """(group size, None) for a well-formed int4_awq QTensor that decodes in float16, else (None, why not)."""
    try:
        _, _, group = ref_awq.check_int4_awq(w)
    except (TypeError, ValueError) as e:
        return None, str(e)
    if not ref_awq.decodes_in_fp16(w):
        return None, (f"int4_awq: the kernel decodes (q - z) * s in float16; these {w.scale.dtype} scales "
                      f"(convention {ref_awq.int4_awq_convention(w)!r}) decode in {w.scale.dtype}")
    return group, None
