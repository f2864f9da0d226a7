"""Quantized x quantized GEMM ops: ``lowbit.scaled_mm`` on both operands already quantized, and
``lowbit.ops.scaled_linear`` (the activation quantized inside the timed call, as ``QuantLinear`` runs it).

Shapes are ``(M, N, K)``: the activation ``[M, K]``, the weight ``[N, K]``; DeepSeek-V3's projections and
8192^3.

- ``scaled_mm.<pair>.prefill`` (M = 4096; 8192 for 8192 x 8192): compute-bound GEMMs;
- ``scaled_mm.<pair>.decode`` (M = 1, 16, 64): weights rotated out of L2 as for ``linear.*.decode``;
- ``scaled_linear.<pair>``: the fused entry at M = 4096 and 16.

Every case is also timed as CUDA-graph replays (the host launch cost out of the figure). Bytes: both operands
(for ``scaled_linear`` the bf16 activation instead) and the bf16 output, each once; FLOPs ``2 M N K``. The
check: relative Frobenius error <= 1e-2 and max error <= 2e-2 of the max against
``lowbit.ops.scaled_mm_reference`` in fp32. Baselines, at every shape: cuBLAS bf16 on the unquantized
operands, ``torch._scaled_mm`` per-tensor FP8 (E4M3 casts, scales 1), DeepGEMM for the fp8_block pair, and
lowbit's own Triton GEMM where the dispatch picked another route (``lowbit.scaled_mm[kernel route]``), and
cuBLASLt's route where the dispatch picked DeepGEMM's (``lowbit.scaled_mm[cublas route]``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from .common import close, copies, on_cuda, optional, randn, rotating
from .quant import qtensor_nbytes
from .registry import Baseline, Case, Context, Op, Shape, Skip, register

# pair -> ((activation format, options), (weight format, options))
PAIRS: dict[str, tuple[tuple[str, dict[str, Any]], tuple[str, dict[str, Any]]]] = {
    "fp8_block": (("fp8_block", {}), ("fp8_block", {"block": (128, 128)})),
    "nvfp4": (("nvfp4", {}), ("nvfp4", {})),
    "mxfp4": (("mxfp4", {}), ("mxfp4", {})),
    "mxfp8": (("mxfp8_e4m3", {}), ("mxfp8_e4m3", {})),
    "mxfp6_mxfp8": (("mxfp8_e4m3", {}), ("mxfp6_e3m2", {})),
    "w4a8_mxfp4": (("fp8_rowwise", {}), ("mxfp4", {})),
}
# (N, K) of DeepSeek-V3's projections, and 8192 x 8192
NK: tuple[tuple[int, int], ...] = ((7168, 2048), (24576, 1536), (2112, 7168), (7168, 16384), (4096, 7168),
                                   (8192, 8192))
DECODE_M = (1, 16, 64)
PREFILL_SHAPES: tuple[Shape, ...] = tuple((8192 if (n, k) == (8192, 8192) else 4096, n, k) for n, k in NK)
DECODE_SHAPES: tuple[Shape, ...] = tuple((m, n, k) for n, k in NK for m in DECODE_M)
FUSED_SHAPES: tuple[Shape, ...] = PREFILL_SHAPES + tuple((16, n, k) for n, k in NK)
ROTATE_MAX_M = 64
WEIGHT_SCALE = 0.05


def _io_nbytes(pair: str, shape: Shape, fused: bool) -> int:
    m, n, k = shape
    (af, ao), (wf, wo) = PAIRS[pair]
    act = m * k * 2 if fused else qtensor_nbytes(af, (m, k), **ao)
    return act + qtensor_nbytes(wf, (n, k), **wo) + m * n * 2


def _lowbit_route(a: Any, qs: list, route: str, other: str = "kernel") -> Baseline:
    """lowbit's ``other`` route of ``lowbit.kernels.scaled_mm`` on the same operands, where the dispatch picked
    ``route``."""
    def build():
        from lowbit.kernels import scaled_mm as ks

        fns = [lambda q=q: ks.scaled_mm(a, q, None, None, torch.bfloat16, other) for q in qs]
        fns[0]()
        return rotating(fns)

    return optional(build, f"lowbit.kernels.scaled_mm (the dispatch picked route {route!r})")


def _setup(pair: str, fused: bool, rotate_max_m: int = ROTATE_MAX_M) -> Callable[[Shape, Context], Case]:
    (af, ao), (wf, wo) = PAIRS[pair]

    def setup(shape: Shape, ctx: Context) -> Case:
        import lowbit
        from lowbit.ops import plan_scaled_mm, policy, scaled_linear, scaled_mm_reference

        m, n, k = shape
        backend = ctx.backend
        w = randn((n, k), ctx.device, seed=1, scale=WEIGHT_SCALE)
        x = randn((m, k), ctx.device, seed=2)
        wq0 = lowbit.quantize(w, wf, **wo)
        a = lowbit.quantize(x, af, **ao)
        plan = plan_scaled_mm(a, wq0, backend=backend)
        if plan.path == "unavailable":
            raise Skip(plan.reason)
        rotate = m <= rotate_max_m
        nq = copies(wq0.nbytes, ctx.device) if rotate else 1
        qs = [wq0] + [lowbit.quantize(w, wf, **wo) for _ in range(nq - 1)]
        if fused:
            fns = [lambda q=q: scaled_linear(x, q, af, act_options=ao, backend=backend) for q in qs]
        else:
            fns = [lambda q=q: lowbit.scaled_mm(a, q, backend=backend) for q in qs]
        for f in fns:  # weight layouts and compilation, outside the timing
            f()
        route = plan.path
        if plan.path == "scaled_mm":
            route = policy.scaled_route(a, wq0, None, torch.bfloat16)

        def check() -> str:
            got = scaled_linear(x, wq0, af, act_options=ao, backend=backend) if fused else \
                lowbit.scaled_mm(a, wq0, backend=backend)
            return close(got, scaled_mm_reference(a, wq0, out_dtype=torch.float32))

        baselines: dict[str, Baseline] = {}
        if ctx.baselines:
            from . import peers

            wb = [w] + [w.clone() for _ in range((copies(w.nbytes, ctx.device) if rotate else 1) - 1)]
            baselines["cublas.bf16"] = rotating([lambda b=b: F.linear(x, b) for b in wb])
            if on_cuda(ctx.device):
                baselines["torch._scaled_mm[fp8]"] = optional(
                    lambda: rotating(peers.scaled_mm_fp8(x, wb)), "torch._scaled_mm")
            else:
                baselines["torch._scaled_mm[fp8]"] = "cuBLASLt's FP8 GEMM: CUDA only"
            if pair == "fp8_block":
                baselines["deep_gemm.fp8_gemm_nt"] = optional(lambda: rotating(peers.deep_gemm_fp8(a, qs)),
                                                              "deep_gemm")
            if not fused and route not in ("kernel", "reference", "empty") and on_cuda(ctx.device):
                baselines["lowbit.scaled_mm[kernel route]"] = _lowbit_route(a, qs, route)
            if not fused and route == "deepgemm":  # what runs where DeepGEMM is not installed
                baselines["lowbit.scaled_mm[cublas route]"] = _lowbit_route(a, qs, route, "cublas")
            if not fused and route == "fold_deepgemm":
                baselines["lowbit.scaled_mm[fold route]"] = _lowbit_route(a, qs, route, "fold")
        return Case(
            fn=rotating(fns),
            bytes=(x.nbytes if fused else a.nbytes) + wq0.nbytes + m * n * 2,
            flops=2 * m * n * k,
            baselines=baselines,
            check=check if ctx.check else None,
            graph=True,
            note=f"route {route}" + (f", {len(qs)} weight copies" if len(qs) > 1 else ""),
            check_numel=n * k + m * k + m * n,
        )

    return setup


def _op(kind: str, pair: str, variant: str, shapes: tuple[Shape, ...], quick: tuple[Shape, ...]) -> Op:
    fused = kind == "scaled_linear"
    (af, ao), (wf, wo) = PAIRS[pair]
    what = (f"lowbit.ops.scaled_linear(x bf16 [M, K] -> {af}, {wf} weight [N, K])" if fused
            else f"lowbit.scaled_mm({af} [M, K], {wf} [N, K])")
    return Op(
        name=".".join(p for p in (kind, pair, variant) if p),
        setup=_setup(pair, fused),
        shapes=shapes,
        quick_shapes=quick,
        nbytes=lambda s: _io_nbytes(pair, s, fused),
        doc=f"{what}; shapes MxNxK" + (", weights rotated out of L2" if variant == "decode" else ""),
        baselines_everywhere=True,
    )


def ops() -> list[Op]:
    return [
        *(_op("scaled_mm", pair, "prefill", PREFILL_SHAPES, PREFILL_SHAPES) for pair in PAIRS),
        *(_op("scaled_mm", pair, "decode", DECODE_SHAPES, tuple((16, n, k) for n, k in NK)) for pair in PAIRS),
        *(_op("scaled_linear", pair, "", FUSED_SHAPES, ((4096, 7168, 16384), (16, 7168, 16384))) for pair in PAIRS),
    ]


def register_all() -> None:
    for op in ops():
        register(op, replace=True)
