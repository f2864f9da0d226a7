"""LightX2V ``lightx2v_kernel.gemm`` on lowbit: the same functions, shapes, dtypes and layouts, on any device.

Upstream (``ModelTC/LightX2V``, folder ``lightx2v_kernel``) runs these only on Blackwell SM120 (CUTLASS
block-scaled tensor cores); here they run on lowbit's reference on CPU and on lowbit's kernels on CUDA
(Hopper), with the upstream contracts:

================================  ==========================================================================
function                          returns / computes
================================  ==========================================================================
``scaled_nvfp4_quant(x, gs)``     ``uint8 [m, n/2]`` (two E2M1 codes per byte, element 2i in the low nibble),
                                  ``float8_e4m3fn [round_up(m, 128), round_up(n/16, 4)]`` 128x4-swizzled
                                  block scales, zero padding. ``gs`` is the global scale *multiplier*
                                  ``2688 / amax`` (fp32, one element), as upstream's ``input_global_scale``.
``scaled_mxfp4_quant(x)``         ``uint8 [m, n/2]``, ``float8_e8m0fnu [round_up(m, 128), round_up(n/32, 4)]``
``scaled_mxfp6_quant(x)``         ``uint8 [m, 3n/4]`` (FP6 **E3M2**, four codes in three bytes,
                                  little-endian), E8M0 scales as above
``scaled_mxfp8_quant(x)``         ``uint8 [m, n]`` (E4M3 bytes), E8M0 scales as above
``cutlass_scaled_*_mm(a, b,       ``bfloat16 [m, n] = alpha * (A * sf_a) @ (B * sf_b).T + bias``, fp32
sa, sb, alpha, bias=None)``       accumulation, raw block scales (no global scale inside): for NVFP4 pass
                                  ``alpha = 1 / (gs_a * gs_b)`` as LightX2V does
================================  ==========================================================================

``x`` is ``[m, n]`` float16/bfloat16 with ``n % 16 == 0`` (NVFP4) or ``n % 32 == 0`` (MX). MX scales are RCEIL
(``cvt ... cudaRoundPosInf`` of ``amax / max_elem``), elements round to nearest even with saturation. NVFP4
elements are scaled by upstream's ``S * (1/sf)`` (lowbit's ``convention="lightx2v"``; vLLM's
``1/(sf * (1/S))`` rounds some elements at E2M1 ties the other way).
Where lowbit differs from the upstream kernels by design: reciprocals are exact (upstream uses
``rcp.approx.ftz``, which no reference can reproduce bit for bit; see docs/formats.md), and MXFP8 scale padding
is zero (upstream leaves it uninitialised).

The GEMMs check what upstream's ``TORCH_CHECK``\\ s check, with the same wording where there is one: tensor
dtypes (TypeError), matrix rank, contiguity, ``k``/``n`` alignment (NVFP4 32/32, MXFP4 128/128, MXFP8 and
MXFP6xMXFP8 ``k % 16`` and ``n % 128``, plus ``k % 32`` for the MX scale blocks), padded swizzled scale
shapes, alpha a float32 tensor of one element, bias ``bfloat16`` with ``n`` elements (``(1, n)`` or ``(n,)``),
one device (ValueError). ``cutlass_scaled_mxfp6_mxfp8_mm`` is upstream's W6A8 GEMM: ``mat_a`` is the MXFP8
(E4M3) activation ``[m, k]``, ``mat_b`` the MXFP6 (E3M2) weight ``[n, 3k/4]``.
"""

from __future__ import annotations

import torch

from .. import api
from ..formats.packing import swizzled_scale_shape
from ..formats.qtensor import QTensor
from ..ops.scaled_mm import scaled_mm

_IN_DTYPES = (torch.float16, torch.bfloat16)


def _round_up(x: int, y: int) -> int:
    return (x + y - 1) // y * y


# ---------------------------------------------------------------------------------------------- quantize


def _check_quant_input(x: torch.Tensor, block: int, fn: str) -> tuple[int, int]:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{fn}: input must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() != 2:
        raise ValueError(f"{fn}: input must be a matrix (m, n), got shape {tuple(x.shape)}")
    if x.dtype not in _IN_DTYPES:
        raise TypeError(f"{fn}: input.dtype needs to be fp16 or bf16 but got {x.dtype}.")
    m, n = x.shape
    if n % block:
        raise ValueError(f"{fn}: The N dimension must be multiple of {block}, got {n}.")
    return m, n


def scaled_nvfp4_quant(
    input: torch.Tensor, input_global_scale: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``input`` ``[m, n]`` to NVFP4 with 16-element blocks and the given global scale multiplier.

    Args:
        input: float16/bfloat16 ``[m, n]``, ``n % 16 == 0``.
        input_global_scale: float32 tensor of one element (``()`` or ``(1,)``), the multiplier
            ``2688 / amax`` (block scales are ``e4m3(amax_block / 6 * gs)``); finite and > 0.

    Returns:
        ``(uint8 [m, n/2], float8_e4m3fn [round_up(m, 128), round_up(n/16, 4)])``: packed E2M1 codes and
        128x4-swizzled block scales (zero padding).
    """
    _check_quant_input(input, 16, "scaled_nvfp4_quant")
    if not isinstance(input_global_scale, torch.Tensor):
        raise TypeError(
            f"scaled_nvfp4_quant: input_global_scale must be a float32 tensor, got {type(input_global_scale).__name__}"
        )
    if input_global_scale.dtype != torch.float32:
        raise TypeError(
            f"scaled_nvfp4_quant: input_global_scale must be float32, got {input_global_scale.dtype}"
        )
    if input_global_scale.numel() != 1:
        raise ValueError(
            f"scaled_nvfp4_quant: input_global_scale must be a scalar tensor, got shape {tuple(input_global_scale.shape)}"
        )
    q = api.quantize(
        input, "nvfp4", global_scale=input_global_scale, convention="lightx2v", scale_layout="swizzled"
    )
    return q.data, q.scale


def _mx_quant(x: torch.Tensor, fmt: str, fn: str) -> tuple[torch.Tensor, torch.Tensor]:
    _check_quant_input(x, 32, fn)
    q = api.quantize(x, fmt, scale_rounding="rceil", scale_layout="swizzled")
    return q.data.view(torch.uint8), q.scale


def scaled_mxfp4_quant(input: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """MXFP4: ``(uint8 [m, n/2], float8_e8m0fnu [round_up(m, 128), round_up(n/32, 4)])``, 32-element blocks,
    RCEIL scales, 128x4-swizzled. ``input``: float16/bfloat16 ``[m, n]``, ``n % 32 == 0``."""
    return _mx_quant(input, "mxfp4", "scaled_mxfp4_quant")


def scaled_mxfp6_quant(input: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """MXFP6 E3M2: ``(uint8 [m, 3n/4], float8_e8m0fnu [round_up(m, 128), round_up(n/32, 4)])`` (four 6-bit codes
    in three bytes, little-endian). ``input``: float16/bfloat16 ``[m, n]``, ``n % 32 == 0``."""
    return _mx_quant(input, "mxfp6_e3m2", "scaled_mxfp6_quant")


def scaled_mxfp8_quant(input: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """MXFP8 E4M3: ``(uint8 [m, n], float8_e8m0fnu [round_up(m, 128), round_up(n/32, 4)])``. ``input``:
    float16/bfloat16 ``[m, n]``, ``n % 32 == 0``."""
    return _mx_quant(input, "mxfp8_e4m3", "scaled_mxfp8_quant")


# ---------------------------------------------------------------------------------------------- GEMMs


def _check_input(t: torch.Tensor, dtype: torch.dtype, name: str, fn: str, what: str) -> None:
    """Upstream's ``CHECK_INPUT`` (device aside: any device works here) plus ``dim() == 2``."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{fn}: {name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype != dtype:
        raise TypeError(f"{fn}: Inconsistency of Tensor type: {name} must be {dtype} ({what}), got {t.dtype}")
    if not t.is_contiguous():
        raise ValueError(f"{fn}: {name} must be contiguous")
    if t.dim() != 2:
        raise ValueError(f"{fn}: {name} must be a matrix, got shape {tuple(t.shape)}")


def _check_alpha(alpha: torch.Tensor, fn: str) -> None:
    if not isinstance(alpha, torch.Tensor):
        raise TypeError(f"{fn}: alpha must be a float32 tensor of one element, got {type(alpha).__name__}")
    if alpha.dtype != torch.float32:
        raise TypeError(f"{fn}: Inconsistency of Tensor type: alpha must be torch.float32, got {alpha.dtype}")
    if alpha.numel() != 1:
        raise TypeError(
            f"{fn}: alpha must be a float32 tensor of one element, got shape {tuple(alpha.shape)}"
        )


def _check_scales(
    sa: torch.Tensor, sb: torch.Tensor, m: int, n: int, k: int, block: int, dtype: torch.dtype, fn: str
) -> None:
    for name, s in (("scale_a", sa), ("scale_b", sb)):
        _check_input(s, dtype, name, fn, f"{'E4M3' if block == 16 else 'E8M0'} block scales")
    if sa.shape[1] != sb.shape[1]:
        raise ValueError(
            f"{fn}: scale_a and scale_b shapes cannot be multiplied ({sa.shape[0]}x{sa.shape[1]} and "
            f"{sb.shape[0]}x{sb.shape[1]})"
        )
    for name, s, rows in (("scale_a", sa, m), ("scale_b", sb, n)):
        want = swizzled_scale_shape(rows, k // block)
        if tuple(s.shape) != want:
            raise ValueError(
                f"{fn}: {name} must be padded and swizzled to a shape ({want[0]}x{want[1]}), but got a shape "
                f"({s.shape[0]}x{s.shape[1]})"
            )


def _check_bias(bias: torch.Tensor | None, n: int, fn: str) -> torch.Tensor | None:
    if bias is None:
        return None
    if not isinstance(bias, torch.Tensor):
        raise TypeError(f"{fn}: bias must be None or a torch.Tensor, got {type(bias).__name__}")
    if bias.dtype != torch.bfloat16:
        raise TypeError(f"{fn}: Inconsistency of Tensor type: bias must be torch.bfloat16, got {bias.dtype}")
    if bias.numel() != n or (bias.dim() == 2 and bias.shape[0] != 1) or bias.dim() not in (1, 2):
        raise ValueError(f"{fn}: bias must have shape (1, n) or (n,) with n = {n}, got {tuple(bias.shape)}")
    return bias.reshape(n)


def _check_alignment(
    k: int, n: int, align_k: int, align_n: int, a: torch.Tensor, b: torch.Tensor, fn: str
) -> None:
    if k % align_k:
        raise ValueError(
            f"{fn}: Expected k to be divisible by {align_k}, but got a shape: ({a.shape[0]}x{a.shape[1]}), k: {k}."
        )
    if n % align_n:
        raise ValueError(
            f"{fn}: Expected n to be divisible by {align_n}, but got b shape: ({b.shape[0]}x{b.shape[1]})."
        )


def _check_devices(fn: str, **tensors: torch.Tensor | None) -> None:
    items = [(k, t) for k, t in tensors.items() if t is not None]
    first_name, first = items[0]
    for name, t in items[1:]:
        if t.device != first.device:
            raise ValueError(
                f"{fn}: all tensors must be on one device: {first_name} is on {first.device}, {name} on {t.device}"
            )


def _operand(data: torch.Tensor, scale: torch.Tensor, fmt: str, rows: int, k: int) -> QTensor:
    """A single-level QTensor around raw LightX2V tensors (no global scale: upstream's alpha carries it)."""
    params = {"convention": "lightx2v"} if fmt == "nvfp4" else {"scale_rounding": "rceil"}
    if fmt.startswith("mxfp8"):
        data = data.view(torch.float8_e4m3fn)
    return QTensor(
        data=data,
        scale=scale,
        fmt=fmt,
        shape=(rows, k),
        dtype=torch.bfloat16,
        scale_layout="swizzled",
        params=params,
    )


def _mm(a_fmt, b_fmt, mat_a, mat_b, scales_a, scales_b, alpha, bias, m, n, k, fn) -> torch.Tensor:
    _check_alpha(alpha, fn)
    bias = _check_bias(bias, n, fn)
    _check_devices(fn, a=mat_a, b=mat_b, scale_a=scales_a, scale_b=scales_b, alpha=alpha, bias=bias)
    qa = _operand(mat_a, scales_a, a_fmt, m, k)
    qb = _operand(mat_b, scales_b, b_fmt, n, k)
    return scaled_mm(qa, qb, alpha, bias, torch.bfloat16)


def _check_operands(mat_a, mat_b, what: str, fn: str) -> tuple[int, int, int]:
    """``(m, n, columns)`` of two uint8 operands of the same encoding (``what``) and the same column count."""
    _check_input(mat_a, torch.uint8, "a", fn, what)
    _check_input(mat_b, torch.uint8, "b", fn, what)
    if mat_a.shape[1] != mat_b.shape[1]:
        raise ValueError(
            f"{fn}: a and b shapes cannot be multiplied ({mat_a.shape[0]}x{mat_a.shape[1]} and "
            f"{mat_b.shape[0]}x{mat_b.shape[1]})"
        )
    return mat_a.shape[0], mat_b.shape[0], mat_a.shape[1]


def _fp4_mm(
    fmt, align, block, scale_dtype, mat_a, mat_b, scales_a, scales_b, alpha, bias, fn
) -> torch.Tensor:
    """The FP4 x FP4 GEMMs (``fmt`` on both sides, two codes per byte): ``k`` and ``n`` both aligned to
    ``align`` (upstream's CUTLASS alignment), then ``scale_dtype`` scales of one per ``block`` elements."""
    m, n, cols = _check_operands(mat_a, mat_b, "two FP4 E2M1 codes per byte", fn)
    k = cols * 2
    _check_alignment(k, n, align, align, mat_a, mat_b, fn)
    _check_scales(scales_a, scales_b, m, n, k, block, scale_dtype, fn)
    return _mm(fmt, fmt, mat_a, mat_b, scales_a, scales_b, alpha, bias, m, n, k, fn)


def cutlass_scaled_nvfp4_mm(
    mat_a: torch.Tensor,
    mat_b: torch.Tensor,
    scales_a: torch.Tensor,
    scales_b: torch.Tensor,
    alpha: torch.Tensor,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """NVFP4 x NVFP4: ``bfloat16 [m, n] = alpha * dequant(A) @ dequant(B).T + bias`` with raw block scales.

    Args:
        mat_a: uint8 ``[m, k/2]`` (from :func:`scaled_nvfp4_quant`); mat_b: uint8 ``[n, k/2]``.
        scales_a / scales_b: float8_e4m3fn, 128x4-swizzled, ``[round_up(m|n, 128), round_up(k/16, 4)]``.
        alpha: float32 tensor of one element; ``1 / (gs_a * gs_b)`` undoes the two global scales.
        bias: None or bfloat16 ``(1, n)`` / ``(n,)``.

    ``k % 32 == 0`` and ``n % 32 == 0`` (upstream's CUTLASS alignment).
    """
    return _fp4_mm("nvfp4", 32, 16, torch.float8_e4m3fn, mat_a, mat_b, scales_a, scales_b, alpha, bias,
                   "cutlass_scaled_nvfp4_mm")


def cutlass_scaled_mxfp4_mm(
    mat_a: torch.Tensor,
    mat_b: torch.Tensor,
    scales_a: torch.Tensor,
    scales_b: torch.Tensor,
    alpha: torch.Tensor,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """MXFP4 x MXFP4: as :func:`cutlass_scaled_nvfp4_mm` with float8_e8m0fnu scales
    ``[round_up(m|n, 128), round_up(k/32, 4)]``; ``k % 128 == 0`` and ``n % 128 == 0``."""
    return _fp4_mm("mxfp4", 128, 32, torch.float8_e8m0fnu, mat_a, mat_b, scales_a, scales_b, alpha, bias,
                   "cutlass_scaled_mxfp4_mm")


def _mxfp8_act_mm(b_fmt, mat_a, mat_b, scales_a, scales_b, alpha, bias, m, n, k, fn) -> torch.Tensor:
    """The GEMMs with an MXFP8 activation: upstream's ``k % 16`` / ``n % 128`` alignment, ``k % 32`` for the
    E8M0 scale blocks, then the scales."""
    _check_alignment(k, n, 16, 128, mat_a, mat_b, fn)
    if k % 32:
        raise ValueError(
            f"{fn}: Expected k to be divisible by 32 (one E8M0 scale per 32 elements), but got k: {k}."
        )
    _check_scales(scales_a, scales_b, m, n, k, 32, torch.float8_e8m0fnu, fn)
    return _mm("mxfp8_e4m3", b_fmt, mat_a, mat_b, scales_a, scales_b, alpha, bias, m, n, k, fn)


def cutlass_scaled_mxfp8_mm(
    mat_a: torch.Tensor,
    mat_b: torch.Tensor,
    scales_a: torch.Tensor,
    scales_b: torch.Tensor,
    alpha: torch.Tensor,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """MXFP8 (E4M3) x MXFP8 (E4M3): ``mat_a`` uint8 ``[m, k]``, ``mat_b`` uint8 ``[n, k]`` (E4M3 bytes), E8M0
    scales ``[round_up(m|n, 128), round_up(k/32, 4)]``; ``k % 16 == 0`` (and ``% 32`` for the scale blocks),
    ``n % 128 == 0``. Returns bfloat16 ``[m, n]``."""
    fn = "cutlass_scaled_mxfp8_mm"
    m, n, k = _check_operands(mat_a, mat_b, "FP8 E4M3 bytes", fn)
    return _mxfp8_act_mm("mxfp8_e4m3", mat_a, mat_b, scales_a, scales_b, alpha, bias, m, n, k, fn)


def cutlass_scaled_mxfp6_mxfp8_mm(
    mat_a: torch.Tensor,
    mat_b: torch.Tensor,
    scales_a: torch.Tensor,
    scales_b: torch.Tensor,
    alpha: torch.Tensor,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """W6A8: ``mat_a`` the MXFP8 E4M3 activation, uint8 ``[m, k]`` (:func:`scaled_mxfp8_quant`), ``mat_b`` the
    MXFP6 E3M2 weight, uint8 ``[n, 3k/4]`` (:func:`scaled_mxfp6_quant`); E8M0 scales
    ``[round_up(m|n, 128), round_up(k/32, 4)]``; ``k % 16 == 0`` (and ``% 32``), ``n % 128 == 0``. Returns
    bfloat16 ``[m, n]``."""
    fn = "cutlass_scaled_mxfp6_mxfp8_mm"
    _check_input(mat_a, torch.uint8, "a", fn, "FP8 E4M3 bytes of the activation")
    _check_input(mat_b, torch.uint8, "b", fn, "FP6 E3M2 codes of the weight, four in three bytes")
    m, n, k = mat_a.shape[0], mat_b.shape[0], mat_a.shape[1]
    if mat_b.shape[1] * 4 != k * 3:
        raise ValueError(
            f"{fn}: a and b shapes cannot be multiplied ({mat_a.shape[0]}x{mat_a.shape[1]} MXFP8 and "
            f"{mat_b.shape[0]}x{mat_b.shape[1]} MXFP6: b must have 3k/4 = {3 * k / 4:g} columns)"
        )
    return _mxfp8_act_mm("mxfp6_e3m2", mat_a, mat_b, scales_a, scales_b, alpha, bias, m, n, k, fn)


__all__ = [
    "cutlass_scaled_mxfp4_mm",
    "cutlass_scaled_mxfp6_mxfp8_mm",
    "cutlass_scaled_mxfp8_mm",
    "cutlass_scaled_nvfp4_mm",
    "scaled_mxfp4_quant",
    "scaled_mxfp6_quant",
    "scaled_mxfp8_quant",
    "scaled_nvfp4_quant",
]
