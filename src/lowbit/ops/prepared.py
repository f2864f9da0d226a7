"""Prepared weights: what a layer's quantized weight needs for every call, decided once.

A :class:`PreparedWeight` is made when a ``QuantLinear`` gets its weight (construction, ``.to(device)``,
``load_state_dict``) and remade when one of the weight's tensors is replaced or changed in place. It holds

- the weight as a QTensor, validated once;
- the kernel layouts (``lowbit.kernels.gemv_prepack.prepare_w4`` and the tensor-core layout) and their static
  facts;
- per (rows M, x dtype, bias or not) a runner with the launch plan, the compiled kernel and every argument
  but x and the output (``lowbit.kernels.gemv_runners.GemvRunner``; for activation-quantized schemes the
  runners of :mod:`lowbit.ops.prepared_runners`).

A call then checks x cheaply (dtype, last dim, device, alignment), looks its runner up and launches. The
dispatch rules are those of :func:`lowbit.ops.linear.linear` / :func:`lowbit.ops.scaled_mm.scaled_linear`:
where no runner applies (fp32 x, M above the GEMV regime, the ``torch`` backend, CPU) the call goes through
those functions unchanged, so every path gives the same bits as before.

Under ``torch.compile`` the W4A16 GEMV regime is the ``torch.library.triton_op`` ``lowbit::w4a16_gemv``
(:func:`lowbit.ops.triton_ops.register_gemv_op`), whose body launches the same kernels through ``wrap_triton``: Inductor traces into it
and launches the kernels from its generated code, with the layouts as graph inputs. Other regimes and
schemes stay one opaque custom op each (``lowbit::linear_w4a16``, ``lowbit::scaled_linear``).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import torch

from .. import kernels as _kernels
from ..formats.qtensor import QTensor
from ..formats.shards import plan_rows
from . import policy
from .linear import ACTIVATIONS, apply_activation, check_weight, chunked_gemm, linear, weight_chunks
from .policy import GEMV_MAX_M
from .prepared_runners import Fp8BlockCublas, Fp8BlockDecode, GemvRouteDecode, MXDecode
from .triton_ops import register_fp8_block_op, register_gemv_op

_X_DTYPES = (torch.bfloat16, torch.float16)
_SCALED_X_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_MAX_RUNNERS = 256
"""Runners kept per layer (one per M up to GEMV_MAX_M, x dtype and bias presence); cleared when full."""


def _trackable(q: QTensor) -> tuple:
    """(tensor, version) of each tensor of ``q`` whose in-place updates can be seen (inference tensors have no
    version counter; they cannot be changed outside inference mode either)."""
    out = []
    for t in q.tensors().values():
        v = _kernels.tensor_version(t)
        if v >= 0:
            out.append((t, v))
    return tuple(out)


class PreparedWeight:
    """A layer's weight made ready for calls (see the module docstring).

    Args:
        w: the QTensor ``[N, K]``.
        weight_only: the scheme's activations stay in bf16/fp16 (W4A16): :func:`lowbit.linear`; else
            :func:`lowbit.ops.scaled_linear` with ``act_format`` / ``act_options``.
        activation: fused activation after the bias.
        backend: the layer's backend (None: ``$LOWBIT_BACKEND`` at call time, else ``"auto"``).
    """

    def __init__(self, w: QTensor, *, weight_only: bool, activation: str | None = None,
                 act_format: str | None = None, act_options: dict | None = None,
                 backend: str | None = None, layouts: bool = True) -> None:
        if activation not in ACTIVATIONS:
            raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
        self.w = w
        self.n, self.k = w.shape
        self.weight_only = weight_only
        self.activation = activation
        self.act_code = 0  # the GEMV kernels' code of ``activation`` (set with the layouts)
        self.act_format = act_format
        self.act_options = dict(act_options or {})
        self.backend = backend
        self.device = w.data.device
        self._dev = w.data.get_device()  # an int, cheaper to compare per call than a torch.device
        self._bias_ok = None
        self.versions = _trackable(w) if layouts else ()
        self.gemv = None          # lowbit.kernels.gemv_prepack.PreparedW4 when the GEMV regime has runners
        self.facts = None         # its GemvFacts
        self.gemv_tensors: tuple = ()
        self.runners: dict = {}
        self._chunks: dict = {}      # x dtype -> the decode calls of the dequantize-then-BLAS regime
        self._dequant_min_m = 1 << 62
        self._scaled_ready = False   # activation-quantized schemes: the quick call below applies
        self._quantizers: dict = {}  # x dtype -> (activation quantize function, its kwargs)
        self._pairs_checked: set = set()
        self._routes: dict = {}      # (M, x dtype, bias dtype) -> (route, target) of the scaled GEMM
        self.scaled_runners: dict = {}  # (M, x dtype, bias is None) -> Fp8BlockDecode
        self.fp8_traced: tuple | None = None  # fp8_block decode under torch.compile (see traced_call)
        ready = layouts and policy.kernels_ready(self.device, backend)
        if weight_only:
            check_weight(w)
            if ready:
                self._prepare_gemv()
        elif ready:
            if w.fmt in ("nvfp4", "mxfp4"):
                from ..kernels import gemv_w4

                gemv_w4.warm(w)  # the decode route of scaled_mm runs the W4A16 GEMV on these weights
            self._scaled_ready = True
            self._prepare_fp8_block_traced()

    def _prepare_gemv(self) -> None:
        from ..kernels import gemv_w4
        from ..kernels.gemv_mma_layout import mma_layout
        from ..kernels.gemv_prepack import dummy_tensor, prepare_w4
        from ..kernels.gemv_runners import facts, mma_rule, traced_scratch_size

        if gemv_w4.supports(self.w) is not None:
            return
        register_gemv_op()
        self.act_code = gemv_w4.ACTIVATIONS[self.activation]
        from ..formats.rows import slice_rows_reason

        if policy.DEQUANT_GEMM_MIN_M is not None and slice_rows_reason(self.w) is None:
            self._dequant_min_m = policy.dequant_gemm_min_m(self.w.fmt)
        p = prepare_w4(self.w)
        self.facts = facts(p)   # builds the tensor-core layout too
        lay = mma_layout(p)
        dummy = p.nested if lay is None else None
        self.gemv = p
        self.gemv_tensors = (p.words, p.scales, p.nested, p.tab, p.gs,
                             lay.words if lay is not None else dummy, lay.scales if lay is not None else dummy)
        # what the compiled path passes besides the layouts: the split-K scratch and placeholders, made here so
        # that the compiled code allocates none of them per call
        from ..kernels.scratch import mark_static, traced_scratch

        idx = self.device.index if self.device.index is not None else torch.cuda.current_device()
        ws, cnt = traced_scratch(self.device, idx, *traced_scratch_size(self.n, self.k))
        self.traced_extra = (ws, cnt, dummy_tensor(self.device, torch.float32))
        self.no_bias = {dt: dummy_tensor(self.device, dt) for dt in _X_DTYPES}
        self.mma_rule = mma_rule(self.facts)
        # fixed addresses for torch.compile: CUDA-graph trees would otherwise copy every layout into graph-owned
        # memory on each replay (they are not module parameters); guarded, so a re-prepared layer recompiles
        mark_static(*{id(t): t for t in (*self.gemv_tensors, *self.traced_extra, *self.no_bias.values())}.values())

    def _prepare_fp8_block_traced(self) -> None:
        """fp8_block activations on an fp8_block weight: under ``torch.compile`` decode runs the
        ``lowbit::fp8_block_decode`` triton_op (the activation quantized inside the GEMM), with the weight
        and a split-K scratch as static graph inputs."""
        w, opts = self.w, self.act_options
        if (w.fmt != "fp8_block" or self.act_format != "fp8_block" or set(opts) - {"block", "scale_fmt"}
                or tuple(opts.get("block", (1, 128))) != (1, 128) or not w.data.is_contiguous()
                or not w.scale.is_contiguous()):
            return  # the decode kernel derives the weight's strides from its shapes
        from ..kernels import scaled_mm as ksm
        from ..kernels.scratch import mark_static, traced_scratch

        register_fp8_block_op()
        idx = self.device.index if self.device.index is not None else torch.cuda.current_device()
        ws, cnt = traced_scratch(self.device, idx, *ksm.quant_in_gemm_scratch_size(self.n, self.k))
        mark_static(w.data, w.scale)
        self.fp8_traced = (w.data, w.scale, ws, cnt, opts.get("scale_fmt") == "ue8m0", int(w.params["block"][0]),
                           plan_rows(w))

    # ------------------------------------------------------------------ state

    def stale(self) -> bool:
        """Whether a tensor of the weight changed in place since preparation."""
        for t, v in self.versions:
            if t._version != v:
                return True
        return False

    def _backend(self) -> str | None:
        return self.backend if self.backend is not None else os.environ.get("LOWBIT_BACKEND")

    # ------------------------------------------------------------------ calls

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None,
                 act_global_scale: torch.Tensor | None = None) -> torch.Tensor:
        """``act(x @ dequant(w).T + bias)`` in x's dtype; ``bias`` None or ``[N]`` in x's dtype."""
        if self.gemv is not None:
            # the decode fast path: a runner made by an earlier call, contiguous aligned x, the checked bias
            shape = x.shape
            if shape[-1] == self.k and (bias is None or bias is self._bias_ok) and x.get_device() == self._dev:
                m = x.numel() // self.k
                run = self.runners.get((m, x.dtype, bias is None))
                if run is not None and x.is_contiguous() and not x.data_ptr() & 15:
                    out = run(x.view(m, self.k), bias)
                    return out if len(shape) == 2 else out.view(*shape[:-1], self.n)
            if x.dtype in _X_DTYPES and x.shape[-1] == self.k and x.device == self.device:
                out = self._gemv_call(x, bias)
                if out is not None:
                    return out
        elif self._scaled_ready:
            if self.scaled_runners and act_global_scale is None:
                # the decode fast path of activation-quantized schemes (see Fp8BlockDecode)
                shape = x.shape
                if (shape[-1] == self.k and (bias is None or bias is self._bias_ok)
                        and x.get_device() == self._dev):
                    m = x.numel() // self.k
                    run = self.scaled_runners.get((m, x.dtype, bias is None))
                    if run is not None and x.is_contiguous() and not x.data_ptr() & 15:
                        out = apply_activation(run(x.view(m, self.k), bias), self.activation)
                        return out if len(shape) == 2 else out.view(*shape[:-1], self.n)
            out = self._scaled_call(x, bias, act_global_scale)
            if out is not None:
                return out
        return self.call_general(x, bias, act_global_scale)

    def _scaled_call(self, x: torch.Tensor, bias: torch.Tensor | None,
                     act_global_scale: torch.Tensor | None) -> torch.Tensor | None:
        """:func:`lowbit.ops.scaled_linear` without its per-call decisions: the activation's quantize function
        is resolved once per x dtype and the operand pair checked once (the same kernels and bits)."""
        if (x.dtype not in _SCALED_X_DTYPES or x.dim() < 1 or x.shape[-1] != self.k or x.device != self.device
                or (bias is not None and (bias.shape != (self.n,) or bias.device != self.device))):
            return None
        backend = self._backend()
        if backend == "torch":
            return None
        from ..api import quantizer
        from .scaled_mm_checks import check_operands
        from .scaled_mm_dispatch import run_checked

        k = self.k
        flat = x.dim() == 2
        x2 = x if flat and x.is_contiguous() else x.reshape(-1, k).contiguous()
        if x2.shape[0] == 0:
            return None
        q = self._quantizers.get(x.dtype)
        if q is None:
            q = self._quantizers[x.dtype] = quantizer(self.act_format, x2, backend=backend, **self.act_options)
        fn, kwargs = q
        if act_global_scale is not None:
            if self.act_format != "nvfp4" or "global_scale" in self.act_options:
                return None  # scaled_linear's error
            kwargs = {**kwargs, "global_scale": act_global_scale}
        a = fn(x2, **kwargs)
        if x.dtype not in self._pairs_checked:
            check_operands(a, self.w)
            self._pairs_checked.add(x.dtype)
        if bias is not None and (bias.data_ptr() % 16 or not bias.is_contiguous()):
            bias = bias.contiguous() if not bias.is_contiguous() else bias.clone()
        key = (x2.shape[0], x.dtype, None if bias is None else bias.dtype)
        route = self._routes.get(key)
        if route is None:
            if torch.cuda.is_current_stream_capturing():  # decided (and its buffers made) outside captures only
                out = run_checked(a, self.w, None, bias, x.dtype, backend or "auto")
                return apply_activation(out if flat else out.reshape(*x.shape[:-1], self.n), self.activation)
            route = self._routes[key] = self._route(a, bias, x.dtype)
        name, target = route
        if name == "kernel*":
            out = target(a, None, bias)
        elif name == "run":  # the kernel module declines the pair: the op's dispatch and its error
            out = run_checked(a, self.w, None, bias, x.dtype, backend or "auto")
        else:
            out = target(a, self.w, None, bias, x.dtype, name)
        # a runner for the next calls like this one: x contiguous (any number of leading dims, which the fast
        # path flattens as x2 is flattened here) and 16-byte aligned
        if (name in ("kernel*", "cublas", "gemv") and act_global_scale is None and x.is_contiguous()
                and not x.data_ptr() & 15):
            self._add_scaled_runner(x2, a, fn, kwargs, name, target, bias)
        out = out if flat else out.reshape(*x.shape[:-1], self.n)
        return apply_activation(out, self.activation)

    def _add_scaled_runner(self, x: torch.Tensor, a: QTensor, fn, kwargs: dict, name: str, route: Any,
                           bias: torch.Tensor | None) -> None:
        """Keep a runner for calls like this one when the activation is quantized by the fp8_block kernel (block
        1x128): :class:`Fp8BlockDecode` where the GEMM is lowbit's decoding kernel (``name`` "kernel*", the
        ``KernelRoute`` ``route``), :class:`Fp8BlockCublas` where it is cuBLASLt's block-scaled GEMM."""
        from ..kernels import blockscaled, fp8_block
        from ..kernels.scaled_mm_launch import operand_args

        if name == "gemv":
            self._add_gemv_route_runner(x, a, fn, kwargs, bias)
            return
        if fn is blockscaled.quantize_mx and name == "kernel*":
            self._add_mx_runner(x, a, kwargs, route, bias)
            return
        if fn is not fp8_block.quantize_fp8_block or set(kwargs) - {"block", "scale_fmt", "scale_layout"}:
            return
        if tuple(kwargs.get("block", (1, 128))) != (1, 128) or kwargs.get("scale_layout", "linear") != "linear":
            return
        if bias is not None and (bias.dtype != x.dtype or bias.data_ptr() & 15 or not bias.is_contiguous()):
            return
        m = x.shape[0]
        if name == "cublas":
            # cuBLAS reads M-major activation scales: the quantize kernel writes them so (the same values)
            plan = fp8_block.quant_plan_cached(x, (1, 128), kwargs.get("scale_fmt"), "column_major")
            if plan.launch is None or plan.batched or plan.scale_strides != (1, m):
                return
            from ..kernels.cublas_fp8_block import PreparedMM

            run = Fp8BlockCublas(plan, PreparedMM(self.w.data, self.w.scale, x.dtype), self.device)
        else:
            run = None
            if m <= policy.FP8_BLOCK_QUANT_IN_GEMM_MAX_M:
                run = route.quant_in_gemm(kwargs.get("scale_fmt") == "ue8m0")
            if run is None:
                plan = fp8_block.quant_plan_cached(x, (1, 128), kwargs.get("scale_fmt"), "linear")
                if plan.scale_storage is not None or plan.launch is None or plan.batched:
                    return
                a_args, _ = operand_args(a)
                run = Fp8BlockDecode(plan, route, tuple(a_args[3:7]), self.device)
        if len(self.scaled_runners) >= _MAX_RUNNERS:
            self.scaled_runners.clear()
        if bias is not None:
            self._bias_ok = bias
        self.scaled_runners[(m, x.dtype, bias is None)] = run

    def _add_gemv_route_runner(self, x: torch.Tensor, a: QTensor, fn, kwargs: dict,
                               bias: torch.Tensor | None) -> None:
        """Keep a :class:`GemvRouteDecode` for decode calls like this one: bf16 x, nvfp4 activations with a
        global scale derived per call (vLLM's or LightX2V's convention) or mxfp4 activations, linear scales,
        the ``"gemv"`` route of ``lowbit.kernels.scaled_mm`` (the activation decoded exactly to bf16, then the
        W4A16 GEMV on the 4-bit weight)."""
        from ..kernels import blockscaled
        from ..kernels.gemv_prepack import prepare_w4
        from ..kernels.gemv_runners import GemvRunner

        if x.dtype != torch.bfloat16 or kwargs.get("scale_layout", "linear") != "linear":
            return
        if bias is not None and (bias.dtype != x.dtype or bias.data_ptr() & 15 or not bias.is_contiguous()):
            return
        if fn is blockscaled.quantize_nvfp4:
            if (set(kwargs) - {"convention", "scale_layout"} or a.global_scale is None
                    or "per_tensor_scale" in a.params):
                return
            rs_mode, block = 3, 16  # the product divided by the activation's global scale, as gemv_w4's divide_by
        elif fn is blockscaled.quantize_mx and kwargs.get("fmt") == "mxfp4":
            if set(kwargs) - {"fmt", "scale_rounding", "scale_layout"}:
                return
            rs_mode, block = 0, 32
        else:
            return
        keep: list = []
        a2 = fn(x, **kwargs, keep=keep)
        if not keep or any(lc is None for lc in keep):
            return
        plain = a2 if rs_mode == 0 else dataclasses.replace(a2, global_scale=None)
        decode = blockscaled.dequantize_call(plain, torch.bfloat16)
        decode()  # compiles, and keeps the launch
        if decode.launch is None or decode.launch.compiled is None:
            return
        m, k = x.shape
        gemv = GemvRunner(prepare_w4(self.w), m, torch.bfloat16, bias is not None, 0, rs_mode)
        if len(self.scaled_runners) >= _MAX_RUNNERS:
            self.scaled_runners.clear()
        if bias is not None:
            self._bias_ok = bias
        self.scaled_runners[(m, x.dtype, bias is None)] = GemvRouteDecode(
            keep, decode.launch, gemv, m, k, block, a2.data.shape[-1], self.device)

    def _add_mx_runner(self, x: torch.Tensor, a: QTensor, kwargs: dict, route: Any,
                       bias: torch.Tensor | None) -> None:
        """Keep an :class:`MXDecode` for calls like this one (MX activations, linear scales, lowbit's decoding
        GEMM): the quantize kernel's launch is taken from one more quantize of ``x`` (the same bits as ``a``)."""
        from ..kernels import blockscaled
        from ..kernels.scaled_mm_launch import operand_args

        if set(kwargs) - {"fmt", "scale_rounding", "scale_layout"} or kwargs.get("scale_layout", "linear") != "linear":
            return
        if bias is not None and (bias.dtype != x.dtype or bias.data_ptr() & 15 or not bias.is_contiguous()):
            return
        keep: list = []
        blockscaled.quantize_mx(x, **kwargs, keep=keep)
        if not keep or keep[0] is None:
            return
        a_args, _ = operand_args(a)
        if len(self.scaled_runners) >= _MAX_RUNNERS:
            self.scaled_runners.clear()
        if bias is not None:
            self._bias_ok = bias
        self.scaled_runners[(x.shape[0], x.dtype, bias is None)] = MXDecode(
            keep[0], x.shape[0], x.shape[1], a.data.dtype, route, tuple(a_args[3:7]), self.device)

    def _route(self, a, bias: torch.Tensor | None, out_dtype: torch.dtype) -> tuple[str, Any]:
        """(route, target) for activations like ``a``: ``lowbit.ops.policy.scaled_route``'s decision, and for
        lowbit's decoding GEMM a ``KernelRoute`` that launches it with everything but the activation fixed."""
        km = policy.kernel_module(policy.SCALED_MM_MODULE)
        if km is None or km.supports(a, self.w) is not None:
            return "run", None
        name = policy.scaled_route(a, self.w, bias, out_dtype, km)
        if name == "kernel":
            route = km.KernelRoute(a, self.w, False, bias is not None, out_dtype)
            if route.ok:
                return "kernel*", route
        return name, km.scaled_mm

    def _gemv_call(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor | None:
        k = self.k
        x2 = x if x.dim() == 2 else x.reshape(-1, k)
        m = x2.shape[0]
        if not 0 < m <= GEMV_MAX_M:
            if m >= self._dequant_min_m and (bias is None or bias.dtype == x.dtype):
                return self._dequant_gemm_call(x, x2, bias)
            return None
        if bias is not None:
            if (bias.dtype != x.dtype or bias.data_ptr() % 16 or not bias.is_contiguous()
                    or bias.device != self.device or bias.shape != (self.n,)):
                return None
            self._bias_ok = bias  # the fast path's check: this very tensor (a layer passes its own bias)
        key = (m, x.dtype, bias is None)
        run = self.runners.get(key)
        if run is None:
            if torch.cuda.is_current_stream_capturing() or self._backend() == "torch":
                return None  # made outside a capture only (its buffers must not live in the graph's pool)
            from ..kernels.gemv_runners import GemvRunner

            if len(self.runners) >= _MAX_RUNNERS:
                self.runners.clear()
            run = self.runners[key] = GemvRunner(self.gemv, m, x.dtype, bias is not None, self.act_code)
        if not x2.is_contiguous() or x2.data_ptr() % 16:
            x2 = x2.clone(memory_format=torch.contiguous_format)
        out = run(x2, bias)
        return out if x.dim() == 2 else out.view(*x.shape[:-1], self.n)

    def _dequant_gemm_call(self, x: torch.Tensor, x2: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor | None:
        """:func:`lowbit.ops.linear.linear_dequant_gemm` with the chunks' decode launches made once per x dtype
        (the same chunks, kernels and BLAS calls, so the same bits)."""
        if self._backend() == "torch" or torch.cuda.is_current_stream_capturing():
            return None
        chunks = self._chunks.get(x.dtype)
        if chunks is None:
            chunks = self._chunks[x.dtype] = self._build_chunks(x.dtype)
        if not chunks:
            return None
        if not x2.is_contiguous():
            x2 = x2.contiguous()
        out = chunked_gemm(x2, chunks, self.n, bias, self.activation)
        return out if x.dim() == 2 else out.view(*x.shape[:-1], self.n)

    def _build_chunks(self, dtype: torch.dtype) -> list:
        """[(n0, n1, KernelCall decoding those rows to ``dtype``)] for the chunks of ``linear_dequant_gemm``,
        or [] where no Triton dequantize kernel covers the weight (the general path then runs)."""
        call = _kernels.dequantize_call(self.w)
        if call is None:
            return []
        size = torch.empty((), dtype=dtype).element_size()
        return [(n0, n1, call(q, dtype)) for n0, n1, q in weight_chunks(self.w, size)]

    def call_general(self, x: torch.Tensor, bias: torch.Tensor | None,
                     act_global_scale: torch.Tensor | None = None) -> torch.Tensor:
        """The call through the public ops (every regime, device and backend; their checks and errors)."""
        if self.weight_only:
            if x.dtype in _X_DTYPES:
                return linear(x, self.w, bias, self.activation, backend=self.backend)
            # fp32 (or other) x: the fp32 reference on any device
            from ..api import dequantize

            y = torch.nn.functional.linear(x.float(), dequantize(self.w, torch.float32, backend=self.backend),
                                           None if bias is None else bias.float())
            return apply_activation(y, self.activation).to(x.dtype)
        from .scaled_mm import scaled_linear

        y = scaled_linear(x, self.w, self.act_format, act_options=self.act_options or None,
                          act_global_scale=act_global_scale, bias=bias, out_dtype=x.dtype, backend=self.backend)
        return apply_activation(y, self.activation)

    def traced_call(self, x: torch.Tensor, bias: torch.Tensor | None,
                    act_global_scale: torch.Tensor | None = None) -> torch.Tensor:
        """The call as ``torch.compile`` traces it: the GEMV regime through the ``lowbit::w4a16_gemv``
        triton_op, everything else through :meth:`call_general` (opaque custom ops)."""
        f = self.facts
        if (f is not None and x.dtype in _X_DTYPES and x.shape[-1] == self.k and x.device == self.device
                and (bias is None or bias.dtype == x.dtype)):
            x2 = x.reshape(-1, self.k)
            m = x2.shape[0]
            if 0 < m <= GEMV_MAX_M:
                t = self.gemv_tensors
                # only the layouts of the kernel that runs become graph inputs (each input costs the compiled
                # code a guard and a size check per call); the rule is gemv_runners.uses_mma's, in comparisons that
                # a symbolic M traces through (bucket guards, as the op's own plan adds)
                dtypes, lo, hi, m1 = self.mma_rule
                if x.dtype in dtypes and lo <= m <= hi and (m > 1 or m1):
                    t = (None, None, None, None, t[4], t[5], t[6])
                else:
                    t = (*t[:5], None, None)
                out = torch.ops.lowbit.w4a16_gemv(
                    x2.contiguous(), *t, *self.traced_extra, self.no_bias[x.dtype], bias, f.fmt,
                    f.fmt_code, f.n, f.k, f.sk, f.wpb, f.post, f.gs_kind, f.mma_fmt, f.cpg, self.act_code,
                    f.plan_n)
                return out.reshape(*x.shape[:-1], self.n)
        ft = self.fp8_traced
        if (ft is not None and act_global_scale is None and x.dtype in _SCALED_X_DTYPES and x.shape[-1] == self.k
                and x.device == self.device and (bias is None or bias.dtype == x.dtype)):
            x2 = x.reshape(-1, self.k)
            m = x2.shape[0]
            if 0 < m <= policy.FP8_BLOCK_QUANT_IN_GEMM_MAX_M:
                out = torch.ops.lowbit.fp8_block_decode(x2.contiguous(), *ft[:4], bias, ft[4], ft[5], ft[6])
                return apply_activation(out, self.activation).reshape(*x.shape[:-1], self.n)
        return self.call_general(x, bias, act_global_scale)


def prepare(w: QTensor, scheme: Any, activation: str | None = None, backend: str | None = None,
            layouts: bool = True) -> PreparedWeight:
    """A :class:`PreparedWeight` for ``w`` under a ``lowbit.nn.Scheme`` (``layouts=False``: no kernel layouts
    and no runners, every call through the public ops)."""
    return PreparedWeight(w, weight_only=scheme.weight_only, activation=activation, act_format=scheme.act_format,
                          act_options=dict(scheme.act_options), backend=backend, layouts=layouts)


__all__ = ["PreparedWeight", "prepare"]
