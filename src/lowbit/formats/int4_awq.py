"""INT4 weight-only asymmetric group quantization, stored in AutoAWQ's GEMM layout (formats.md section 5).

Arithmetic (AutoAWQ 0.2.9, ``awq/quantize/quantizer.py::AwqQuantizer``): ``_apply_quant`` casts the layer to
fp16 (``linear.half()``) before ``pseudo_quantize_tensor`` (zero_point=True, w_bit=4), so every step runs in
float16 whatever the checkpoint dtype was. Per group of ``g`` consecutive input channels of a row::

    s = (max - min).clamp(min=1e-5) / 15
    z = clamp(-round(min / s), 0, 15)
    w_fq = (clamp(round(w / s) + z, 0, 15) - z) * s          # the fake-quantized weight

``WQLinear_GEMM.from_linear`` then derives the stored integers from ``w_fq`` rather than from ``w``:
``q = round((w_fq + z*s) / s)``, with ``z*s`` rounded to fp16 first. ``round`` is ``torch.round`` (ties to
even) throughout. We evaluate the same fp16 expressions in the same order so the integers match AutoAWQ bit
for bit; for every finite input whose fp16 range is representable, ``q`` equals the first-pass code.

Consequences worth knowing: bf16/fp32 weights are quantized through their fp16 image (running
``pseudo_quantize_tensor`` on a bf16 tensor directly changes most scales and ~2% of zero points, so that is
not what AutoAWQ checkpoints hold); values beyond fp16's range, NaN and Inf raise ValueError where
AutoAWQ would assert or emit Inf; a constant group (``max == min``) gets ``s = fp16(1e-5)/15`` and
saturates to code 15 (positive) or 0 (negative), so it decodes to about ``+-1e-5``, not to the constant.

Storage (``awq/modules/linear/gemm.py::WQLinear_GEMM``):

- ``data`` = ``qweight`` int32 ``[in, out/8]``: nibble ``i`` (bits ``4i..4i+3``) of word ``c`` holds output
  column ``8c + AWQ_ORDER[i]`` with ``AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]``.
- ``zeros`` = ``qzeros`` int32 ``[in/g, out/8]``: the raw zero points (no ``-1``), same interleave.
- ``scale`` = ``scales`` float16 ``[in/g, out]``.

Decoding conventions (``params["convention"]``, absent means ``"autoawq"``):

- ``"autoawq"``: float16 scales; ``(q - z) * s`` is one float16 multiply, then cast to the requested dtype
  (AutoAWQ ``dequantize_gemm`` and its Triton kernel).
- ``"compressed-tensors"``: the scales keep the dtype the producer wrote (llm-compressor writes the model's
  dtype: float16, bfloat16 or float32) and ``(q - z) * s`` is one multiply in that dtype, then cast
  (compressed-tensors ``_dequantize``). With float16 scales both conventions give the same bits; with
  bfloat16 scales decoding in fp16 and casting would round twice and differ.
"""

from __future__ import annotations

import torch

from .checks import check_2d
from .codecs import true_div
from .qtensor import QTensor

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
"""Nibble ``i`` of an AutoAWQ word holds column ``8c + AWQ_ORDER[i]``."""
AWQ_REVERSE_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)
"""Inverse of :data:`AWQ_ORDER`: column ``8c + j`` sits in nibble ``AWQ_REVERSE_ORDER[j]``."""

FMT = "int4_awq"
CONVENTIONS = ("autoawq", "compressed-tensors")
"""``params["convention"]`` values: whose decode arithmetic (and scale dtypes) an int4_awq QTensor follows."""
_CT_SCALE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_MAX_INT = 15
_SUPPORTED_INPUT = (torch.float32, torch.bfloat16, torch.float16)
_SHIFTS = tuple(4 * i for i in range(8))


def _to_int32_words(words: torch.Tensor) -> torch.Tensor:
    """Reinterpret unsigned 32-bit words held in int64 as int32 (two's complement), without relying on
    the wrap-around of an out-of-range integer conversion."""
    return torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)


def _check_nibble_values(values: torch.Tensor, name: str) -> None:
    if not isinstance(values, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(values).__name__}")
    if values.dtype.is_floating_point or values.dtype.is_complex or values.dtype == torch.bool:
        raise TypeError(f"{name} must be an integer tensor, got {values.dtype}")
    # a meta tensor (a shape-only quantize) has no values to check
    if values.numel() and not values.is_meta and (values.min() < 0 or values.max() > _MAX_INT):
        raise ValueError(
            f"{name} must hold 4-bit values in [0, 15], "
            f"got range [{values.min().item()}, {values.max().item()}]"
        )


def pack_awq(intweight: torch.Tensor) -> torch.Tensor:
    """Pack 4-bit values along the last dim in AutoAWQ's interleaved order.

    Args:
        intweight: integer tensor ``[rows, cols]`` with values in ``[0, 15]``, ``cols % 8 == 0``. For the
            weight that is ``[in, out]`` (the transpose of the ``[out, in]`` weight); for zero points
            ``[in/g, out]``.

    Returns:
        int32 ``[rows, cols/8]``; nibble ``i`` of word ``c`` holds column ``8c + AWQ_ORDER[i]``, so
        columns ``0..7`` holding ``0..7`` pack to ``0x75316420``.
    """
    _check_nibble_values(intweight, "intweight")
    if intweight.dim() != 2 or intweight.shape[-1] % 8:
        raise ValueError(
            f"intweight must be 2-D [rows, cols] with cols % 8 == 0, got shape {tuple(intweight.shape)}"
        )
    rows, cols = intweight.shape
    groups = intweight.to(torch.int64).reshape(rows, cols // 8, 8)[..., list(AWQ_ORDER)]
    shifts = torch.tensor(_SHIFTS, dtype=torch.int64, device=intweight.device)
    return _to_int32_words((groups << shifts).sum(dim=-1))


def unpack_awq(qweight: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack_awq`.

    Args:
        qweight: int32 ``[rows, cols/8]`` in AutoAWQ's interleaved nibble order (``qweight`` or ``qzeros``).

    Returns:
        int32 ``[rows, cols]`` with values in ``[0, 15]``, in natural column order.
    """
    check_2d(qweight, "qweight", torch.int32)
    rows, words = qweight.shape
    # scalar shifts, no index tensor: nothing is copied from the host (safe inside CUDA graph capture)
    nibbles = torch.stack([(qweight >> (4 * AWQ_REVERSE_ORDER[j])) & 0xF for j in range(8)], dim=-1)
    return nibbles.reshape(rows, words * 8)


def pack_int4_sequential(values: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Pack 4-bit values LSB-first along ``dim``: element ``8w + k`` goes to bits ``4k..4k+3`` of word ``w``.

    This is the GPTQ order (``qweight`` along ``in``, ``qzeros`` along ``out``) and compressed-tensors'
    ``pack_to_int32`` for 4 bits (which stores signed values ``+8`` first). A length that is not a multiple
    of 8 is padded with nibble 0, as ``pack_to_int32`` pads.

    Args:
        values: 2-D integer tensor with values in ``[0, 15]``.
        dim: 0 or 1 (or -1/-2): the dimension to pack along.

    Returns:
        int32 tensor with ``ceil(n/8)`` words along ``dim`` (``n`` = size of ``dim``).
    """
    _check_nibble_values(values, "values")
    if values.dim() != 2:
        raise ValueError(f"values must be 2-D, got shape {tuple(values.shape)}")
    if dim not in (0, 1, -1, -2):
        raise ValueError(f"dim must be 0, 1, -1 or -2, got {dim}")
    v = values.to(torch.int64)
    if dim in (0, -2):
        v = v.t()
    rows, n = v.shape
    n_words = -(-n // 8)
    if n_words * 8 != n:
        v = torch.cat([v, v.new_zeros(rows, n_words * 8 - n)], dim=1)
    shifts = torch.tensor(_SHIFTS, dtype=torch.int64, device=v.device)
    words = _to_int32_words((v.reshape(rows, n_words, 8) << shifts).sum(dim=-1))
    return (words.t() if dim in (0, -2) else words).contiguous()


def unpack_int4_sequential(words: torch.Tensor, n: int, dim: int = -1) -> torch.Tensor:
    """Inverse of :func:`pack_int4_sequential`.

    Args:
        words: 2-D int32 tensor packed LSB-first along ``dim``.
        n: number of 4-bit values along ``dim`` to return (at most 8 per word).
        dim: 0 or 1 (or -1/-2).

    Returns:
        int32 tensor with ``n`` values in ``[0, 15]`` along ``dim``.
    """
    check_2d(words, "words", torch.int32)
    if dim not in (0, 1, -1, -2):
        raise ValueError(f"dim must be 0, 1, -1 or -2, got {dim}")
    w = words.t() if dim in (0, -2) else words
    rows, n_words = w.shape
    if not 0 <= n <= 8 * n_words or n_words != -(-n // 8):
        raise ValueError(f"n = {n} values do not fit {n_words} words along dim {dim} (need ceil(n/8) words)")
    shifts = torch.tensor(_SHIFTS, dtype=torch.int32, device=w.device)
    values = ((w.unsqueeze(-1) >> shifts) & 0xF).reshape(rows, n_words * 8)[:, :n]
    return (values.t() if dim in (0, -2) else values).contiguous()


def _check_group_size(group_size: int) -> None:
    if isinstance(group_size, bool) or not isinstance(group_size, int):
        raise TypeError(f"group_size must be a positive int, got {type(group_size).__name__}")
    if group_size <= 0:
        raise ValueError(f"group_size must be a positive int, got {group_size}")


def _check_weight(x: torch.Tensor, group_size: int) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in _SUPPORTED_INPUT:
        raise TypeError(f"int4_awq: x must be float32, bfloat16 or float16, got {x.dtype}")
    if x.dim() != 2:
        raise ValueError(f"int4_awq: x must be a 2-D weight [out, in], got shape {tuple(x.shape)}")
    _check_group_size(group_size)
    out_features, in_features = x.shape
    if in_features % group_size:
        raise ValueError(
            f"int4_awq: in_features (x.shape[1] = {in_features}) must be a multiple of "
            f"group_size = {group_size}"
        )
    if out_features % 8:
        raise ValueError(
            f"int4_awq: out_features (x.shape[0] = {out_features}) must be a multiple of 8 "
            "(8 nibbles per int32)"
        )


def quantize_int4_awq(x: torch.Tensor, group_size: int = 128) -> QTensor:
    """AutoAWQ INT4 (zero_point=True, w_bit=4) round-to-nearest group quantization of a weight.

    Args:
        x: weight ``[out, in]``, float16/bfloat16/float32, any strides; ``in % group_size == 0``,
            ``out % 8 == 0``. It is cast to float16 first, as AutoAWQ does, so its fp16 image must be
            finite, and each group's ``max - min`` and ``15 * s`` must not overflow float16 (AutoAWQ
            would produce NaN/Inf there).
        group_size: number of consecutive input channels sharing one scale and zero point (AutoAWQ's
            ``q_group_size``; ``-1`` there means ``in``, pass ``in`` here).

    Returns:
        QTensor with ``data`` = qweight int32 ``[in, out/8]``, ``zeros`` = qzeros int32 ``[in/g, out/8]``,
        ``scale`` = scales float16 ``[in/g, out]``, ``shape = (out, in)``, ``dtype = x.dtype``,
        ``params = {"group_size": g}``. ``x`` is never modified.
    """
    _check_weight(x, group_size)
    out_features, in_features = x.shape
    n_groups = in_features // group_size
    w = x.detach().to(torch.float16)
    # a meta x (a shape-only quantize) has no values: the value checks below are skipped for it
    checkable = not w.is_meta
    if checkable and not torch.isfinite(w).all():
        raise ValueError(
            "int4_awq: x must be finite after the cast to float16 (AutoAWQ quantizes the fp16 weight and "
            "asserts on NaN); |x| must stay below 65520"
        )
    wg = w.reshape(out_features, n_groups, group_size)

    max_val = wg.amax(dim=-1, keepdim=True)
    min_val = wg.amin(dim=-1, keepdim=True)
    scales = true_div((max_val - min_val).clamp(min=1e-5), _MAX_INT)
    zeros = (-torch.round(min_val / scales)).clamp(0, _MAX_INT)
    w_fq = (torch.clamp(torch.round(wg / scales) + zeros, 0, _MAX_INT) - zeros) * scales
    if checkable and not (torch.isfinite(scales).all() and torch.isfinite(w_fq).all()):
        raise ValueError(
            "int4_awq: a group of x spans a range too wide for float16 scales (max - min or 15 * scale "
            "overflows); AutoAWQ produces NaN/Inf for such a weight"
        )
    # from_linear recomputes the integers from the fake-quantized weight, adding the fp16-rounded z*s
    q = torch.round((w_fq + zeros * scales) / scales)
    if checkable and q.numel() and (q.min() < 0 or q.max() > _MAX_INT):
        raise ValueError("int4_awq: x leaves AutoAWQ's integer recomputation outside [0, 15]")

    intweight = q.to(torch.int32).reshape(out_features, in_features).t()
    return QTensor(
        data=pack_awq(intweight),
        scale=scales.reshape(out_features, n_groups).t().contiguous(),
        fmt=FMT,
        shape=torch.Size((out_features, in_features)),
        dtype=x.dtype,
        zeros=pack_awq(zeros.to(torch.int32).reshape(out_features, n_groups).t()),
        params={"group_size": group_size},
    )


def check_int4_awq(q: QTensor) -> tuple[int, int, int]:
    """Validate an int4_awq QTensor's tensors against its shape and group size.

    Args:
        q: a QTensor with ``fmt == "int4_awq"``.

    Returns:
        ``(out_features, in_features, group_size)``.
    """
    if not isinstance(q, QTensor):
        raise TypeError(f"q must be a QTensor, got {type(q).__name__}")
    if q.fmt != FMT:
        raise ValueError(f"q must be an int4_awq QTensor, got fmt={q.fmt!r}")
    if len(q.shape) != 2:
        raise ValueError(f"int4_awq: q.shape must be 2-D [out, in], got {tuple(q.shape)}")
    out_features, in_features = q.shape
    group_size = q.params.get("group_size")
    _check_group_size(group_size)
    if in_features % group_size or out_features % 8:
        raise ValueError(
            f"int4_awq: q.shape {tuple(q.shape)} needs in % group_size == 0 (group_size={group_size}) "
            "and out % 8 == 0"
        )
    n_groups = in_features // group_size
    convention = int4_awq_convention(q)
    expected = {
        "data": (q.data, (torch.int32,), (in_features, out_features // 8)),
        "zeros": (q.zeros, (torch.int32,), (n_groups, out_features // 8)),
        "scale": (q.scale, _CT_SCALE_DTYPES if convention == "compressed-tensors" else (torch.float16,),
                  (n_groups, out_features)),
    }
    for name, (t, dtypes, shape) in expected.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"int4_awq: q.{name} must be a tensor, got {type(t).__name__}")
        if t.dtype not in dtypes:
            allowed = " or ".join(str(d) for d in dtypes)
            rule = f" (convention {convention!r})" if name == "scale" else ""
            raise TypeError(f"int4_awq: q.{name} must be {allowed}{rule}, got {t.dtype}")
        if tuple(t.shape) != shape:
            raise ValueError(f"int4_awq: q.{name} must have shape {shape}, got {tuple(t.shape)}")
    return out_features, in_features, group_size


def int4_awq_convention(q: QTensor) -> str:
    """``q.params["convention"]`` (``"autoawq"`` when absent); ValueError for any other value."""
    convention = q.params.get("convention", "autoawq")
    if convention not in CONVENTIONS:
        raise ValueError(f"int4_awq: params['convention'] must be one of {CONVENTIONS}, got {convention!r}")
    return convention


def decodes_in_fp16(q: QTensor) -> bool:
    """True when ``q`` decodes as one float16 multiply (AutoAWQ's rule): float16 scales, either convention.
    The Triton int4 kernels implement only this; other scale dtypes decode in the torch reference."""
    return q.scale.dtype == torch.float16


def require_fp16_decode(q: QTensor, what: str) -> None:
    """ValueError unless ``q`` decodes as one float16 multiply, as ``what`` (an fp16-only consumer) would."""
    if not decodes_in_fp16(q):
        raise ValueError(
            f"{what} stores float16 scales and decodes (q - z) * s in float16; this int4_awq weight has "
            f"{q.scale.dtype} scales (convention {int4_awq_convention(q)!r}) and decodes in {q.scale.dtype}, "
            "so writing it there would change its values"
        )


def int4_awq_codes(q: QTensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The unpacked integers of an int4_awq QTensor.

    Args:
        q: an int4_awq QTensor.

    Returns:
        ``(intweight, zeros)``: int32 ``[in, out]`` and ``[in/g, out]`` (AutoAWQ's orientation), values
        in ``[0, 15]``.
    """
    check_int4_awq(q)
    return unpack_awq(q.data), unpack_awq(q.zeros)


def dequantize_int4_awq(q: QTensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``(q - z) * s`` as the producer computes it, returned as ``[out, in]``.

    ``q - z`` is an exact small integer. Convention ``"autoawq"``: the product with the fp16 scale is a
    float16 multiply (one rounding to fp16, as in AutoAWQ's ``packing_utils.dequantize_gemm`` and its Triton
    ``awq_dequantize_kernel``). Convention ``"compressed-tensors"``: one multiply in the scale's dtype (fp16,
    bf16 or fp32), as compressed-tensors' ``_dequantize``. That result is then cast to ``dtype``, so
    requesting the scale's dtype (or a wider one) returns the producer's values exactly.

    Args:
        q: int4_awq QTensor (logical shape ``[out, in]``).
        dtype: float32, bfloat16 or float16.

    Returns:
        ``[out, in]`` tensor of ``dtype``: the transpose of ``dequantize_gemm``'s ``[in, out]`` output.
    """
    out_features, in_features, group_size = check_int4_awq(q)
    if dtype not in _SUPPORTED_INPUT:
        raise TypeError(f"dtype must be float32, bfloat16 or float16, got {dtype}")
    intweight, zeros = int4_awq_codes(q)
    zeros_full = zeros.repeat_interleave(group_size, dim=0)
    scales_full = q.scale.repeat_interleave(group_size, dim=0)
    # autoawq scales are float16, so the scale's dtype is the arithmetic dtype of both conventions
    w = (intweight - zeros_full).to(scales_full.dtype) * scales_full
    return w.t().contiguous().to(dtype)
