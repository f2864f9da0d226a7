"""DeepSeek-V3 FP8 block scaling (``fp8_block``): E4M3 values, one fp32 scale per 1x128 or 128x128 block.

Two block shapes, each pinned to the producer that defines it (formats.md section 3):

- ``(1, 128)`` (activations, any leading dims): DeepSeek-V3 ``inference/kernel.py::act_quant`` (DeepSeek-V3
  repository commit 9b4e9788). Per 128 elements of the last dim: ``amax = max(max|x|, fp32(1e-4))``,
  ``s = amax / 448``, values ``e4m3(x / s)`` (IEEE fp32 division).
- ``(128, 128)`` (2-D weights ``[N, K]``): DeepGEMM ``deep_gemm/utils/math.py::per_block_cast_to_fp8``.
  Per 128x128 block: the same ``s``, values ``e4m3(x * fp32(1/s))`` (multiply by the reciprocal).

The divide and multiply forms differ by one E4M3 code near ties (e.g. ``x / s`` lands exactly on the
midpoint 0.65625 and rounds to even 0.625, while ``x * (1/s)`` is one ulp above and rounds to 0.6875), so
the block shape fixes the evaluation order; DeepGEMM's ``per_token_cast_to_fp8`` uses the multiply form
for 1x128 and therefore disagrees with DeepSeek's ``act_quant`` there. With ``scale_fmt="ue8m0"`` the
scale is a power of two and both forms are exact and agree.

Edge blocks of a dimension that is not a multiple of 128 are zero-padded for the amax, as DeepGEMM pads
(zeros never raise an amax); the data keeps the input's shape. DeepSeek itself asserts ``K % 128 == 0``.

Non-finite input (the producers disagree; lowbit keeps one rule for all formats): a NaN anywhere in a block
makes ``amax`` and the scale NaN (``torch.amax`` propagates NaN, as in DeepGEMM's torch code; DeepSeek's
Triton ``tl.max`` skips NaN instead), so every code of the block is the canonical NaN ``0x7F``. A block
whose amax is +-Inf gets scale ``+Inf``: finite elements encode to +-0 and the Inf elements to ``0x7F``
(``Inf/Inf``). A NaN scale is stored as the canonical fp32 NaN ``0x7FC00000``. UE8M0 rounding leaves NaN
and Inf scales as they are (DeepSeek's ``exp2(ceil(log2 s))`` does the same; DeepGEMM's ``ceil_to_ue8m0``
would clamp them to ``2^127``). The whole block then decodes to NaN, as in every lowbit format.
"""

from __future__ import annotations

import torch

from .codecs import canonical_nan, encode_minifloat, true_div
from .qtensor import QTensor
from .spec import E4M3

FP8_E4M3_MAX = 448.0
AMAX_EPS = 1e-4
"""Lower clamp of the block amax (DeepSeek ``tl.maximum(amax, 1e-4)``, DeepGEMM ``clamp(1e-4)``), as fp32."""
BLOCK_SIZE = 128
BLOCKS = ((1, 128), (128, 128))
SCALE_FMTS = (None, "ue8m0")
_SUPPORTED_INPUT = (torch.float32, torch.bfloat16, torch.float16)
_TMA_ALIGNMENT_BYTES = 16


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def check_block(block: object) -> tuple[int, int]:
    if not isinstance(block, (tuple, list)) or len(block) != 2 or not all(
        isinstance(b, int) and not isinstance(b, bool) for b in block
    ):
        raise TypeError(f"fp8_block: block must be a pair of ints, (1, 128) or (128, 128), got {block!r}")
    pair = (int(block[0]), int(block[1]))
    if pair not in BLOCKS:
        raise ValueError(f"fp8_block: block must be (1, 128) or (128, 128), got {pair}")
    return pair


def check_scale_fmt(scale_fmt: object) -> str | None:
    if scale_fmt not in SCALE_FMTS:
        raise ValueError(f"fp8_block: scale_fmt must be None or 'ue8m0', got {scale_fmt!r}")
    return scale_fmt  # type: ignore[return-value]


def ue8m0_ceil(s: torch.Tensor) -> torch.Tensor:
    """The smallest power of two >= ``s`` for positive fp32 ``s``, from the exponent bits.

    DeepGEMM ``ceil_to_ue8m0``: the biased exponent plus one when any mantissa bit is set, clamped to
    ``[1, 254]`` (so the result is a normal fp32 power of two). This is exact, unlike
    ``exp2(ceil(log2(s)))``: at ``s = nextafter(2^-7)`` fp32 ``log2`` rounds to exactly -7.0 and that form
    returns ``2^-7 < s``, while this returns ``2^-6``.
    NaN and +-Inf are returned unchanged.

    Args:
        s: float32 tensor of any shape (positive finite values, NaN or Inf).

    Returns:
        float32 tensor of the same shape.
    """
    if not isinstance(s, torch.Tensor) or s.dtype != torch.float32:
        raise TypeError(f"s must be a float32 tensor, got {getattr(s, 'dtype', type(s).__name__)}")
    bits = s.abs().view(torch.int32)
    exp = ((bits >> 23) & 0xFF) + ((bits & 0x7FFFFF) != 0).to(torch.int32)
    pow2 = (exp.clamp(1, 254) << 23).view(torch.float32)
    return torch.where(torch.isfinite(s), pow2, s)


def _block_scale(amax: torch.Tensor, scale_fmt: str | None) -> torch.Tensor:
    s = true_div(amax.clamp(min=AMAX_EPS), FP8_E4M3_MAX)
    if scale_fmt == "ue8m0":
        s = ue8m0_ceil(s)
    # NaN payloads differ between torch kernels (CPU max can give 0xFFFFFFFF); store one NaN pattern
    return torch.where(s.isnan(), torch.full_like(s, float("nan")), s)


def check_input(x: torch.Tensor, block: tuple[int, int]) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"fp8_block: x must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in _SUPPORTED_INPUT:
        raise TypeError(f"fp8_block: x must be float32, bfloat16 or float16, got {x.dtype}")
    if block == (1, 128) and x.dim() < 1:
        raise ValueError("fp8_block: x must have at least 1 dimension for block (1, 128), got a scalar")
    if block == (128, 128) and x.dim() != 2:
        raise ValueError(f"fp8_block: x must be 2-D [N, K] for block (128, 128), got shape {tuple(x.shape)}")


def _quantize_1x128(
    x: torch.Tensor, scale_fmt: str | None, group: int = BLOCK_SIZE
) -> tuple[torch.Tensor, torch.Tensor]:
    k = x.shape[-1]
    groups = _cdiv(k, group)
    rows = x.shape[:-1].numel()
    xr = x.detach().float().reshape(rows, k)
    xb = torch.nn.functional.pad(xr, (0, groups * group - k)).view(rows, groups, group)
    s = _block_scale(xb.abs().amax(dim=-1), scale_fmt)
    codes = encode_minifloat(xb / s.unsqueeze(-1), E4M3).view(rows, groups * group)[:, :k]
    return codes.reshape(x.shape), s.reshape(*x.shape[:-1], groups)


def act_quant_groups(
    x: torch.Tensor, group: int, scale_fmt: str | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek ``act_quant`` arithmetic with ``group`` contiguous elements of the last dim per scale: the
    ``(1, 128)`` rule of :func:`quantize_fp8_block` (``s = max(amax, 1e-4) / 448``, ``y = e4m3(x / s)``) for
    the other block sizes DeepSeek's kernel takes. ``fp8_block`` QTensors keep 128; this returns raw tensors.

    Args:
        x: float32/bfloat16/float16 ``[..., K]`` with ``K % group == 0``.
        group: a positive int.
        scale_fmt: None or ``"ue8m0"``.

    Returns:
        ``(y, s)``: float8_e4m3fn shaped like ``x``, float32 ``[..., K/group]`` (dequant multipliers).
    """
    scale_fmt = check_scale_fmt(scale_fmt)
    if isinstance(group, bool) or not isinstance(group, int) or group < 1:
        raise ValueError(f"group must be a positive int, got {group!r}")
    check_input(x, (1, BLOCK_SIZE))
    if x.shape[-1] % group:
        raise ValueError(f"the last dim of x ({x.shape[-1]}) must be a multiple of group={group}")
    codes, scale = _quantize_1x128(x, scale_fmt, group)
    return codes.view(torch.float8_e4m3fn), scale


def _quantize_128x128(x: torch.Tensor, scale_fmt: str | None) -> tuple[torch.Tensor, torch.Tensor]:
    n, k = x.shape
    gn, gk = _cdiv(n, BLOCK_SIZE), _cdiv(k, BLOCK_SIZE)
    padded = torch.zeros(gn * BLOCK_SIZE, gk * BLOCK_SIZE, dtype=torch.float32, device=x.device)
    padded[:n, :k] = x.detach()
    xb = padded.view(gn, BLOCK_SIZE, gk, BLOCK_SIZE)
    s = _block_scale(xb.abs().amax(dim=(1, 3)), scale_fmt)
    codes = encode_minifloat(xb * (1.0 / s)[:, None, :, None], E4M3).view(gn * BLOCK_SIZE, gk * BLOCK_SIZE)
    return codes[:n, :k].contiguous(), s


SCALE_LAYOUTS = ("linear", "column_major")


def quantize_fp8_block(
    x: torch.Tensor, block: tuple[int, int] = (1, 128), scale_fmt: str | None = None, scale_layout: str = "linear"
) -> QTensor:
    """DeepSeek-V3 FP8: E4M3 values with one fp32 scale per 1x128 or 128x128 block.

    Args:
        x: float32/bfloat16/float16. Block ``(1, 128)``: ``[..., K]`` (any K, any leading dims);
            block ``(128, 128)``: ``[N, K]`` (any N, K). Non-contiguous input is fine; x is not modified.
        block: ``(1, 128)`` (activations, DeepSeek ``act_quant``) or ``(128, 128)`` (weights, DeepGEMM
            ``per_block_cast_to_fp8``).
        scale_fmt: None (scale ``amax/448``) or ``"ue8m0"`` (that scale rounded up to a power of two,
            see :func:`ue8m0_ceil`).
        scale_layout: ``"linear"`` (row-major) or ``"column_major"``: block ``(1, 128)`` on a 2-D or 3-D x
            only; the same values in the MN-major TMA-aligned layout of :func:`column_major_scales`, which
            DeepGEMM-style GEMMs read.

    Returns:
        QTensor with ``data`` float8_e4m3fn shaped like x and ``scale`` float32 ``[..., ceil(K/128)]``
        (block ``(1, 128)``) or ``[ceil(N/128), ceil(K/128)]`` (block ``(128, 128)``; DeepSeek's
        ``weight_scale_inv``). Both are dequant multipliers: ``x ~= fp32(data) * scale`` per block.
        ``params = {"block": block, "scale_fmt": scale_fmt}``.
    """
    block = check_block(block)
    scale_fmt = check_scale_fmt(scale_fmt)
    check_input(x, block)
    if scale_layout not in SCALE_LAYOUTS:
        raise ValueError(f"fp8_block: scale_layout must be one of {SCALE_LAYOUTS}, got {scale_layout!r}")
    if scale_layout == "column_major" and (block != (1, 128) or x.dim() not in (2, 3)):
        raise ValueError("fp8_block: scale_layout='column_major' needs block (1, 128) and a 2-D [M, K] or "
                         f"3-D [B, M, K] x, got block {block} and shape {tuple(x.shape)}")
    if block == (1, 128):
        codes, scale = _quantize_1x128(x, scale_fmt)
    else:
        codes, scale = _quantize_128x128(x, scale_fmt)
    if scale_layout == "column_major":
        scale = column_major_scales(scale)
    return QTensor(
        data=codes.view(torch.float8_e4m3fn),
        scale=scale,
        fmt="fp8_block",
        shape=x.shape,
        dtype=x.dtype,
        scale_layout=scale_layout,
        params={"block": block, "scale_fmt": scale_fmt},
    )


def expected_scale_shape(shape: torch.Size | tuple[int, ...], block: tuple[int, int]) -> tuple[int, ...]:
    """Scale shape of an ``fp8_block`` tensor of logical ``shape`` and ``block``."""
    block = check_block(block)
    if block == (1, 128):
        return (*shape[:-1], _cdiv(shape[-1], BLOCK_SIZE))
    return (_cdiv(shape[0], BLOCK_SIZE), _cdiv(shape[1], BLOCK_SIZE))


def check_qtensor(q: QTensor) -> tuple[int, int]:
    if not isinstance(q, QTensor):
        raise TypeError(f"q must be a QTensor, got {type(q).__name__}")
    if q.fmt != "fp8_block":
        raise ValueError(f"q must be an fp8_block QTensor, got fmt {q.fmt!r}")
    block = check_block(q.params.get("block"))
    if q.data.dtype != torch.float8_e4m3fn:
        raise TypeError(f"q.data must be float8_e4m3fn, got {q.data.dtype}")
    if q.scale.dtype != torch.float32:
        raise TypeError(f"q.scale must be float32, got {q.scale.dtype}")
    if tuple(q.data.shape) != tuple(q.shape):
        raise ValueError(f"q.data shape {tuple(q.data.shape)} must equal q.shape {tuple(q.shape)}")
    want = expected_scale_shape(q.shape, block)
    if tuple(q.scale.shape) != want:
        raise ValueError(f"q.scale must have shape {want} for shape {tuple(q.shape)} and block {block}, "
                         f"got {tuple(q.scale.shape)}")
    return block


def dequantize_fp8_block(q: QTensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``fp32(data) * scale`` per block, then cast to ``dtype`` (DeepSeek ``weight_dequant``: ``y = x * s``).

    Args:
        q: an ``fp8_block`` QTensor (see :func:`quantize_fp8_block`).
        dtype: output dtype.

    Returns:
        Tensor of shape ``q.shape`` in ``dtype``.
    """
    block = check_qtensor(q)
    values = q.data.float()
    if block == (1, 128):
        mult = q.scale.repeat_interleave(BLOCK_SIZE, dim=-1)[..., : q.shape[-1]]
    else:
        n, k = q.shape
        mult = q.scale.repeat_interleave(BLOCK_SIZE, dim=0)[:n].repeat_interleave(BLOCK_SIZE, dim=1)[:, :k]
    return canonical_nan(values * mult, dtype)


def check_pow2_scales(scale: torch.Tensor, name: str) -> None:
    if not isinstance(scale, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(scale).__name__}")
    if scale.dtype != torch.float32:
        raise TypeError(f"{name} must be float32, got {scale.dtype}")
    if scale.dim() < 1:
        raise ValueError(f"{name} must have at least 1 dimension, got a scalar")
    bits = scale.view(torch.int32)
    exp = (bits >> 23) & 0xFF
    ok = ((bits & 0x7FFFFF) == 0) & (bits >= 0) & (exp >= 1) & (exp <= 254)
    if not bool(ok.all()):
        bad = scale[~ok][0].item()
        raise ValueError(f"{name} must hold positive normal powers of two (UE8M0 values), found {bad!r}")


def pack_ue8m0_to_int32(scale: torch.Tensor) -> torch.Tensor:
    """Pack power-of-two fp32 scales into UE8M0 bytes, four consecutive K groups per int32 (DeepGEMM SM100).

    Byte ``j`` (bits ``8j..8j+7``) of int32 ``i`` is the biased exponent of group ``4i + j``, the layout of
    DeepGEMM ``pack_ue8m0_to_int`` on a little-endian machine: ``[1, 2, 0.5, 4] -> 0x817e807f``. A last
    dim that is not a multiple of 4 is padded with byte 0x00, as DeepGEMM's
    ``get_mn_major_tma_aligned_packed_ue8m0_tensor`` pads.

    Args:
        scale: float32 ``[..., G]``, every value a positive normal power of two (e.g. from
            ``quantize_fp8_block(..., scale_fmt="ue8m0")``).

    Returns:
        int32 ``[..., ceil(G/4)]``.
    """
    check_pow2_scales(scale, "scale")
    groups = scale.shape[-1]
    codes = (scale.view(torch.int32) >> 23).to(torch.int64)
    codes = torch.nn.functional.pad(codes, (0, _cdiv(groups, 4) * 4 - groups))
    codes = codes.view(*scale.shape[:-1], -1, 4)
    word = codes[..., 0] | (codes[..., 1] << 8) | (codes[..., 2] << 16) | (codes[..., 3] << 24)
    # int64 -> int32 keeps the low 32 bits, so a top byte >= 0x80 becomes a negative int32 as in DeepGEMM
    return torch.where(word >= 1 << 31, word - (1 << 32), word).to(torch.int32)


def unpack_ue8m0_from_int32(packed: torch.Tensor, groups: int | None = None) -> torch.Tensor:
    """Inverse of :func:`pack_ue8m0_to_int32`: each byte ``e`` becomes the fp32 with bits ``e << 23``.

    As DeepGEMM ``unpack_ue8m0_from_int``: byte 0x00 (padding) gives 0.0 and 0xFF gives +Inf.

    Args:
        packed: int32 ``[..., P]``.
        groups: number of K groups to keep (``<= 4P``); None keeps all ``4P``.

    Returns:
        float32 ``[..., groups]``.
    """
    if not isinstance(packed, torch.Tensor):
        raise TypeError(f"packed must be a torch.Tensor, got {type(packed).__name__}")
    if packed.dtype != torch.int32:
        raise TypeError(f"packed must be int32, got {packed.dtype}")
    if packed.dim() < 1:
        raise ValueError("packed must have at least 1 dimension, got a scalar")
    total = 4 * packed.shape[-1]
    if groups is None:
        groups = total
    if not isinstance(groups, int) or isinstance(groups, bool) or not 0 <= groups <= total:
        raise ValueError(f"groups must be an int in [0, {total}] (4 per int32), got {groups!r}")
    p = packed.to(torch.int64)
    shifts = torch.arange(0, 32, 8, device=packed.device)
    codes = ((p.unsqueeze(-1) >> shifts) & 0xFF).flatten(-2)[..., :groups]
    return (codes.to(torch.int32) << 23).view(torch.float32)


def tma_aligned_size(mn: int, element_size: int) -> int:
    """``mn`` rounded up to 16 bytes worth of elements (DeepGEMM ``get_tma_aligned_size``)."""
    if element_size <= 0 or _TMA_ALIGNMENT_BYTES % element_size:
        raise ValueError(f"element_size must divide {_TMA_ALIGNMENT_BYTES}, got {element_size}")
    align = _TMA_ALIGNMENT_BYTES // element_size
    return _cdiv(mn, align) * align


def column_major_scales(scale: torch.Tensor) -> torch.Tensor:
    """The MN-major, TMA-aligned scale layout DeepGEMM's SM90 kernels and vLLM/SGLang hand them.

    Storage is ``[..., G, round_up(M, 16/elem_size)]`` (``round_up(M, 4)`` for fp32/int32), row-major, and
    the returned tensor is its logical ``[..., M, G]`` view: ``stride(-2) == 1``,
    ``stride(-1) == round_up(M, 4)``, and for 3-D ``stride(0) == round_up(M, 4) * G``, as DeepGEMM's
    ``get_mn_major_tma_aligned_tensor`` (fp32 1x128 activation scales) and
    ``get_mn_major_tma_aligned_packed_ue8m0_tensor`` (int32 packed UE8M0) return. The padding rows of the
    storage are zero (DeepGEMM leaves the fp32 padding uninitialised; kernels never read it). Values are
    unchanged: ``column_major_scales(s).contiguous()`` equals ``s``.

    Args:
        scale: float32 or int32 ``[M, G]`` or ``[B, M, G]`` (e.g. the ``(1, 128)`` scales of a 2-D x).

    Returns:
        Tensor equal to ``scale`` with the strides above (a view of fresh storage, not of ``scale``).
    """
    if not isinstance(scale, torch.Tensor):
        raise TypeError(f"scale must be a torch.Tensor, got {type(scale).__name__}")
    if scale.dtype not in (torch.float32, torch.int32):
        raise TypeError(f"scale must be float32 or int32 (packed UE8M0), got {scale.dtype}")
    if scale.dim() not in (2, 3):
        raise ValueError(f"scale must be 2-D [M, G] or 3-D [B, M, G], got shape {tuple(scale.shape)}")
    mn, groups = scale.shape[-2], scale.shape[-1]
    aligned = tma_aligned_size(mn, scale.element_size())
    storage = scale.new_zeros(*scale.shape[:-2], groups, aligned)
    storage[..., :mn] = scale.transpose(-2, -1)
    return storage.transpose(-2, -1)[..., :mn, :]


__all__ = [
    "AMAX_EPS", "BLOCKS", "FP8_E4M3_MAX", "SCALE_FMTS",
    "column_major_scales", "dequantize_fp8_block", "expected_scale_shape", "pack_ue8m0_to_int32",
    "quantize_fp8_block", "tma_aligned_size", "ue8m0_ceil", "unpack_ue8m0_from_int32",
]
