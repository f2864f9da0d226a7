"""Triton kernel for NF4 dequantization (bitsandbytes layout), bit-identical to ``lowbit.formats.nf4``.

The reference runs on an x86 CPU, whose fp32 NaN rules the kernel reproduces explicitly (a GPU returns
the canonical NaN 0x7FFFFFFF from any op that yields NaN):

- an op with a NaN operand returns that operand with its quiet bit set (when both are NaN, the one torch's
  CPU kernel evaluates first);
- an op that creates NaN (``0 * inf``, ``inf - inf``) returns the x86 default NaN 0xFFC00000.

No fp32 multiply feeds an add directly (the NaN fix-up sits between them), so no FMA contraction is
possible; the launcher also passes ``enable_fp_fusion=False``.
"""

import triton
import triton.language as tl

from .device import load_nc, nan_mask

QNAN_BIT = tl.constexpr(0x00400000)
X86_DEFAULT_NAN = tl.constexpr(-4194304)  # 0xFFC00000 as int32


@triton.jit
def _x86_nan_bits(res, a, b):
    """int32 bits of ``res = a op b`` with x86 NaN rules (``a`` the first operand, ``b`` the second)."""
    nan = tl.where(nan_mask(a), a.to(tl.int32, bitcast=True) | QNAN_BIT,
                   tl.where(nan_mask(b), b.to(tl.int32, bitcast=True) | QNAN_BIT, X86_DEFAULT_NAN))
    return tl.where(nan_mask(res), nan, res.to(tl.int32, bitcast=True))


@triton.jit
def _to_out_bits(prod, nan_bits, OUT_KIND: tl.constexpr, ON_GPU: tl.constexpr):
    """fp32 ``prod`` (its NaN elements standing for ``nan_bits``, the NaN the reference holds) converted as
    the reference converts: OUT_KIND 0 fp32 bits (int32); 1 bf16 by bitsandbytes' bit trick
    ``(b + 0x7FFF + ((b >> 16) & 1)) >> 16``, which is round-to-nearest-even for every non-NaN (int16);
    2 fp16 as x86 F16C converts, round-to-nearest-even, NaN keeping its sign and top payload bits (int16).
    """
    is_nan = nan_mask(prod)
    if OUT_KIND == 0:
        v = tl.where(is_nan, nan_bits, prod.to(tl.int32, bitcast=True))
    elif OUT_KIND == 1:
        if ON_GPU:
            nb = (nan_bits + 0x7FFF + ((nan_bits >> 16) & 1)) >> 16
            v = tl.where(is_nan, nb, prod.to(tl.bfloat16).to(tl.int16, bitcast=True).to(tl.int32)).to(tl.int16)
        else:
            # the interpreter's fp32 -> bf16 cast truncates
            b = tl.where(is_nan, nan_bits, prod.to(tl.int32, bitcast=True))
            v = ((b + 0x7FFF + ((b >> 16) & 1)) >> 16).to(tl.int16)
    else:
        nh = ((nan_bits >> 16) & 0x8000) | 0x7C00 | ((nan_bits >> 13) & 0x3FF)
        v = tl.where(is_nan, nh, prod.to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32)).to(tl.int16)
    return v


@triton.jit
def _lut(table_ptr, idx, ON_GPU: tl.constexpr):
    """``table_ptr[idx]`` for a small read-only fp32 table. The inline-asm load is elementwise, so it takes
    the layout of its consumers (a ``tl.load`` gather would impose its own and cost a shared-memory layout
    conversion) and its address is one ``mad.wide``; the interpreter cannot run inline asm and uses
    ``tl.load``."""
    if ON_GPU:
        return tl.inline_asm_elementwise(
            "{ .reg .b64 a; mad.wide.u32 a, $1, 4, $2; ld.global.nc.f32 $0, [a]; }",
            "=f,r,l", [idx, table_ptr], dtype=tl.float32, is_pure=True, pack=1)
    else:
        return tl.load(table_ptr + idx)


@triton.jit
def _ld_u16(ptrs, ON_GPU: tl.constexpr):
    if ON_GPU:
        return tl.inline_asm_elementwise("ld.global.nc.u16 $0, [$1];", "=r,l", [ptrs], dtype=tl.int32,
                                         is_pure=True, pack=1)
    else:
        return tl.load(ptrs).to(tl.int32) & 0xFFFF


@triton.jit
def _nf4_tile(
    data_ptr, absmax_ptr, nested_ptr, offset_ptr, lut_ptr, dmap_ptr, out_ptr, n, pid,
    BLOCKSIZE: tl.constexpr, BLOCK: tl.constexpr, V: tl.constexpr,
    DOUBLE_QUANT: tl.constexpr, OUT_KIND: tl.constexpr, MASKED: tl.constexpr, ON_GPU: tl.constexpr,
):
    NCH: tl.constexpr = BLOCK // V
    base = pid * BLOCK                                   # first element of this tile (int64)
    ch = tl.arange(0, NCH)                               # chunks of V elements, in one absmax block each
    e = tl.arange(0, V)
    if MASKED:
        rem = (n - base).to(tl.int32)                    # < BLOCK elements left
        ch_ok = ch * V < rem
    else:
        rem = BLOCK
        ch_ok = ch < NCH

    # absmax of each chunk (BLOCK and BLOCKSIZE are powers of two)
    blk = base // BLOCKSIZE + (ch * V // BLOCKSIZE)
    if DOUBLE_QUANT:
        if MASKED:
            code = tl.load(absmax_ptr + blk, mask=ch_ok, other=0).to(tl.int32)
            nested = tl.load(nested_ptr + blk // 256, mask=ch_ok, other=0.0)
        else:
            code = tl.load(absmax_ptr + blk).to(tl.int32)
            nested = tl.load(nested_ptr + blk // 256)
        c2 = _lut(dmap_ptr, code, ON_GPU)
        p = _x86_nan_bits(c2 * nested, c2, nested).to(tl.float32, bitcast=True)
        off = tl.load(offset_ptr)
        # torch evaluates absmax + offset as offset's NaN first (an FMA ``alpha * offset + absmax``)
        a_bits = _x86_nan_bits(p + off, off, p)
        absmax = a_bits.to(tl.float32, bitcast=True)
    else:
        if MASKED:
            absmax = tl.load(absmax_ptr + blk, mask=ch_ok, other=0.0)
        else:
            absmax = tl.load(absmax_ptr + blk)
        a_bits = absmax.to(tl.int32, bitcast=True)
    # NaN products of a chunk are its absmax (quieted) or, for 0 * inf, the default NaN
    nan_bits = tl.where(nan_mask(absmax), a_bits | QNAN_BIT, X86_DEFAULT_NAN)

    # the V/2 packed bytes of each chunk as one little-endian word
    bytes_ptr = data_ptr + pid * (BLOCK // 2)
    if MASKED:
        word = tl.zeros([NCH], dtype=tl.int32)
        for k in tl.static_range(V // 2):
            boff = ch * (V // 2) + k
            b = tl.load(bytes_ptr + boff, mask=2 * boff < rem, other=0)
            word = word | (b.to(tl.int32) << (8 * k))
    elif V == 4:
        word = _ld_u16(bytes_ptr.to(tl.pointer_type(tl.int16), bitcast=True) + ch, ON_GPU)
    else:
        word = load_nc(bytes_ptr.to(tl.pointer_type(tl.int32), bitcast=True) + ch, "ld.global.nc.b32 $0, [$1];",
                       "=r,l", tl.int32, ON_GPU)
    # element 2k of a chunk is the high nibble of byte k
    shift = 8 * (e // 2) + 4 * (1 - e % 2)
    codes = (word[:, None] >> shift[None, :]) & 0xF
    vals = _lut(lut_ptr, codes, ON_GPU)
    prod = vals * absmax[:, None]
    out = _to_out_bits(prod, nan_bits[:, None], OUT_KIND, ON_GPU)

    offs = ch[:, None] * V + e[None, :]
    if MASKED:
        tl.store(out_ptr + base + offs, out, mask=offs < rem)
    else:
        tl.store(out_ptr + base + offs, out)


@triton.jit
def dequantize_nf4_kernel(
    data_ptr, absmax_ptr, nested_ptr, offset_ptr, lut_ptr, dmap_ptr, out_ptr, n,
    BLOCKSIZE: tl.constexpr, BLOCK: tl.constexpr, V: tl.constexpr,
    DOUBLE_QUANT: tl.constexpr, OUT_KIND: tl.constexpr, ON_GPU: tl.constexpr,
):
    """Decode BLOCK consecutive elements per program into ``out_ptr`` (an integer view of the output).

    V elements (4 for fp32 output, 8 for 16-bit: 16 bytes) form a chunk: one word load, one vector store.
    Every program but the last runs unmasked; the last masks and loads single bytes.
    """
    pid = tl.program_id(0).to(tl.int64)
    if (pid + 1) * BLOCK <= n:
        _nf4_tile(data_ptr, absmax_ptr, nested_ptr, offset_ptr, lut_ptr, dmap_ptr, out_ptr, n, pid,
                  BLOCKSIZE, BLOCK, V, DOUBLE_QUANT, OUT_KIND, False, ON_GPU)
    else:
        _nf4_tile(data_ptr, absmax_ptr, nested_ptr, offset_ptr, lut_ptr, dmap_ptr, out_ptr, n, pid,
                  BLOCKSIZE, BLOCK, V, DOUBLE_QUANT, OUT_KIND, True, ON_GPU)
