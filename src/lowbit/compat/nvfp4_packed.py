"""The nvfp4_packed GEMV plugin's Python API on lowbit: ``NVFP4PackedLinear``, ``replace_mlp_with_nvfp4_packed``.

The plugin's "NVFP4 packed" layer is W4A16 with FP4 E2M1 weights packed two per byte (element 2i in the low
nibble), one fp32 scale ``amax / 6`` per 32 weights along K, and a GEMV fused with bias and activation
(``activation_type`` 0 = none, 1 = GELU, 2 = SiLU). That is lowbit's ``fp4_b32`` format and the
``w4a16-fp4b32`` scheme, so :class:`NVFP4PackedLinear` is a :class:`~lowbit.nn.QuantLinear` of that scheme whose
forward runs :func:`lowbit.linear` with the fused activation (Triton GEMV/GEMM on CUDA, the reference on CPU).

:func:`replace_mlp_with_nvfp4_packed` swaps the Linear layers of a model's MLP blocks and, where it can tell which
activation follows the MLP's up-projection, fuses that activation into the layer (the model's own activation
becomes ``nn.Identity``), as the plugin does. Detected MLP shapes:

- ``fc1 -> activation_fn -> fc2`` (SigLIP, CLIP, ViT-style ``*MLP``): the activation goes into ``fc1``;
- ``down_proj(act_fn(gate_proj(x)) * up_proj(x))`` (Llama, Gemma, PaliGemma's language model): into ``gate_proj``;
- BERT ``*Intermediate`` (``dense`` + ``intermediate_act_fn``) and the following ``*Output.dense``: into the
  intermediate ``dense``;
- ``nn.Sequential(Linear, GELU|SiLU, Linear, ...)``: into the Linear before the activation.

Activations recognised: ``nn.GELU`` (exact or tanh), ``nn.SiLU``, ``F.gelu``/``F.silu``, transformers'
``GELUActivation``, ``PytorchGELUTanh``/``GELUTanh`` (tanh GELU), ``SiLUActivation``. Anything else (e.g.
``NewGELUActivation``, whose formula rounds differently from ``gelu(approximate="tanh")``, or ``QuickGELU``) is
left in place unfused and the layers are swapped without an activation.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..formats.qtensor import QTensor
from ..nn.modules import QuantLinear

SCHEME = "w4a16-fp4b32"
BLOCK_SIZE = 32
ACTIVATION_TYPES = {0: None, 1: "gelu", 2: "silu"}
"""The plugin's ``activation_type`` parameter -> lowbit activation name."""
_NAMES = {None: None, "none": None, "gelu": "gelu", "gelu_tanh": "gelu_tanh", "silu": "silu"}


def _activation_name(activation) -> str | None:
    if isinstance(activation, int) and not isinstance(activation, bool):
        if activation not in ACTIVATION_TYPES:
            raise ValueError(
                f"activation_type must be one of {sorted(ACTIVATION_TYPES)} (0=None, 1=GELU, 2=SiLU)"
            )
        return ACTIVATION_TYPES[activation]
    if activation is None or isinstance(activation, str):
        key = activation.lower() if isinstance(activation, str) else None
        if key in _NAMES:
            return _NAMES[key]
    raise ValueError(
        f"activation must be None, 'none', 'gelu', 'gelu_tanh', 'silu' or 0/1/2, got {activation!r}"
    )


class NVFP4PackedLinear(QuantLinear):
    """The nvfp4_packed plugin's ``NVFP4PackedLinear``: FP4 weights ``uint8 [N, K/2]`` + fp32 scales
    ``[N, K/32]``, fused ``act(x @ W.T + bias)`` with ``activation`` None/``"gelu"``/``"silu"`` (or
    ``activation_type`` 0/1/2).

    ``in_features`` must be a multiple of 32. Use :meth:`from_linear` to quantize an ``nn.Linear``.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        activation: str | int | None = None,
        *,
        weight: QTensor | None = None,
        bias_tensor: torch.Tensor | None = None,
        backend: str | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        if in_features % BLOCK_SIZE:
            raise ValueError(
                f"NVFP4PackedLinear: in_features={in_features} must be a multiple of {BLOCK_SIZE}"
            )
        super().__init__(
            in_features,
            out_features,
            bias,
            scheme=SCHEME,
            weight=weight,
            bias_tensor=bias_tensor,
            activation=_activation_name(activation),
            backend=backend,
            device=device,
            dtype=dtype,
        )

    @classmethod
    def from_linear(  # type: ignore[override]
        cls, linear: nn.Linear, activation: str | int | None = None, *, backend: str | None = None
    ) -> NVFP4PackedLinear:
        """Quantize ``linear`` (not modified) into an ``NVFP4PackedLinear`` with the fused ``activation``."""
        q = QuantLinear.from_linear(linear, SCHEME, backend=backend)
        return cls(
            linear.in_features,
            linear.out_features,
            linear.bias is not None,
            activation,
            weight=q.weight_qtensor,
            bias_tensor=q.bias,
            backend=backend,
        )

    @property
    def weight_packed(self) -> torch.Tensor:
        """``uint8 [N, K/2]``: two E2M1 codes per byte, element 2i in the low nibble (the plugin's input 1)."""
        return self.weight_data

    @property
    def activation_type(self) -> int:
        """The plugin's ``activation_type``: 0 none, 1 GELU, 2 SiLU (3 for tanh GELU, which the plugin lacks)."""
        return {None: 0, "gelu": 1, "silu": 2, "gelu_tanh": 3}[self.activation]

    @property
    def block_size(self) -> int:
        return BLOCK_SIZE


# ---------------------------------------------------------------------------------------------- model surgery


def detect_activation(act) -> str | None:
    """lowbit's name for an activation module or function, or None if it is not one lowbit.linear fuses exactly."""
    if isinstance(act, nn.GELU):
        return "gelu" if act.approximate == "none" else "gelu_tanh"
    if isinstance(act, nn.SiLU):
        return "silu"
    if act is F.gelu:
        return "gelu"
    if act is F.silu:
        return "silu"
    name = type(act).__name__
    if name == "GELUActivation" and getattr(act, "act", None) in (F.gelu, None):
        return "gelu"
    if name in ("PytorchGELUTanh", "GELUTanh"):
        return "gelu_tanh"
    if name == "SiLUActivation":
        return "silu"
    return None


def _swap(parent: nn.Module, child: str, activation: str | None, backend: str | None) -> bool:
    lin = getattr(parent, child, None)
    if type(lin) is not nn.Linear or lin.in_features % BLOCK_SIZE:
        return False
    setattr(parent, child, NVFP4PackedLinear.from_linear(lin, activation, backend=backend))
    return True


def _fuse(module: nn.Module, act_attr: str, want: str) -> str | None:
    """The activation to fuse (and replace ``module.<act_attr>`` by Identity), or None to leave it."""
    act = getattr(module, act_attr, None)
    found = detect_activation(act)
    if want == "auto":
        chosen = found
    elif want is None:
        chosen = None
    else:
        chosen = want if act is not None else None
    if chosen is not None:
        setattr(module, act_attr, nn.Identity())
    return chosen


def _can_take(module: nn.Module, name: str) -> bool:
    lin = getattr(module, name, None)
    return type(lin) is nn.Linear and lin.in_features % BLOCK_SIZE == 0


def _bert_layer(module: nn.Module) -> bool:
    inter, out = getattr(module, "intermediate", None), getattr(module, "output", None)
    return (
        inter is not None
        and out is not None
        and hasattr(inter, "intermediate_act_fn")
        and _can_take(inter, "dense")
        and _can_take(out, "dense")
    )


def replace_mlp_with_nvfp4_packed(
    model: nn.Module,
    activation: str | int | None = "auto",
    *,
    backend: str | None = None,
) -> nn.Module:
    """Replace the Linear layers of every MLP block in ``model`` by :class:`NVFP4PackedLinear` (in place).

    Args:
        model: any module (transformers models, ``nn.Sequential`` MLPs).
        activation: ``"auto"`` (default): fuse the activation that follows each up-projection when it is one of
            GELU (exact or tanh) / SiLU; ``None``/``"none"``/0: swap the layers, fuse nothing; ``"gelu"``,
            ``"silu"`` (or 1, 2): fuse that activation wherever an activation slot was found, whatever the model
            had there (you assert they are the same function).
        backend: lowbit backend for quantization and the forward.

    Returns:
        ``model``. Layers whose in_features is not a multiple of 32 are left as they are.

    Raises:
        ValueError: no MLP layer was found to replace, or a bad ``activation``.
    """
    want = "auto" if activation == "auto" else _activation_name(activation)
    replaced = 0
    for _, module in list(model.named_modules()):
        if isinstance(module, NVFP4PackedLinear):
            continue
        if _can_take(module, "fc1") and _can_take(module, "fc2") and hasattr(module, "activation_fn"):
            act = _fuse(module, "activation_fn", want)
            replaced += _swap(module, "fc1", act, backend) + _swap(module, "fc2", None, backend)
        elif all(hasattr(module, n) for n in ("gate_proj", "up_proj", "down_proj")) and _can_take(
            module, "gate_proj"
        ):
            act = _fuse(module, "act_fn", want) if _can_take(module, "up_proj") else None
            for n in ("gate_proj", "up_proj", "down_proj"):
                replaced += _swap(module, n, act if n == "gate_proj" else None, backend)
        elif _bert_layer(module):  # intermediate.dense -> intermediate_act_fn -> output.dense
            act = _fuse(module.intermediate, "intermediate_act_fn", want)
            replaced += _swap(module.intermediate, "dense", act, backend) + _swap(
                module.output, "dense", None, backend
            )
        elif isinstance(module, nn.Sequential):
            children = list(module.named_children())
            for i in range(len(children) - 1):
                (name, child), (act_name, act) = children[i], children[i + 1]
                found = detect_activation(act)
                if type(child) is not nn.Linear or child.in_features % BLOCK_SIZE or found is None:
                    continue
                chosen = found if want == "auto" else want
                if chosen is not None:
                    setattr(module, act_name, nn.Identity())
                replaced += _swap(module, name, chosen, backend)
                if i + 2 < len(children):
                    replaced += _swap(module, children[i + 2][0], None, backend)
    if not replaced:
        raise ValueError(
            "replace_mlp_with_nvfp4_packed: found no MLP block (fc1/activation_fn/fc2, gate_proj/up_proj/down_proj, "
            "BERT intermediate/output, or Sequential Linear-activation-Linear) with in_features % 32 == 0"
        )
    return model


__all__ = ["ACTIVATION_TYPES", "NVFP4PackedLinear", "detect_activation", "replace_mlp_with_nvfp4_packed"]
