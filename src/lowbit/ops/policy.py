"""Every regime decision of lowbit's operators, in one module.

Kernel modules say what they *can* run (``supports`` and the ``*_unsupported`` capability checks, reasons as
strings) and launch what they are told; this module says what *should* run, for which rows ``M``, formats and
device, with the measurement behind each number. :func:`lowbit.explain` and
:func:`lowbit.ops.explain_scaled_mm` print these decisions, and a prepared layer
(:mod:`lowbit.ops.prepared`) makes them once per row count.

W4A16 (``lowbit.linear``), on CUDA:

- ``M <= GEMV_MAX_M``: the split-K GEMV (``lowbit.kernels.gemv_w4``) when it covers the weight, else the GEMM;
  past it, weights of the formats in ``gemv_w4.MMA["row_blocks_max_m"]`` (by default nvfp4 and mxfp4 with bf16 x
  up to 48 rows, ``gemv_w4.ROW_BLOCKS_MAX_M``: 1.00-2.24x the GEMM there, H200) still take the tensor-core GEMV,
  in blocks of x rows;
- ``GEMV_MAX_M < M < DEQUANT_GEMM_MIN_M``: the tensor-core GEMM (``lowbit.kernels.gemm_w4``);
- ``M >= DEQUANT_GEMM_MIN_M``: dequantize a bounded chunk of rows at a time, then cuBLAS;
- before both, where :func:`register_operand_config` says so (nvfp4, mxfp4, int4_awq weights whose tiles fill
  the GPU, large enough to cover the launch's host time): the Gluon GEMM with the decoded weight as the wgmma
  register operand, read as register fragments (``gemm_w4.gemm_w4_rf``; with
  :data:`REGISTER_OPERAND_FRAGMENTS` off, ``gemm_w4_ra`` through shared memory).

Block-scaled pairs (``lowbit.scaled_mm``), on CUDA, through ``lowbit.kernels.scaled_mm`` (:func:`scaled_route`):

- ``"gemv"``: ``M <= SCALED_GEMV_MAX_M``, an nvfp4/mxfp4 weight with an nvfp4, mxfp4 or fp8_rowwise activation:
  the activation decoded exactly to bf16, then the W4A16 GEMV;
- ``"dequant"``: ``M >= DEQUANT_MM_MIN_M``, nvfp4 x nvfp4 or a pair of 6/8-bit MX operands (``w8a8-mxfp8``,
  W6A8): both decoded exactly to bf16, then cuBLAS (MX pairs with a guarded exact fallback);
- ``"fold"``: ``M >= FOLD_MIN_M``, an mxfp4 weight with an mxfp4, fp8_rowwise or fp8_block activation: the
  exact E4M3 re-encoding, then the FP8 GEMM (cuBLASLt's block-scaled one where it can run, else the TMA kernel);
  ``"fold_deepgemm"``: the same pairs where DeepGEMM is installed and :func:`deepgemm_preferred` says so, with
  DeepGEMM's FP8 GEMM behind the re-encoding;
- ``"deepgemm"``: ``M >= CUBLAS_FP8_BLOCK_MIN_M``, fp8_block with 128x128 weight blocks, where DeepGEMM is
  installed and :func:`deepgemm_preferred` says so: DeepGEMM's FP8 GEMM;
- ``"cublas"``: ``M >= CUBLAS_FP8_BLOCK_MIN_M``, fp8_block with 128x128 weight blocks: cuBLASLt's block-scaled
  FP8 GEMM where it can run;
- ``"kernel"``: lowbit's block-scaled GEMM kernels (tile configs by M in ``lowbit.kernels.scaled_mm``).
"""

from __future__ import annotations

from typing import Any

import torch

from .. import kernels as _kernels
from ..formats.qtensor import QTensor
from ..formats.rows import slice_rows_reason
from . import op_common

GEMV_MAX_M = 16
"""Largest M (rows of x) for which the W4A16 split-K GEMV is chosen; above it the tensor-core GEMM runs. Also
the largest M the GEMV kernel takes (``lowbit.kernels.gemv_w4.MAX_M``)."""
DEQUANT_GEMM_MIN_M: int | None = 512
"""On CUDA, the M at and above which ``lowbit.linear`` runs ``linear_dequant_gemm`` (the weight dequantized a
bounded chunk of rows at a time by the Triton dequantize kernels, then cuBLAS) instead of ``gemm_w4``; None:
never. H200, CUDA-graph replays with the weights rotated out of L2, ratio to cuBLAS bf16 on the six
Llama-class shapes (``benchmarks/experiments/sweep_w4a16_mid_m.py``; nvfp4, mxfp4, int4_awq, nf4):
dequantize-then-cuBLAS 0.48-0.63x at M=512 (the GEMM 0.20-0.42x), 0.65-0.78x at 1024 (GEMM 0.27-0.49x),
0.75-0.95x at 2048 (GEMM 0.30-0.51x): faster on all 72 (format, shape, M >= 512) cases. At M=256 the two
are even (dequantize 0.35-0.46x, GEMM 0.21-0.50x; nf4's GEMM 0.21-0.29x, hence its override), at M <= 128
the GEMM wins (0.42-0.80x against 0.29-0.44x; int4 at M=64 up to 1.03x)."""
DEQUANT_GEMM_MIN_M_BY_FORMAT: dict[str, int] = {"nf4": 256, "nvfp4": 256}
"""Per-format values replacing :data:`DEQUANT_GEMM_MIN_M` (when that is not None), where dequantizing already
wins at M=256 in the sweep above: nf4, whose GEMM looks up its table per weight (0.21-0.29x against
dequantizing's 0.37-0.45x), and nvfp4 (0.27-0.38x against 0.35-0.43x, faster on all 11 shapes of two runs;
mxfp4 and int4_awq were even there, 3 of 6 and 1 of 6)."""
SCALED_GEMV_MAX_M = GEMV_MAX_M
"""Up to this M, an nvfp4 / mxfp4 weight with an nvfp4, mxfp4 or fp8_rowwise activation runs the W4A16 GEMV."""
FOLD_MIN_M = 1024
"""From this M, mxfp4 weights with mxfp4, fp8_rowwise or fp8_block activations run on the FP8 tensor cores
through the exact E4M3 re-encoding. At M = 1024 the route beat or matched the decoding kernel on 5 of the 6
DeepSeek/8192 shapes for mxfp4 x mxfp4 and W4A8 (H200; not on
7168x2048, where the per-call launches outweigh a 48 us GEMM); at M = 256 it lost on most."""
CUBLAS_FP8_BLOCK_MIN_M = 65
"""From this M, fp8_block pairs run cuBLASLt's block-scaled FP8 GEMM (faster than lowbit's kernels at every
M >= 256 of a probe on an H100); below it (decode) lowbit's
split-K kernel streams the weight faster."""
DEEP_GEMM_CUBLAS_MIN_K = 16384
DEEP_GEMM_CUBLAS_MAX_M = 1024
"""Where DeepGEMM is installed, fp8_block pairs from :data:`CUBLAS_FP8_BLOCK_MIN_M` rows run DeepGEMM's FP8
GEMM, except those with ``K >= DEEP_GEMM_CUBLAS_MIN_K`` and ``M <= DEEP_GEMM_CUBLAS_MAX_M``, which stay on
cuBLASLt's. H200, ``lowbit bench --ops scaled_mm.fp8_block.prefill`` on the DeepSeek-V3 shapes (N x K 7168x2048,
24576x1536, 2112x7168, 7168x16384, 4096x7168) at M = 256, 1024, 4096, CUDA-graph replays, DeepGEMM
(``tokenspeed-deepgemm`` 2.5.0) against cuBLASLt: DeepGEMM 1.11-1.75x faster at M = 256 on 24576x1536,
2112x7168 and 4096x7168 and 1.32x at M = 1024 on 2112x7168; within 0.95-1.09x of cuBLASLt on the other cases
(cuBLASLt 1.05x faster at 256x7168x2048, 1.03x at 4096x7168x2048); cuBLASLt faster on the long-K shape at
M <= 1024 (7168x16384: 1.27x at M = 256, 1.11x at 1024), hence the exception. Not measured below M = 256.
At the DiT shapes (M = 8190: 5120x5120, 13824x5120, 5120x13824; 32760x5120x5120) DeepGEMM was 1.13-1.30x
faster than cuBLASLt (eager medians), so the FP8 GEMM behind the mxfp4 re-encoding (``"fold_deepgemm"``)
follows the same rule."""

FP8_BLOCK_QUANT_IN_GEMM_MAX_M = 16
"""Up to this M, an fp8_block weight with fp8_block activations (``w8a8-fp8-block``) quantizes the activation
inside the decode GEMM (``lowbit.kernels.scaled_mm.KernelRoute.quant_in_gemm``: one launch, the same bits) in a
prepared layer and under ``torch.compile``; above it the quantize kernel runs first. Every program of the
split-K grid re-quantizes its x tiles, which is free at decode sizes (a 16 x 128 tile per 128 x 128 weight
tile) but grows with M."""


DEQUANT_ONLY_FORMATS = ("bnb_fp4",)
"""Weight formats no W4A16 GEMV / GEMM kernel reads: on CUDA ``lowbit.linear`` always runs ``linear_dequant_gemm``
for them (the Triton dequantize kernel, then cuBLAS), at every M. bnb_fp4 has nf4's layout and the kernels take
the 16-entry table as data, but the GEMV's prepared layouts and traced plans key the table on the format code;
until they carry bitsandbytes' FP4 table the format stays out of them rather than decode with NF4's levels."""


DEQUANT_MM_MIN_M = 512
"""From this M, nvfp4 x nvfp4 pairs (``w4a4-nvfp4``) and pairs of 6/8-bit MX operands (``w8a8-mxfp8``, whose
decoding kernel ran a Wan2.1-sized DiT block at 0.26-0.38x bf16 on an H100) run the ``"dequant"`` route: both
operands decoded exactly to bf16, then cuBLAS's bf16 GEMM. On an H100 at M = 2048 on a 4096 x 4096 layer, the
nvfp4 decoding kernel took 326 us where the passes of this route took about 21 (weight decode) + 96 (cuBLAS
bf16) us in the W4A16 profile of the same run; the crossover M is estimated from those per-pass times, not yet
measured (for the MX pairs not at all)."""
FP8_COMPUTE_MIN_M = 512
"""From this M, a ``w4a4-nvfp4`` layer switched to the FP8 compute mode (``lowbit.nn.set_compute``) runs the
fp8_block product (``lowbit.ops.fp8_compute``); below it the exact path, whose decode kernels serve small M. The
same bound as :data:`DEQUANT_MM_MIN_M`, where the exact path itself turns to cuBLAS; not yet measured."""
STATIC_LAUNCH_COMPILED_KERNELS = True
"""Whether preparing a layer for the compiled W4A16 GEMV turns on Inductor's static launcher for user-defined
Triton kernels (``lowbit.ops.prepared``): on an H100 host, Triton's own launcher cost about 30-55 us per
GEMV launched from a ``torch.compile``d decode step (cProfile of ``benchmarks/experiments/profile_compiled_step.py``)
against about 15 us for Inductor's kernels through the static launcher."""


REGISTER_OPERAND_M = ((192, 256), (384, 512))
"""M ranges in which :func:`register_operand_config` may choose the register-operand GEMM with two warpgroups and
256-row x tiles (``{"WG": 2, "BM": 256}``): M at least 3/4 of its 256-row tiles. H200, CUDA-graph replays with
the weights rotated out of L2, ratio to cuBLAS bf16 (``benchmarks/experiments/sweep_w4a16_ws.py``, nvfp4 and
int4_awq): where the output tiles (times the split) filled 0.97-1.7 waves, 0.61-0.72x against the current
route's 0.42-0.56x (28672x8192 at M = 256: 0.65 / 0.68 against 0.42 / 0.51; 4096x14336 at M = 512, split 2:
0.61 / 0.63 against 0.55 / 0.56); where they filled 0.73 of a wave (6144x4096, 4096x14336 at M = 256) or more
than 3 waves (28672x8192 at M = 512: 0.58 against 0.61), it lost, hence :data:`REGISTER_OPERAND_WAVES`."""
REGISTER_OPERAND_WAVES = (0.9, 2.0)
"""The fill (output tiles x split, over the SM count) within which the rule above runs the kernel."""
REGISTER_OPERAND_SMALL_M = (33, 64)
"""M range in which nvfp4 weights run the register-operand GEMM with 64-row x tiles, split K in 4 (2 from
N = 16384). Same sweep, M = 64: 0.61 / 0.72 / 0.78x cuBLAS (6144x4096, 4096x14336, 28672x8192) against the
Triton GEMM's 0.53 / 0.64 / 0.62x; on 1024x4096 0.62 against 0.76. Not taken for mxfp4 and int4_awq, whose
Triton GEMM was as fast or faster there (int4: 0.72 / 0.92x against 0.66 / 0.83x). Measured at M = 64 only:
below it the 64-row x tile is partly empty for both kernels."""
REGISTER_OPERAND_MIN_WORK = 10**10
"""Smallest M x N x K for the two-warpgroup rule (:data:`REGISTER_OPERAND_M`): every case of its sweep was
above it; below, at short K or few columns, the kernel's pipeline prologue and epilogue weigh more and nothing
was measured."""
REGISTER_OPERAND_SMALL_M_MIN_WORK = 10**9
"""Smallest M x N x K for the nvfp4 rule (:data:`REGISTER_OPERAND_SMALL_M`). H200, QuantLinear at M = 64, eager
median / CUDA-graph replay (the loop of ``benchmarks/experiments/ab_register_operand.py``, run before it was
committed, when one bound served both rules): 6144x4096 (1.6e9) 30.3 /
30.7 us against the Triton GEMM's 34.7 / 34.4, 4096x14336 54.5 / 54.4 against 61.7 / 61.0; 1024x4096 (2.7e8)
17.2 / 17.2 against 17.6 / 16.1. Host time per call through the prepared layer's kept launch 26-40 us, the
Triton GEMM's 27-42 (``F.linear`` 16-21), so eager gains what the GPU gains."""

REGISTER_OPERAND_FRAGMENTS = True
"""Where :func:`register_operand_config` takes a call, run the register-fragment kernel (``gemm_w4.gemm_w4_rf``)
under the fragment rule (:data:`FRAGMENT_MAX_M` and below). That kernel reads the weight's codes from a second copy
laid out once per weight as wgmma register fragments (the size of the packed codes; made at the first call that
takes the route, kept while the weight lives), against ``gemm_w4_ra``'s shared-memory operand. False: the
register-operand kernel under its own rule (:data:`REGISTER_OPERAND_M` and above), no second copy.

H200, CUDA-graph replays with the weights rotated out of L2, ratio to cuBLAS bf16 (``sweep_w4a16_ws.py``), two
warpgroups and 256-row x tiles, fragment against operand kernel: 28672x8192 at M = 256 nvfp4 0.85 / 0.69,
int4_awq 0.71 / 0.72; 4096x14336 at M = 512 (split 2) nvfp4 0.74 / 0.63 (0.37 unsplit), int4_awq 0.69 / 0.64;
nvfp4 at M = 64 with 64-row tiles, split 4: 0.67 / 0.73 / 0.86 against 0.58 / 0.71 / 0.80 (6144x4096,
4096x14336, 28672x8192)."""
FRAGMENT_MAX_M = {"nvfp4": 1024, "mxfp4": 1024, "int4_awq": 512}
"""Largest M per format for the fragment rule's 256-row tiles (taken where the last of them is at least half
full: measured down to half, at M = 384). Same sweep, M = 192 to 2048 on 28672x8192,
4096x14336, 6144x4096, 5120x5120 (the best of split 1 / 2 against the route of the time): nvfp4 won wherever
the fill (:data:`FRAGMENT_MIN_FILL`) was 0.85 or more up to M = 1024 (28672x8192 at M = 768 / 1024: 0.75 / 0.81
against dequantizing's 0.72 / 0.74; 4096x14336 at M = 1024: 0.84 against 0.75; 5120x5120 at M = 768: 0.80
against 0.73), and was even or lost above it (4096x14336 at M = 2048: 0.83 / 0.83; 6144x4096: 0.81 / 0.88).
Dequantizing mxfp4 and int4_awq weights is the faster route from M = 768 (28672x8192: 0.67 / 0.64 against
0.76 / 0.69; 4096x14336 at M = 1024: 0.75 / 0.73 against 0.81 / 0.75); at M = 384 the kernel won (28672x8192:
0.49 / 0.50 against the Triton GEMM's 0.40 / 0.46; 4096x14336, split 2: 0.53 / 0.55 against the operand
kernel's 0.49 / 0.51). Eager QuantLinear (``lowbit bench --ops qlinear.w4a16-*``, H200) with this rule against the
operand kernel's rule of the session before: 28672x8192 at M = 256 nvfp4 227.6 / 272.4 us, int4_awq 248.3 /
259.4, mxfp4 277.4 / 260.3 (the one loss); 4096x14336 at M = 512 nvfp4 112.8 / 132.8, mxfp4 130.0 / 154.9,
int4_awq 124.4 / 189.3. With the loads four K steps ahead (:data:`FRAGMENT_DEEP`) mxfp4 won at M = 1024 too
(28672x8192 0.76 against dequantizing's 0.73, 4096x14336 0.83 against 0.81; without: 0.63 / 0.69; M = 768
not measured with them); int4_awq did not (0.71 / 0.75 against 0.80 / 0.75)."""
FRAGMENT_MIN_FILL = 0.8
"""Smallest share of the SMs busy in the fragment rule's last wave of programs (output tiles x split): 0.85 and
up won in the sweep above (28672x8192 at M = 256 / 384 / 768 are 0.85); at 0.73 it lost or tied (6144x4096 at
M = 1024: 0.62 against 0.79; at M = 256, split 2: 0.49 / 0.50), at 0.61 lost (5120x5120 at M = 1024: 0.53 /
0.77)."""
FRAGMENT_SMALL_M = (32, 64)
"""M range in which nvfp4 weights run the fragment kernel with 64-row x tiles and K split in 4, from
:data:`FRAGMENT_SMALL_M_MIN_WORK`. Same sweep at M = 32: 0.69 / 0.69 / 0.81 / 0.68 (6144x4096, 4096x14336,
28672x8192, 5120x5120) against the Triton GEMM's 0.58 / 0.71 / 0.70 / 0.62, split 2 0.41-0.72; at M = 64 see
:data:`REGISTER_OPERAND_FRAGMENTS`. mxfp4 and int4_awq lost there (28672x8192 at M = 32: 0.83 / 0.90 against
0.95 / 1.36)."""
FRAGMENT_SMALL_M_OTHERS = (33, 64)
"""M range in which mxfp4 and int4_awq weights run the fragment kernel as nvfp4 does at small M, from
:data:`FRAGMENT_SMALL_M_OTHERS_MIN_WORK`. Sweep at M = 64 with the loads four steps ahead, against the Triton
GEMM: mxfp4 0.91 / 0.91 / 0.69 against 0.79 / 0.78 / 0.65 (4096x14336, 28672x8192, 6144x4096), int4_awq
0.94 / 0.87 / 0.71 against 0.88 / 0.83 / 0.73; at M = 32 the Triton GEMM won (mxfp4 0.89 / 0.87 against
1.02 / 0.94, int4_awq 0.89 / 0.92 against 1.19 / 1.35)."""
FRAGMENT_SMALL_M_OTHERS_MIN_WORK = 2 * 10**9
"""Smallest M x N x K for :data:`FRAGMENT_SMALL_M_OTHERS`: 4096x14336 at M = 64 (3.8e9) won, 6144x4096 (1.6e9)
was even."""
FRAGMENT_DEEP = True
"""Every fragment-rule config loads the block scales and fragment words four K steps ahead (``DEEP``; else
one and two). Sweep, CUDA graph, ratio to cuBLAS bf16 against the shallow loads: 64-row tiles, split 4, at
M = 64: 4096x14336 nvfp4 0.94 / 0.82, mxfp4 0.91 / 0.72, int4_awq 0.94 / 0.81, 28672x8192 0.90 / 0.91,
0.91 / 0.86, 0.87 / 0.85, 6144x4096 even; two warpgroups, 256-row tiles: 28672x8192 at M = 256 mxfp4
0.79 / 0.66, nvfp4 0.85 / 0.83, int4_awq 0.75 / 0.74, at M = 512 0.70 / 0.58, 0.72 / 0.71, 0.65 / 0.63;
128-row tiles at M = 128: 0.73 / 0.61, 0.78 / 0.71, 0.83 / 0.75."""
FRAGMENT_SMALL_M_MIN_WORK = 5 * 10**8
"""Smallest M x N x K for :data:`FRAGMENT_SMALL_M`: 6144x4096 and 5120x5120 at M = 32 (8.1e8, 8.4e8) won;
1024x4096 at M = 32 (1.3e8) tied (0.59 / 0.59) and at M = 64 (2.7e8) the operand kernel lost (0.62 / 0.76)."""
FRAGMENT_MID_M = (97, 128)
"""M range in which the fragment kernel runs with two warpgroups and 128-row x tiles, K not split, under
:data:`FRAGMENT_MIN_FILL`: 28672x8192 at M = 128 (loads four steps ahead) nvfp4 0.78, mxfp4 0.73, int4_awq 0.83
against the Triton GEMM's 0.71 (the sweep before: 0.52) / 0.64 / 0.74. Split K lost at this M (4096x14336,
split 2: 0.44 against 0.60)."""

_SM_COUNT: dict = {}


def sm_count(device: torch.device) -> int:
    """The device's streaming multiprocessors, asked once per device."""
    idx = device.index if device.index is not None else torch.cuda.current_device()
    n = _SM_COUNT.get(idx)
    if n is None:
        n = _SM_COUNT[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return n


def wave_fill(programs: int, sms: int) -> float:
    """Share of the SM slots the ``programs`` fill over the waves they need (1.0: the last wave is full)."""
    return programs / (-(-programs // sms) * sms)


def register_operand_config(m: int, w: QTensor, device: torch.device) -> dict | None:
    """The ``gemm_w4_rf`` config (``gemm_w4_ra``'s without :data:`REGISTER_OPERAND_FRAGMENTS`) for ``m`` rows of
    x on weight ``w`` where that kernel is the W4A16 route, else None. The caller has checked that the kernel
    reads ``w`` (``gemm_w4.ra_weight_supports``)."""
    if REGISTER_OPERAND_FRAGMENTS:
        return _fragment_config(m, w, device)
    return _operand_config(m, w, device)


def _fragment_config(m: int, w: QTensor, device: torch.device) -> dict | None:
    if w.fmt not in FRAGMENT_MAX_M:
        return None
    n = w.shape[0]
    work = m * n * w.shape[1]
    deep = {"DEEP": 1} if FRAGMENT_DEEP else {}
    if m <= FRAGMENT_SMALL_M[1]:
        if w.fmt == "nvfp4":
            lo, least = FRAGMENT_SMALL_M[0], FRAGMENT_SMALL_M_MIN_WORK
        else:
            lo, least = FRAGMENT_SMALL_M_OTHERS[0], FRAGMENT_SMALL_M_OTHERS_MIN_WORK
        return {"BM": 64, "WG": 1, "SPLIT": 4, **deep} if m >= lo and work >= least else None
    if work < REGISTER_OPERAND_MIN_WORK or m > FRAGMENT_MAX_M[w.fmt]:
        return None
    if m <= FRAGMENT_MID_M[1]:
        if m < FRAGMENT_MID_M[0]:
            return None
        bm, splits = 128, (1,)
    elif m % 256 and m % 256 < 128:
        return None  # the last 256-row x tile less than half full: measured down to half (M = 384)
    else:
        bm, splits = 256, (1, 2, 3)
    sms = sm_count(device)
    tiles = -(-n // 128) * -(-m // bm)
    split = max((s for s in splits if tiles * s <= sms), default=1)
    if wave_fill(tiles * split, sms) < FRAGMENT_MIN_FILL:
        return None
    return {"BM": bm, "WG": 2, "SPLIT": split, **deep}


def _operand_config(m: int, w: QTensor, device: torch.device) -> dict | None:
    n = w.shape[0]
    work = m * n * w.shape[1]
    lo, hi = REGISTER_OPERAND_SMALL_M
    if lo <= m <= hi:
        if w.fmt == "nvfp4" and work >= REGISTER_OPERAND_SMALL_M_MIN_WORK:
            return {"BM": 64, "WG": 1, "SPLIT": 2 if n >= 16384 else 4}
        return None
    if (w.fmt not in ("nvfp4", "mxfp4", "int4_awq") or not any(a <= m <= b for a, b in REGISTER_OPERAND_M)
            or work < REGISTER_OPERAND_MIN_WORK):
        return None
    sms = sm_count(device)
    tiles = -(-n // 128) * -(-m // 256)
    split = max((s for s in (1, 2, 3) if tiles * s <= sms), default=1)
    low, high = REGISTER_OPERAND_WAVES
    if not low * sms <= tiles * split <= high * sms:
        return None
    return {"BM": 256, "WG": 2, "SPLIT": split}


def dequant_only(w: QTensor) -> bool:
    """Whether no W4A16 kernel reads ``w`` directly, by design of its format or convention, so that ``lowbit.linear``
    decodes it exactly (in chunks: ``linear_dequant_gemm``) and multiplies with cuBLAS at every M:
    :data:`DEQUANT_ONLY_FORMATS`, and int4 weights whose scales are not float16 (compressed-tensors' convention of
    decoding in the scale's dtype, which the int4 kernels do not implement; their decode runs in torch ops)."""
    if w.fmt in DEQUANT_ONLY_FORMATS:
        return True
    return w.fmt == "int4_awq" and w.scale is not None and w.scale.dtype != torch.float16


def dequant_gemm_min_m(fmt: str) -> int:
    if fmt in DEQUANT_ONLY_FORMATS:
        return 0
    return DEQUANT_GEMM_MIN_M_BY_FORMAT.get(fmt, DEQUANT_GEMM_MIN_M)


# looked up here on every call: tests replace it with stand-in kernel modules
kernel_module = op_common.kernel_module


# ---------------------------------------------------------------------------------------------- W4A16


def linear_decide(m: int, device: torch.device, w: QTensor, backend: str,
                  x_dtype: torch.dtype | None = None) -> tuple[str, Any, tuple]:
    """THE W4A16 dispatch rules (module docstring), cheap enough for every call. ``x_dtype``: the activations'
    (None: the weight's dtype), which decides whether the GEMV's row blocks can run past GEMV_MAX_M.

    Returns ``(path, target, facts)``: ``target`` is the kernel function for ``gemv_w4``/``gemm_w4``, the
    exception class for ``unavailable``, None for ``dequant_gemm`` (the op runs it) and the other paths;
    ``facts`` feed :func:`linear_reason` (only formatted when asked for, so the hot path builds no strings).
    """
    common = op_common.decide_common(backend, device, m == 0)
    if common is not None:
        return common
    if m > GEMV_MAX_M:
        module = kernel_module("gemv_w4")
        rows = getattr(module, "row_blocks_apply", None)
        if rows is not None and rows(w, m, w.dtype if x_dtype is None else x_dtype):
            return "gemv_w4", module.gemv_w4, ("row_blocks",)
    least = min(REGISTER_OPERAND_MIN_WORK, REGISTER_OPERAND_SMALL_M_MIN_WORK, FRAGMENT_SMALL_M_MIN_WORK)
    if m > GEMV_MAX_M and m * w.shape[0] * w.shape[1] >= least and not dequant_only(w):
        module = kernel_module("gemm_w4")
        ra = getattr(module, "gemm_w4_rf" if REGISTER_OPERAND_FRAGMENTS else "gemm_w4_ra", None)
        if ra is not None and module.ra_weight_supports(w) is None:
            config = register_operand_config(m, w, device)
            if config is not None:
                return "gemm_w4_ra", ra, ({**config, "FRAGMENTS": 1} if REGISTER_OPERAND_FRAGMENTS else config,)
    if dequant_only(w):
        if slice_rows_reason(w) is None:
            return "dequant_gemm", None, ("dequant_only",)
    elif DEQUANT_GEMM_MIN_M is not None and m >= dequant_gemm_min_m(w.fmt) and slice_rows_reason(w) is None:
        return "dequant_gemm", None, ()
    gemv_why = None
    if m <= GEMV_MAX_M:
        module, gemv_why = op_common.kernel_choice(kernel_module, "gemv_w4", w)
        if module is not None:
            return "gemv_w4", module.gemv_w4, ()
    module, gemm_why = op_common.kernel_choice(kernel_module, "gemm_w4", w)
    if module is not None:
        return "gemm_w4", module.gemm_w4, (gemv_why,)
    return "unavailable", RuntimeError, ("no_kernel", gemv_why, gemm_why)


def linear_reason(path: str, facts: tuple, m: int, device: torch.device, w: QTensor, chunk_rows: int) -> str:
    """The sentence ``lowbit.explain`` and the errors give for a :func:`linear_decide` result."""
    regime = f"M={m} <= GEMV_MAX_M={GEMV_MAX_M}" if m <= GEMV_MAX_M else f"M={m} > GEMV_MAX_M={GEMV_MAX_M}"
    if path == "reference":
        if facts[0] == "torch":
            return "backend='torch': dequantize to fp32, fp32 matmul (linear_reference)"
        return f"x is on {device.type}, no kernels there: linear_reference"
    if path == "empty":
        return "M == 0: nothing to compute, no launch"
    if path == "gemv_w4":
        if facts[:1] == ("row_blocks",):
            return (f"{regime}, {w.fmt} up to gemv_w4.MMA['row_blocks_max_m']: the split-K tensor-core mma.sync GEMV "
                    "in blocks of x rows")
        return f"{regime}: split-K {kernel_module('gemv_w4').describe(w, m)}"
    if path == "dequant_gemm":
        if facts[:1] == ("dequant_only",):
            return (f"no W4A16 kernel reads this {w.fmt} weight directly (policy.dequant_only): dequantize chunks "
                    f"of {chunk_rows} rows exactly, then cuBLAS, at every M")
        name = (f"DEQUANT_GEMM_MIN_M_BY_FORMAT[{w.fmt!r}]" if w.fmt in DEQUANT_GEMM_MIN_M_BY_FORMAT
                else "DEQUANT_GEMM_MIN_M")
        return (f"M={m} >= {name}={dequant_gemm_min_m(w.fmt)}: dequantize chunks of {chunk_rows} rows "
                "(Triton), then cuBLAS")
    if path == "gemm_w4_ra":
        cfg = facts[0]
        kind = ("register-fragment weight (a copy of the codes in fragment order, made once per weight)"
                if cfg.get("FRAGMENTS") else "register-operand")
        return (f"M={m}, {w.fmt}, N={w.shape[0]}: {kind} tensor-core GEMM (policy.register_operand_config: "
                f"{cfg['WG']} warpgroup(s), {cfg['BM']}-row x tiles, K split in {cfg['SPLIT']}"
                f"{', loads four K steps ahead' if cfg.get('DEEP') else ''})")
    if path == "gemm_w4":
        if m <= GEMV_MAX_M:
            return f"{regime} but no GEMV (gemv_w4: {facts[0]}): tensor-core GEMM"
        return f"{regime}: tensor-core GEMM"
    if facts[0] == "triton_off_cuda":
        return f"backend='triton' needs CUDA tensors, x is on {device}"
    if facts[0] == "no_triton":
        return f"{facts[1]}; pass backend='torch' for the reference"
    _, gemv_why, gemm_why = facts
    reasons = ([f"gemv_w4: {gemv_why}"] if gemv_why is not None else []) + [f"gemm_w4: {gemm_why}"]
    return (
        f"no triton kernel runs lowbit.linear for {w.fmt} with {regime} on CUDA ({'; '.join(reasons)}); "
        "pass backend='torch' for the reference"
    )


# ---------------------------------------------------------------------------------------------- scaled_mm

SCALED_MM_MODULE = "scaled_mm"
"""The kernel module behind ``lowbit.scaled_mm`` on CUDA."""


def scaled_decide(m: int, n: int, k: int, device: torch.device, a: QTensor, b: QTensor, backend: str):
    """THE ``lowbit.scaled_mm`` dispatch rules: ``(path, target, facts)`` as :func:`linear_decide` returns;
    for ``"scaled_mm"`` the target is the kernel module's ``scaled_mm`` and facts ``(module,)``."""
    common = op_common.decide_common(backend, device, m == 0 or n == 0 or k == 0)
    if common is not None:
        return common
    module, why = op_common.kernel_choice(kernel_module, SCALED_MM_MODULE, a, b)
    if module is None:
        return "unavailable", RuntimeError, ("no_kernel", why)
    return "scaled_mm", module.scaled_mm, (module,)


def deepgemm_preferred(m: int, k: int) -> bool:
    """Whether an fp8_block GEMM of ``M >= CUBLAS_FP8_BLOCK_MIN_M`` rows should run DeepGEMM rather than
    cuBLASLt where both can (:data:`DEEP_GEMM_CUBLAS_MIN_K`)."""
    return not (k >= DEEP_GEMM_CUBLAS_MIN_K and m <= DEEP_GEMM_CUBLAS_MAX_M)


def scaled_route(a: QTensor, b: QTensor, bias: torch.Tensor | None, out_dtype: torch.dtype,
                 module: Any = None) -> str:
    """Which route of ``lowbit.kernels.scaled_mm`` runs this pair (module docstring): ``"gemv"``, ``"fold"``,
    ``"fold_deepgemm"``, ``"deepgemm"``, ``"cublas"``, ``"dequant"`` or ``"kernel"``. ``module``: the kernel
    module (default: the one the lookup finds)."""
    km = module if module is not None else kernel_module(SCALED_MM_MODULE)
    m = a.shape[0]
    if m <= SCALED_GEMV_MAX_M and km.gemv_unsupported(a, b) is None:
        return "gemv"
    if m >= FOLD_MIN_M and km.fold_unsupported(a, b) is None:
        fold_deepgemm = getattr(km, "fold_deepgemm_unsupported", None)
        if (fold_deepgemm is not None and deepgemm_preferred(m, a.shape[1])
                and fold_deepgemm(a, b, bias, out_dtype) is None):
            return "fold_deepgemm"
        return "fold"
    if m >= CUBLAS_FP8_BLOCK_MIN_M:
        deepgemm = getattr(km, "deepgemm_unsupported", None)
        if (deepgemm is not None and deepgemm_preferred(m, a.shape[1])
                and deepgemm(a, b, bias, out_dtype) is None):
            return "deepgemm"
        if km.cublas_unsupported(a, b, bias, out_dtype) is None:
            return "cublas"
    if m >= DEQUANT_MM_MIN_M and getattr(km, "dequant_unsupported", None) and km.dequant_unsupported(a, b) is None:
        return "dequant"
    return "kernel"


_ROUTE_REASONS = {
    "gemv": "decode: the activation decoded exactly to bf16, then the W4A16 GEMV on the 4-bit weight "
            "(M <= SCALED_GEMV_MAX_M={gemv})",
    "fold": "mxfp4 re-encoded exactly as E4M3 with one fp32 scale per 128 columns, then the FP8 GEMM "
            "(cuBLASLt's block-scaled one where it can run, else the TMA kernel); an exact decoding fallback "
            "runs if a block does not fit (M >= FOLD_MIN_M={fold})",
    "fold_deepgemm": "mxfp4 re-encoded exactly as E4M3 with one fp32 scale per 128 columns, then DeepGEMM's FP8 "
                     "GEMM (deep_gemm.fp8_gemm_nt, installed); an exact decoding fallback runs if a block does not "
                     "fit (M >= FOLD_MIN_M={fold}; cuBLASLt's GEMM instead where K >= DEEP_GEMM_CUBLAS_MIN_K={dg_k} "
                     "and M <= DEEP_GEMM_CUBLAS_MAX_M={dg_m})",
    "cublas": "cuBLASLt's block-scaled FP8 GEMM (torch.nn.functional.scaled_mm, BlockWise1x128 x "
              "BlockWise128x128; M >= CUBLAS_FP8_BLOCK_MIN_M={cublas})",
    "deepgemm": "DeepGEMM's FP8 GEMM (deep_gemm.fp8_gemm_nt, installed; M >= CUBLAS_FP8_BLOCK_MIN_M={cublas}, "
                "cuBLASLt's instead where K >= DEEP_GEMM_CUBLAS_MIN_K={dg_k} and M <= DEEP_GEMM_CUBLAS_MAX_M={dg_m})",
    "dequant": "nvfp4 x nvfp4 or 6/8-bit MX pairs decoded exactly to bf16 (the weight in chunks of rows), then "
               "cuBLAS's bf16 GEMM with fp32 accumulation and the global scales in its epilogue; for MX pairs an "
               "exact decoding fallback runs if a scale leaves bf16's exact range (M >= DEQUANT_MM_MIN_M={dequant})",
    "kernel": "Triton block-scaled GEMM (lowbit.kernels.scaled_mm)",
}


def scaled_reason(path: str, facts: tuple, device: torch.device, a: QTensor, b: QTensor) -> str:
    """The sentence ``explain_scaled_mm`` and the errors give for a :func:`scaled_decide` result (for the
    kernel module, the route of a bf16 output without bias)."""
    if path == "reference":
        if facts[0] == "torch":
            return "backend='torch': dequantize both operands to fp32, fp32 matmul (scaled_mm_reference)"
        return f"operands are on {device.type}, no kernels there: scaled_mm_reference"
    if path == "empty":
        return "M, N or K is 0: nothing to multiply, no launch"
    if path == "scaled_mm":
        route = scaled_route(a, b, None, torch.bfloat16, facts[0])
        why = _ROUTE_REASONS[route].format(gemv=SCALED_GEMV_MAX_M, fold=FOLD_MIN_M, cublas=CUBLAS_FP8_BLOCK_MIN_M,
                                           dequant=DEQUANT_MM_MIN_M, dg_k=DEEP_GEMM_CUBLAS_MIN_K,
                                           dg_m=DEEP_GEMM_CUBLAS_MAX_M)
        if (route == "kernel" and a.fmt == b.fmt == "fp8_block" and a.shape[0] <= FP8_BLOCK_QUANT_IN_GEMM_MAX_M):
            why += ("; a prepared layer (QuantLinear) quantizes its activation inside this kernel, one launch "
                    f"(M <= FP8_BLOCK_QUANT_IN_GEMM_MAX_M={FP8_BLOCK_QUANT_IN_GEMM_MAX_M})")
        return why
    if facts[0] == "triton_off_cuda":
        return f"backend='triton' needs CUDA tensors, the operands are on {device}"
    if facts[0] == "no_triton":
        return f"{facts[1]}; pass backend='torch' for the reference"
    return (
        f"no triton kernel runs lowbit.scaled_mm for {a.fmt} x {b.fmt} on CUDA ({SCALED_MM_MODULE}: {facts[1]}); "
        "pass backend='torch' for the reference"
    )


def kernels_ready(device: torch.device, backend: str | None) -> bool:
    """Whether a layer on ``device`` with ``backend`` can prepare kernel launches (CUDA, triton importable,
    not the torch backend)."""
    return device.type == "cuda" and backend != "torch" and _kernels.triton_available() is None


__all__ = [
    "CUBLAS_FP8_BLOCK_MIN_M",
    "DEEP_GEMM_CUBLAS_MAX_M",
    "DEEP_GEMM_CUBLAS_MIN_K",
    "DEQUANT_GEMM_MIN_M",
    "DEQUANT_GEMM_MIN_M_BY_FORMAT",
    "FOLD_MIN_M",
    "FP8_BLOCK_QUANT_IN_GEMM_MAX_M",
    "FP8_COMPUTE_MIN_M",
    "GEMV_MAX_M",
    "SCALED_GEMV_MAX_M",
    "deepgemm_preferred",
    "dequant_gemm_min_m",
    "register_operand_config",
    "sm_count",
    "linear_decide",
    "linear_reason",
    "scaled_decide",
    "scaled_reason",
    "scaled_route",
]
