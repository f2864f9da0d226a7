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

This module holds the class, its state and the dispatch of a call (the fast paths of runners made earlier, the
general path through the public ops, the call ``torch.compile`` traces). The regimes it dispatches to live
beside it, as mixins of :class:`PreparedWeight`: the weight-only GEMV and dequantize-then-GEMM calls in
:mod:`lowbit.ops.prepared_w4a16`, the activation-quantized calls in :mod:`lowbit.ops.prepared_scaled`.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from .. import kernels as _kernels
from ..formats.qtensor import QTensor
from ..kernels.scratch import traced_shared
from . import policy
from .linear import ACTIVATIONS, GATED_ACTIVATIONS, apply_activation, check_weight, gated_why_not, linear
from .policy import GEMV_MAX_M
from .prepared_scaled import SCALED_X_DTYPES, ScaledCalls
from .prepared_w4a16 import X_DTYPES, W4A16Calls
from .traced_plans import PLANS


def _trackable(q: QTensor) -> tuple:
    """(tensor, version) of each tensor of ``q`` whose in-place updates can be seen (inference tensors have no
    version counter; they cannot be changed outside inference mode either)."""
    out = []
    for t in q.tensors().values():
        v = _kernels.tensor_version(t)
        if v >= 0:
            out.append((t, v))
    return tuple(out)


class PreparedWeight(W4A16Calls, ScaledCalls):
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
        self.gated = activation in GATED_ACTIVATIONS
        why = gated_why_not(activation, weight_only, self.n)
        if why is not None:
            raise ValueError(why)
        self.n_out = self.n // 2 if self.gated else self.n
        """Columns of the output (half the rows for a gated activation)."""
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
        # M past GEMV_MAX_M up to this, of these x dtypes, still takes a GEMV runner (the tensor-core GEMV's blocks
        # of x rows: lowbit.kernels.gemv_w4.MMA["row_blocks_max_m"]); set by _prepare_gemv
        self._gemv_rows_max, self._gemv_rows_dtypes = 0, ()
        self._ra_configs: dict = {}  # M -> the register-operand GEMM's config where the rules choose it, else None
        self._scaled_ready = False   # activation-quantized schemes: the quick call below applies
        self._quantizers: dict = {}  # x dtype -> (activation quantize function, its kwargs)
        self._pairs_checked: set = set()
        self._routes: dict = {}      # (M, x dtype, bias dtype) -> (route, target) of the scaled GEMM
        self.scaled_runners: dict = {}  # (M, x dtype, bias is None) -> Fp8BlockDecode
        # under torch.compile (traced_call): keys of the layer's plans in traced_plans.PLANS (-1: none), and the
        # fp8_block decode's weight tensors
        self.gemv_plan = -1
        self.fp8_plan = -1
        self.fp8_traced: tuple | None = None
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
                    return out if len(shape) == 2 else out.view(*shape[:-1], self.n_out)
            if x.dtype in X_DTYPES and x.shape[-1] == self.k and x.device == self.device:
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

    def call_general(self, x: torch.Tensor, bias: torch.Tensor | None,
                     act_global_scale: torch.Tensor | None = None) -> torch.Tensor:
        """The call through the public ops (every regime, device and backend; their checks and errors)."""
        if self.weight_only:
            if x.dtype in X_DTYPES:
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
        triton_op, fp8_block decode through ``lowbit::fp8_block_decode``, everything else through
        :meth:`call_general` (opaque custom ops). What the call reads besides the layer's tensors comes from
        the layer's shared plan (:mod:`lowbit.ops.traced_plans`): each read value is a guard checked on every
        call of the compiled code, and a plan shared by many layers is checked once."""
        if self.gemv_plan >= 0:
            p = PLANS[self.gemv_plan]
            if (x.dtype in X_DTYPES and x.shape[-1] == p.k and x.device == p.device
                    and (bias is None or (bias.dtype == x.dtype and not p.gated))):
                x2 = x.reshape(-1, p.k)
                m = x2.shape[0]
                # past GEMV_MAX_M: the tensor-core GEMV's blocks of x rows, where the rule allows them
                if 0 < m <= GEMV_MAX_M or (x.dtype in p.mma_rule[0] and GEMV_MAX_M < m <= p.mma_rule[2]):
                    t = self.gemv_tensors
                    # only the layouts of the kernel that runs become graph inputs (each input costs the compiled
                    # code a guard and a size check per call); the rule is gemv_runners.uses_mma's, in
                    # comparisons that a symbolic M traces through (bucket guards, as the op's own plan adds)
                    dtypes, lo, hi, m1 = p.mma_rule
                    if x.dtype in dtypes and lo <= m <= hi and (m > 1 or m1):
                        t = (None, None, None, None, t[4], t[5], t[6])
                    else:
                        t = (*t[:5], None, None)
                    # the device's scratch and placeholders, read through one table (see traced_shared)
                    sh = traced_shared(p.traced_index)
                    out = torch.ops.lowbit.w4a16_gemv(
                        x2.contiguous(), *t, sh[0], sh[1], sh[2], sh[3] if x.dtype == torch.bfloat16 else sh[4],
                        bias, *p.op_args)
                    return out.reshape(*x.shape[:-1], p.n_out)
        elif self.fp8_plan >= 0 and act_global_scale is None:
            p = PLANS[self.fp8_plan]
            if (x.dtype in SCALED_X_DTYPES and x.shape[-1] == p.k and x.device == p.device
                    and (bias is None or bias.dtype == x.dtype)):
                x2 = x.reshape(-1, p.k)
                m = x2.shape[0]
                if 0 < m <= policy.FP8_BLOCK_QUANT_IN_GEMM_MAX_M:
                    sh = traced_shared(p.traced_index)
                    w_data, w_scale = self.fp8_traced
                    out = torch.ops.lowbit.fp8_block_decode(x2.contiguous(), w_data, w_scale, sh[0], sh[1], bias,
                                                            *p.op_args)
                    return apply_activation(out, p.activation).reshape(*x.shape[:-1], p.n)
        return self.call_general(x, bias, act_global_scale)


def prepare(w: QTensor, scheme: Any, activation: str | None = None, backend: str | None = None,
            layouts: bool = True) -> PreparedWeight:
    """A :class:`PreparedWeight` for ``w`` under a ``lowbit.nn.Scheme`` (``layouts=False``: no kernel layouts
    and no runners, every call through the public ops)."""
    return PreparedWeight(w, weight_only=scheme.weight_only, activation=activation, act_format=scheme.act_format,
                          act_options=dict(scheme.act_options), backend=backend, layouts=layouts)


__all__ = ["PreparedWeight", "prepare"]
