"""Gluon device functions shared by the warp-specialized kernel modules (``_fp8_block_ws``, ``_gemm_w4_ws``), as
``device`` holds the Triton ones: a helper more than one Gluon kernel calls lives here under a public name
(the W4A16 scale loads, scale values, word decode and epilogue are shared by ``_gemm_w4_ws``, ``_gemm_w4_ra`` and
``_gemm_w4_rf``)."""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier

ROWS_PER_CONSUMER = gl.constexpr(64)
"""Output rows of one consumer warpgroup: one wgmma m64 row block."""


@gluon.constexpr_function
def w4_acc_layout(WG, BM):
    """The fp32 accumulator of a register-operand W4A16 program's transposed tile [64 WG weight rows, BM rows of
    x]: WG warpgroups stacked along the weight rows, m64nBMk16 wgmmas."""
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4 * int(WG), 1], instr_shape=[16, int(BM), 16])


@gluon.jit
def ring_barriers(STAGES: gl.constexpr):
    """One mbarrier per slot of a TMA ring, each expecting one arrival (the copy's ``expect``)."""
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
    return ready


@gluon.jit
def grouped_tile(tile, num_m, num_n, GROUP_M: gl.constexpr):
    """Output tile index -> (pid_m, pid_n): GROUP_M row tiles per column tile, so that the programs of a wave
    share their operand tiles in L2."""
    per_group = GROUP_M * num_n
    first_m = (tile // per_group) * GROUP_M
    size_m = gl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (tile % per_group) % size_m
    pid_n = (tile % per_group) // size_m
    return pid_m, pid_n


@gluon.jit
def w4_program_run(M, N, K, ROWS: gl.constexpr, BM: gl.constexpr, BK: gl.constexpr, GROUP_M: gl.constexpr,
                   SPLIT: gl.constexpr):
    """This program's share of the register-operand W4A16 GEMMs: (output tile, split index, first weight row
    n0, first x row m0, K steps, first K step). SPLIT programs per tile take equal even runs of K steps (the
    loops are unrolled by two); steps past the end read zeros and add nothing."""
    tile = gl.program_id(0) // SPLIT
    pid_n, pid_m = grouped_tile(tile, gl.cdiv(N, ROWS), gl.cdiv(M, BM), GROUP_M)
    steps = gl.cdiv(gl.cdiv(gl.cdiv(K, BK), SPLIT), 2) * 2
    split = gl.program_id(0) % SPLIT
    return tile, split, pid_n * ROWS, pid_m * BM, steps, split * steps


@gluon.jit
def load_w4_scales(s_ptr, rows, row_ok, words, kt, K, stride_sn, FMT: gl.constexpr, GROUP: gl.constexpr,
                 BK: gl.constexpr, SCALE_SWIZZLED: gl.constexpr):
    """The block scale of every packed word [BN, BK / 8] of K step kt (``load_block_scales``)."""
    return load_block_scales(s_ptr, rows[:, None], row_ok[:, None], (kt * BK + words * 8)[None, :], K, stride_sn,
                             GROUP, SCALE_SWIZZLED)


@gluon.jit
def load_block_scales(s_ptr, rows, row_ok, k_elem, K, stride_sn, GROUP: gl.constexpr, SCALE_SWIZZLED: gl.constexpr):
    """The block scale codes (int32: the scale byte, or for int4 the ``fp16 scale bits | zero << 16`` word) of
    weight rows ``rows`` at K elements ``k_elem`` (broadcastable int32 tensors); rows past N (``row_ok`` False)
    and columns past the end read 0. SCALE_SWIZZLED: the 128x4-swizzled layout (torchao ``to_blocked``),
    ``stride_sn`` then the scale columns padded to 4."""
    col = k_elem // GROUP
    ok = row_ok & (col < K // GROUP)
    return gl.load(s_ptr + w4_scale_offset(rows, col, stride_sn, SCALE_SWIZZLED), mask=ok, other=0).to(gl.int32)


@gluon.jit
def w4_scale_offset(r, c, stride_sn, SCALE_SWIZZLED: gl.constexpr):
    """Element offset of the block scale of weight row ``r``, scale column ``c`` (broadcastable int32 tensors):
    row-major with row stride ``stride_sn``, or the 128x4-swizzled layout (torchao ``to_blocked``; ``stride_sn``
    the scale columns padded to 4)."""
    if SCALE_SWIZZLED:
        return (((r >> 7) * (stride_sn >> 2) + (c >> 2)) * 512 + (r & 31) * 16 + ((r >> 5) & 3) * 4
                + (c & 3)).to(gl.int64)
    return r.to(gl.int64) * stride_sn + c


@gluon.jit
def w4_scale_values(scale, DT: gl.constexpr, FMT: gl.constexpr):
    """The block scales' values in DT from their int32 codes (``load_w4_scales``): (scale, zero point) for int4
    (FMT 4: the zero point as ``magic + zero``, the code's own offset), else (scale, scale): the second value
    unused."""
    if FMT == 4:
        if DT == gl.float16:
            magic: gl.constexpr = 0x6400
        else:
            magic: gl.constexpr = 0x4300
        z = ((scale >> 16) | magic).to(gl.int16).to(DT, bitcast=True)
        s = (scale & 0xFFFF).to(gl.int16).to(gl.float16, bitcast=True).to(DT)
        return s, z
    if FMT == 0:
        s = scale.to(gl.uint8).to(gl.float8e4nv, bitcast=True).to(gl.float32).to(DT)
    elif DT == gl.bfloat16:
        # 2^-127 is the bf16 subnormal 0x0040; code 255 is NaN
        sb = gl.where(scale == 0, 0x0040, gl.where(scale == 255, 0x7FC0, scale << 7))
        s = sb.to(gl.int16).to(gl.bfloat16, bitcast=True)
    else:
        f = gl.where(scale == 0, 0x00400000, gl.where(scale == 255, 0x7FC00000, scale << 23))
        s = f.to(gl.float32, bitcast=True).to(DT)
    return s, s


@gluon.jit
def decode_w4_words(words, scale, DT: gl.constexpr, FMT: gl.constexpr, shift_layout: gl.constexpr):
    """int32 words [BN, W] (eight codes each, element 8c + j in nibble j) and their scales [BN, W] -> the
    decoded tile [BN, 8 W] in DT."""
    shifts = gl.arange(0, 8, layout=shift_layout) * 4
    code = (gl.expand_dims(words, 2) >> gl.expand_dims(gl.expand_dims(shifts, 0), 0)) & 15
    s, z = w4_scale_values(scale, DT, FMT)
    if FMT == 4:
        if DT == gl.float16:
            magic: gl.constexpr = 0x6400
        else:
            magic: gl.constexpr = 0x4300
        q = (code | magic).to(gl.int16).to(DT, bitcast=True)
        v = (q - gl.expand_dims(z, 2)) * gl.expand_dims(s, 2)
    else:
        if DT == gl.float16:
            bits = ((code & 7) << 9) | ((code & 8) << 12)
            v = bits.to(gl.int16).to(DT, bitcast=True) * 16384.0
        else:
            bits = ((code & 7) << 6) | ((code & 8) << 12)
            v = bits.to(gl.int16).to(DT, bitcast=True) * 8.507059173023462e37
        v = v * gl.expand_dims(s, 2)
    return gl.reshape(v, [v.shape[0], v.shape[1] * 8])


@gluon.jit
def tanh_approx(x):
    """tanh.approx.f32 of fp32 ``x`` (the kernels' tanh GELU and SiLU epilogues)."""
    return gl.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=f,f", [x], dtype=gl.float32, is_pure=True,
                                     pack=1)


@gluon.jit
def w4_activation(acc, ACT: gl.constexpr):
    """The W4A16 GEMMs' epilogue activation of fp32 ``acc`` (``gemm_w4.ACTIVATIONS``: 1 erf GELU, 2 tanh GELU,
    3 SiLU as ``x * (1 + tanh(x / 2)) / 2``; 0 none)."""
    if ACT == 1:
        acc = 0.5 * acc * (1.0 + gl.erf(acc * 0.7071067811865476))
    elif ACT == 2:
        acc = 0.5 * acc * (1.0 + tanh_approx(0.7978845608028654 * (acc + 0.044715 * acc * acc * acc)))
    elif ACT == 3:
        acc = acc * (0.5 + 0.5 * tanh_approx(0.5 * acc))
    return acc


@gluon.jit
def store_w4_tile(acc, gscale_ptr, bias_ptr, out_ptr, M, N, stride_om, n0, m0, acc_layout: gl.constexpr,
                  ROWS: gl.constexpr, BM: gl.constexpr, GSCALE_MODE: gl.constexpr, HAS_BIAS: gl.constexpr,
                  ACT: gl.constexpr):
    """Global scale, bias and activation on the fp32 tile ``acc`` [ROWS weight rows, BM x rows]; stores the
    transposed tile into ``out`` [M, N] (the register-operand W4A16 kernels' epilogue)."""
    wr = n0 + gl.arange(0, ROWS, layout=gl.SliceLayout(1, acc_layout))
    xr = m0 + gl.arange(0, BM, layout=gl.SliceLayout(0, acc_layout))
    w_ok = wr < N
    if GSCALE_MODE == 1:
        acc = acc * gl.div_rn(1.0, gl.load(gscale_ptr))
    elif GSCALE_MODE == 2:
        acc = acc * gl.load(gscale_ptr)
    if HAS_BIAS:
        acc = acc + gl.load(bias_ptr + wr, mask=w_ok, other=0.0).to(gl.float32)[:, None]
    acc = w4_activation(acc, ACT)
    ptrs = out_ptr + xr.to(gl.int64)[None, :] * stride_om + wr[:, None]
    gl.store(ptrs, acc.to(out_ptr.dtype.element_ty), mask=w_ok[:, None] & (xr < M)[None, :])


@gluon.jit
def finish_w4_tile(acc, ws_ptr, cnt_ptr, tile, split, gscale_ptr, bias_ptr, out_ptr, M, N, stride_om, n0, m0,
                   acc_layout: gl.constexpr, ROWS: gl.constexpr, BM: gl.constexpr, SPLIT: gl.constexpr,
                   GSCALE_MODE: gl.constexpr, HAS_BIAS: gl.constexpr, ACT: gl.constexpr):
    """The epilogue of output tile ``tile`` (``store_w4_tile``), or with split K (SPLIT > 1) this program's part:
    every program leaves its fp32 partial in the workspace ``ws_ptr``; the last of a tile to arrive (a counter
    per tile in ``cnt_ptr``, reset by that program for the next launch) sums the partials in split order, so the
    result does not depend on the arrival order, and runs the epilogue."""
    if SPLIT == 1:
        store_w4_tile(acc, gscale_ptr, bias_ptr, out_ptr, M, N, stride_om, n0, m0, acc_layout, ROWS, BM,
                      GSCALE_MODE, HAS_BIAS, ACT)
    else:
        loc = (gl.arange(0, ROWS, layout=gl.SliceLayout(1, acc_layout))[:, None] * BM
               + gl.arange(0, BM, layout=gl.SliceLayout(0, acc_layout))[None, :])
        part = ws_ptr + tile.to(gl.int64) * (SPLIT * ROWS * BM)
        gl.store(part + split * (ROWS * BM) + loc, acc)
        gl.thread_barrier()
        if gl.atomic_add(cnt_ptr + tile, 1, sem="acq_rel", scope="gpu") == SPLIT - 1:
            total = gl.zeros([ROWS, BM], gl.float32, acc_layout)
            for s in gl.static_range(SPLIT):
                total += gl.load(part + s * (ROWS * BM) + loc, cache_modifier=".cg")
            gl.store(cnt_ptr + tile, 0)
            store_w4_tile(total, gscale_ptr, bias_ptr, out_ptr, M, N, stride_om, n0, m0, acc_layout, ROWS, BM,
                          GSCALE_MODE, HAS_BIAS, ACT)
