"""``QuantLinear``: a drop-in ``nn.Linear`` whose weight is a lowbit QTensor held in buffers."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..api import dequantize, quantize
from ..formats.qtensor import QTensor
from ..ops.linear import ACTIVATIONS, gated_why_not
from ..ops.prepared import PreparedWeight, prepare
from .schemes import Scheme, get_scheme

QTENSOR_FIELDS = ("data", "scale", "global_scale", "zeros", "nested_scale", "nested_offset")
"""QTensor tensor fields; each is stored in the buffer ``weight_<field>`` (None fields are None buffers)."""
BUFFER_NAMES = tuple(f"weight_{f}" for f in QTENSOR_FIELDS)


class QuantLinear(nn.Module):
    """A linear layer ``y = act(x @ W.T + b)`` with a quantized ``W``.

    The weight's QTensor tensors live in buffers ``weight_data``, ``weight_scale``, ``weight_global_scale``,
    ``weight_zeros``, ``weight_nested_scale``, ``weight_nested_offset`` (None where the format has no such
    tensor), so ``.to(device)``, ``state_dict()`` and ``load_state_dict()`` work as for any module. Casting the
    module to another dtype (``model.half()``, ``model.to(torch.bfloat16)``) casts only ``bias``: the
    quantized tensors keep their storage dtypes (they are bit patterns, not values) and move devices only.

    Everything about the weight that does not depend on the call (validation, kernel layouts, launch plans
    per row count) is decided once, when the layer gets its weight on a device (construction, ``.to()``,
    ``load_state_dict``; :class:`lowbit.ops.prepared.PreparedWeight`), and again when a weight buffer is
    replaced or changed in place. Under ``torch.compile`` the decode regime of the weight-only schemes is a
    ``triton_op`` whose kernels Inductor launches from its generated code.

    ``forward``:
      - weight-only schemes (``w4a16-*``): :func:`lowbit.linear` for bfloat16/float16 ``x`` (Triton kernels
        on CUDA, the reference on CPU); float32 ``x`` runs the fp32 reference ``x @ dequant(W).T`` on any
        device.
      - activation-quantized schemes (``w4a4-*``, ``w8a8-*``, ``w4a8-*``): ``lowbit.ops.scaled_linear``
        (activation quantized to the scheme's ``act_format``, with the static ``input_global_scale`` buffer
        for NVFP4 activations when calibrated, dynamic per-tensor otherwise).

    Attributes:
        in_features, out_features: as ``nn.Linear``.
        scheme: the :class:`~lowbit.nn.Scheme`.
        activation: None, ``"gelu"``, ``"gelu_tanh"`` or ``"silu"`` applied after the bias (fused,
            as the ``nvfp4_packed`` plugin does); or, for weight-only schemes, a gated form (``"silu_and_mul"``
            ...: the weight is ``[gate; up]`` and the output ``act(gate) * up`` has ``out_features / 2``
            columns; :func:`lowbit.nn.fuse_projections` builds such layers for gated MLPs).
        backend: passed to the lowbit ops (None: ``$LOWBIT_BACKEND`` or ``"auto"``).
        input_global_scale: buffer, fp32 ``[1]`` static NVFP4 activation multiplier (``2688 / absmax``) or None.
        compute, keep_fp8_weight: ``"exact"`` (default) or, for ``w4a4-nvfp4``, ``"fp8_block"``: the opt-in
            FP8 compute mode set by :func:`lowbit.nn.set_compute` (``lowbit.ops.fp8_compute``); not stored in
            the state dict.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        *,
        scheme: str | Scheme,
        weight: QTensor | None = None,
        bias_tensor: torch.Tensor | None = None,
        input_global_scale: torch.Tensor | None = None,
        activation: str | None = None,
        backend: str | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        """Build a layer around an existing quantized weight (or an empty one to ``load_state_dict`` into).

        Args:
            in_features, out_features, bias: as ``nn.Linear``.
            scheme: a scheme name from ``lowbit.SCHEMES`` or a :class:`Scheme`.
            weight: the QTensor ``[out_features, in_features]``; None leaves the weight buffers None (fill them
                with :meth:`set_weight` or ``load_state_dict`` of a matching state dict).
            bias_tensor: the bias ``[out_features]`` (None: zeros if ``bias`` else no bias).
            input_global_scale: static NVFP4 activation global scale (multiplier), fp32 with one value.
            activation: fused activation (see :data:`ACTIVATIONS`).
            backend: lowbit backend for the ops.
            device, dtype: of a zero bias created here.
        """
        super().__init__()
        self.in_features = int(in_features)
        self.out_features = int(out_features)
        self.scheme = get_scheme(scheme)
        if activation not in ACTIVATIONS:
            raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
        why = gated_why_not(activation, self.scheme.weight_only, self.out_features)
        if why is not None:
            raise ValueError(why)
        self.activation = activation
        self.backend = backend
        self.weight_format = self.scheme.weight_format
        self._meta: dict[str, Any] = {}
        self._prepared: PreparedWeight | None = None
        self.compute = "exact"  # or "fp8_block": lowbit.nn.set_compute (lowbit.ops.fp8_compute)
        self.keep_fp8_weight = False
        for name in BUFFER_NAMES:
            self.register_buffer(name, None)
        if weight is not None:
            self.set_weight(weight)
        if bias_tensor is not None:
            if tuple(bias_tensor.shape) != (self.out_features,):
                raise ValueError(
                    f"bias must have shape ({self.out_features},), got {tuple(bias_tensor.shape)}"
                )
            self.register_buffer("bias", bias_tensor.detach().clone())
        elif bias:
            self.register_buffer("bias", torch.zeros(self.out_features, device=device, dtype=dtype))
        else:
            self.register_buffer("bias", None)
        self.register_buffer(
            "input_global_scale",
            None if input_global_scale is None else input_global_scale.detach().float().reshape(1).clone(),
        )
        self._prepare_if_ready()

    # ------------------------------------------------------------------ weight

    def set_weight(self, weight: QTensor) -> None:
        """Store ``weight`` (a QTensor ``[out_features, in_features]`` of the scheme's weight format)."""
        if not isinstance(weight, QTensor):
            raise TypeError(f"weight must be a lowbit QTensor, got {type(weight).__name__}")
        if weight.fmt != self.scheme.weight_format:
            raise ValueError(
                f"scheme {self.scheme.name} stores {self.scheme.weight_format} weights, got a {weight.fmt} QTensor"
            )
        if tuple(weight.shape) != (self.out_features, self.in_features):
            raise ValueError(
                f"weight must have logical shape ({self.out_features}, {self.in_features}), got {tuple(weight.shape)}"
            )
        for f in QTENSOR_FIELDS:
            t = getattr(weight, f)
            setattr(self, f"weight_{f}", None if t is None else t.detach())
        self._meta = {
            "dtype": weight.dtype,
            "scale_layout": weight.scale_layout,
            "params": dict(weight.params),
        }
        self._prepared = None
        if hasattr(self, "bias"):  # set_weight after construction: prepare now
            self._prepare_if_ready()

    # ------------------------------------------------------------------ preparation

    def _new_prepared(self, layouts: bool = True):
        prep = prepare(self.weight_qtensor, self.scheme, self.activation, self.backend, layouts=layouts)
        if getattr(self, "compute", "exact") == "fp8_block":
            from ..ops.fp8_compute import Fp8BlockCompute

            prep = Fp8BlockCompute(prep, self.keep_fp8_weight)
        return prep

    def _prepare(self) -> PreparedWeight:
        self._prepared = self._new_prepared()
        return self._prepared

    def _prepare_if_ready(self) -> None:
        """Prepare now (a weight on a CUDA device, outside a CUDA-graph capture and torch.compile tracing);
        otherwise the first eager call prepares."""
        self._prepared = None
        data = self.weight_data
        if (data is None or self.weight_scale is None or data.device.type != "cuda"
                or torch.compiler.is_compiling() or torch.cuda.is_current_stream_capturing()):
            return
        self._prepare()

    @property
    def weight_qtensor(self) -> QTensor:
        """The weight as a QTensor (a new object over this module's buffers; no copy)."""
        if self.weight_data is None or self.weight_scale is None:
            raise RuntimeError(
                f"{type(self).__name__} has no weight yet (load a state dict or call set_weight)"
            )
        tensors = {f: getattr(self, f"weight_{f}") for f in QTENSOR_FIELDS}
        meta = self._meta or self._default_meta()
        return QTensor(
            fmt=self.scheme.weight_format,
            shape=torch.Size((self.out_features, self.in_features)),
            dtype=meta["dtype"],
            scale_layout=meta["scale_layout"],
            params=dict(meta["params"]),
            **tensors,
        )

    def _default_meta(self) -> dict[str, Any]:
        """Metadata for buffers that came from ``load_state_dict`` (not stored there): the scheme's options, with
        what the tensors themselves say (nf4 double quantization, int4 group size, layout)."""
        params = dict(self.scheme.weight_options)
        fmt = self.scheme.weight_format
        if fmt in ("nf4", "bnb_fp4"):
            params["double_quant"] = self.weight_nested_scale is not None
            params["blocksize"] = params.get("blocksize", 64)
        elif fmt == "int4_awq" and self.weight_scale is not None:
            params = {"group_size": self.in_features // self.weight_scale.shape[0]}
        elif fmt == "fp8_block":
            params = {"block": tuple(params.get("block", (128, 128))), "scale_fmt": params.get("scale_fmt")}
        linear_scale = self.weight_scale is not None and self.weight_scale.shape[0] == self.out_features
        layout = (
            "linear" if fmt in ("nf4", "bnb_fp4", "int4_awq", "fp8_block", "fp4_b32") or linear_scale else "swizzled"
        )
        return {"dtype": torch.bfloat16, "scale_layout": layout, "params": params}

    def _load_from_state_dict(
        self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
    ):
        # buffers that are None here (a layer built without a weight) take the tensors of the state dict
        for name in (*BUFFER_NAMES, "input_global_scale", "bias"):
            key = prefix + name
            if self._buffers.get(name) is None and key in state_dict:
                self._buffers[name] = state_dict[key].detach().clone()
        super()._load_from_state_dict(
            state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
        )
        self._prepare_if_ready()

    def dequantize_weight(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The dense weight ``[out_features, in_features]`` in ``dtype``."""
        return dequantize(self.weight_qtensor, dtype, backend=self.backend)

    @property
    def weight_nbytes(self) -> int:
        """Bytes the quantized weight occupies (all its tensors)."""
        return self.weight_qtensor.nbytes

    # ------------------------------------------------------------------ construction

    @classmethod
    def from_linear(
        cls,
        linear: nn.Linear,
        scheme: str | Scheme,
        *,
        global_scale: torch.Tensor | None = None,
        input_global_scale: torch.Tensor | None = None,
        activation: str | None = None,
        backend: str | None = None,
    ) -> QuantLinear:
        """Quantize an ``nn.Linear`` (on its device) into a new ``QuantLinear``; ``linear`` is not modified.

        Args:
            linear: the layer; its weight may be float32, bfloat16 or float16.
            scheme: scheme name or :class:`Scheme`.
            global_scale: nvfp4 weights: the weight global scale to use (fused siblings share one);
                None: the format default ``2688 / amax(W)``.
            input_global_scale: nvfp4 activations: the static activation multiplier (``2688 / absmax``).
            activation: fused activation.
            backend: lowbit backend for quantize and for the forward.

        Raises:
            ValueError: the layer's shape does not fit the scheme (the message says why).
        """
        if not isinstance(linear, nn.Linear):
            raise TypeError(f"from_linear needs an nn.Linear, got {type(linear).__name__}")
        scheme = get_scheme(scheme)
        why = scheme.unsupported(linear.out_features, linear.in_features)
        if why is not None:
            raise ValueError(
                f"scheme {scheme.name} cannot take a [{linear.out_features}, {linear.in_features}] weight: {why}"
            )
        opts = scheme.weight_quantize_options(linear.in_features)
        if global_scale is not None:
            if scheme.weight_format != "nvfp4":
                raise ValueError(f"global_scale applies to nvfp4 weights only, not {scheme.weight_format}")
            opts["global_scale"] = global_scale
        with torch.no_grad():
            q = quantize(linear.weight.detach(), scheme.weight_format, backend=backend, **opts)
        bias = linear.bias.detach() if linear.bias is not None else None
        return cls(
            linear.in_features,
            linear.out_features,
            bias is not None,
            scheme=scheme,
            weight=q,
            bias_tensor=bias,
            input_global_scale=input_global_scale,
            activation=activation,
            backend=backend,
        )

    # ------------------------------------------------------------------ forward

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # buffers read from _buffers directly: Module.__getattr__ is a Python call per attribute, and this is the
        # per-token path of every layer
        buffers = self._buffers
        try:
            bias, igs = buffers["bias"], buffers["input_global_scale"]
        except KeyError:  # re-registered as a parameter or plain attribute
            bias, igs = self.bias, self.input_global_scale
        if bias is not None and bias.dtype != x.dtype:
            bias = bias.to(x.dtype)
        return self.call_weight(x, bias, igs)

    def call_weight(self, x: torch.Tensor, bias: torch.Tensor | None, igs: torch.Tensor | None) -> torch.Tensor:
        """``act(x @ W.T + bias)`` through the prepared weight, ``bias`` given by the caller (None, or ``[N]`` in
        x's dtype) and ``igs`` the static NVFP4 activation scale (or None): ``forward`` without its buffer reads.
        Tensor-parallel shards call it with the bias they add after their reduction."""
        prep = self._prepared
        if torch.compiler.is_compiling():
            # prepared in eager mode (at load / .to(), or by an eager call): the traced path reads its layouts
            if prep is None:  # not prepared: the opaque custom ops, nothing derived inside the graph
                prep = self._new_prepared(layouts=False)
            return prep.traced_call(x, bias, igs)
        if prep is None or prep.activation != self.activation or prep.backend != self.backend or (
                prep.versions and prep.stale()):
            prep = self._prepare()  # first call, edited attributes, or weight buffers changed in place
        return prep(x, bias, igs)

    # ------------------------------------------------------------------ nn.Module plumbing

    def __getstate__(self):
        # pickling and deepcopy leave the prepared launches out (compiled kernels, device handles): the copy
        # prepares again on its first call
        state = self.__dict__.copy()
        state["_prepared"] = None
        return state

    def _apply(self, fn, recurse: bool = True):
        # keep the bit patterns: quantized buffers follow device moves only, never dtype casts
        saved = {n: getattr(self, n) for n in (*BUFFER_NAMES, "input_global_scale")}
        super()._apply(fn, recurse)
        for name, old in saved.items():
            new = getattr(self, name)
            if old is not None and new is not None and new.dtype != old.dtype:
                self._buffers[name] = old.to(new.device)
        if any(getattr(self, n) is not saved[n] for n in saved):
            self._prepare_if_ready()
        return self

    def extra_repr(self) -> str:
        parts = [
            f"in_features={self.in_features}",
            f"out_features={self.out_features}",
            f"bias={self.bias is not None}",
            f"scheme={self.scheme.name}",
            f"weight={self.scheme.weight_format}",
        ]
        group = self.group_size
        if group is not None:
            parts.append(f"group={group}")
        if self.scheme.act_format is not None:
            static = self.input_global_scale is not None
            parts.append(f"act={self.scheme.act_format}" + (" static" if static else " dynamic"))
        if self.activation is not None:
            parts.append(f"activation={self.activation}")
        return ", ".join(parts)

    @property
    def group_size(self) -> int | str | None:
        """Elements per weight scale (``"128x128"`` for fp8 blocks)."""
        fmt = self.scheme.weight_format
        params = self._meta.get("params", {})
        if fmt == "int4_awq":
            return params.get("group_size")
        if fmt in ("nf4", "bnb_fp4"):
            return params.get("blocksize", 64)
        if fmt == "fp8_block":
            block = params.get("block", (128, 128))
            return f"{block[0]}x{block[1]}"
        from ..formats.spec import FORMATS

        block = FORMATS[fmt].block
        return block if isinstance(block, int) else None


__all__ = ["ACTIVATIONS", "BUFFER_NAMES", "QTENSOR_FIELDS", "QuantLinear"]
