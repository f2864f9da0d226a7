"""Gluon device functions shared by the warp-specialized kernel modules (``_fp8_block_ws``, ``_gemm_w4_ws``), as
``device`` holds the Triton ones: a helper more than one Gluon kernel calls lives here under a public name."""

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
