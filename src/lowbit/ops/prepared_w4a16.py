"""The weight-only (W4A16) calls of a prepared weight (:class:`lowbit.ops.prepared.PreparedWeight`).

At preparation the GEMV layouts are made (``lowbit.kernels.gemv_prepack.prepare_w4`` and the tensor-core
layout) with the static inputs of the compiled path; a call then runs, for M up to ``GEMV_MAX_M`` (and past it up
to the GEMV's row-block limit, ``gemv_w4.MMA["row_blocks_max_m"]``, where that covers the format), a
``lowbit.kernels.gemv_runners.GemvRunner`` made once per (M, x dtype, bias or not), between that and the
dequantize threshold a ``lowbit.kernels.gemm_w4.GemmRunner`` (the same keys), and above the threshold the chunks
of :func:`lowbit.ops.linear.linear_dequant_gemm` with their decode launches made once per x dtype. Each gives the
bits of :func:`lowbit.linear`; where none applies the call returns None and the layer takes the general path.
"""

from __future__ import annotations

import torch

from . import policy
from .linear import apply_activation, chunked_gemm, decode_chunks
from .policy import GEMV_MAX_M
from .prepared_runners import MAX_RUNNERS
from .traced_plans import GemvPlan, plan_key
from .triton_ops import register_gemv_op

X_DTYPES = (torch.bfloat16, torch.float16)
"""x dtypes of the W4A16 kernels (fp32 x takes the fp32 reference)."""


MAX_RA_ROWS = 256
"""Row counts whose register-operand decision a prepared layer keeps (prefill lengths vary)."""


class GatedProduct:
    """``run(x, bias) -> act(gate) * up`` of a runner's ``[gate; up]`` product (``apply_activation``): a gated
    layer's call in the GEMM regime, whose kernel has no gating epilogue."""

    __slots__ = ("activation", "run")

    def __init__(self, run, activation: str) -> None:
        self.run, self.activation = run, activation

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return apply_activation(self.run(x, bias), self.activation)


class W4A16Calls:
    """The W4A16 methods of :class:`lowbit.ops.prepared.PreparedWeight` (a mixin: the state it reads and
    keeps, ``w``, ``gemv``, ``runners``, ``_chunks`` ..., is made by ``PreparedWeight.__init__``)."""

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
        if self.gated:
            from ..kernels.gemv_prepack import gated_layout, gated_why_not

            if gated_why_not(p) is not None:
                return  # no GEMV layout for this gated weight: every call takes the general path
            p = gated_layout(p)  # [gate; up] rows interleaved for the gated epilogue
        self.facts = facts(p)   # builds the tensor-core layout too
        lay = mma_layout(p)
        self.gemv = p
        dtypes, _, hi, _ = mma_rule(self.facts)
        if hi > GEMV_MAX_M:  # what gemv_w4.row_blocks_apply decides for lowbit.linear, per layer once
            self._gemv_rows_max, self._gemv_rows_dtypes = hi, dtypes
        # under torch.compile the placeholders (the fp32 one standing for an absent nested scale, table or
        # global scale) are passed as None and the op puts the device's shared placeholder in their place
        # (lowbit.kernels.scratch.traced_shared); so are the layouts of a kernel that cannot run
        placeholder = dummy_tensor(self.device, torch.float32)
        self.gemv_tensors = tuple(None if t is placeholder else t for t in (
            p.words, p.scales, p.nested, p.tab, p.gs,
            lay.words if lay is not None else None, lay.scales if lay is not None else None))
        # what the compiled path passes besides the layouts: the split-K scratch and placeholders, shared by
        # the device's layers and made here, so that the compiled code allocates none of them per call
        from ..kernels.scratch import mark_static, traced_scratch

        idx = self.device.index if self.device.index is not None else torch.cuda.current_device()
        traced_scratch(self.device, idx, *traced_scratch_size(self.n, self.k))
        f = self.facts
        self.gemv_plan = plan_key(GemvPlan(
            self.k, self.n_out, self.device, self.gated, idx, mma_rule(f),
            (f.fmt, f.fmt_code, f.n, f.k, f.sk, f.wpb, f.post, f.gs_kind, f.mma_fmt, f.cpg, self.act_code, f.plan_n)))
        # fixed addresses for torch.compile: CUDA-graph trees would otherwise copy every layout into graph-owned
        # memory on each replay (they are not module parameters); guarded, so a re-prepared layer recompiles
        mark_static(*{id(t): t for t in self.gemv_tensors if t is not None}.values())

    def _gemv_call(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor | None:
        k = self.k
        x2 = x if x.dim() == 2 else x.reshape(-1, k)
        m = x2.shape[0]
        if not 0 < m <= GEMV_MAX_M and not (m <= self._gemv_rows_max and x.dtype in self._gemv_rows_dtypes):
            if m > GEMV_MAX_M:
                ra = self._ra_configs.get(m, False)
                if ra is False:
                    ra = self._register_operand_config(m)
                if ra is not None:
                    return self._ra_call(x, x2, bias, ra)
            if m >= self._dequant_min_m and (bias is None or bias.dtype == x.dtype):
                return self._dequant_gemm_call(x, x2, bias)
            if m > GEMV_MAX_M:
                return self._gemm_call(x, x2, bias)
            return None
        if bias is not None:
            if (self.gated or bias.dtype != x.dtype or bias.data_ptr() % 16 or not bias.is_contiguous()
                    or bias.device != self.device or bias.shape != (self.n,)):
                return None
            self._bias_ok = bias  # the fast path's check: this very tensor (a layer passes its own bias)
        key = (m, x.dtype, bias is None)
        run = self.runners.get(key)
        if run is None:
            if torch.cuda.is_current_stream_capturing() or self._backend() == "torch":
                return None  # made outside a capture only (its buffers must not live in the graph's pool)
            from ..kernels.gemv_runners import GemvRunner

            if len(self.runners) >= MAX_RUNNERS:
                self.runners.clear()
            run = self.runners[key] = GemvRunner(self.gemv, m, x.dtype, bias is not None, self.act_code)
        if not x2.is_contiguous() or x2.data_ptr() % 16:
            x2 = x2.clone(memory_format=torch.contiguous_format)
        out = run(x2, bias)
        return out if x.dim() == 2 else out.view(*x.shape[:-1], self.n_out)

    def _register_operand_config(self, m: int) -> dict | None:
        """The dispatch rules' ``gemm_w4_ra`` config for ``m`` rows, or None, asked once per M (kept for the
        last :data:`MAX_RA_ROWS` row counts)."""
        from .linear import resolve_backend

        path, _, facts = policy.linear_decide(m, self.device, self.w, resolve_backend(self.backend))
        if len(self._ra_configs) >= MAX_RA_ROWS:
            self._ra_configs.clear()
        ra = self._ra_configs[m] = facts[0] if path == "gemm_w4_ra" else None
        return ra

    def _ra_call(self, x: torch.Tensor, x2: torch.Tensor, bias: torch.Tensor | None,
                 config: dict) -> torch.Tensor | None:
        """The register-operand GEMM with the config the rules gave for this M, through a
        ``lowbit.kernels.gemm_w4.RaRunner`` made once per (M, x dtype, bias or not): the call
        :func:`lowbit.linear` makes (a gated layer's product, then the gating), with a kept compiled launch."""
        from ..kernels.gemm_w4 import RaRunner

        return self._kept_call(x, x2, bias, lambda m, dtype, act: RaRunner(self.w, m, dtype, act, config))

    def _gemm_call(self, x: torch.Tensor, x2: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor | None:
        """The tensor-core GEMM regime (M between the GEMV and the dequantize threshold) through a
        ``lowbit.kernels.gemm_w4.GemmRunner`` made once per (M, x dtype, bias or not) where the dispatch rules
        choose ``gemm_w4``: the kernel, tiles and arguments decided once, kept compiled launches per call (the
        general path decides them on every call). The same launch, so the bits of :func:`lowbit.linear`."""
        from ..kernels.gemm_w4 import GemmRunner
        from .linear import resolve_backend

        def make(m, dtype, act):
            if policy.linear_decide(m, self.device, self.w, resolve_backend(self.backend))[0] != "gemm_w4":
                return None
            return GemmRunner(self.w, m, dtype, act)

        return self._kept_call(x, x2, bias, make)

    def _kept_call(self, x: torch.Tensor, x2: torch.Tensor, bias: torch.Tensor | None, make) -> torch.Tensor | None:
        """A GEMM-regime call through the runner kept for (M, x dtype, bias or not), made by ``make(m, dtype,
        activation)`` (None: the general path runs) outside a capture; a gated layer's runner gates the product
        after it (:class:`GatedProduct`), as :func:`lowbit.linear` does. None where the fast path does not apply."""
        if bias is not None:
            if (bias.dtype != x.dtype or bias.data_ptr() % 16 or not bias.is_contiguous()
                    or bias.device != self.device or bias.shape != (self.n,)):
                return None
            self._bias_ok = bias
        m = x2.shape[0]
        key = (m, x.dtype, bias is None)
        run = self.runners.get(key)
        if run is None:
            if torch.cuda.is_current_stream_capturing() or self._backend() == "torch":
                return None  # made outside a capture only (its buffers must not live in the graph's pool)
            run = make(m, x.dtype, None if self.gated else self.activation)
            if run is None:
                return None
            if self.gated:
                run = GatedProduct(run, self.activation)
            if len(self.runners) >= MAX_RUNNERS:
                self.runners.clear()
            self.runners[key] = run
        if not x2.is_contiguous() or x2.data_ptr() % 16:
            x2 = x2.clone(memory_format=torch.contiguous_format)
        out = run(x2, bias)
        return out if x.dim() == 2 else out.view(*x.shape[:-1], self.n_out)

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
        return out if x.dim() == 2 else out.view(*x.shape[:-1], self.n_out)

    def _build_chunks(self, dtype: torch.dtype) -> list:
        """[(n0, n1, KernelCall decoding those rows to ``dtype``)] for the chunks of ``linear_dequant_gemm``,
        or [] where no Triton dequantize kernel covers the weight (the general path then runs)."""
        return decode_chunks(self.w, dtype)


__all__ = ["GatedProduct", "W4A16Calls", "X_DTYPES"]
