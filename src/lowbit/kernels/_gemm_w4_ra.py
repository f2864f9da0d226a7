"""W4A16 GEMM for Hopper in Gluon with the decoded weight as the wgmma's register operand:
``out = act(x @ dequant(w).T * g + bias)``.

Each warpgroup of a program computes the transposed tile ``acc[64 weight rows, BM x rows] = w_tile @ x_tile.T``
(WG warpgroups: 64 WG weight rows sharing the x tiles): TMA streams x tiles [BM, BK] and packed weight tiles
(the weight's uint8 rows viewed as int32 words, boxes [64 WG, BK / 8]) into a ring of ``STAGES`` slots; the
program decodes a weight tile exactly into the activation dtype (``gluon_device.decode_w4_words``, the
warp-specialized kernel's decode), converts it to the wgmma A
operand layout and issues ``m64nBMk16`` wgmmas with A from registers and x from shared memory, keeping one
K step in flight, so the decode of the next tile overlaps the tensor cores of this one.

Why it is written this way: the tensor cores read a register operand asynchronously, until the
``wgmma.wait_group`` that retires the wgmma, and neither Triton 3.6's pipeliner nor a plain Gluon loop keeps
those registers from being reused before then (Triton's wait covers only the first wgmma of a tile,
triton-lang/triton#9433; a loop-carried A value in Gluon is copied at the back edge and its registers
rewritten by the next decode, seen in the sm_90 SASS). Here the loop is unrolled by two K tiles with one A
register set each, and each set is a dependency of the ``warpgroup_mma_wait`` that retires its wgmma (the
even set of the second wait of a pass, the odd set of the first wait of the next), so every set stays live,
untouched, while its wgmma runs and no live set crosses the loop's back edge: the sm_90 build keeps the two
sets in disjoint registers and writes neither before its retiring wait (``tests/kernels/test_compile_sm90.py``
checks the SASS).

Where the output tiles are too few to fill the GPU, SPLIT programs share a tile, each over an equal run of K
steps; the last to finish sums the fp32 partials in a fixed order (deterministic) and runs the epilogue.

K steps past the end (an odd count, a ragged K, a last split's run) are TMA reads out of bounds, zeros, with
masked scale loads: they add zero. Rows past M and N are read as zeros and not stored.

``gemm_w4.gemm_w4_ra`` launches it; ``tests/kernels/test_gemm_w4_ra_gpu.py`` checks it on a GPU.
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait

from .gluon_device import (
    decode_w4_words,
    finish_w4_tile,
    load_w4_scales,
    ring_barriers,
    w4_acc_layout,
    w4_program_run,
)


@gluon.jit
def _issue(x_desc, w_desc, x_bufs, raw_bufs, ready, kt, k0, m0, n0, ROWS: gl.constexpr, BM: gl.constexpr,
           BK: gl.constexpr, STAGES: gl.constexpr):
    """TMA of the program's K step ``kt`` (the weight's K step ``k0 + kt``): x and packed weight tiles into
    ring slot ``kt % STAGES`` (the caller knows the slot's previous wgmma has retired)."""
    s = kt % STAGES
    mbarrier.expect(ready.index(s), BM * BK * 2 + ROWS * BK // 2)
    tma.async_copy_global_to_shared(x_desc, [m0, (k0 + kt) * BK], ready.index(s), x_bufs.index(s))
    tma.async_copy_global_to_shared(w_desc, [n0, (k0 + kt) * (BK // 8)], ready.index(s), raw_bufs.index(s))


@gluon.jit
def _operand(raw_bufs, ready, kt, scale, DT: gl.constexpr, FMT: gl.constexpr, STAGES: gl.constexpr,
             word_layout: gl.constexpr, shift_layout: gl.constexpr, a_layout: gl.constexpr):
    """K step ``kt``'s decoded weight tile as the wgmma A operand, once its TMA has landed."""
    s = kt % STAGES
    mbarrier.wait(ready.index(s), (kt // STAGES) & 1)
    packed = raw_bufs.index(s).load(word_layout)
    return gl.convert_layout(decode_w4_words(packed, scale, DT, FMT, shift_layout), a_layout)


@gluon.jit
def gemm_w4_ra_kernel(x_desc, w_desc, s_ptr, gscale_ptr, bias_ptr, out_ptr, ws_ptr, cnt_ptr, M, N, K, stride_sn,
                      stride_om,
                      FMT: gl.constexpr, GROUP: gl.constexpr, SCALE_SWIZZLED: gl.constexpr,
                      GSCALE_MODE: gl.constexpr, HAS_BIAS: gl.constexpr, ACT: gl.constexpr, BM: gl.constexpr,
                      BK: gl.constexpr, STAGES: gl.constexpr, GROUP_M: gl.constexpr, WG: gl.constexpr,
                      SPLIT: gl.constexpr):
    """SPLIT programs per output tile (64 WG weight rows x BM rows of x), each over its own run of K steps, WG
    warpgroups of 4 warps per program, each with its own 64 weight rows. ``x_desc``: x [M, K] (bf16/fp16) with
    [BM, BK] boxes; ``w_desc``: the packed weight as int32 [N, K / 8] with [64 WG, BK / 8] boxes; ``s_ptr``: the
    block scales (uint8 codes, linear or 128x4-swizzled; int4: the int32 ``scale | zero << 16`` words), row
    stride ``stride_sn``. SPLIT > 1: ``ws_ptr`` an fp32 workspace of SPLIT x 64 WG x BM per tile, ``cnt_ptr``
    one int32 zero per tile (left zero). STAGES >= 3 (two K steps in flight per pass)."""
    W: gl.constexpr = BK // 8
    ROWS: gl.constexpr = 64 * WG
    DT: gl.constexpr = x_desc.dtype
    x_bufs = gl.allocate_shared_memory(DT, [STAGES, BM, BK], x_desc.layout)
    raw_bufs = gl.allocate_shared_memory(gl.int32, [STAGES, ROWS, W], w_desc.layout)
    ready = ring_barriers(STAGES)
    acc_layout: gl.constexpr = w4_acc_layout(WG, BM)
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
    # one thread holds the eight codes of a word; a warp covers 32 / W rows of W words
    code_layout: gl.constexpr = gl.BlockedLayout([1, 1, 8], [32 // W, W, 1], [4 * WG, 1, 1], [2, 1, 0])
    word_layout: gl.constexpr = gl.SliceLayout(2, code_layout)
    shift_layout: gl.constexpr = gl.SliceLayout(0, gl.SliceLayout(0, code_layout))

    tile, split, n0, m0, steps, k0 = w4_program_run(M, N, K, ROWS, BM, BK, GROUP_M, SPLIT)
    for i in gl.static_range(STAGES - 1):
        if i < steps:
            _issue(x_desc, w_desc, x_bufs, raw_bufs, ready, i, k0, m0, n0, ROWS, BM, BK, STAGES)
    words = gl.arange(0, W, layout=gl.SliceLayout(0, word_layout))
    rows = n0 + gl.arange(0, ROWS, layout=gl.SliceLayout(1, word_layout))
    row_ok = rows < N
    # block scales prefetched one K step ahead in registers (an L2 round trip is longer than a step)
    nxt = load_w4_scales(s_ptr, rows, row_ok, words, k0, K, stride_sn, FMT, GROUP, BK, SCALE_SWIZZLED)
    acc = gl.zeros([ROWS, BM], gl.float32, acc_layout)
    a_odd = gl.zeros([ROWS, BK], DT, a_layout)
    for kt in range(0, steps, 2):
        scale = nxt
        nxt = load_w4_scales(s_ptr, rows, row_ok, words, k0 + kt + 1, K, stride_sn, FMT, GROUP, BK, SCALE_SWIZZLED)
        a_even = _operand(raw_bufs, ready, kt, scale, DT, FMT, STAGES, word_layout, shift_layout, a_layout)
        acc = warpgroup_mma(a_even, x_bufs.index(kt % STAGES).permute((1, 0)), acc, is_async=True)
        # retires the previous pass's odd wgmma: its registers (a dependency here) and its slot are free
        acc, a_odd = warpgroup_mma_wait(num_outstanding=1, deps=(acc, a_odd))
        if kt + STAGES - 1 < steps:
            _issue(x_desc, w_desc, x_bufs, raw_bufs, ready, kt + STAGES - 1, k0, m0, n0, ROWS, BM, BK,
                       STAGES)
        scale = nxt
        nxt = load_w4_scales(s_ptr, rows, row_ok, words, k0 + kt + 2, K, stride_sn, FMT, GROUP, BK, SCALE_SWIZZLED)
        a_odd = _operand(raw_bufs, ready, kt + 1, scale, DT, FMT, STAGES, word_layout, shift_layout, a_layout)
        acc = warpgroup_mma(a_odd, x_bufs.index((kt + 1) % STAGES).permute((1, 0)), acc, is_async=True)
        # retires this pass's even wgmma
        acc, a_even = warpgroup_mma_wait(num_outstanding=1, deps=(acc, a_even))
        if kt + STAGES < steps:
            _issue(x_desc, w_desc, x_bufs, raw_bufs, ready, kt + STAGES, k0, m0, n0, ROWS, BM, BK, STAGES)
    acc, a_odd = warpgroup_mma_wait(num_outstanding=0, deps=(acc, a_odd))

    finish_w4_tile(acc, ws_ptr, cnt_ptr, tile, split, gscale_ptr, bias_ptr, out_ptr, M, N, stride_om, n0, m0,
                   acc_layout, ROWS, BM, SPLIT, GSCALE_MODE, HAS_BIAS, ACT)
