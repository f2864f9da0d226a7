"""W4A16 GEMM for Hopper in Gluon with the weight stored as wgmma register fragments:
``out = act(x @ dequant(w).T * g + bias)``.

The register-operand kernel (``_gemm_w4_ra``) reads the packed weight as it is stored, decodes one code per
operation and moves the decoded tile into the wgmma A operand layout through shared memory, behind a CTA
barrier. Here the weight is laid out once (``w4_fragments.fragment_words``) so that each thread's 16-byte load
per K step holds exactly the 32 codes of its A fragments, in an order where two codes 16 bits apart become one
bf16x2 / f16x2 register with a few bit operations (inline PTX, as Marlin-style dequantization does): no shared
memory for the weight, no layout change, no barrier between warpgroups. The blocked layout ``_frag_layout`` of
the [warps, 2, 8, 4, 2, 4, 2] decode tensor is, reshaped to [64 WG, 64], the wgmma A operand layout itself.

Each warpgroup of a program computes ``acc[64 weight rows, BM x rows] = w_tile @ x_tile.T``; x tiles [BM, 64]
come by TMA through a ring of ``STAGES`` slots, the weight words by plain loads two K steps ahead. As in
``_gemm_w4_ra`` the loop is unrolled by two K steps with one A register set each, each set a dependency of the
``warpgroup_mma_wait`` that retires its wgmma (``tests/kernels/test_compile_sm90.py`` checks the SASS), and
split K ends in ``gluon_device.finish_w4_tile``. Two warpgroups share the x ring with no other barrier between
them, so each pair of K steps ends in a CTA barrier before its two slots are refilled. The last pair is peeled
off the loop and ends in the wait for every wgmma, with nothing between the last wgmma and that wait. K steps
past the end read zero words and zero scales (x zeros by TMA): they add zero. Rows past N read zero scales and
are not stored. ``gemm_w4.gemm_w4_rf`` launches it; the dispatch policy routes W4A16 calls to it
(``policy.register_operand_config``).
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait

from .gluon_device import (
    finish_w4_tile,
    load_block_scales,
    ring_barriers,
    w4_acc_layout,
    w4_program_run,
    w4_scale_values,
)

BK = gl.constexpr(64)
"""K columns per step: four 16-wide chunks, one fragment word each per thread."""
WORDS = gl.constexpr(512)
"""Fragment words of one 64-row tile and one K step."""

# $4: the word (the first of the eight copies a pack of eight elements gets; $0 .. $3 the four outputs, element
# 2 p in the low half of $p). Two codes 16 bits apart -> one 32-bit register of two 16-bit values, per pair p
# (nibbles p and p + 4): the sign
# to bit 15 / 31, e1 e0 m to bits 6..8 / 22..24 (bf16) or 9..11 / 25..27 (fp16); magnitude x 2^126 / 2^14 after
_FP4_BF16 = """{ .reg .b32 s, e;
shl.b32 s, $4, 12; and.b32 s, s, 0x80008000; shl.b32 e, $4, 6; and.b32 e, e, 0x01C001C0; or.b32 $0, s, e;
shl.b32 s, $4, 8; and.b32 s, s, 0x80008000; shl.b32 e, $4, 2; and.b32 e, e, 0x01C001C0; or.b32 $1, s, e;
shl.b32 s, $4, 4; and.b32 s, s, 0x80008000; shr.b32 e, $4, 2; and.b32 e, e, 0x01C001C0; or.b32 $2, s, e;
and.b32 s, $4, 0x80008000; shr.b32 e, $4, 6; and.b32 e, e, 0x01C001C0; or.b32 $3, s, e; }"""
_FP4_F16 = """{ .reg .b32 s, e;
shl.b32 s, $4, 12; and.b32 s, s, 0x80008000; shl.b32 e, $4, 9; and.b32 e, e, 0x0E000E00; or.b32 $0, s, e;
shl.b32 s, $4, 8; and.b32 s, s, 0x80008000; shl.b32 e, $4, 5; and.b32 e, e, 0x0E000E00; or.b32 $1, s, e;
shl.b32 s, $4, 4; and.b32 s, s, 0x80008000; shl.b32 e, $4, 1; and.b32 e, e, 0x0E000E00; or.b32 $2, s, e;
and.b32 s, $4, 0x80008000; shr.b32 e, $4, 3; and.b32 e, e, 0x0E000E00; or.b32 $3, s, e; }"""
# int4: the code as the low mantissa bits of magic + code (bf16 128 + q, fp16 1024 + q)
_INT4 = """{ .reg .b32 t;
and.b32 t, $4, 0x000F000F; or.b32 $0, t, MAGIC;
shr.b32 t, $4, 4; and.b32 t, t, 0x000F000F; or.b32 $1, t, MAGIC;
shr.b32 t, $4, 8; and.b32 t, t, 0x000F000F; or.b32 $2, t, MAGIC;
shr.b32 t, $4, 12; and.b32 t, t, 0x000F000F; or.b32 $3, t, MAGIC; }"""
_INT4_BF16 = gl.constexpr(_INT4.replace("MAGIC", "0x43004300"))
_INT4_F16 = gl.constexpr(_INT4.replace("MAGIC", "0x64006400"))
_FP4_BF16 = gl.constexpr(_FP4_BF16)
_FP4_F16 = gl.constexpr(_FP4_F16)
_CONSTRAINTS = gl.constexpr("=r,=r,=r,=r,r,r,r,r,r,r,r,r")


@gluon.constexpr_function
def _frag_layout(WG):
    """The decode tensor [4 WG warps, h 2, l 8, c 4, g 2, q 4, j 2] (row 16 w + 8 h + l, column 16 c + 8 g + 2 q
    + j): registers j, h, g, c (the A fragment's order), lanes 4 l + q, warps w."""
    return gl.BlockedLayout([1, 2, 1, 4, 2, 1, 2], [1, 1, 8, 1, 1, 4, 1], [4 * int(WG), 1, 1, 1, 1, 1, 1],
                            [6, 1, 4, 3, 5, 2, 0])


@gluon.jit
def _arange4(n: gl.constexpr, dim: gl.constexpr, L: gl.constexpr):
    """[n] arange laid out as dimension ``dim`` of the 4-D layout ``L`` (to index a 4-D tensor)."""
    if dim == 0:
        return gl.arange(0, n, layout=gl.SliceLayout(1, gl.SliceLayout(2, gl.SliceLayout(3, L))))
    elif dim == 1:
        return gl.arange(0, n, layout=gl.SliceLayout(0, gl.SliceLayout(2, gl.SliceLayout(3, L))))
    elif dim == 2:
        return gl.arange(0, n, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(3, L))))
    else:
        return gl.arange(0, n, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(2, L))))


@gluon.jit
def _issue_x(x_desc, x_bufs, ready, kt, k0, m0, BM: gl.constexpr, STAGES: gl.constexpr):
    """TMA of the program's K step ``kt`` (the weight's step ``k0 + kt``) of x into ring slot ``kt % STAGES``."""
    s = kt % STAGES
    mbarrier.expect(ready.index(s), BM * BK * 2)
    tma.async_copy_global_to_shared(x_desc, [m0, (k0 + kt) * BK], ready.index(s), x_bufs.index(s))


@gluon.jit
def _load_words(w_ptr, w_off, w_ok, step, KS):
    """This thread's fragment words [4 WG, 8, 4, 4] of K step ``step`` (zeros past the last step)."""
    return gl.load(w_ptr + w_off + step * WORDS, mask=w_ok & (step < KS), other=0)


@gluon.jit
def _operand(words, scale, DT: gl.constexpr, FMT: gl.constexpr, WG: gl.constexpr, a_layout: gl.constexpr):
    """The A operand [64 WG, 64] of one K step from this thread's fragment words and block scale codes."""
    L7: gl.constexpr = _frag_layout(WG)
    shape: gl.constexpr = [4 * WG, 2, 8, 4, 2, 4, 2]
    w7 = gl.expand_dims(gl.expand_dims(gl.expand_dims(words, 1), 4), 6)
    w7 = gl.broadcast(w7, gl.full(shape, 0, gl.int32, L7))[0]
    s, z = w4_scale_values(scale, DT, FMT)
    s7 = gl.broadcast(gl.expand_dims(gl.expand_dims(gl.expand_dims(s, 4), 5), 6), w7)[0]
    if FMT == 4:
        if DT == gl.float16:
            q = gl.inline_asm_elementwise(_INT4_F16, _CONSTRAINTS, [w7], dtype=gl.float16, is_pure=True, pack=8)
        else:
            q = gl.inline_asm_elementwise(_INT4_BF16, _CONSTRAINTS, [w7], dtype=gl.bfloat16, is_pure=True, pack=8)
        z7 = gl.broadcast(gl.expand_dims(gl.expand_dims(gl.expand_dims(z, 4), 5), 6), s7)[0]
        v = (q - z7) * s7
    elif DT == gl.float16:
        v = (gl.inline_asm_elementwise(_FP4_F16, _CONSTRAINTS, [w7], dtype=gl.float16, is_pure=True, pack=8)
             * 16384.0 * s7)
    else:
        v = (gl.inline_asm_elementwise(_FP4_BF16, _CONSTRAINTS, [w7], dtype=gl.bfloat16, is_pure=True, pack=8)
             * 8.507059173023462e37 * s7)
    return gl.convert_layout(gl.reshape(v, [64 * WG, 64]), a_layout)


@gluon.jit
def _advance(s_near, s_far, w_near, w_far, step, s_ptr, rows, row_ok, chunks, K, stride_sn, w_ptr, w_off, w_ok, KS,
             GROUP: gl.constexpr, SCALE_SWIZZLED: gl.constexpr, DEEP: gl.constexpr):
    """(scales, words) of K step ``step`` from a chain of loads in flight, and the chain moved on: ``DEEP``,
    ``near`` holds ``step``, ``far`` ``step + 2``, and ``step + 4`` is loaded into ``far``; else the scales of
    ``step + 1`` and words of ``step + 2`` are loaded into ``near`` (``far`` unused)."""
    scale = s_near
    words = w_near
    if DEEP:
        s_near = s_far
        s_far = load_block_scales(s_ptr, rows, row_ok, (step + 4) * BK + chunks * 16, K, stride_sn, GROUP,
                                  SCALE_SWIZZLED)
        w_near = w_far
        w_far = _load_words(w_ptr, w_off, w_ok, step + 4, KS)
    else:
        s_near = load_block_scales(s_ptr, rows, row_ok, (step + 1) * BK + chunks * 16, K, stride_sn, GROUP,
                                   SCALE_SWIZZLED)
        w_near = _load_words(w_ptr, w_off, w_ok, step + 2, KS)
    return scale, words, s_near, s_far, w_near, w_far


@gluon.jit
def _step_pair(kt, steps, k0, m0, acc, a_odd, sc0, sc1, sc2, sc3, cur0, cur1, cur2, cur3, x_desc, x_bufs, ready,
               w_ptr, w_off, w_ok, s_ptr, rows, row_ok, chunks, K, KS, stride_sn, DT: gl.constexpr,
               FMT: gl.constexpr, GROUP: gl.constexpr, SCALE_SWIZZLED: gl.constexpr, WG: gl.constexpr,
               BM: gl.constexpr, STAGES: gl.constexpr, a_layout: gl.constexpr, DEEP: gl.constexpr,
               LAST: gl.constexpr):
    """K steps ``kt`` (even A register set) and ``kt + 1`` (odd set) of the program's run. The block scales
    ``sc*`` and fragment words ``cur*`` in flight come back two steps on: ``DEEP``, those of steps ``kt`` to
    ``kt + 3`` (loads four steps ahead); else ``sc0`` step ``kt``'s scales (one step ahead) and ``cur0`` /
    ``cur1`` its and the next step's words. ``LAST``: wait for every wgmma at the end, else for all but the odd
    one, then refill the two slots retired."""
    # step kt's operands; the loads of step kt + 4 (DEEP) or of its scales' next step and words' step after
    scale, words, sc0, sc2, cur0, cur2 = _advance(sc0, sc2, cur0, cur2, k0 + kt, s_ptr, rows, row_ok, chunks, K,
                                                  stride_sn, w_ptr, w_off, w_ok, KS, GROUP, SCALE_SWIZZLED, DEEP)
    a_even = _operand(words, scale, DT, FMT, WG, a_layout)
    mbarrier.wait(ready.index(kt % STAGES), (kt // STAGES) & 1)
    acc = warpgroup_mma(a_even, x_bufs.index(kt % STAGES).permute((1, 0)), acc, is_async=True)
    # retires the previous pair's odd wgmma: its registers (a dependency here) are free
    acc, a_odd = warpgroup_mma_wait(num_outstanding=1, deps=(acc, a_odd))
    if DEEP:
        scale, words, sc1, sc3, cur1, cur3 = _advance(sc1, sc3, cur1, cur3, k0 + kt + 1, s_ptr, rows, row_ok, chunks,
                                                      K, stride_sn, w_ptr, w_off, w_ok, KS, GROUP, SCALE_SWIZZLED,
                                                      DEEP)
    else:  # one chain of scales
        scale, words, sc0, sc3, cur1, cur3 = _advance(sc0, sc3, cur1, cur3, k0 + kt + 1, s_ptr, rows, row_ok, chunks,
                                                      K, stride_sn, w_ptr, w_off, w_ok, KS, GROUP, SCALE_SWIZZLED,
                                                      DEEP)
    a_odd = _operand(words, scale, DT, FMT, WG, a_layout)
    mbarrier.wait(ready.index((kt + 1) % STAGES), ((kt + 1) // STAGES) & 1)
    acc = warpgroup_mma(a_odd, x_bufs.index((kt + 1) % STAGES).permute((1, 0)), acc, is_async=True)
    if LAST:
        acc, a_odd, a_even = warpgroup_mma_wait(num_outstanding=0, deps=(acc, a_odd, a_even))
    else:
        # retires this pair's even wgmma; after the CTA barrier every warp (both warpgroups) has retired steps
        # kt - 1 and kt, whose x slots are refilled here (one barrier and both refills per pair: faster than a
        # barrier and a refill per step in the sweep of this change)
        acc, a_even = warpgroup_mma_wait(num_outstanding=1, deps=(acc, a_even))
        gl.thread_barrier()
        if kt + STAGES - 1 < steps:
            _issue_x(x_desc, x_bufs, ready, kt + STAGES - 1, k0, m0, BM, STAGES)
        if kt + STAGES < steps:
            _issue_x(x_desc, x_bufs, ready, kt + STAGES, k0, m0, BM, STAGES)
    return acc, a_odd, sc0, sc1, sc2, sc3, cur0, cur1, cur2, cur3


@gluon.jit
def gemm_w4_rf_kernel(x_desc, w_ptr, s_ptr, gscale_ptr, bias_ptr, out_ptr, ws_ptr, cnt_ptr, M, N, K, stride_sn,
                      stride_om, FMT: gl.constexpr, GROUP: gl.constexpr, SCALE_SWIZZLED: gl.constexpr,
                      GSCALE_MODE: gl.constexpr, HAS_BIAS: gl.constexpr, ACT: gl.constexpr, BM: gl.constexpr,
                      STAGES: gl.constexpr, GROUP_M: gl.constexpr, WG: gl.constexpr, SPLIT: gl.constexpr,
                      DEEP: gl.constexpr):
    """SPLIT programs per output tile (64 WG weight rows x BM rows of x), each over its own run of K steps, WG
    warpgroups of 4 warps per program. ``x_desc``: x [M, K] (bf16/fp16) with [BM, 64] boxes; ``w_ptr``: the
    fragment words int32 [ceil(N / 64), ceil(K / 64), 512] (``w4_fragments``); ``s_ptr``: the block scales
    (uint8 codes, linear or 128x4-swizzled; int4: the int32 ``scale | zero << 16`` words), row stride
    ``stride_sn``. SPLIT > 1: ``ws_ptr`` an fp32 workspace of SPLIT x 64 WG x BM per tile, ``cnt_ptr`` one int32
    zero per tile (left zero). STAGES >= 3."""
    ROWS: gl.constexpr = 64 * WG
    DT: gl.constexpr = x_desc.dtype
    x_bufs = gl.allocate_shared_memory(DT, [STAGES, BM, BK], x_desc.layout)
    ready = ring_barriers(STAGES)
    acc_layout: gl.constexpr = w4_acc_layout(WG, BM)
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
    L7: gl.constexpr = _frag_layout(WG)
    word_layout: gl.constexpr = gl.SliceLayout(1, gl.SliceLayout(4, gl.SliceLayout(6, L7)))    # [w, l, c, q]
    scale_layout: gl.constexpr = gl.SliceLayout(4, gl.SliceLayout(5, gl.SliceLayout(6, L7)))   # [w, h, l, c]

    tile, split, n0, m0, steps, k0 = w4_program_run(M, N, K, ROWS, BM, BK, GROUP_M, SPLIT)
    KS = gl.cdiv(K, BK)
    for i in gl.static_range(STAGES - 1):
        if i < steps:
            _issue_x(x_desc, x_bufs, ready, i, k0, m0, BM, STAGES)

    # fragment words: 64-row tile n0 / 64 + w // 4, warp w % 4 of it; each thread's 4 words contiguous
    ww = _arange4(4 * WG, 0, word_layout)[:, None, None, None]
    lane = (_arange4(8, 1, word_layout)[None, :, None, None] * 4 + _arange4(4, 3, word_layout)[None, None, None, :])
    chunk = _arange4(4, 2, word_layout)[None, None, :, None]
    t64 = n0 // 64 + ww // 4
    w_ok = t64 < gl.cdiv(N, 64)
    w_off = ((t64.to(gl.int64) * KS) * 4 + ww % 4) * 128 + lane * 4 + chunk
    # block scales: rows 16 w + 8 h + l of the program's tile, chunks c
    rows = (n0 + _arange4(4 * WG, 0, scale_layout)[:, None, None, None] * 16
            + _arange4(2, 1, scale_layout)[None, :, None, None] * 8 + _arange4(8, 2, scale_layout)[None, None, :, None])
    row_ok = rows < N
    chunks = _arange4(4, 3, scale_layout)[None, None, None, :]

    sc0 = load_block_scales(s_ptr, rows, row_ok, k0 * BK + chunks * 16, K, stride_sn, GROUP, SCALE_SWIZZLED)
    cur0 = _load_words(w_ptr, w_off, w_ok, k0, KS)
    cur1 = _load_words(w_ptr, w_off, w_ok, k0 + 1, KS)
    if DEEP:
        sc1 = load_block_scales(s_ptr, rows, row_ok, (k0 + 1) * BK + chunks * 16, K, stride_sn, GROUP,
                                SCALE_SWIZZLED)
        sc2 = load_block_scales(s_ptr, rows, row_ok, (k0 + 2) * BK + chunks * 16, K, stride_sn, GROUP,
                                SCALE_SWIZZLED)
        sc3 = load_block_scales(s_ptr, rows, row_ok, (k0 + 3) * BK + chunks * 16, K, stride_sn, GROUP,
                                SCALE_SWIZZLED)
        cur2 = _load_words(w_ptr, w_off, w_ok, k0 + 2, KS)
        cur3 = _load_words(w_ptr, w_off, w_ok, k0 + 3, KS)
    else:
        sc1 = sc0
        sc2 = sc0
        sc3 = sc0
        cur2 = cur0
        cur3 = cur1
    acc = gl.zeros([ROWS, BM], gl.float32, acc_layout)
    a_odd = gl.zeros([ROWS, BK], DT, a_layout)
    # the last pair of K steps is peeled off: its wait for every wgmma directly follows the last one, so that no
    # read of the accumulator can be scheduled before it (ptxas moved the epilogue's conversions of the
    # accumulator above a wait placed after the loop)
    for kt in range(0, steps - 2, 2):
        acc, a_odd, sc0, sc1, sc2, sc3, cur0, cur1, cur2, cur3 = _step_pair(
            kt, steps, k0, m0, acc, a_odd, sc0, sc1, sc2, sc3, cur0, cur1, cur2, cur3, x_desc, x_bufs, ready, w_ptr,
            w_off, w_ok, s_ptr, rows, row_ok, chunks, K, KS, stride_sn, DT, FMT, GROUP, SCALE_SWIZZLED, WG, BM,
            STAGES, a_layout, DEEP, False)
    acc, a_odd, sc0, sc1, sc2, sc3, cur0, cur1, cur2, cur3 = _step_pair(
        steps - 2, steps, k0, m0, acc, a_odd, sc0, sc1, sc2, sc3, cur0, cur1, cur2, cur3, x_desc, x_bufs, ready,
        w_ptr, w_off, w_ok, s_ptr, rows, row_ok, chunks, K, KS, stride_sn, DT, FMT, GROUP, SCALE_SWIZZLED, WG, BM,
        STAGES, a_layout, DEEP, True)
    finish_w4_tile(acc, ws_ptr, cnt_ptr, tile, split, gscale_ptr, bias_ptr, out_ptr, M, N, stride_om, n0, m0,
                   acc_layout, ROWS, BM, SPLIT, GSCALE_MODE, HAS_BIAS, ACT)
