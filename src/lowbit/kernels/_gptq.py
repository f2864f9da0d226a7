"""Triton kernel for one block of GPTQ's coordinate-descent refinement (:mod:`lowbit.algorithms.gptq_refine`).

The refinement's objective is separable over the weight's rows: within a block of columns, a row's moves read
only that row's values and its row of ``G = E H``. So one program owns a tile of rows and runs every column
of the block in order, with the tile of ``G`` for the block's columns in registers (updated by one rank-1
FMA per column), where the torch loop launches about twenty kernels per column over all rows.

Each column does what ``gptq_refine._column`` does, in the same fp32 operation order: ``target = w + (g -
e * d) / d`` (the product is ``mul.rn``, never contracted into the subtraction; the division is IEEE), the
distance to each of the row's 16 grid levels, the first nearest level (NaN counts as smallest, as
``torch.argmin``), a move only when strictly nearer than the current level and ``H_jj > 0``. Only the rank-1
update of ``G`` may round differently from torch's ``addr_`` (one FMA); a level is always one of the grid's
own decoded values, so the codes still decode to the values bit for bit.
"""

import triton
import triton.language as tl


@triton.jit
def _mul_rn(a, b, ON_GPU: tl.constexpr):
    # an explicitly rounded product: ptxas never fuses mul.rn into a following add (torch rounds it too)
    if ON_GPU:
        return tl.inline_asm_elementwise("mul.rn.f32 $0, $1, $2;", "=r,r,r", [a, b], dtype=tl.float32,
                                         is_pure=True, pack=1)
    else:
        return a * b


@triton.jit
def refine_block_kernel(
    wt_ptr, qt_ptr, ct_ptr, et_ptr, gt_ptr, h_ptr, diag_ptr, lv_ptr, de_ptr,
    ROWS, COLS, B1, NCOLS, GROUP,
    BS: tl.constexpr, BR: tl.constexpr, ON_GPU: tl.constexpr,
):
    """Columns ``B1 .. B1 + NCOLS`` (``NCOLS <= BS``) for rows ``pid * BR ..``, in place.

    ``wt, qt, et, gt`` fp32 and ``ct`` (uint8 or int32 codes) are ``[COLS, ROWS]`` (a weight column is a
    contiguous row); ``h`` fp32 ``[COLS, COLS]``; ``diag`` fp32 ``[COLS]`` (``H_jj``); ``lv`` fp32
    ``[COLS / GROUP, ROWS, 16]`` (each group's levels per row, index = code); ``de`` fp32 ``[BS, ROWS]``
    receives each column's change of E.
    """
    pid = tl.program_id(0)
    r = pid * BR + tl.arange(0, BR)
    rmask = r < ROWS
    r64 = r.to(tl.int64)
    rows64 = r64 * 0 + ROWS  # [BR] int64: every offset below is computed in 64 bits
    k = tl.arange(0, BS)
    kmask = k < NCOLS
    # G's rows for the block's columns, [BS, BR]
    g_offs = (B1 + k).to(tl.int64)[:, None] * ROWS + r64[None, :]
    g_mask = kmask[:, None] & rmask[None, :]
    gb = tl.load(gt_ptr + g_offs, mask=g_mask, other=0.0)
    for i in range(NCOLS):
        j = B1 + i
        col = rows64 * j + r64
        w = tl.load(wt_ptr + col, mask=rmask, other=0.0)
        q = tl.load(qt_ptr + col, mask=rmask, other=0.0)
        c = tl.load(ct_ptr + col, mask=rmask, other=0).to(tl.int32)
        e = tl.load(et_ptr + col, mask=rmask, other=0.0)
        d_raw = tl.zeros([BR], dtype=tl.float32) + tl.load(diag_ptr + j)
        positive = d_raw > 0
        d = tl.where(positive, d_raw, 1.0)
        gi = tl.sum(tl.where(k[:, None] == i, gb, 0.0), axis=0)
        target = w + tl.div_rn(gi - _mul_rn(e, d, ON_GPU), d)
        lv_row = (rows64 * (j // GROUP) + r64) * 16
        best = tl.zeros([BR], dtype=tl.int32)
        best_v = tl.load(lv_ptr + lv_row, mask=rmask, other=0.0)
        best_d = tl.abs(best_v - target)
        cur_d = tl.where(c == 0, best_d, 0.0)
        cur_v = tl.where(c == 0, best_v, 0.0)
        for n in tl.static_range(1, 16):
            v = tl.load(lv_ptr + lv_row + n, mask=rmask, other=0.0)
            dist = tl.abs(v - target)
            # torch.argmin: the first minimum, a NaN before any number
            take = (dist < best_d) | ((dist != dist) & (best_d == best_d))  # noqa: PLR0124 - NaN tests
            best = tl.where(take, n, best)
            best_d = tl.where(take, dist, best_d)
            best_v = tl.where(take, v, best_v)
            cur_d = tl.where(c == n, dist, cur_d)
            cur_v = tl.where(c == n, v, cur_v)
        better = (best_d < cur_d) & positive
        new_c = tl.where(better, best, c)
        q_new = tl.where(better, best_v, cur_v)
        delta = q - q_new
        tl.store(ct_ptr + col, new_c.to(ct_ptr.dtype.element_ty), mask=rmask)
        tl.store(qt_ptr + col, q_new, mask=rmask)
        tl.store(et_ptr + col, e + delta, mask=rmask)
        tl.store(de_ptr + rows64 * i + r64, delta, mask=rmask)
        h_row = tl.load(h_ptr + (k.to(tl.int64) * 0 + COLS) * j + B1 + k, mask=kmask, other=0.0)
        gb = gb + h_row[:, None] * delta[None, :]
    tl.store(gt_ptr + g_offs, gb, mask=g_mask)
