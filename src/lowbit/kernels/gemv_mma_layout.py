"""The tensor-core GEMV's weight layout (:func:`mma_layout`): a further copy of a prepared weight's 4-bit words in
the order the mma.sync fragments of ``_gemv_mma`` read them (16-row groups, 64-column chunks, int32 words
``[N/16, K/64, 32 lanes, 4]``; that module's docstring has the layout), with the scales paired per lane. Made
once per prepared weight and kept on it (``PreparedW4.mma``); where it does not apply, the GEMV runs the FMA /
dot kernels on the row-major layout of :mod:`lowbit.kernels.gemv_prepack`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..formats import nf4 as ref_nf4
from ..formats.packing import unpack_fp4, unpack_nibbles_high_first
from . import _gemv_mma as km
from . import _gemv_w4 as k
from . import cdiv
from .gemv_prepack import PreparedW4, no_caching, to_int32


# bit positions (m, e0, e1, sign) of element (row g + 8 h, column 4 i + c) of a lane's word: three of the four
# bf16x2 A registers are then one shift and one AND (see _gemv_mma)
_MMA_BITS = {(0, 0): (6, 7, 8, 15), (0, 1): (22, 23, 24, 31), (1, 0): (3, 4, 5, 12), (1, 1): (19, 20, 21, 28),
             (0, 2): (0, 1, 2, 9), (0, 3): (16, 17, 18, 25), (1, 2): (10, 11, 13, 14), (1, 3): (26, 27, 29, 30)}


def has_mma_layout(fmt: str, kdim: int, group: int | None = None) -> bool:
    """Whether the tensor-core layout exists for this format, K and (int4_awq) group size: a 64-column chunk
    must lie in one group (NF4: one absmax block), since the int4 scale and the NF4 absmax are applied per
    chunk after its mmas (MXFP4 scale codes are checked apart)."""
    if fmt in ("int4_awq", "nf4", "nf4_dq"):
        return kdim % 64 == 0 and group is not None and group % 64 == 0
    return fmt in ("nvfp4", "mxfp4") and kdim % 64 == 0


@dataclass(eq=False)
class MmaLayout:
    words: torch.Tensor    # int32 [N16, K/64, 32, 4]
    scales: torch.Tensor   # int16 [N16, K/SB, 8]: (row g, row g + 8) scale codes; int4: int32 [N16, K/G, 8, 2]
    fmt_code: int
    cpg: int = 1           # int4 / NF4: 64-column chunks per group (block)
    plans: dict = field(default_factory=dict, repr=False)

    def table(self, x_dtype: torch.dtype) -> tuple:
        return mma_table(self.fmt_code, x_dtype)


def mma_table(fmt_code: int, x_dtype: torch.dtype) -> tuple:
    """The tensor-core kernel's T0..T7: NF4's level table for the mma operand type as signed int32 values,
    else 0s."""
    if fmt_code != km.FMT_NF4.value:
        return _NO_TABLE
    return _NF4_TABLE_F16 if x_dtype == torch.float16 else _NF4_TABLE_BF16


def _signed_words(lo: tuple, hi: tuple) -> tuple:
    return tuple(v - (1 << 32) if v >= 1 << 31 else v for v in lo + hi)


_NO_TABLE = (0,) * 8
_NF4_TABLE_BF16 = _signed_words(*km.nf4_table_words(False))
_NF4_TABLE_F16 = _signed_words(*km.nf4_table_words(True))

# int4: nibble bit position of element (row g + 8 h, column 4 i + c) of a lane's word (see _gemv_mma)
_MMA_INT4_BITS = {(h, c): 4 * (h + 2 * (c // 2)) + 16 * (c % 2) for h in range(2) for c in range(4)}
# NF4: the low half-word holds A registers 0 and 1 (rows g, g + 8 at c = 0, 1), the high one registers 2 and 3
_MMA_NF4_BITS = {(h, c): 4 * (2 * h + c % 2) + 16 * (c // 2) for h in range(2) for c in range(4)}


def _mma_words(codes: torch.Tensor, nibbles: dict | None = None) -> torch.Tensor:
    """E2M1 codes (or, with ``nibbles``, int4 / NF4 codes placed whole at those bit positions) uint8 [16 G, K]
    (G row groups) -> int32 words [G, K/64, 32, 4]."""
    g16, kdim = codes.shape
    c = codes.reshape(g16 // 16, 2, 8, kdim // 64, 4, 4, 4).to(torch.int64)   # [G, h, g, kq, t, i, c]
    word = torch.zeros(g16 // 16, 8, kdim // 64, 4, 4, dtype=torch.int64, device=codes.device)
    for (h, col), pos in (nibbles or {}).items():
        word |= c[:, h, :, :, :, :, col] << pos
    for (h, col), pos in ({} if nibbles else _MMA_BITS).items():
        v = c[:, h, :, :, :, :, col]                                          # [G, g, kq, t, i]
        for b, bit in enumerate(pos):
            word |= ((v >> b) & 1) << bit
    word = word.permute(0, 2, 1, 3, 4).reshape(g16 // 16, kdim // 64, 32, 4)  # lane = 4 g + t
    return to_int32(word)


def mma_layout(p: PreparedW4) -> MmaLayout | None:
    """The tensor-core layout of a prepared NVFP4 / MXFP4 / int4_awq / nf4 weight (made once, cached on ``p``),
    or None where the tensor-core GEMV does not apply: other formats, K not a multiple of 64 (int4 / nf4: a
    group or block not a multiple of 64 columns), MXFP4 scale codes outside
    [-62, 191] - 127 (their 2^63-offset bf16 form would overflow; such weights use the FMA kernel)."""
    if p.mma is not None:
        return p.mma or None
    if no_caching():
        # not built inside the custom op or a capture (see prepare_w4; the MXFP4 check reads the scales on the
        # host): the FMA / dot kernels run instead
        return None
    ok = has_mma_layout(p.fmt, p.k, 8 * p.words_per_block)
    if ok and p.fmt == "mxfp4":
        ok = int(p.scales.max()) <= 191
    if not ok:
        p.mma = False
        return None
    if p.fmt == "int4_awq":
        p.mma = _mma_int4_layout(p)
        return p.mma
    if p.fmt in ("nf4", "nf4_dq"):
        p.mma = _mma_nf4_layout(p)
        return p.mma
    n, kdim = p.n, p.k
    n16 = cdiv(n, 16)
    codes_packed = p.words.view(torch.uint8).reshape(n, kdim // 2)
    words = _layout_words(p, lambda r0, r1: unpack_fp4(codes_packed[r0:r1]))
    scales = p.scales.reshape(n, -1)
    sb = scales.shape[1]
    sc = torch.zeros(16 * n16, sb, dtype=torch.int32, device=p.device)
    sc[:n] = scales.view(torch.uint8).to(torch.int32)
    sc = sc.reshape(n16, 2, 8, sb)
    pairs = (sc[:, 0] | (sc[:, 1] << 8)).permute(0, 2, 1).to(torch.int16).contiguous()   # [N16, SB, 8]
    p.mma = MmaLayout(words=words, scales=pairs,
                      fmt_code=km.FMT_NVFP4.value if p.fmt == "nvfp4" else km.FMT_MXFP4.value)
    return p.mma


def _layout_words(p: PreparedW4, codes_of, nibbles: dict | None = None) -> torch.Tensor:
    """The words [N16, K/64, 32, 4] of :func:`_mma_words`, made over slices of row groups (bounded int64
    temporaries); ``codes_of(r0, r1)``: the uint8 codes [r1 - r0, K] of rows r0..r1. Padding rows get code 0."""
    n, kdim = p.n, p.k
    n16 = cdiv(n, 16)
    words = torch.empty(n16, kdim // 64, 32, 4, dtype=torch.int32, device=p.device)
    step = max(1, (1 << 24) // kdim)
    for g0 in range(0, n16, step):
        g1 = min(n16, g0 + step)
        r0, r1 = 16 * g0, min(n, 16 * g1)
        codes = torch.zeros(16 * (g1 - g0), kdim, dtype=torch.uint8, device=p.device)
        codes[: r1 - r0] = codes_of(r0, r1)
        words[g0:g1] = _mma_words(codes, nibbles)
    return words


def _mma_int4_layout(p: PreparedW4) -> MmaLayout:
    """Words from the N-major int4 words (nibble j of word w = element 8 w + j), and per group the lane's
    (fp16 scale of row g | row g + 8 << 16, zero of row g | row g + 8 << 16) from the ``sz`` pairs
    (fp16 scale bits | (0x6400 + z) << 16). Padding rows get zero words and scales."""
    n, kdim, group = p.n, p.k, 8 * p.words_per_block
    n16, ng = cdiv(n, 16), kdim // group
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=p.device)
    words = _layout_words(
        p, lambda r0, r1: ((p.words[r0:r1, :, None] >> shifts) & 0xF).reshape(r1 - r0, kdim).to(torch.uint8),
        _MMA_INT4_BITS)
    sz = torch.full((16 * n16, ng), 0x6400 << 16, dtype=torch.int64, device=p.device)   # padding: s = z = 0
    sz[:n] = p.scales.to(torch.int64) & 0xFFFFFFFF
    scale, zero = sz & 0xFFFF, (sz >> 16) - 0x6400
    scale, zero = scale.reshape(n16, 2, 8, ng), zero.reshape(n16, 2, 8, ng)
    pairs = torch.stack([scale[:, 0] | (scale[:, 1] << 16), zero[:, 0] | (zero[:, 1] << 16)], dim=-1)
    pairs = to_int32(pairs.permute(0, 2, 1, 3).contiguous())                   # [N16, NG, 8, 2]
    return MmaLayout(words=words, scales=pairs, fmt_code=km.FMT_INT4.value, cpg=group // 64)


def _nf4_block_absmax(p: PreparedW4) -> torch.Tensor:
    """fp32 absmax [N, K / blocksize] of a prepared nf4 weight, double quantization decoded as
    ``formats.nf4.nf4_absmax`` does (bitsandbytes' ``dequantize_4bit``)."""
    n, nb = p.n, p.k // (8 * p.words_per_block)
    if p.fmt == "nf4":
        return p.scales.reshape(n, nb)
    absmax = ref_nf4.dequantize_blockwise_8bit(p.scales.reshape(-1), p.nested, None, ref_nf4.NESTED_BLOCKSIZE)
    return (absmax + p.tab[k.TAB_OFFSET.value]).reshape(n, nb)


def _mma_nf4_layout(p: PreparedW4) -> MmaLayout:
    """Words from bitsandbytes' bytes (element 2 i in the high nibble), nibbles at :data:`_MMA_NF4_BITS`, and
    per block the lane's (absmax of row g, absmax of row g + 8) as fp32 bits; double quantization is decoded
    here, once (4 bytes per block instead of 1 + 4/256: the same bytes per weight as NVFP4 at blocksize 64).
    Padding rows get zero words and absmax."""
    n, kdim, block = p.n, p.k, 8 * p.words_per_block
    n16, nb = cdiv(n, 16), kdim // block
    packed = p.words.view(torch.uint8).reshape(n, kdim // 2)
    words = _layout_words(
        p, lambda r0, r1: unpack_nibbles_high_first(packed[r0:r1], (r1 - r0) * kdim).reshape(r1 - r0, kdim),
        _MMA_NF4_BITS)
    absmax = torch.zeros(16 * n16, nb, dtype=torch.float32, device=p.device)
    absmax[:n] = _nf4_block_absmax(p)
    bits = absmax.view(torch.int32).reshape(n16, 2, 8, nb)
    pairs = torch.stack([bits[:, 0], bits[:, 1]], dim=-1).permute(0, 2, 1, 3).contiguous()   # [N16, NB, 8, 2]
    return MmaLayout(words=words, scales=pairs, fmt_code=km.FMT_NF4.value, cpg=block // 64)
