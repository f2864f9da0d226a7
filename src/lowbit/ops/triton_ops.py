"""The ``torch.library.triton_op`` registrations of prepared layers: ``lowbit::w4a16_gemv`` (the W4A16 GEMV
regime) and ``lowbit::fp8_block_decode`` (fp8_block decode with the activation quantized inside the GEMM).
Under ``torch.compile`` their bodies launch the same kernels as the eager runners through ``wrap_triton``:
Inductor traces into them and launches the kernels from its generated code, with the layouts as graph inputs.
Each op is defined once, when a weight is first prepared for the CUDA kernels (defining it imports triton),
never at import.
"""

from __future__ import annotations

import os
import sys

import torch

from . import policy


def _gemv_body(
    x: torch.Tensor,
    words: torch.Tensor | None,
    scales: torch.Tensor | None,
    nested: torch.Tensor | None,
    tab: torch.Tensor | None,
    gs: torch.Tensor | None,
    mma_words: torch.Tensor | None,
    mma_scales: torch.Tensor | None,
    ws: torch.Tensor,
    cnt: torch.Tensor,
    rs: torch.Tensor,
    no_bias: torch.Tensor,
    bias: torch.Tensor | None,
    fmt: str,
    fmt_code: int,
    n: int,
    k: int,
    sk: int,
    wpb: int,
    post: float,
    gs_kind: int,
    mma_fmt: int,
    cpg: int,
    act: int,
    plan_n: int = 0,
) -> torch.Tensor:
    """``act(x @ W.T + bias)`` for x ``[M, K]`` (M <= 16, or to the row-block limit; contiguous) on a prepared
    weight's GEMV layouts (``lowbit.kernels.gemv_prepack`` and ``gemv_mma_layout``: words, scales, nested
    absmax, NF4 table, global scale, tensor-core words and scales; None where the weight has none), the device's
    split-K scratch and placeholders (:func:`lowbit.kernels.gemv_runners.traced_gemv`) and the weight's static
    facts; the plan is :func:`lowbit.kernels.gemv_w4.gemv_w4`'s default one."""
    from ..kernels.gemv_runners import GemvFacts, traced_gemv

    f = GemvFacts(fmt, fmt_code, n, k, sk, wpb, post, gs_kind, mma_fmt, cpg, plan_n)
    return traced_gemv(x, words, scales, nested, tab, gs, mma_words, mma_scales, ws, cnt, rs, no_bias, bias, f,
                       act)


_GEMV_OP = []


STATIC_LAUNCH_ENV = "TORCHINDUCTOR_STATIC_LAUNCH_USER_DEFINED_TRITON_KERNELS"


def _static_launch_compiled_kernels() -> None:
    """Let Inductor launch the op's kernels with its static launcher (``static_launch_user_defined_triton_kernels``,
    as it launches its own kernels) instead of Triton's Python launcher: several microseconds less host time per
    GEMV in compiled code without CUDA graphs. A process-wide Inductor setting; lowbit leaves it alone when
    ``$TORCHINDUCTOR_STATIC_LAUNCH_USER_DEFINED_TRITON_KERNELS`` is set or ``policy.STATIC_LAUNCH_COMPILED_KERNELS``
    is False. Kernels the static launcher cannot take still go through Triton (Inductor falls back).

    The environment variable is set too: Inductor compiles kernels in a pool of worker processes, which is
    where it decides how each kernel is launched, and it hands the workers only its general static-launcher
    switch, not this one; a worker reads this setting from the environment when it starts. A pool that is
    already running (something was compiled before the first lowbit weight was prepared) is shut down, so that
    Inductor starts its next pool with the setting; without that, every op kernel compiled by the old pool
    kept Triton's launcher."""
    if not policy.STATIC_LAUNCH_COMPILED_KERNELS or STATIC_LAUNCH_ENV in os.environ:
        return
    import torch._inductor.config as inductor_config

    if hasattr(inductor_config, "static_launch_user_defined_triton_kernels"):
        inductor_config.static_launch_user_defined_triton_kernels = True
        os.environ[STATIC_LAUNCH_ENV] = "1"
        _restart_running_compile_workers()


def _restart_running_compile_workers() -> None:
    """Shut down Inductor's compile-worker pools if any is running (they started without the environment
    setting); Inductor starts a new one on its next compile. Inductor versions without these internals are
    left alone."""
    async_compile = sys.modules.get("torch._inductor.async_compile")
    shutdown = getattr(async_compile, "shutdown_compile_workers", None)
    if getattr(async_compile, "_pool_set", None) and shutdown is not None:
        shutdown()


def register_gemv_op():
    """Define the ``lowbit::w4a16_gemv`` triton_op (once; defining it imports triton, so it happens when a
    weight is first prepared for the CUDA kernels, never at import)."""
    if not _GEMV_OP:
        _static_launch_compiled_kernels()
        # declared without mutated arguments: the op's only writes besides its output are to the layer's split-K
        # scratch (its counters are reset before the kernels exit); under torch.compile the body is traced and
        # the wrapped kernels' own analysis records those writes
        _GEMV_OP.append(torch.library.triton_op("lowbit::w4a16_gemv", _gemv_body, mutates_args=()))
    return _GEMV_OP[0]


def _fp8_block_decode_body(x: torch.Tensor, w_data: torch.Tensor, w_scale: torch.Tensor, ws: torch.Tensor,
                           cnt: torch.Tensor, bias: torch.Tensor | None, pow2: bool, rows_per_scale: int,
                           plan_n: int = 0) -> torch.Tensor:
    """``x @ W.T + bias`` for x ``[M, K]`` (M <= ``policy.FP8_BLOCK_QUANT_IN_GEMM_MAX_M``, contiguous) quantized
    to fp8_block 1x128 inside the GEMM, on an fp8_block weight (:func:`lowbit.kernels.scaled_mm.traced_quant_in_gemm`)."""
    from ..kernels import scaled_mm as ksm

    return ksm.traced_quant_in_gemm(x, w_data, w_scale, ws, cnt, bias, pow2, rows_per_scale, plan_n)


_FP8_BLOCK_OP = []


def register_fp8_block_op():
    """Define the ``lowbit::fp8_block_decode`` triton_op (once, when an fp8_block weight is first prepared for
    the CUDA kernels; never at import). Its only writes besides the output are to the split-K scratch, as for
    ``lowbit::w4a16_gemv``."""
    if not _FP8_BLOCK_OP:
        _static_launch_compiled_kernels()
        _FP8_BLOCK_OP.append(torch.library.triton_op("lowbit::fp8_block_decode", _fp8_block_decode_body,
                                                     mutates_args=()))
    return _FP8_BLOCK_OP[0]
