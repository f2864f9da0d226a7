"""Warp-specialized W4A16 GEMM for Hopper, written in Gluon: ``out = act(x @ dequant(w).T * g + bias)``.

The decoded-operand design. The 4-bit weight is decoded into shared memory by a warpgroup of its own, and the
tensor cores read both operands from shared memory, so no wgmma takes an operand from registers (Triton 3.6's
register-A hazard) and no warp that issues a wgmma waits for a decode:

- a loader warp streams x tiles [64, BK] (one per consumer warpgroup) into a ring of ``STAGES`` slots and the
  packed weight tiles (int32 words [BN, BK / 8], eight codes per word) into a ring of ``RSTAGES`` slots, running
  ``RLAG`` K steps further ahead with the weight so that its bytes have arrived when the decoder wants them;
- a decoder warpgroup takes a packed tile, fetches its block scales (prefetched one K step ahead into
  registers), decodes it exactly into the activation dtype and stores it as the [BN, BK] K-major wgmma operand
  into the slot the consumers free;
- two consumer warpgroups each own 64 rows of the 128-row output tile and run one wgmma per K step from
  shared memory, keeping one in flight; the fp32 accumulator gets the epilogue (global scale, bias, activation)
  and one rounding to the output dtype.

Program ``p`` of ``P`` walks the output tiles ``p, p + P, ...`` in grouped order, every partition the same flat
sequence of (tile, K step). The launcher starts one program per tile: with several tiles per program the
outputs were nondeterministic on an H200 (a quarter of the second tiles wrong; waiting for every wgmma did not
change it; the cause is not found), with one they are exact and repeatable.

Status: correct (GPU tests against the fp32 reference and the Triton GEMM), not routed by ``lowbit.ops.policy``:
on an H200 it runs at 0.12-0.52x cuBLAS bf16, below the routes it would replace at every M. Without any decode
the skeleton (x loads, shared-memory stores of a tile, the wgmma ring) already takes 0.45x; docs/perf_notes.md
has the measurements. ``DEBUG`` selects the probe's variants (0 is the kernel): 1 stores the packed bits
undecoded, 2 skips the scale loads, 4 skips the weight loads and decode, 5 waits for every wgmma.

Decoding (exact, the same values as ``_gemm_w4``'s decode and the formats' references):
- FMT 0 nvfp4 / 1 mxfp4: an E2M1 code's bits go to the bottom of the exponent field of the activation dtype
  (bf16: times 2^126, fp16: times 2^14, code 1 a subnormal), times the block scale converted to that dtype
  (e4m3, or e8m0 built from its exponent); both products are exact. The nvfp4 global scale is the epilogue's
  (``GSCALE_MODE`` 1: times 1 / S, 2: times an exact per-tensor multiplier p).
- FMT 4 int4 (AutoAWQ after ``gemm_w4.prelayout_int4_awq``): ``(MAGIC + q) - (MAGIC + z)`` is exact and the
  product with the fp16 scale converted to the activation dtype rounds once.

The packed words are the weight's uint8 [N, K / 2] rows viewed as int32: nibble j of word c is element 8c + j.
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

from .gluon_device import ROWS_PER_CONSUMER, decode_w4_words, grouped_tile, load_w4_scales, w4_activation

CONSUMERS = gl.constexpr(2)
DECODE_WARPS = gl.constexpr(4)


def launch_options() -> dict:
    """num_warps (the default partition: consumer warpgroup 0) and the register cap before the partitions
    set their own. Four warpgroups (2 consumers, the decoder, the loader warp padded to a warpgroup) share the
    64K-register file at 128 per thread; Triton gives the default partition what the others leave:
    4 * 128 - (consumer + loader + decoder), so CONSUMER_REGS 168, LOADER_REGS 24, DECODER_REGS 152 give both
    consumers 168."""
    return {"num_warps": 4, "maxnreg": 128}


@gluon.jit
def _program_steps(M, N, K, BN: gl.constexpr, BK: gl.constexpr):
    """(row tiles, column tiles, K steps per tile, this program's number of (tile, K step) steps)."""
    num_m = gl.cdiv(M, CONSUMERS * ROWS_PER_CONSUMER)
    num_n = gl.cdiv(N, BN)
    k_tiles = gl.cdiv(K, BK)
    return num_m, num_n, k_tiles, gl.cdiv(num_m * num_n - gl.program_id(0), gl.num_programs(0)) * k_tiles


@gluon.jit
def _step_coords(step, k_tiles, num_m, num_n, GROUP_M: gl.constexpr):
    """Flat step of this program -> (pid_m, pid_n, kt)."""
    tile = gl.program_id(0) + (step // k_tiles) * gl.num_programs(0)
    pid_m, pid_n = grouped_tile(tile, num_m, num_n, GROUP_M)
    return pid_m, pid_n, step % k_tiles


@gluon.jit
def _load_weight(w_desc, raw_bufs, raw_ready, raw_empty, step, k_tiles, num_m, num_n, BN: gl.constexpr,
                 BK: gl.constexpr, RSTAGES: gl.constexpr, GROUP_M: gl.constexpr):
    """TMA of step ``step``'s packed weight tile into its ring slot, once the decoder has handed the slot back."""
    _, pid_n, kt = _step_coords(step, k_tiles, num_m, num_n, GROUP_M)
    r = step % RSTAGES
    mbarrier.wait(raw_empty.index(r), ((step // RSTAGES) & 1) ^ 1)
    mbarrier.expect(raw_ready.index(r), BN * BK // 2)
    tma.async_copy_global_to_shared(w_desc, [pid_n * BN, kt * (BK // 8)], raw_ready.index(r), raw_bufs.index(r))


@gluon.jit
def _loader(x_desc, w_desc, x_bufs, raw_bufs, x_ready, raw_ready, raw_empty, empty, M, N, K,
            BN: gl.constexpr, BK: gl.constexpr, STAGES: gl.constexpr, RSTAGES: gl.constexpr, RLAG: gl.constexpr,
            GROUP_M: gl.constexpr, DEBUG: gl.constexpr):
    BM: gl.constexpr = CONSUMERS * ROWS_PER_CONSUMER
    num_m, num_n, k_tiles, total = _program_steps(M, N, K, BN, BK)
    x_bytes: gl.constexpr = BM * BK * 2
    # the weight runs RLAG steps ahead of x: its first RLAG steps before the loop
    for s in range(gl.minimum(RLAG, total) if DEBUG != 4 else 0):
        _load_weight(w_desc, raw_bufs, raw_ready, raw_empty, s, k_tiles, num_m, num_n, BN, BK, RSTAGES, GROUP_M)
    for s in range(total):
        if (s + RLAG < total) and (DEBUG != 4):
            _load_weight(w_desc, raw_bufs, raw_ready, raw_empty, s + RLAG, k_tiles, num_m, num_n, BN, BK, RSTAGES,
                         GROUP_M)
        pid_m, _, kt = _step_coords(s, k_tiles, num_m, num_n, GROUP_M)
        slot = s % STAGES
        # a fresh mbarrier counts as having completed the phase before phase 0: the first lap does not wait
        mbarrier.wait(empty.index(slot), ((s // STAGES) & 1) ^ 1)
        mbarrier.expect(x_ready.index(slot), x_bytes)
        for c in gl.static_range(CONSUMERS):
            tma.async_copy_global_to_shared(x_desc, [pid_m * BM + c * ROWS_PER_CONSUMER, kt * BK],
                                            x_ready.index(slot), x_bufs.index(slot * CONSUMERS + c))


@gluon.jit
def _decoder(x_desc, raw_bufs, w_bufs, raw_ready, raw_empty, w_ready, empty, s_ptr, M, N, K, stride_sn,
             FMT: gl.constexpr, GROUP: gl.constexpr, SCALE_SWIZZLED: gl.constexpr, BN: gl.constexpr,
             BK: gl.constexpr, STAGES: gl.constexpr, RSTAGES: gl.constexpr, GROUP_M: gl.constexpr,
             DEBUG: gl.constexpr):
    W: gl.constexpr = BK // 8
    DT: gl.constexpr = x_desc.dtype
    # one thread holds the eight codes of a word; a warp covers 32 / W rows of W words
    code_layout: gl.constexpr = gl.BlockedLayout([1, 1, 8], [32 // W, W, 1], [DECODE_WARPS, 1, 1], [2, 1, 0])
    word_layout: gl.constexpr = gl.SliceLayout(2, code_layout)
    row_layout: gl.constexpr = gl.SliceLayout(1, word_layout)
    col_layout: gl.constexpr = gl.SliceLayout(0, word_layout)
    shift_layout: gl.constexpr = gl.SliceLayout(0, gl.SliceLayout(0, code_layout))
    num_m, num_n, k_tiles, total = _program_steps(M, N, K, BN, BK)
    words = gl.arange(0, W, layout=col_layout)
    lanes = gl.arange(0, BN, layout=row_layout)
    # the scales of step s + 1 are loaded while step s decodes (an L2 round trip is longer than a step)
    _, pid_n, kt = _step_coords(0, k_tiles, num_m, num_n, GROUP_M)
    rows = pid_n * BN + lanes
    nxt = load_w4_scales(s_ptr, rows, (rows < N) & (total > 0), words, kt, K, stride_sn, FMT, GROUP, BK, SCALE_SWIZZLED)
    for s in range(total):
        scale = nxt
        _, pid_n, kt = _step_coords(s + 1, k_tiles, num_m, num_n, GROUP_M)
        rows = pid_n * BN + lanes
        if DEBUG != 2:
            nxt = load_w4_scales(s_ptr, rows, (rows < N) & (s + 1 < total), words, kt, K, stride_sn, FMT, GROUP, BK,
                               SCALE_SWIZZLED)
        r = s % RSTAGES
        if DEBUG == 4:
            packed = gl.zeros([BN, W], gl.int32, word_layout)
        else:
            mbarrier.wait(raw_ready.index(r), (s // RSTAGES) & 1)
            packed = raw_bufs.index(r).load(word_layout)
            gl.thread_barrier()  # every warp has read the slot before it is handed back
            mbarrier.arrive(raw_empty.index(r))
        if DEBUG == 1:
            w = gl.reshape(gl.expand_dims(packed, 2) + gl.zeros([BN, W, 8], gl.int32, code_layout),
                           [BN, BK]).to(gl.int16).to(DT, bitcast=True)
        else:
            w = decode_w4_words(packed, scale, DT, FMT, shift_layout)
        slot = s % STAGES
        mbarrier.wait(empty.index(slot), ((s // STAGES) & 1) ^ 1)
        w_bufs.index(slot).store(w)
        fence_async_shared()  # the generic-proxy stores before the tensor cores' async-proxy reads
        gl.thread_barrier()
        mbarrier.arrive(w_ready.index(slot))


@gluon.jit
def _consumer(x_bufs, w_bufs, x_ready, w_ready, empty, gscale_ptr, bias_ptr, out_ptr, M, N, K, stride_om,
              GSCALE_MODE: gl.constexpr, HAS_BIAS: gl.constexpr, ACT: gl.constexpr, BN: gl.constexpr,
              BK: gl.constexpr, STAGES: gl.constexpr, GROUP_M: gl.constexpr, DEBUG: gl.constexpr,
              WG: gl.constexpr):
    """Consumer warpgroup ``WG``: rows [WG * 64, WG * 64 + 64) of every tile."""
    R: gl.constexpr = ROWS_PER_CONSUMER
    BM: gl.constexpr = CONSUMERS * R
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, BN, 16])
    row_layout: gl.constexpr = gl.SliceLayout(1, acc_layout)
    col_layout: gl.constexpr = gl.SliceLayout(0, acc_layout)
    num_m, num_n, k_tiles, _ = _program_steps(M, N, K, BN, BK)
    zero = gl.zeros([R, BN], gl.float32, acc_layout)
    g = 1.0
    if GSCALE_MODE == 1:
        g = gl.div_rn(1.0, gl.load(gscale_ptr))
    elif GSCALE_MODE == 2:
        g = gl.load(gscale_ptr)
    it = 0
    for tile in range(gl.program_id(0), num_m * num_n, gl.num_programs(0)):
        pid_m, pid_n = grouped_tile(tile, num_m, num_n, GROUP_M)
        acc = zero
        for kt in range(k_tiles):
            slot = it % STAGES
            phase = (it // STAGES) & 1
            mbarrier.wait(x_ready.index(slot), phase)
            mbarrier.wait(w_ready.index(slot), phase)
            acc = warpgroup_mma(x_bufs.index(slot * CONSUMERS + WG), w_bufs.index(slot).permute((1, 0)), acc,
                                use_acc=kt > 0, is_async=True)
            if DEBUG == 5:
                # every wgmma waited for at once, its slot handed back at once
                acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
                mbarrier.arrive(empty.index(slot))
            else:
                # the previous step's wgmma has read its slot: hand that slot back
                acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc, ))
                mbarrier.arrive(empty.index((it + STAGES - 1) % STAGES), pred=kt > 0)
            it += 1
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
        if DEBUG != 5:
            mbarrier.arrive(empty.index((it + STAGES - 1) % STAGES))
        rows = pid_m * BM + WG * R + gl.arange(0, R, layout=row_layout)
        cols = pid_n * BN + gl.arange(0, BN, layout=col_layout)
        col_ok = cols < N
        if GSCALE_MODE != 0:
            acc = acc * g
        if HAS_BIAS:
            acc = acc + gl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(gl.float32)[None, :]
        acc = w4_activation(acc, ACT)
        ptrs = out_ptr + rows.to(gl.int64)[:, None] * stride_om + cols[None, :]
        gl.store(ptrs, acc.to(out_ptr.dtype.element_ty), mask=(rows < M)[:, None] & col_ok[None, :])


@gluon.jit
def gemm_w4_ws_kernel(x_desc, w_desc, s_ptr, gscale_ptr, bias_ptr, out_ptr, M, N, K, stride_sn, stride_om,
                      FMT: gl.constexpr, GROUP: gl.constexpr, SCALE_SWIZZLED: gl.constexpr, GSCALE_MODE: gl.constexpr,
                      HAS_BIAS: gl.constexpr, ACT: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr,
                      STAGES: gl.constexpr, RSTAGES: gl.constexpr, RLAG: gl.constexpr, GROUP_M: gl.constexpr,
                      CONSUMER_REGS: gl.constexpr, LOADER_REGS: gl.constexpr, DECODER_REGS: gl.constexpr,
                      DEBUG: gl.constexpr = 0):
    """Launch with ``launch_options()`` and one program per output tile (module docstring). ``x_desc``: x [M, K]
    (bf16/fp16) with [64, BK] boxes; ``w_desc``: the packed weight as int32 [N, K / 8] with [BN, BK / 8] boxes;
    ``s_ptr``: the block scales [N, K / GROUP] (uint8 codes, linear layout; int4: the int32 scale|zero words),
    row stride ``stride_sn``. K must be a multiple of BK's packing (K % 32 == 0: the weight's TMA rows are
    16-byte multiples); tiles past M, N and K read zeros."""
    DT: gl.constexpr = x_desc.dtype
    x_bufs = gl.allocate_shared_memory(DT, [STAGES * CONSUMERS, ROWS_PER_CONSUMER, BK], x_desc.layout)
    raw_bufs = gl.allocate_shared_memory(gl.int32, [RSTAGES, BN, BK // 8], w_desc.layout)
    w_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BN, BK], DT)
    w_bufs = gl.allocate_shared_memory(DT, [STAGES, BN, BK], w_layout)
    x_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    w_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    raw_ready = gl.allocate_shared_memory(gl.int64, [RSTAGES, 1], mbarrier.MBarrierLayout())
    raw_empty = gl.allocate_shared_memory(gl.int64, [RSTAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(x_ready.index(i), count=1)
        mbarrier.init(w_ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=CONSUMERS)  # one arrival per consumer warpgroup
    for i in gl.static_range(RSTAGES):
        mbarrier.init(raw_ready.index(i), count=1)
        mbarrier.init(raw_empty.index(i), count=1)
    # argument tuples written out in place (a tuple assigned to a variable turns its constexprs into tensors);
    # a consumer's last argument is its warpgroup's index
    gl.warp_specialize([
        (_consumer, (x_bufs, w_bufs, x_ready, w_ready, empty, gscale_ptr, bias_ptr, out_ptr, M, N, K, stride_om,
                     GSCALE_MODE, HAS_BIAS, ACT, BN, BK, STAGES, GROUP_M, DEBUG, 0)),
        (_consumer, (x_bufs, w_bufs, x_ready, w_ready, empty, gscale_ptr, bias_ptr, out_ptr, M, N, K, stride_om,
                     GSCALE_MODE, HAS_BIAS, ACT, BN, BK, STAGES, GROUP_M, DEBUG, 1)),
        (_loader, (x_desc, w_desc, x_bufs, raw_bufs, x_ready, raw_ready, raw_empty, empty, M, N, K,
                   BN, BK, STAGES, RSTAGES, RLAG, GROUP_M, DEBUG)),
        (_decoder, (x_desc, raw_bufs, w_bufs, raw_ready, raw_empty, w_ready, empty, s_ptr, M, N, K, stride_sn,
                    FMT, GROUP, SCALE_SWIZZLED, BN, BK, STAGES, RSTAGES, GROUP_M, DEBUG)),
    ], [4, 1, DECODE_WARPS], [CONSUMER_REGS, LOADER_REGS, DECODER_REGS])
