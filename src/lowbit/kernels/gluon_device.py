"""Gluon device functions shared by the warp-specialized kernel modules (``_fp8_block_ws``, ``_gemm_w4_ws``), as
``device`` holds the Triton ones: a helper more than one Gluon kernel calls lives here under a public name
(the W4A16 scale loads, word decode and epilogue activation are shared by ``_gemm_w4_ws`` and ``_gemm_w4_ra``)."""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl

ROWS_PER_CONSUMER = gl.constexpr(64)
"""Output rows of one consumer warpgroup: one wgmma m64 row block."""


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
def load_w4_scales(s_ptr, rows, row_ok, words, kt, K, stride_sn, FMT: gl.constexpr, GROUP: gl.constexpr,
                 BK: gl.constexpr, SCALE_SWIZZLED: gl.constexpr):
    """The block scale of every packed word [BN, BK / 8] of K step kt (int32: the scale byte, or for int4 the
    ``fp16 scale bits | zero << 16`` word); rows past N and steps past the end read 0. SCALE_SWIZZLED: the
    128x4-swizzled layout (torchao ``to_blocked``), ``stride_sn`` then the scale columns padded to 4."""
    col = (kt * BK + words * 8) // GROUP
    if SCALE_SWIZZLED:
        r = rows[:, None]
        c = col[None, :]
        off = (((r >> 7) * (stride_sn >> 2) + (c >> 2)) * 512 + (r & 31) * 16 + ((r >> 5) & 3) * 4
               + (c & 3)).to(gl.int64)
    else:
        off = rows.to(gl.int64)[:, None] * stride_sn + col[None, :]
    ok = row_ok[:, None] & (col < K // GROUP)[None, :]
    if FMT == 4:
        return gl.load(s_ptr + off, mask=ok, other=0)
    return gl.load(s_ptr + off, mask=ok, other=0).to(gl.int32)


@gluon.jit
def decode_w4_words(words, scale, DT: gl.constexpr, FMT: gl.constexpr, shift_layout: gl.constexpr):
    """int32 words [BN, W] (eight codes each, element 8c + j in nibble j) and their scales [BN, W] -> the
    decoded tile [BN, 8 W] in DT."""
    shifts = gl.arange(0, 8, layout=shift_layout) * 4
    code = (gl.expand_dims(words, 2) >> gl.expand_dims(gl.expand_dims(shifts, 0), 0)) & 15
    if FMT == 4:
        if DT == gl.float16:
            magic: gl.constexpr = 0x6400
        else:
            magic: gl.constexpr = 0x4300
        q = (code | magic).to(gl.int16).to(DT, bitcast=True)
        z = ((scale >> 16) | magic).to(gl.int16).to(DT, bitcast=True)
        s = (scale & 0xFFFF).to(gl.int16).to(gl.float16, bitcast=True).to(DT)
        v = (q - gl.expand_dims(z, 2)) * gl.expand_dims(s, 2)
    else:
        if DT == gl.float16:
            bits = ((code & 7) << 9) | ((code & 8) << 12)
            v = bits.to(gl.int16).to(DT, bitcast=True) * 16384.0
        else:
            bits = ((code & 7) << 6) | ((code & 8) << 12)
            v = bits.to(gl.int16).to(DT, bitcast=True) * 8.507059173023462e37
        if FMT == 0:
            s = scale.to(gl.uint8).to(gl.float8e4nv, bitcast=True).to(gl.float32).to(DT)
        else:
            if DT == gl.bfloat16:
                # 2^-127 is the bf16 subnormal 0x0040; code 255 is NaN
                sb = gl.where(scale == 0, 0x0040, gl.where(scale == 255, 0x7FC0, scale << 7))
                s = sb.to(gl.int16).to(gl.bfloat16, bitcast=True)
            else:
                f = gl.where(scale == 0, 0x00400000, gl.where(scale == 255, 0x7FC00000, scale << 23))
                s = f.to(gl.float32, bitcast=True).to(DT)
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
