"""Warp-specialized fp8_block x fp8_block GEMM for Hopper, written in Gluon (DeepGEMM's structure).

``out = alpha * (a * sa) @ (b * sb).T + bias``: a [M, K] E4M3 with fp32 scales per (row, 128-column block), b
[N, K] E4M3 with fp32 scales per 128 x 128 block. Each 128-wide K tile's FP8 product is promoted into the fp32
accumulator with ``sa[m] * sb`` (DeepSeek-V3's promotion), so the result equals the reference up to fp32
accumulation order (the same math as ``_scaled_mm.fp8_block_mm_tma_kernel``).

Why warp specialization: in the one-partition Triton kernel every warp waits for its K tile's wgmma, then does
the promotion FMAs while the tensor cores sit idle, then issues the next loads (0.55-0.70x of
``torch._scaled_mm`` on an H200). Here the partitions run independently:

- a producer warp issues the TMA loads of A and B tiles into a ring of ``STAGES`` shared-memory slots, as far
  ahead as the slots allow (``ready`` / ``empty`` mbarriers per slot);
- two consumer warpgroups each own 64 rows of the 128-row tile. Each issues its wgmma for a K tile, waits for it,
  releases the slot and promotes; while one promotes, the other's wgmma keeps the tensor cores busy.

The launch is persistent: every program walks the output tiles ``pid, pid + P, ...`` in grouped order; the
producer runs ahead into the next tile while the consumers finish the epilogue of the current one.
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from .gluon_device import ROWS_PER_CONSUMER, grouped_tile


def launch_options(consumers: int = 2) -> dict:
    """num_warps and the register cap: 2 consumer + 1 producer warpgroups share the 64K-register file (3 x 168
    per thread); setmaxnreg then moves registers from the producer (24) to the consumers (240)."""
    assert consumers == 2, "two consumer warpgroups (three spill at 160 registers)"
    return {"num_warps": 4, "maxnreg": 168}


@gluon.jit
def _producer(a_desc, b_desc, c_desc, a_bufs, b_bufs, c_bufs, ready, empty, as_ptr, bs_ptr, alpha_ptr, bias_ptr, out_ptr,
              M, N, K, stride_as0, stride_as1, stride_bs0, stride_bs1, stride_om,
              B_ROWS_PER_SCALE: gl.constexpr, HAS_ALPHA: gl.constexpr, HAS_BIAS: gl.constexpr,
              BM: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr, STAGES: gl.constexpr,
              GROUP_M: gl.constexpr, TMA_STORE: gl.constexpr, WG: gl.constexpr):
    num_m = gl.cdiv(M, BM)
    num_n = gl.cdiv(N, BN)
    k_tiles = gl.cdiv(K, BK)
    tile_bytes: gl.constexpr = (BM + BN) * BK
    it = 0
    for tile in range(gl.program_id(0), num_m * num_n, gl.num_programs(0)):
        pid_m, pid_n = grouped_tile(tile, num_m, num_n, GROUP_M)
        for kt in range(k_tiles):
            slot = it % STAGES
            # a fresh mbarrier counts as having completed the phase before phase 0: the first lap does not wait
            mbarrier.wait(empty.index(slot), ((it // STAGES) & 1) ^ 1)
            bar = ready.index(slot)
            mbarrier.expect(bar, tile_bytes)
            # one [64, BK] box of A per consumer warpgroup (each consumer's wgmma reads its own slot)
            for c in gl.static_range(BM // ROWS_PER_CONSUMER):
                tma.async_copy_global_to_shared(a_desc, [pid_m * BM + c * ROWS_PER_CONSUMER, kt * BK], bar,
                                                a_bufs.index(slot * (BM // ROWS_PER_CONSUMER) + c))
            tma.async_copy_global_to_shared(b_desc, [pid_n * BN, kt * BK], bar, b_bufs.index(slot))
            it += 1


@gluon.jit
def _k_tile_scales(sa_ptrs, sb_ptr, row_ok, kt, stride_as1, stride_bs1):
    """The activation scales of the consumer's rows and the tile's weight scale for K tile kt."""
    return gl.load(sa_ptrs + kt * stride_as1, mask=row_ok, other=0.0), gl.load(sb_ptr + kt * stride_bs1)


@gluon.jit
def _issue(a_bufs, b_bufs, ready, it, zero, WG: gl.constexpr, CONSUMERS: gl.constexpr, STAGES: gl.constexpr):
    """Wait for ring slot ``it % STAGES`` and start this warpgroup's wgmma on it (into fresh registers)."""
    slot = it % STAGES
    mbarrier.wait(ready.index(slot), (it // STAGES) & 1)
    a = a_bufs.index(slot * CONSUMERS + WG)
    return warpgroup_mma(a, b_bufs.index(slot).permute((1, 0)), zero, use_acc=False, is_async=True)


@gluon.jit
def _consumer(a_desc, b_desc, c_desc, a_bufs, b_bufs, c_bufs, ready, empty, as_ptr, bs_ptr, alpha_ptr, bias_ptr, out_ptr,
              M, N, K, stride_as0, stride_as1, stride_bs0, stride_bs1, stride_om,
              B_ROWS_PER_SCALE: gl.constexpr, HAS_ALPHA: gl.constexpr, HAS_BIAS: gl.constexpr,
              BM: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr, STAGES: gl.constexpr,
              GROUP_M: gl.constexpr, TMA_STORE: gl.constexpr, WG: gl.constexpr):
    """Warpgroup ``WG`` of the consumers: rows [WG * 64, WG * 64 + 64) of every tile."""
    R: gl.constexpr = ROWS_PER_CONSUMER
    gl.static_assert(B_ROWS_PER_SCALE % BN == 0, "the BN rows of a tile must share one weight scale block")
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, BN, 32])
    row_layout: gl.constexpr = gl.SliceLayout(1, acc_layout)
    col_layout: gl.constexpr = gl.SliceLayout(0, acc_layout)
    num_m = gl.cdiv(M, BM)
    num_n = gl.cdiv(N, BN)
    k_tiles = gl.cdiv(K, BK)
    zero = gl.zeros([R, BN], gl.float32, acc_layout)
    it = 0
    for tile in range(gl.program_id(0), num_m * num_n, gl.num_programs(0)):
        pid_m, pid_n = grouped_tile(tile, num_m, num_n, GROUP_M)
        rows = pid_m * BM + WG * R + gl.arange(0, R, layout=row_layout)
        row_ok = rows < M
        sa_ptrs = as_ptr + rows.to(gl.int64) * stride_as0
        cols = pid_n * BN + gl.arange(0, BN, layout=col_layout)
        col_ok = cols < N
        sb_ptr = bs_ptr + ((pid_n * BN) // B_ROWS_PER_SCALE) * stride_bs0
        # The wgmma of each K tile is waited for at once: promoting tile kt - 1 while tile kt's wgmma runs would
        # read accumulator registers inside a wgmma pipeline stage, and ptxas then serializes every wgmma
        # (C7514; measured 0.55x instead of 0.65x). The other consumer warpgroup's wgmma fills the gap instead.
        # The scales of tile kt + 1 are loaded while tile kt runs: an L2 round trip under this much TMA
        # traffic is longer than one tile's wgmma.
        sa, sb = _k_tile_scales(sa_ptrs, sb_ptr, row_ok, 0, stride_as1, stride_bs1)
        acc = zero
        for kt in range(k_tiles):
            nxt = gl.minimum(kt + 1, k_tiles - 1)
            nsa, nsb = _k_tile_scales(sa_ptrs, sb_ptr, row_ok, nxt, stride_as1, stride_bs1)
            part = _issue(a_bufs, b_bufs, ready, it, zero, WG, BM // R, STAGES)
            part = warpgroup_mma_wait(num_outstanding=0, deps=(part, ))
            # the slot is free once this warpgroup's wgmma has read it (the arrive follows a warpgroup barrier)
            mbarrier.arrive(empty.index(it % STAGES), count=1)
            acc += part * (sa * sb)[:, None]
            sa = nsa
            sb = nsb
            it += 1
        if HAS_ALPHA:
            acc = acc * gl.load(alpha_ptr)
        if HAS_BIAS:
            acc = acc + gl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(gl.float32)[None, :]
        if TMA_STORE:
            c_smem = c_bufs.index(WG)
            tma.store_wait(0)  # this warpgroup's previous tile has left c_smem
            c_smem.store(acc.to(c_desc.dtype))
            fence_async_shared()
            tma.async_copy_shared_to_global(c_desc, [pid_m * BM + WG * R, pid_n * BN], c_smem)
        else:
            ptrs = out_ptr + rows.to(gl.int64)[:, None] * stride_om + cols[None, :]
            gl.store(ptrs, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])
    if TMA_STORE:
        tma.store_wait(0)


@gluon.jit
def fp8_block_mm_ws_kernel(a_desc, b_desc, c_desc, as_ptr, bs_ptr, alpha_ptr, bias_ptr, out_ptr,
                           M, N, K, stride_as0, stride_as1, stride_bs0, stride_bs1, stride_om,
                           B_ROWS_PER_SCALE: gl.constexpr, HAS_ALPHA: gl.constexpr, HAS_BIAS: gl.constexpr,
                           BN: gl.constexpr, STAGES: gl.constexpr, GROUP_M: gl.constexpr,
                           CONSUMERS: gl.constexpr, CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr,
                           TMA_STORE: gl.constexpr):
    """Launch with num_warps=4 (the default partition is consumer warpgroup 0) and a grid of at most one program
    per SM. ``a_desc`` has [64, 128] boxes, ``b_desc`` [BN, 128]; CONSUMERS is 2 or 3. TMA_STORE: each consumer
    writes its [64, BN] output block to shared memory and one TMA store takes it out (``c_desc`` over ``out``,
    [64, BN] boxes; it clips the edges), so the next tile's K loop starts while the store drains."""
    BM: gl.constexpr = CONSUMERS * ROWS_PER_CONSUMER
    BK: gl.constexpr = 128
    a_bufs = gl.allocate_shared_memory(a_desc.dtype, [STAGES * CONSUMERS, ROWS_PER_CONSUMER, BK], a_desc.layout)
    b_bufs = gl.allocate_shared_memory(b_desc.dtype, [STAGES, BN, BK], b_desc.layout)
    if TMA_STORE:
        c_bufs = gl.allocate_shared_memory(c_desc.dtype, [CONSUMERS, ROWS_PER_CONSUMER, BN], c_desc.layout)
    else:
        c_bufs = b_bufs
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=CONSUMERS)  # one arrival per consumer warpgroup
    # The argument tuples are written out in place (a tuple assigned to a variable turns its constexprs into
    # tensors); the last one is the warpgroup index (-1: the producer).
    gl.static_assert(CONSUMERS == 2, "two consumer warpgroups (three spill at 160 registers)")
    gl.warp_specialize([
        (_consumer, (a_desc, b_desc, c_desc, a_bufs, b_bufs, c_bufs, ready, empty, as_ptr, bs_ptr, alpha_ptr, bias_ptr, out_ptr,
                     M, N, K, stride_as0, stride_as1, stride_bs0, stride_bs1, stride_om,
                     B_ROWS_PER_SCALE, HAS_ALPHA, HAS_BIAS, BM, BN, BK, STAGES, GROUP_M, TMA_STORE, 0)),
        (_consumer, (a_desc, b_desc, c_desc, a_bufs, b_bufs, c_bufs, ready, empty, as_ptr, bs_ptr, alpha_ptr, bias_ptr, out_ptr,
                     M, N, K, stride_as0, stride_as1, stride_bs0, stride_bs1, stride_om,
                     B_ROWS_PER_SCALE, HAS_ALPHA, HAS_BIAS, BM, BN, BK, STAGES, GROUP_M, TMA_STORE, 1)),
        (_producer, (a_desc, b_desc, c_desc, a_bufs, b_bufs, c_bufs, ready, empty, as_ptr, bs_ptr, alpha_ptr, bias_ptr, out_ptr,
                     M, N, K, stride_as0, stride_as1, stride_bs0, stride_bs1, stride_om,
                     B_ROWS_PER_SCALE, HAS_ALPHA, HAS_BIAS, BM, BN, BK, STAGES, GROUP_M, TMA_STORE, -1)),
    ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])
