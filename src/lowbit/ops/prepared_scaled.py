"""The calls of a prepared weight whose activations are quantized (:class:`lowbit.ops.prepared.PreparedWeight`
of a W8A8 / W4A8 / W4A4 scheme).

A call is :func:`lowbit.ops.scaled_linear` without its per-call decisions: the activation's quantize function
is resolved once per x dtype, the operand pair checked once, the GEMM's route
(``lowbit.ops.policy.scaled_route``) decided once per (M, x dtype, bias dtype); for decode calls a runner of
:mod:`lowbit.ops.prepared_runners` is kept, which makes the same launches with everything but x fixed. Under
``torch.compile`` fp8_block decode runs the ``lowbit::fp8_block_decode`` triton_op with the weight as a static
graph input. Every path gives the bits of ``scaled_linear``; where none applies the call returns None and the
layer takes the general path.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from ..formats.qtensor import QTensor
from ..formats.shards import plan_rows
from . import policy
from .linear import apply_activation
from .prepared_runners import (
    MAX_RUNNERS,
    Fp8BlockDecode,
    Fp8BlockLibraryGemm,
    GemvRouteDecode,
    MXDecode,
    Nvfp4DequantGemm,
)
from .traced_plans import Fp8DecodePlan, plan_key
from .triton_ops import register_fp8_block_op

SCALED_X_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
"""x dtypes that the activation quantizers of ``scaled_linear`` take."""


class ScaledCalls:
    """The activation-quantized methods of :class:`lowbit.ops.prepared.PreparedWeight` (a mixin: the state it
    reads and keeps, ``w``, ``act_format``, ``scaled_runners``, ``_routes`` ..., is made by
    ``PreparedWeight.__init__``)."""

    def _prepare_fp8_block_traced(self) -> None:
        """fp8_block activations on an fp8_block weight: under ``torch.compile`` decode runs the
        ``lowbit::fp8_block_decode`` triton_op (the activation quantized inside the GEMM), with the weight
        and the device's split-K scratch (``lowbit.kernels.scratch.traced_shared``) as static graph inputs."""
        w, opts = self.w, self.act_options
        if (w.fmt != "fp8_block" or self.act_format != "fp8_block" or set(opts) - {"block", "scale_fmt"}
                or tuple(opts.get("block", (1, 128))) != (1, 128) or not w.data.is_contiguous()
                or not w.scale.is_contiguous()):
            return  # the decode kernel derives the weight's strides from its shapes
        from ..kernels import scaled_mm as ksm
        from ..kernels.scratch import mark_static, traced_scratch

        register_fp8_block_op()
        idx = self.device.index if self.device.index is not None else torch.cuda.current_device()
        traced_scratch(self.device, idx, *ksm.quant_in_gemm_scratch_size(self.n, self.k))  # sized for this weight
        mark_static(w.data, w.scale)
        self.fp8_traced = (w.data, w.scale)
        self.fp8_plan = plan_key(Fp8DecodePlan(
            self.k, self.n, self.device, idx, self.activation,
            (opts.get("scale_fmt") == "ue8m0", int(w.params["block"][0]), plan_rows(w))))

    def _scaled_call(self, x: torch.Tensor, bias: torch.Tensor | None,
                     act_global_scale: torch.Tensor | None) -> torch.Tensor | None:
        """:func:`lowbit.ops.scaled_linear` without its per-call decisions: the activation's quantize function
        is resolved once per x dtype and the operand pair checked once (the same kernels and bits)."""
        if (x.dtype not in SCALED_X_DTYPES or x.dim() < 1 or x.shape[-1] != self.k or x.device != self.device
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
        if (name in ("kernel*", "cublas", "deepgemm", "gemv", "dequant") and act_global_scale is None
                and x.is_contiguous() and not x.data_ptr() & 15):
            self._add_scaled_runner(x2, a, fn, kwargs, name, target, bias)
        out = out if flat else out.reshape(*x.shape[:-1], self.n)
        return apply_activation(out, self.activation)

    def _add_scaled_runner(self, x: torch.Tensor, a: QTensor, fn, kwargs: dict, name: str, route: Any,
                           bias: torch.Tensor | None) -> None:
        """Keep a runner for calls like this one when the activation is quantized by the fp8_block kernel (block
        1x128): :class:`Fp8BlockDecode` where the GEMM is lowbit's decoding kernel (``name`` "kernel*", the
        ``KernelRoute`` ``route``), :class:`Fp8BlockLibraryGemm` where it is cuBLASLt's block-scaled GEMM or
        DeepGEMM's."""
        from ..kernels import blockscaled, fp8_block
        from ..kernels.scaled_mm_launch import operand_args

        if name == "gemv":
            self._add_gemv_route_runner(x, a, fn, kwargs, bias)
            return
        if name == "dequant":
            self._add_nvfp4_dequant_runner(x, a, fn, kwargs, bias)
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
        if name in ("cublas", "deepgemm"):
            if m % 4:  # cuBLAS pads such M (lowbit.kernels.cublas_fp8_block.mm): the general path runs them
                return
            # cuBLAS and DeepGEMM read M-major activation scales: the quantize kernel writes them so (the same
            # values)
            plan = fp8_block.quant_plan_cached(x, (1, 128), kwargs.get("scale_fmt"), "column_major")
            if plan.launch is None or plan.batched or plan.scale_strides != (1, m):
                return
            from ..kernels import cublas_fp8_block

            mm = cublas_fp8_block.PreparedMM(self.w.data, self.w.scale, x.dtype)
            if name == "deepgemm":
                from ..kernels import deep_gemm_fp8

                mm = deep_gemm_fp8.PreparedMM(self.w.data, self.w.scale, mm)
            run = Fp8BlockLibraryGemm(plan, mm, self.device)
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
        if len(self.scaled_runners) >= MAX_RUNNERS:
            self.scaled_runners.clear()
        if bias is not None:
            self._bias_ok = bias
        self.scaled_runners[(m, x.dtype, bias is None)] = run

    def _add_nvfp4_dequant_runner(self, x: torch.Tensor, a: QTensor, fn, kwargs: dict,
                                  bias: torch.Tensor | None) -> None:
        """Keep a :class:`Nvfp4DequantGemm` for calls like this one: nvfp4 activations of the Triton quantize
        kernel (vLLM's or LightX2V's convention, the global scale derived per call or given) on an nvfp4
        weight, the ``"dequant"`` route."""
        from ..formats.checks import positive_fp32_scalar
        from ..kernels import blockscaled

        if fn is not blockscaled.quantize_nvfp4 or self.w.fmt != "nvfp4" or a.fmt != "nvfp4":
            return
        if set(kwargs) - {"convention", "scale_layout", "global_scale"} or "per_tensor_scale" in a.params:
            return
        if bias is not None and (bias.data_ptr() & 15 or not bias.is_contiguous()):
            return
        opts = {key: v for key, v in kwargs.items() if key != "scale_layout"}
        g = opts.get("global_scale")
        if g is not None and not isinstance(g, str) and not (isinstance(g, torch.Tensor) and g.is_cuda):
            # a given host scale goes to the device once (the general path copies it per call, which a CUDA
            # graph capture refuses); the same fp32 value
            opts["global_scale"] = positive_fp32_scalar(g, "global_scale").to(x.device)
        if len(self.scaled_runners) >= MAX_RUNNERS:
            self.scaled_runners.clear()
        if bias is not None:
            self._bias_ok = bias
        self.scaled_runners[(x.shape[0], x.dtype, bias is None)] = Nvfp4DequantGemm(self.w, opts, x.dtype,
                                                                                     x.shape[0])

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
        roundtrip = None
        if rs_mode == 3 and m * k <= blockscaled.ROUNDTRIP_MAX:
            # absmax, quantize and decode of a decode step's activation in one launch (the same bits)
            roundtrip = blockscaled.nvfp4_roundtrip_launch(m * k, kwargs.get("convention", "vllm"))
            probe = torch.empty((m, k), dtype=torch.bfloat16, device=self.device)
            idx = self.device.index if self.device.index is not None else torch.cuda.current_device()
            roundtrip.run(idx, x, torch.empty(1, dtype=torch.float32, device=self.device),
                          probe.view(torch.int16), m * k)  # compiles it, outside any capture
            if roundtrip.compiled is None:
                roundtrip = None
        if len(self.scaled_runners) >= MAX_RUNNERS:
            self.scaled_runners.clear()
        if bias is not None:
            self._bias_ok = bias
        self.scaled_runners[(m, x.dtype, bias is None)] = GemvRouteDecode(
            keep, decode.launch, gemv, m, k, block, a2.data.shape[-1], self.device, roundtrip)

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
        if len(self.scaled_runners) >= MAX_RUNNERS:
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


__all__ = ["SCALED_X_DTYPES", "ScaledCalls"]
