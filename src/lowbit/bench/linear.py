"""W4A16 ops: ``lowbit.linear`` at decode and prefill sizes, and one ``QuantLinear`` forward per scheme.

Shapes are ``(M, N, K)``: x ``[M, K]`` bf16, the weight ``[N, K]`` (``nn.Linear``'s ``[out, in]``).

- ``linear.<format>.decode`` (M = 1, 16): the GEMV regime. Where one weight fits in three L2 caches, the case
  cycles through enough quantized copies of it that every call reads its weight from HBM, in ``do_bench``
  and in the CUDA-graph replays alike (a serving engine captures its decode step; the graph time is the
  number that counts); cuBLAS and the peers cycle through bf16 copies the same way.
- ``linear.<format>.prefill`` (M = 33 ... 4096): the GEMM regime; ``lowbit.linear`` picks the Triton GEMM or,
  at large M, chunked dequantize + cuBLAS; the other lowbit path is timed as a ``lowbit.*`` baseline.
- ``qlinear.<scheme>``: ``QuantLinear.forward`` (every scheme, weight-only and activation-quantized), the
  module path a quantized model runs, host work included; ``qlinear.w4a4-nvfp4+fp8`` and ``+fp8-kept``: the
  same layer in the opt-in FP8 compute mode (``lowbit.nn.set_compute``; the FP8 weight re-encoded per call or
  kept), at the DiT projection shapes, checked against the same mode on the PyTorch backend.

Bytes: the quantized weight, x and the bf16 output, each once; FLOPs ``2 M N K``. The check: relative
Frobenius error <= 1e-2 and max error <= 2e-2 of the max against ``lowbit.ops.linear_reference`` in fp32 (the
QuantLinear ops: against the same layer with ``backend="torch"``). Baselines, timed at every shape: cuBLAS
bf16 ``F.linear`` on the unquantized weight, and the peers of the format (:mod:`lowbit.bench.peers`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from .common import close, copies, on_cuda, optional, randn, rotating
from .quant import qtensor_nbytes
from .registry import Baseline, Case, Context, Op, Shape, Skip, register

# (N, K) of Llama-3-8B/70B-sized projections: square, MLP up (28672 x 8192) and down, QKV, MLP of 8B
NK: tuple[tuple[int, int], ...] = ((4096, 4096), (8192, 8192), (28672, 8192), (8192, 28672), (6144, 4096),
                                   (4096, 14336))
DECODE_M = (1, 16)
PREFILL_M = (4096, 1000, 128, 33)
WEIGHT_SCALE = 0.02
# label -> (format, quantize options); the label is the op name's format part
FORMATS: dict[str, tuple[str, dict[str, Any]]] = {
    "nvfp4": ("nvfp4", {}),
    "mxfp4": ("mxfp4", {}),
    "fp4_b32": ("fp4_b32", {}),
    "nf4": ("nf4", {}),
    "nf4.dq": ("nf4", {"double_quant": True}),
    "int4_awq": ("int4_awq", {"group_size": 128}),
}
PREFILL_FORMATS = ("nvfp4", "mxfp4", "fp4_b32", "nf4.dq", "int4_awq")
QLINEAR_SHAPES: tuple[Shape, ...] = ((1, 4096, 4096), (16, 4096, 4096), (4096, 4096, 4096))
DIT_SHAPES: tuple[Shape, ...] = tuple((m, n, k) for m in (32760, 8190)
                                      for n, k in ((5120, 5120), (13824, 5120), (5120, 13824)))
"""A Wan2.1-14B-shaped DiT block's projections (attention 5120², FFN up and down) at 32760 and 8190 tokens."""
COMPUTE_VARIANTS = {"fp8": False, "fp8-kept": True}
"""``qlinear.w4a4-nvfp4+<variant>``: the FP8 compute mode, with ``keep_weight`` as given."""
GRAPH_MAX_M = 64
"""Matmul cases up to this M are also timed as CUDA-graph replays (launch-bound at these sizes)."""


def _shapes(ms: tuple[int, ...]) -> tuple[Shape, ...]:
    return tuple((m, n, k) for n, k in NK for m in ms)


def _io_bytes(m: int, n: int, k: int) -> int:
    return m * k * 2 + m * n * 2  # bf16 x read, bf16 output written


def quantize_weight(w: torch.Tensor, fmt: str, options: dict[str, Any]) -> Any:
    """``lowbit.quantize`` of a bf16 weight as a user would (int4_awq from fp16, as AutoAWQ checkpoints are)."""
    import lowbit

    return lowbit.quantize(w.half() if fmt == "int4_awq" else w, fmt, **options)


@dataclass
class _Problem:
    x: torch.Tensor
    w: torch.Tensor  # bf16 weight the quantized copies come from
    bf16: list[torch.Tensor]  # rotated bf16 copies (the first is w)


def _problem(shape: Shape, ctx: Context, rotate: bool) -> _Problem:
    m, n, k = shape
    w = randn((n, k), ctx.device, seed=1, scale=WEIGHT_SCALE)
    x = randn((m, k), ctx.device, seed=2)
    nb = copies(w.nbytes, ctx.device) if rotate else 1
    return _Problem(x, w, [w] + [w.clone() for _ in range(nb - 1)])


def _cublas(p: _Problem) -> Callable[[], Any]:
    x = p.x
    return rotating([lambda wb=wb: F.linear(x, wb) for wb in p.bf16])


def _fp8_baseline(p: _Problem, ctx: Context) -> Baseline:
    """``torch._scaled_mm`` per-tensor FP8 on the same (rotated) weights: cuBLASLt's FP8 GEMM, the fastest
    product torch offers for a layer, at twice the weight bytes of a 4-bit format."""
    if not on_cuda(ctx.device):
        return "cuBLASLt's FP8 GEMM: CUDA only"
    from . import peers

    return optional(lambda: rotating(peers.scaled_mm_fp8(p.x, p.bf16)), "torch._scaled_mm")


def _peer_baselines(fmt: str, options: dict[str, Any], p: _Problem) -> dict[str, Baseline]:
    from . import peers

    x = p.x

    def calls(build: Callable[[], list]) -> Callable[[], Callable[[], Any]]:
        return lambda: rotating([lambda f=f: f(x) for f in build()])

    out: dict[str, Baseline] = {}
    if fmt == "nf4":
        dq = bool(options.get("double_quant", False))
        out["bitsandbytes.matmul_4bit"] = optional(calls(lambda: peers.bnb_nf4(p.bf16, dq, x)), "bitsandbytes")
    if fmt == "int4_awq":
        out["gemlite.A16Wn[int4]"] = optional(calls(lambda: peers.gemlite(p.bf16, "int4", x)), "gemlite")
        out["torchao.int4[tile_packed_to_4d]"] = optional(calls(lambda: peers.torchao_int4(p.bf16, x)), "torchao")
    if fmt == "mxfp4":
        out["gemlite.A16W4_MXFP"] = optional(calls(lambda: peers.gemlite(p.bf16, "mxfp4", x)), "gemlite")
    if fmt in peers.HUMMING_WEIGHTS:
        out[f"humming.HummingLayer[{fmt}]"] = optional(calls(lambda: peers.humming(p.bf16, fmt, x)), "humming")
    return out


def _gemm_w4_baseline(x: torch.Tensor, qs: list, ctx: Context) -> Baseline:
    if not on_cuda(ctx.device) or ctx.backend == "torch":
        return "the Triton GEMM runs on CUDA only"

    def build():
        from lowbit.kernels import gemm_w4

        why = gemm_w4.supports(qs[0])
        if why is not None:
            raise RuntimeError(why)
        fns = [lambda q=q: gemm_w4.gemm_w4(x, q) for q in qs]
        fns[0]()
        return rotating(fns)

    return optional(build, "lowbit.kernels.gemm_w4")


def _linear_setup(label: str, regime: str) -> Callable[[Shape, Context], Case]:
    fmt, options = FORMATS[label]

    def setup(shape: Shape, ctx: Context) -> Case:
        import lowbit
        from lowbit.ops import linear_dequant_gemm, linear_reference, plan_linear

        m, n, k = shape
        p = _problem(shape, ctx, rotate=regime == "decode")
        q0 = quantize_weight(p.w, fmt, options)
        x = p.x
        plan = plan_linear(x, q0, backend=ctx.backend)
        if plan.path == "unavailable":
            raise Skip(plan.reason)
        nq = copies(q0.nbytes, ctx.device) if regime == "decode" else 1
        qs = [q0] + [quantize_weight(p.w, fmt, options) for _ in range(nq - 1)]
        backend = ctx.backend
        fns = [lambda q=q: lowbit.linear(x, q, backend=backend) for q in qs]
        for f in fns:  # kernel layouts and compilation, outside the timing
            f()
        def check() -> str:
            return close(lowbit.linear(x, q0, backend=backend), linear_reference(x, q0, out_dtype=torch.float32))

        baselines: dict[str, Baseline] = {}
        if ctx.baselines:
            baselines["cublas.bf16"] = _cublas(p)
            baselines["torch._scaled_mm[fp8]"] = _fp8_baseline(p, ctx)
            baselines.update(_peer_baselines(fmt, options, p))
            if regime == "decode" and m == 1:
                bias = randn((n,), ctx.device, seed=3)
                baselines["lowbit.linear+bias+gelu"] = rotating(
                    [lambda q=q: lowbit.linear(x, q, bias, "gelu", backend=backend) for q in qs])
            if regime == "prefill":
                if plan.path != "gemm_w4":
                    baselines["lowbit.gemm_w4"] = _gemm_w4_baseline(x, qs, ctx)
                if plan.path != "dequant_gemm":
                    baselines["lowbit.dequant_gemm"] = lambda: linear_dequant_gemm(x, q0)
        return _matmul_case(shape, ctx, fns, q0.nbytes, baselines, check,
                            f"path {plan.path}" + (f", {len(qs)} weight copies" if len(qs) > 1 else ""))

    return setup


def _matmul_case(shape: Shape, ctx: Context, fns: list, weight_bytes: int, baselines: dict[str, Baseline],
                 check: Callable[[], Any], note: str) -> Case:
    """The Case of an [M, K] x [N, K] layer call: ``fns`` over rotated weight copies, the weight read once plus
    x and the output, CUDA-graph timing at decode sizes."""
    m, n, k = shape
    return Case(
        fn=rotating(fns),
        bytes=weight_bytes + _io_bytes(m, n, k),
        flops=2 * m * n * k,
        baselines=baselines,
        check=check if ctx.check else None,
        graph=True if m <= GRAPH_MAX_M else None,
        note=note,
        check_numel=n * k + m * n + m * k,
    )


def _linear_nbytes(label: str) -> Callable[[Shape], int]:
    fmt, options = FORMATS[label]

    def nbytes(shape: Shape) -> int:
        m, n, k = shape
        return qtensor_nbytes(fmt, (n, k), **options) + _io_bytes(m, n, k)

    return nbytes


def _qlinear_setup(scheme_name: str, compute: str | None = None) -> Callable[[Shape, Context], Case]:
    def setup(shape: Shape, ctx: Context) -> Case:
        from lowbit.nn import SCHEMES, QuantLinear, set_compute

        def in_mode(layer: QuantLinear) -> QuantLinear:
            if compute is not None:
                set_compute(layer, "fp8_block", keep_weight=COMPUTE_VARIANTS[compute])
            return layer

        scheme = SCHEMES[scheme_name]
        m, n, k = shape
        why = scheme.unsupported(n, k)
        if why is not None:
            raise Skip(f"{scheme_name} cannot take a [{n}, {k}] weight: {why}")
        p = _problem(shape, ctx, rotate=m <= GRAPH_MAX_M)
        x = p.x

        def layer_of(w: torch.Tensor) -> QuantLinear:
            lin = torch.nn.Linear(k, n, bias=False, device=ctx.device, dtype=torch.bfloat16)
            with torch.no_grad():
                lin.weight.copy_(w)
            # "auto" for "triton": on CUDA it runs the same kernels, and it quantizes the formats that have no
            # Triton quantize kernel (int4_awq, nf4) with the reference instead of refusing them
            backend = None if ctx.backend == "triton" else ctx.backend
            return in_mode(QuantLinear.from_linear(lin, scheme, backend=backend))

        first = layer_of(p.w)
        nl = copies(first.weight_qtensor.nbytes, ctx.device) if m <= GRAPH_MAX_M else 1
        layers = [first] + [layer_of(p.w) for _ in range(nl - 1)]
        fns = [lambda layer=layer: layer(x) for layer in layers]
        for f in fns:  # kernel layouts and compilation, outside the timing
            f()
        def check() -> str:
            ref = in_mode(QuantLinear(k, n, False, scheme=scheme, weight=first.weight_qtensor, backend="torch"))
            return close(first(x), ref(x))

        baselines: dict[str, Baseline] = {}
        if ctx.baselines:
            baselines["cublas.bf16"] = _cublas(p)
            baselines["torch._scaled_mm[fp8]"] = _fp8_baseline(p, ctx)
            if scheme.act_format is None and compute is None:
                # a weight-only layer against the peers' layers of its weight format (module against module,
                # host work included on both sides)
                baselines.update(_peer_baselines(scheme.weight_format, dict(scheme.weight_options), p))
        return _matmul_case(shape, ctx, fns, first.weight_qtensor.nbytes, baselines, check,
                            f"{scheme.description}" + (f"; FP8 compute mode ({compute})" if compute else "")
                            + (f"; {len(layers)} layer copies" if len(layers) > 1 else ""))

    return setup


def _qlinear_nbytes(scheme_name: str) -> Callable[[Shape], int]:
    def nbytes(shape: Shape) -> int:
        from lowbit.nn import SCHEMES

        scheme = SCHEMES[scheme_name]
        m, n, k = shape
        return qtensor_nbytes(scheme.weight_format, (n, k), **scheme.weight_quantize_options(k)) + _io_bytes(m, n, k)

    return nbytes


@dataclass(frozen=True)
class LinearOp:
    """One registered W4A16 ``lowbit.linear`` op: a format label of :data:`FORMATS` and a regime."""

    label: str
    regime: str  # "decode" or "prefill"
    shapes: tuple[Shape, ...] = field(default=())

    @property
    def name(self) -> str:
        return f"linear.{self.label}.{self.regime}"

    def to_op(self) -> Op:
        fmt, options = FORMATS[self.label]
        opts = ", ".join(f"{k}={v}" for k, v in options.items())
        decode = self.regime == "decode"
        shapes = self.shapes or _shapes(DECODE_M if decode else PREFILL_M)
        quick = ((1, 8192, 8192), (16, 8192, 8192)) if decode else tuple((4096, n, k) for n, k in NK)
        return Op(
            name=self.name,
            setup=_linear_setup(self.label, self.regime),
            shapes=shapes,
            quick_shapes=quick,
            nbytes=_linear_nbytes(self.label),
            doc=f"lowbit.linear(x bf16 [M, K], {fmt}{' (' + opts + ')' if opts else ''} weight [N, K]); shapes MxNxK"
            + (", weights rotated out of L2" if decode else ""),
            baselines_everywhere=True,
        )


def _qlinear_op(scheme_name: str, compute: str | None = None) -> Op:
    from lowbit.nn import SCHEMES

    mode = "" if compute is None else f" in the FP8 compute mode ({compute})"
    return Op(
        name=f"qlinear.{scheme_name}" + (f"+{compute}" if compute else ""),
        setup=_qlinear_setup(scheme_name, compute),
        shapes=QLINEAR_SHAPES if compute is None else DIT_SHAPES,
        quick_shapes=QLINEAR_SHAPES[:1] if compute is None else DIT_SHAPES[:3],
        nbytes=_qlinear_nbytes(scheme_name),
        doc=f"QuantLinear.forward, scheme {scheme_name}{mode}: {SCHEMES[scheme_name].description}; shapes MxNxK",
        baselines_everywhere=True,
    )


LINEAR_OPS: tuple[LinearOp, ...] = (
    *(LinearOp(label, "decode") for label in FORMATS),
    *(LinearOp(label, "prefill") for label in PREFILL_FORMATS),
)


def register_all() -> None:
    from lowbit.nn import SCHEMES

    for lop in LINEAR_OPS:
        register(lop.to_op(), replace=True)
    for name in SCHEMES:
        register(_qlinear_op(name), replace=True)
    for compute in COMPUTE_VARIANTS:
        register(_qlinear_op("w4a4-nvfp4", compute), replace=True)
