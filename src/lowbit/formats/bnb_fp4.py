"""bitsandbytes' ``fp4`` 4-bit type (``quantize_4bit(..., quant_type="fp4")``) as the lowbit format ``bnb_fp4``.

Not E2M1 (that is ``fp4_b32`` / NVFP4 / MXFP4): a 16-entry table, code = sign bit (8) | 3 bits indexing
``[0, 0.0625, 8, 12, 4, 6, 2, 3] / 12`` (``BNB_FP4`` in ``spec``; code 8 is +0.0, as in bitsandbytes' own
table). Everything but the table and the encode rule is nf4's layout (``formats.nf4``): blocks of
``blocksize`` over the flattened tensor, fp32 absmax (tail block true division, 1e-38 floor), element ``2i``
in the high nibble, optional double quantization of the absmax.

Encode, as bitsandbytes 0.50.2 on CPU (``backends/default/ops.py``, pure torch): the table is sorted with a
stable argsort (the two zeros keep code order: 0, then 8), the value goes to ``bucketize(scaled, midpoints)``
of consecutive sorted levels (ties to the lower level) and the bucket maps back through the sort order. So:

- ``-0.0026 < v <= 0`` (midpoint of -0.0625/12 and 0, fp32) gives code 0 and ``0 < v <= 0.0026`` gives
  code 8: a tiny *positive* value gets the sign-bit code (both decode to +0.0);
- ties go to the lower level: ``v = 0.0859375`` (midpoint of 0.0625/12 and 2/12) gives code 1, one ulp above
  gives code 6;
- NaN (any NaN in a block makes its absmax NaN and the whole block NaN) gives code 3 (+1.0), the last bucket;
- an all-zero block gives absmax 0 and code 0 (bytes 0x00); the odd pad nibble is code 0.

bitsandbytes' CUDA kernel (``dQuantizeFP4``) encodes differently: sign first (``x < 0`` sets bit 3), then a
threshold tree on ``|x|``, so tiny negative values get code 8 and tiny positive ones code 0, NaN and a zero
block (``0 * (1/0)``) code 0; its decode multiplies by a sign, so code 8 decodes to -0.0. lowbit follows the
CPU encode and bitsandbytes' table (code 8 -> +0.0), as it does for nf4.
"""

from __future__ import annotations

import functools

import torch

from .codecs import codebook_table
from .nf4 import check_bnb4_qtensor, dequantize_bnb_4bit, quantize_bnb_4bit
from .qtensor import QTensor
from .spec import BNB_FP4

_NAN_BUCKET = 15  # torch.bucketize puts NaN after every boundary


@functools.lru_cache(maxsize=8)
def _bounds(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp32 midpoints [15] of the sorted levels, codes in level order [16]) on ``device``, computed as
    bitsandbytes' ``_get_4bit_quantize_bounds`` does."""
    code = codebook_table(BNB_FP4)
    # stable: +0.0 (code 0) and +0.0 (code 8) are equal, and bitsandbytes' CPU argsort keeps them in code order
    order = torch.argsort(code, stable=True)
    mids = (code[order[:-1]] + code[order[1:]]) / 2
    return mids.to(device), order.to(device)


def encode_bnb_fp4(scaled: torch.Tensor) -> torch.Tensor:
    """uint8 bnb_fp4 codes of fp32 values already scaled into [-1, 1] (NaN allowed), by bitsandbytes' CPU rule
    (see the module docstring)."""
    if not isinstance(scaled, torch.Tensor) or scaled.dtype != torch.float32:
        raise TypeError(
            f"scaled must be a float32 tensor, got {getattr(scaled, 'dtype', type(scaled).__name__)}"
        )
    mids, order = _bounds(scaled.device)
    pos = torch.bucketize(scaled, mids, right=False)
    return order[pos].to(torch.uint8)


def quantize_bnb_fp4(x: torch.Tensor, blocksize: int = 64, double_quant: bool = False) -> QTensor:
    """Quantize ``x`` exactly as bitsandbytes ``quantize_4bit(x, blocksize, compress_statistics=double_quant,
    quant_type="fp4")`` does on CPU (the codes and absmax bytes, and with ``double_quant`` the nested codes,
    absmax and offset).

    Args:
        x: float32/bfloat16/float16 tensor of any shape, ``n = x.numel()`` elements (not modified).
        blocksize: one of 32, 64, ..., 4096.
        double_quant: quantize the absmax to 8 bits (bitsandbytes ``compress_statistics``; what
            ``Linear4bit`` does by default).

    Returns:
        QTensor ``fmt="bnb_fp4"``, laid out as nf4's (see ``formats.nf4.quantize_nf4``).
    """
    return quantize_bnb_4bit(x, blocksize, double_quant, "bnb_fp4", encode_bnb_fp4)


def check_bnb_fp4_qtensor(q: QTensor) -> tuple[int, int, bool]:
    """Validate a bnb_fp4 QTensor's layout; returns ``(numel, blocksize, double_quant)``."""
    if not isinstance(q, QTensor):
        raise TypeError(f"q must be a QTensor, got {type(q).__name__}")
    if q.fmt != "bnb_fp4":
        raise ValueError(f"q must be a bnb_fp4 QTensor, got fmt={q.fmt!r}")
    return check_bnb4_qtensor(q)


def dequantize_bnb_fp4(q: QTensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Decode a bnb_fp4 QTensor (from :func:`quantize_bnb_fp4`) into a ``dtype`` (float32, bfloat16 or float16)
    tensor of shape ``q.shape``: ``BNB_FP4[code] * absmax[block]`` in fp32, then cast; bitsandbytes
    ``dequantize_4bit(..., quant_type="fp4")`` on CPU bit for bit (the conversions and the logical shape as
    ``formats.nf4.dequantize_nf4`` describes)."""
    check_bnb_fp4_qtensor(q)
    return dequantize_bnb_4bit(q, dtype)


__all__ = ["check_bnb_fp4_qtensor", "dequantize_bnb_fp4", "encode_bnb_fp4", "quantize_bnb_fp4"]
