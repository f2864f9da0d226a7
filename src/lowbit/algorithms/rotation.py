"""Random Hadamard rotations of a Linear layer's input space (QuaRot-style), for activation-quantized schemes.

For an orthogonal ``R`` ``[K, K]``, ``y = x W^T = (x R) (W R)^T``: the layer computes the same function when
its weight is replaced by ``W R`` and its input by ``x R``. With ``R = D H``, ``D`` a diagonal of random
signs and ``H`` a block-diagonal Walsh-Hadamard matrix of block ``b`` (normalised, so ``H H^T = I``), the
rotated input spreads a channel's outlier over the ``b`` channels of its block, which can make both the
activation and the weight blocks easier to round to 4 bits. With ``b`` equal to the format's scale block
(16 for nvfp4, 32 for mxfp4) the rotation stays inside the quantization blocks.

Where the rotation lands:

- **Offline**, when the input of the layer is the per-head average of another Linear's outputs (the value
  projection feeding the attention output projection: ``v_proj -> o_proj``, BERT ``value ->
  attention.output.dense``, diffusers ``to_v -> to_out.0``) and ``b`` divides the head size: the attention
  average mixes tokens, not channels, so ``R`` is folded into the value projection's rows and bias. No
  runtime cost.
- **Online** everywhere else: an :class:`InputTransform` child module applies ``x -> H(x * d)`` (block-wise
  Walsh-Hadamard transform, pure torch, any device) in a forward pre-hook of the layer, and ``W R`` is
  what gets quantized. This has a runtime cost: per token, one multiply by ``d`` and the block transform of
  the ``K`` inputs (``K log2 b`` additions as a fast Walsh-Hadamard transform, ``K b`` multiply-adds as the
  block matrix product lowbit runs in pure torch, against the ``K N`` of the layer), i.e. a few extra kernel
  launches and one more read and write of the activation per layer call; a fused kernel would apply it while
  quantizing the activation. Folding the rotation fully (QuaRot's rotated residual stream) needs
  pre-norm blocks with bias-free RMSNorms; post-norm models such as BERT normalise the residual stream
  itself, so their LayerNorm outputs cannot be rotated offline.

Online transforms are not part of any checkpoint format: :func:`lowbit.save_quantized` refuses a model that
holds one (the saved weights would be ``W R`` without the ``x R`` that goes with them).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..nn.quantize import warn_layers

INPUT_TRANSFORM = "input_transform"
"""Name of the :class:`InputTransform` child a layer with an online input transform holds."""


def _is_pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


MATMUL_MAX_BLOCK = 256
"""Blocks up to this size are transformed as one matrix product with the ``[b, b]`` Hadamard matrix, larger ones
by butterflies. In pure torch the product is the faster of the two at these sizes: one BLAS call against
``3 log2(b)`` elementwise kernels (on 2 CPU cores, 4377 x 384 fp32 inputs, b = 16: 2.1 ms against 16.7 ms)."""


def _butterfly(y: torch.Tensor, block: int) -> torch.Tensor:
    """The fast Walsh-Hadamard transform of each ``block`` of the last dim (unnormalised)."""
    k = y.shape[-1]
    y = y.reshape(-1, k // block, block)
    h = 1
    while h < block:
        # butterfly stage: pairs (i, i + h) inside each 2h-group become (a + b, a - b)
        y = y.reshape(y.shape[0], y.shape[1], block // (2 * h), 2, h)
        a, b = y[..., 0, :], y[..., 1, :]
        y = torch.stack((a + b, a - b), dim=-2)
        h *= 2
    return y


def _check(x: Any, block: Any) -> None:
    if isinstance(block, bool) or not isinstance(block, int) or not _is_pow2(block):
        raise ValueError(f"block must be a power of two, got {block!r}")
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        raise TypeError(f"x must be a floating-point tensor, got {getattr(x, 'dtype', type(x))}")
    if x.dim() == 0 or x.shape[-1] % block:
        raise ValueError(f"x must have a last dim divisible by block={block}, got shape {tuple(x.shape)}")


def hadamard_transform(x: torch.Tensor, block: int, *, method: str = "auto") -> torch.Tensor:
    """``x`` times the block-diagonal normalised Walsh-Hadamard matrix along the last dim.

    Each consecutive group of ``block`` elements of the last dim is multiplied by the Sylvester Hadamard
    matrix ``H_b / sqrt(b)`` (symmetric and orthogonal, so the transform is its own inverse).

    Args:
        x: ``[..., K]`` float tensor, ``K % block == 0``.
        block: a power of two.
        method: ``"butterfly"`` (the fast Walsh-Hadamard transform, ``log2(b)`` stages of additions),
            ``"matmul"`` (one product with the ``[b, b]`` matrix) or ``"auto"`` (matmul up to
            :data:`MATMUL_MAX_BLOCK`). Both give the same values up to float rounding.

    Returns:
        A new tensor of ``x``'s shape and dtype (computed in fp32 for 16-bit inputs).
    """
    _check(x, block)
    if method not in ("auto", "butterfly", "matmul"):
        raise ValueError(f"method must be 'auto', 'butterfly' or 'matmul', got {method!r}")
    dtype = x.dtype
    y = x.float() if dtype in (torch.float16, torch.bfloat16) else x
    if method == "butterfly" or (method == "auto" and block > MATMUL_MAX_BLOCK):
        y = _butterfly(y, block) * (1.0 / math.sqrt(block))
    else:
        y = y.reshape(-1, block) @ hadamard_matrix(block, y.dtype, y.device)
    return y.reshape(x.shape).to(dtype)


def hadamard_matrix(n: int, dtype: torch.dtype = torch.float32, device: Any = None) -> torch.Tensor:
    """The normalised Sylvester Hadamard matrix ``[n, n]`` (``n`` a power of two)."""
    if isinstance(n, bool) or not isinstance(n, int) or not _is_pow2(n):
        raise ValueError(f"n must be a power of two, got {n!r}")
    eye = torch.eye(n, dtype=torch.float64, device=device)
    return (_butterfly(eye, n).reshape(n, n) / math.sqrt(n)).to(dtype)


class InputTransform(nn.Module):
    """``x -> H_b(x * scale)``: an online per-channel scale and/or block Hadamard rotation of a layer's input.

    Held as the child ``input_transform`` of the layer it feeds and applied by a forward pre-hook (see
    :func:`attach_input_transform`), so ``.to(device)`` moves it, ``deepcopy`` copies it and the layer's own
    forward is unchanged. ``scale`` stays fp32 under dtype casts and is cast to the input's dtype when applied.

    Attributes:
        in_features: ``K``.
        scale: fp32 ``[K]`` buffer (per-channel multiplier: ``1/s`` of smoothing times the rotation's random
            signs) or None.
        block: Hadamard block size (a power of two dividing ``K``) or None for no rotation.
    """

    def __init__(self, in_features: int, scale: torch.Tensor | None = None, block: int | None = None) -> None:
        super().__init__()
        if isinstance(in_features, bool) or not isinstance(in_features, int) or in_features <= 0:
            raise ValueError(f"in_features must be a positive int, got {in_features!r}")
        if block is not None and (
            isinstance(block, bool) or not isinstance(block, int) or not _is_pow2(block) or in_features % block
        ):
            raise ValueError(f"block must be a power of two dividing in_features={in_features}, got {block!r}")
        if scale is not None:
            if not isinstance(scale, torch.Tensor) or tuple(scale.shape) != (in_features,):
                got = getattr(scale, "shape", scale)
                raise ValueError(f"scale must be a tensor of shape ({in_features},), got {got}")
            scale = scale.detach().float().clone()
        self.in_features = in_features
        self.block = block
        self.register_buffer("scale", scale)
        # the [b, b] matrix of the block product (not part of the state: it follows from block)
        h = hadamard_matrix(block) if block is not None and block <= MATMUL_MAX_BLOCK else None
        self.register_buffer("hadamard", h, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = self.scale
        if scale is not None:
            x = x * scale.to(x.dtype)
        if self.block is None:
            return x
        h = self.hadamard
        if h is None:
            return hadamard_transform(x, self.block)
        dtype = x.dtype
        y = x.float() if dtype in (torch.float16, torch.bfloat16) else x
        return (y.reshape(-1, self.block) @ h.to(y.dtype)).reshape(x.shape).to(dtype)

    def _apply(self, fn, recurse: bool = True):
        super()._apply(fn, recurse)
        for name in ("scale", "hadamard"):
            t = self._buffers.get(name)
            if t is not None and t.dtype != torch.float32:
                self._buffers[name] = t.float()
        return self

    def extra_repr(self) -> str:
        parts = [f"in_features={self.in_features}"]
        if self.scale is not None:
            parts.append("scale")
        if self.block is not None:
            parts.append(f"hadamard_block={self.block}")
        return ", ".join(parts)


def _pre_hook(module: nn.Module, args: tuple) -> tuple:
    t = module._modules.get(INPUT_TRANSFORM)
    if t is None or not args:
        return args
    return (t(args[0]), *args[1:])


def input_transform_of(module: nn.Module) -> InputTransform | None:
    """The :class:`InputTransform` a layer applies to its input, or None."""
    t = module._modules.get(INPUT_TRANSFORM)
    return t if isinstance(t, InputTransform) else None


def attach_input_transform(module: nn.Module, transform: InputTransform) -> None:
    """Make ``module`` apply ``transform`` to its first input (child ``input_transform`` + forward pre-hook).

    A layer that already has one gets the composition: the new transform runs after the old one; scales
    merge into one vector when the old transform has no rotation.
    """
    if not isinstance(transform, InputTransform):
        raise TypeError(f"transform must be an InputTransform, got {type(transform).__name__}")
    old = input_transform_of(module)
    if old is not None:
        if old.block is not None:
            raise ValueError(f"{type(module).__name__} already rotates its input; a second transform would "
                             "have to follow the rotation (apply smoothing before rotation)")
        scale = old.scale
        if transform.scale is not None:
            scale = transform.scale if scale is None else scale * transform.scale.to(scale)
        module._modules[INPUT_TRANSFORM] = InputTransform(transform.in_features, scale, transform.block).to(
            old.scale.device if old.scale is not None else "cpu"
        )
        return
    setattr(module, INPUT_TRANSFORM, transform)
    module.register_forward_pre_hook(_pre_hook)


def carry_input_transform(old: nn.Module, new: nn.Module) -> nn.Module:
    """Give ``new`` (the module replacing ``old``) the input transform ``old`` applied; returns ``new``."""
    t = input_transform_of(old)
    if t is not None and input_transform_of(new) is None:
        attach_input_transform(new, t)
    return new


def online_transform_layers(model: nn.Module) -> list[str]:
    """Names of the layers of ``model`` that apply an online :class:`InputTransform`."""
    return [n for n, m in model.named_modules() if input_transform_of(m) is not None]


# ------------------------------------------------------------------------------------------------ algorithm


@dataclass(frozen=True)
class Rotate:
    """Random Hadamard rotation options (``quantize_model(algorithm=Rotate(...))`` or ``"rotate"``).

    Attributes:
        block_size: Hadamard block ``b`` (a power of two); None: the activation format's scale block (16 for
            nvfp4, 32 for mxfp4 and mxfp8, 128 for fp8 1x128 blocks). Layers whose ``in_features`` it does
            not divide keep their input as it is (one warning lists them).
        random_signs: multiply by random signs ``D`` before ``H`` (``R = D H``, a random Hadamard rotation);
            False: ``R = H``.
        seed: of the ``torch.Generator`` drawing the signs (one draw per layer, in model order).
        fold: fold the rotation offline into value projections where the attention average allows (see the
            module docstring); False: every layer rotates online.
    """

    block_size: int | None = None
    random_signs: bool = True
    seed: int = 0
    fold: bool = True

    def __post_init__(self) -> None:
        b = self.block_size
        if b is not None and (isinstance(b, bool) or not isinstance(b, int)):
            raise TypeError(f"block_size must be None or an int, got {type(b).__name__}")
        if b is not None and not _is_pow2(b):
            raise ValueError(f"block_size must be a power of two, got {b}")
        for name in ("random_signs", "fold"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be a bool, got {type(getattr(self, name)).__name__}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise TypeError(f"seed must be an int, got {type(self.seed).__name__}")


ACT_BLOCKS = {"nvfp4": 16, "mxfp4": 32, "mxfp8_e4m3": 32, "mxfp8_e5m2": 32, "fp8_block": 128}
"""Default Hadamard block per activation format (its scale block along K)."""


def default_block(scheme: Any) -> int:
    """The Hadamard block of ``scheme``'s activation format; ValueError for a weight-only scheme."""
    fmt = scheme.act_format
    if fmt is None:
        raise ValueError(
            f"algorithm 'rotate' needs a scheme that quantizes activations (w8a8-*, w4a8-*, w4a4-*); "
            f"{scheme.name} is weight-only"
        )
    if fmt == "fp8_block":
        block = dict(scheme.act_options).get("block", (1, 128))
        return int(block[-1])
    return ACT_BLOCKS.get(fmt, 32)


def _head_dim(modules: Mapping[str, nn.Module], v_name: str) -> int | None:
    """Head size of the attention a value projection belongs to (BERT ``attention_head_size``, Llama
    ``head_dim``, diffusers ``heads``), or None when the module does not say."""
    parent = modules.get(v_name.rpartition(".")[0])
    if parent is None:
        return None
    for attr in ("attention_head_size", "head_dim"):
        v = getattr(parent, attr, None)
        if isinstance(v, int) and v > 0:
            return v
    heads = getattr(parent, "heads", None)
    v = modules[v_name]
    if isinstance(heads, int) and heads > 0 and isinstance(v, nn.Linear) and v.out_features % heads == 0:
        return v.out_features // heads
    return None


def value_output_pairs(model: nn.Module) -> dict[str, str]:
    """``{output projection: value projection}`` for attention whose output projection reads the per-head
    average of one value projection (the pairs :mod:`lowbit.nn.awq_search` folds scales through)."""
    from ..nn.awq_search import find_groups

    modules = dict(model.named_modules())
    pairs = {}
    for g in find_groups(model):
        if g.prev_kind != "linear" or len(g.linears) != 1:
            continue
        prev = g.prev.rpartition(".")[2]
        if prev in ("v_proj", "value", "to_v"):
            pairs[g.linears[0]] = g.prev
    return {o: v for o, v in pairs.items() if isinstance(modules.get(v), nn.Linear)}


@torch.no_grad()
def apply_rotation(
    model: nn.Module, targets: Mapping[str, nn.Linear], scheme: Any, config: Rotate | None = None
) -> dict[str, str]:
    """Rotate the input space of every Linear in ``targets`` (modifies the float weights of ``model``).

    Args:
        model: the float model, before its Linear layers are quantized.
        targets: the Linear layers to rotate, by name.
        scheme: the :class:`lowbit.nn.Scheme` they will be quantized with (its activation format gives the
            default block).
        config: :class:`Rotate` options.

    Returns:
        ``{name: "folded" | "online" | why it was left as it is}``.
    """
    config = Rotate() if config is None else config
    if not isinstance(config, Rotate):
        raise TypeError(f"config must be a lowbit.algorithms.Rotate, got {type(config).__name__}")
    block = default_block(scheme)  # raises for a weight-only scheme
    block = config.block_size or block
    from ..nn.quantize import fused_groups

    modules = dict(model.named_modules())
    pairs = value_output_pairs(model) if config.fold else {}
    # siblings reading one input (q/k/v, gate/up) share their signs: a fused layer rotates its input once
    first = {n: g[0] for g in fused_groups(targets) for n in g}
    gen = torch.Generator().manual_seed(config.seed)
    drawn: dict[str, torch.Tensor] = {}
    how: dict[str, str] = {}
    for name, lin in targets.items():
        k = lin.in_features
        if k % block:
            how[name] = f"not rotated: in_features={k} is not a multiple of the Hadamard block {block}"
            continue
        signs = None
        if config.random_signs:
            key = first.get(name, name)
            if key not in drawn or drawn[key].shape[0] != k:
                drawn[key] = (torch.randint(0, 2, (k,), generator=gen) * 2 - 1).float()
            signs = drawn[key]
        w = lin.weight
        d = signs.to(w.device) if signs is not None else None
        w_rot = hadamard_transform(w.float() * d if d is not None else w.float(), block)
        v_name = pairs.get(name)
        hd = _head_dim(modules, v_name) if v_name is not None else None
        if v_name is not None and hd is not None and hd % block == 0 and input_transform_of(lin) is None:
            # x R with x = per-head average of v's outputs: R^T folded into v's rows, (R^T W_v)^T = W_v^T D H
            v = modules[v_name]
            v.weight.copy_(_rotate_rows(v.weight.float(), d, block).to(v.weight.dtype))
            if v.bias is not None:
                bv = v.bias.float()
                v.bias.copy_(hadamard_transform(bv * d.to(bv) if d is not None else bv, block).to(v.bias.dtype))
            w.copy_(w_rot.to(w.dtype))
            how[name] = f"folded into {v_name}"
            continue
        w.copy_(w_rot.to(w.dtype))
        attach_input_transform(lin, InputTransform(k, signs, block).to(w.device))
        how[name] = "online"
    skipped = [f"{n} ({h.split(': ', 1)[1]})" for n, h in how.items() if h.startswith("not rotated")]
    warn_layers("lowbit rotate", "keep their input unrotated", skipped, stacklevel=3)
    return how


def _rotate_rows(w: torch.Tensor, d: torch.Tensor | None, block: int) -> torch.Tensor:
    """``R^T W`` for ``R = D H`` block-diagonal: the output channels of ``W`` ``[N, K]`` (``N`` a multiple
    of ``block``) rotated, so that ``x W'^T = (x W^T) R``."""
    wt = w.t()  # [K, N]: rotate the last dim
    if d is not None:
        wt = wt * d.to(wt)
    return hadamard_transform(wt, block).t()


__all__ = [
    "ACT_BLOCKS",
    "INPUT_TRANSFORM",
    "InputTransform",
    "MATMUL_MAX_BLOCK",
    "Rotate",
    "apply_rotation",
    "attach_input_transform",
    "carry_input_transform",
    "default_block",
    "hadamard_matrix",
    "hadamard_transform",
    "input_transform_of",
    "online_transform_layers",
    "value_output_pairs",
]
