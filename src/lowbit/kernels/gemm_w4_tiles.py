"""Tile configurations of the prefill-regime W4A16 GEMM (``lowbit.kernels.gemm_w4``): data, not autotuning.

``CONFIGS`` maps an M regime to tile sizes, warps, pipeline stages and the GROUP_M program order
(``M_REGIMES`` gives each regime's largest M), ``FORMAT_CONFIGS`` overrides entries per format, and
:func:`choose_config` fits BLOCK_K to the format and group, cuts the pipeline to the shared-memory budget and
adds split-K when the (M, N) tiles alone cannot fill the GPU. A sweep can edit these dicts in place or pass
``config=`` to ``gemm_w4``.
"""

from __future__ import annotations

import functools

import torch

from . import cdiv

# Largest M of each regime, ascending; M above the last one uses "large".
M_REGIMES: list[tuple[int, str]] = [(32, "m32"), (64, "m64"), (128, "m128"), (512, "m512")]
# BLOCK_M: x rows per program (the wgmma N dimension, <= 256); BLOCK_N: weight rows (the wgmma M dimension,
# 64 per warpgroup); BLOCK_K: reduction step; num_stages: software-pipeline depth of the x / packed-weight /
# scale loads; GROUP_M: row tiles of x per group of programs (L2 reuse of weight tiles).
# The large-M tile is the 128x256 (weight rows x x rows) cuBLAS-like shape, 2 warpgroups of m64n256k16
# wgmmas, 4 stages (~185 KB shared memory, one program per SM; compiled and inspected on sm_90, not swept: at
# M > 512 the W4A16 ops take the dequantize route). The small-M tiles keep shared memory under ~110 KB so that
# two programs share an SM (the decode is most of their work, and it is done once per BLOCK_M rows of x).
# Every small-M regime holds the winners of `benchmarks/experiments/sweep_w4a16_tiles.py gemm --m 32 / 64 / 128 /
# 256` on an H200 (nvfp4, mxfp4, int4_awq, nf4 on 6144x4096, 4096x14336, 28672x8192; best geometric mean of the
# ratio to cuBLAS per format, each candidate checked against the fp32 reference): from M = 65 the 128x64 tile of
# one warpgroup with a 128-wide K step (at M = 256 it beats the former 128x128 two-warpgroup tile by 1.1-1.6x:
# more programs at these M); at M <= 32 a 256-wide K step. Single timings at these sizes vary by up to 2x
# between neighbouring candidates, so near-ties were settled by what most formats and shapes agreed on.
CONFIGS: dict[str, dict[str, int]] = {
    "m32": dict(BLOCK_M=32, BLOCK_N=64, BLOCK_K=256, num_warps=4, num_stages=4, GROUP_M=1),
    "m64": dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=5, GROUP_M=1),
    "m128": dict(BLOCK_M=128, BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=4, GROUP_M=4),
    "m512": dict(BLOCK_M=128, BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=4, GROUP_M=8),
    "large": dict(BLOCK_M=256, BLOCK_N=128, BLOCK_K=64, num_warps=8, num_stages=4, GROUP_M=8),
}
# (format, regime) -> entries replacing those of CONFIGS[regime] (same sweep): nf4 takes the other K step at
# M <= 64 (its table loads weigh differently in the tile)
FORMAT_CONFIGS: dict[tuple[str, str], dict[str, int]] = {
    ("nf4", "m32"): dict(BLOCK_K=128, num_stages=5),
    ("nf4", "m64"): dict(BLOCK_K=256, num_stages=3),
}
# split-K: used when the output tiles fill less than half of the SMs; each split keeps >= this many K tiles
SPLIT_K_MIN_TILES = 4
SPLIT_K_MAX = 8


def regime(m: int) -> str:
    for limit, name in M_REGIMES:
        if m <= limit:
            return name
    return "large"


@functools.lru_cache(maxsize=8)
def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 132
    return torch.cuda.get_device_properties(device).multi_processor_count


# Groups of >= 32 columns (one scale per row per tile or per half tile) with BLOCK_K = 64 gave wrong results
# on the H100 (Triton 3.6; mxfp4, fp4_b32 and int4 g128, rel. error 5e-3..0.19 varying with num_stages: the
# pipelined scale tile of <= 8 bytes per row is read before it lands), while BLOCK_K = 128 was exact in every
# tile shape swept; so these formats use BLOCK_K >= 128.
_MIN_BLOCK_K = {"mxfp4": 128, "fp4_b32": 128, "int4_awq": 128}
# estimate (x tile + packed weight tile per stage) against which num_stages is cut: Triton's real use is
# about 1.28x the estimate here (256x128x128: 3 stages estimated 216 KB asked 276 KB of the 227 KB)
_SMEM_BUDGET = 170 * 1024


def fit_tile(fmt: str, cfg: dict, group: int) -> dict:
    """``cfg`` with the BLOCK_K the kernel can use for this format and group, and num_stages cut to the
    shared-memory budget (x tile + packed weight tile per stage). int4 tiles must not straddle a group
    unless they hold whole groups (group a multiple of 16)."""
    cfg = dict(cfg)
    block_k = max(cfg["BLOCK_K"], _MIN_BLOCK_K.get(fmt, 0))
    if fmt == "int4_awq" and group % block_k and block_k % group:
        block_k = group & -group                      # largest power of two dividing the group
    if block_k != cfg["BLOCK_K"]:
        per_stage = cfg["BLOCK_M"] * block_k * 2 + cfg["BLOCK_N"] * block_k // 2
        cfg["num_stages"] = max(1, min(cfg["num_stages"], _SMEM_BUDGET // per_stage))
    cfg["BLOCK_K"] = block_k
    return cfg


def choose_config(m: int, n: int, k_dim: int, fmt: str, group: int = 0, device: torch.device | None = None,
                  plan_n: int | None = None) -> dict:
    """The launch configuration for an [m, k] x [n, k]^T problem: CONFIGS[regime(m)] with the format's
    overrides, BLOCK_K adjusted to the int4 group size, and SPLIT_K (chosen as for ``plan_n`` rows, default
    ``n``: a column shard splits K as its whole weight does)."""
    name = regime(m)
    cfg = dict(CONFIGS[name])
    cfg.update(FORMAT_CONFIGS.get((fmt, name), {}))
    cfg = fit_tile(fmt, cfg, group)
    cfg.setdefault("SPLIT_K", _split_k(m, plan_n or n, k_dim, cfg, device))
    cfg["regime"] = name
    return cfg


def _split_k(m: int, n: int, k_dim: int, cfg: dict, device) -> int:
    tiles = cdiv(m, cfg["BLOCK_M"]) * cdiv(n, cfg["BLOCK_N"])
    sms = _sm_count(device if device is not None else torch.device("cuda"))
    if 2 * tiles > sms:
        return 1
    k_tiles = cdiv(k_dim, cfg["BLOCK_K"])
    return nonempty_split(k_tiles, min(SPLIT_K_MAX, sms // tiles, k_tiles // SPLIT_K_MIN_TILES))


def nonempty_split(k_tiles: int, split: int) -> int:
    """The largest split <= ``split`` whose every slice of ceil(k_tiles / split) K tiles is non-empty (the
    kernel computes the first tile of its slice unconditionally)."""
    split = max(1, min(split, k_tiles))
    while split > 1 and (split - 1) * cdiv(k_tiles, split) >= k_tiles:
        split -= 1
    return split


__all__ = [
    "CONFIGS", "FORMAT_CONFIGS", "M_REGIMES", "SPLIT_K_MAX", "SPLIT_K_MIN_TILES", "choose_config",
    "fit_tile", "nonempty_split", "regime",
]
