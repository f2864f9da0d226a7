"""LightX2V's quantized checkpoint keys, read and written bit for bit.

LightX2V (``ModelTC/LightX2V``) keeps a quantized Linear under its own name, one tensor per key, the layout its
``MMWeight*`` classes load and its converter (``tools/convert``) writes:

=================  ===========================================================================================
key                value
=================  ===========================================================================================
``<m>.weight``      ``uint8``: NVFP4/MXFP4 ``[N, K/2]`` (element 2i in the low nibble), MXFP6 E3M2 ``[N, 3K/4]``
                    (four codes in three bytes), MXFP8 E4M3 ``[N, K]`` (the E4M3 bytes)
``<m>.weight_scale``  128x4-swizzled block scales ``[round_up(N, 128), round_up(K/block, 4)]``, zero padding:
                    ``float8_e4m3fn`` (NVFP4, block 16) or ``float8_e8m0fnu`` (MX, block 32)
``<m>.weight_global_scale``  NVFP4: fp32 scalar multiplier ``S`` (``2688 / amax`` as the converter computes it,
                    see :func:`quantize_weight`); the weight decodes as ``e2m1 * sf / S``
``<m>.input_global_scale``  NVFP4: the static activation multiplier (``2688 / input_absmax``, fp32)
``<m>.alpha``        NVFP4: fp32 ``1 / (input_global_scale * weight_global_scale)``, the GEMM's output scale
``<m>.input_absmax``  NVFP4, instead of the two above: the calibrated activation absmax; LightX2V then
                    computes ``input_global_scale = (2688.0 / input_absmax).to(float32)`` and ``alpha`` as above
``<m>.bias``         unchanged
=================  ===========================================================================================

The MX classes need no global or activation scale (their ``alpha`` is the constant 1). The model's quantized
type is one per checkpoint (LightX2V's ``dit_quant_scheme``): ``nvfp4`` (W4A4), ``mxfp4`` (W4A4),
``mxfp6-mxfp8`` (MXFP6 E3M2 weights, MXFP8 activations) or ``mxfp8`` (W8A8); activations are quantized
dynamically per call, except NVFP4's static global scale. :data:`LIGHTX2V_SCHEMES` maps those names to lowbit
schemes whose activation quantization is LightX2V's (NVFP4 with ``convention="lightx2v"``, MX with RCEIL), so a
LightX2V state dict loaded here computes what ``lowbit.compat.lightx2v`` computes.

LightX2V's ``add_scale_to_models`` drops ``weight_global_scale`` after writing ``alpha``; lowbit writes all
three. Reading a module without ``weight_global_scale``, lowbit takes the fp32 ``S`` with
``1 / (input_global_scale * S) == alpha`` bit for bit (the nearest such value to ``1 / (alpha * igs)``), so the
GEMM's output scale is the stored one.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from .. import __version__
from ..formats.packing import swizzle_scales, swizzled_scale_shape
from ..formats.qtensor import QTensor
from ..nn.modules import QuantLinear
from ..nn.schemes import SCHEMES, Scheme

LIGHTX2V_ACT_MAX = 2688.0
"""LightX2V's global-scale numerator: E2M1 max (6) times E4M3 max (448)."""

LIGHTX2V_SCHEMES: Mapping[str, Scheme] = {
    "nvfp4": Scheme(
        "w4a4-nvfp4-lightx2v",
        "nvfp4",
        {"convention": "lightx2v"},
        act_format="nvfp4",
        act_options={"convention": "lightx2v"},
        k_multiple=16,
        static_act_scale=True,
        checkpoint="lightx2v",
        description="NVFP4 weights and activations as LightX2V quantizes them (convention lightx2v)",
    ),
    "mxfp4": SCHEMES["w4a4-mxfp4"],
    "mxfp6-mxfp8": Scheme(
        "w6a8-mxfp6",
        "mxfp6_e3m2",
        {"scale_rounding": "rceil"},
        act_format="mxfp8_e4m3",
        act_options={"scale_rounding": "rceil"},
        k_multiple=32,
        checkpoint="lightx2v",
        description="MXFP6 E3M2 weights, dynamic MXFP8 E4M3 activations (LightX2V's W6A8)",
    ),
    "mxfp8": SCHEMES["w8a8-mxfp8"],
}
"""LightX2V ``dit_quant_scheme`` names -> the lowbit scheme a module of that type loads as."""

# weight format -> (LightX2V name, activation format LightX2V pairs with it, block, packed columns per K)
_FORMATS = {
    "nvfp4": ("nvfp4", "nvfp4", 16, lambda k: k // 2),
    "mxfp4": ("mxfp4", "mxfp4", 32, lambda k: k // 2),
    "mxfp6_e3m2": ("mxfp6-mxfp8", "mxfp8_e4m3", 32, lambda k: 3 * k // 4),
    "mxfp8_e4m3": ("mxfp8", "mxfp8_e4m3", 32, lambda k: k),
}
_K_FROM_COLS = {"nvfp4": lambda c: 2 * c, "mxfp4": lambda c: 2 * c, "mxfp6-mxfp8": lambda c: 4 * c // 3,
                "mxfp8": lambda c: c}  # fmt: skip
_WEIGHT_FORMAT = {v[0]: k for k, v in _FORMATS.items()}
WEIGHT_FORMATS = tuple(_FORMATS)
"""The lowbit weight formats LightX2V's layout stores."""
QUANT_SCHEMES = tuple(LIGHTX2V_SCHEMES)


def check_quant_scheme(quant_scheme: object, name: str = "quant_scheme") -> str:
    if not isinstance(quant_scheme, str):
        raise TypeError(f"{name} must be a str, one of {QUANT_SCHEMES}, got {type(quant_scheme).__name__}")
    if quant_scheme not in LIGHTX2V_SCHEMES:
        raise ValueError(f"{name} must be one of LightX2V's {QUANT_SCHEMES}, got {quant_scheme!r}")
    return quant_scheme


def unsupported(scheme: Scheme, params: Mapping | None = None) -> str | None:
    """Why LightX2V's layout cannot store a layer of ``scheme`` (None if it can)."""
    entry = _FORMATS.get(scheme.weight_format)
    if entry is None:
        return (
            f"LightX2V stores nvfp4, mxfp4, mxfp6_e3m2 or mxfp8_e4m3 weights, not {scheme.weight_format}"
        )
    name, act, _, _ = entry
    if scheme.act_format != act:
        return (
            f"LightX2V's {name} layers quantize activations to {act}; scheme {scheme.name} uses "
            f"{scheme.act_format or '16-bit activations'}"
        )
    if params is not None and params.get("per_tensor_scale") is not None:
        return "the nvfp4 weight decodes with an exact divisor (torchao/ModelOpt), LightX2V decodes sf / S"
    return None


def quant_scheme_of(scheme: Scheme) -> str:
    """The LightX2V ``dit_quant_scheme`` name of a lowbit scheme (ValueError if it has none)."""
    why = unsupported(scheme)
    if why is not None:
        raise ValueError(f"scheme {scheme.name}: {why}")
    return _FORMATS[scheme.weight_format][0]


def _scalar(t: torch.Tensor) -> torch.Tensor:
    return t.detach().float().reshape(()).clone()


def to_lightx2v(q: QTensor, input_global_scale: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """The module-local LightX2V tensors (``weight``, ``weight_scale``, NVFP4's scalars) of a QTensor.

    Args:
        q: a 2-D nvfp4 / mxfp4 / mxfp6_e3m2 / mxfp8_e4m3 QTensor (linear scales are swizzled here).
        input_global_scale: NVFP4 only: the static activation multiplier; writes ``input_global_scale`` and
            ``alpha = 1 / (input_global_scale * weight_global_scale)`` in fp32 as LightX2V computes it.

    Returns:
        ``{"weight", "weight_scale"[, "weight_global_scale"[, "input_global_scale", "alpha"]]}``; scalars are
        0-d fp32 as LightX2V's converter writes them. Nothing of ``q`` is modified.
    """
    if not isinstance(q, QTensor):
        raise TypeError(f"q must be a lowbit QTensor, got {type(q).__name__}")
    if q.fmt not in _FORMATS:
        raise ValueError(f"q: LightX2V stores nvfp4, mxfp4, mxfp6_e3m2 or mxfp8_e4m3 weights, not {q.fmt}")
    if len(q.shape) != 2:
        raise ValueError(f"q: LightX2V stores 2-D Linear weights, got shape {list(q.shape)}")
    if q.params.get("per_tensor_scale") is not None:
        raise ValueError("q: an nvfp4 weight with an exact divisor (torchao/ModelOpt) does not decode as sf / S")
    n, k = q.shape
    _, _, block, _ = _FORMATS[q.fmt]
    scale = q.scale if q.scale_layout == "swizzled" else swizzle_scales(q.scale.reshape(n, k // block))
    out = {"weight": q.data.view(torch.uint8), "weight_scale": scale}
    if q.fmt == "nvfp4":
        wgs = _scalar(q.global_scale) if q.global_scale is not None else torch.tensor(1.0)
        out["weight_global_scale"] = wgs
        if input_global_scale is not None:
            igs = _scalar(input_global_scale)
            out["input_global_scale"] = igs
            out["alpha"] = 1.0 / (igs * wgs)
    elif input_global_scale is not None:
        raise ValueError(f"input_global_scale: {q.fmt} activations have no static scale in LightX2V")
    return out


def _weight_scale_from_alpha(alpha: torch.Tensor, igs: torch.Tensor, where: str) -> torch.Tensor:
    """The fp32 ``S`` nearest ``1 / (alpha * igs)`` with ``1 / (igs * S) == alpha`` exactly."""
    guess = 1.0 / (alpha * igs)
    cands = [guess]
    up, down = guess, guess
    for _ in range(4):
        up = torch.nextafter(up, torch.tensor(float("inf")))
        down = torch.nextafter(down, torch.tensor(0.0))
        cands += [up, down]
    for s in cands:
        if torch.equal(1.0 / (igs * s), alpha):
            return s
    raise ValueError(
        f"{where}: no weight_global_scale and no fp32 S with 1 / (input_global_scale * S) == alpha "
        f"(alpha {alpha.item()!r}, input_global_scale {igs.item()!r})"
    )


def _fp32_scalar(t: torch.Tensor, key: str, where: str) -> torch.Tensor:
    if not isinstance(t, torch.Tensor) or t.numel() != 1 or not t.is_floating_point():
        raise ValueError(f"{where}: {key} must be a floating-point scalar tensor, got {getattr(t, 'shape', t)!r}")
    s = t.detach().reshape(()).to(torch.float32)
    if not (torch.isfinite(s) and s > 0):
        raise ValueError(f"{where}: {key} must be finite and > 0, got {s.item()!r}")
    return s


def from_lightx2v(
    tensors: Mapping[str, torch.Tensor],
    quant_scheme: str,
    *,
    in_features: int | None = None,
    dtype: torch.dtype = torch.bfloat16,
    where: str = "module",
) -> tuple[QTensor, torch.Tensor | None]:
    """A QTensor (swizzled scales) and the static activation scale from module-local LightX2V tensors.

    Args:
        tensors: ``{"weight", "weight_scale", ...}`` of one module (see the module docstring).
        quant_scheme: LightX2V's name of the type: ``nvfp4``, ``mxfp4``, ``mxfp6-mxfp8`` or ``mxfp8``.
        in_features: checked against the K the packed weight implies, when given.
        dtype: the QTensor's logical dtype (what dequantize returns by default).
        where: names the module in errors.

    Returns:
        ``(QTensor, input_global_scale fp32 [1] or None)``. The tensors are not modified; the QTensor shares
        their storage.
    """
    quant_scheme = check_quant_scheme(quant_scheme)
    fmt = _WEIGHT_FORMAT[quant_scheme]
    _, _, block, _ = _FORMATS[fmt]
    for key in ("weight", "weight_scale"):
        if key not in tensors:
            raise ValueError(f"{where}: LightX2V {quant_scheme} needs {key!r}, got keys {sorted(tensors)}")
    w, s = tensors["weight"], tensors["weight_scale"]
    if w.dim() != 2 or w.dtype not in (torch.uint8, torch.float8_e4m3fn):
        raise ValueError(f"{where}: weight must be a 2-D uint8 tensor, got {w.dtype} {list(w.shape)}")
    n, cols = w.shape
    if quant_scheme == "mxfp6-mxfp8" and cols % 3:
        raise ValueError(f"{where}: an MXFP6 weight has 3 bytes per 4 elements; {cols} columns is not a multiple of 3")
    k = _K_FROM_COLS[quant_scheme](cols)
    if in_features is not None and k != in_features:
        raise ValueError(
            f"{where}: a {quant_scheme} weight of {list(w.shape)} bytes holds K={k}, the layer has in_features={in_features}"
        )
    if k % block:
        raise ValueError(f"{where}: K={k} is not a multiple of the {quant_scheme} block {block}")
    scale_dtype = torch.float8_e4m3fn if fmt == "nvfp4" else torch.float8_e8m0fnu
    if s.dtype == torch.uint8:
        s = s.view(scale_dtype)
    if s.dtype != scale_dtype:
        raise ValueError(f"{where}: weight_scale must be {scale_dtype} for {quant_scheme}, got {s.dtype}")
    want = swizzled_scale_shape(n, k // block)
    if tuple(s.shape) != want:
        raise ValueError(
            f"{where}: weight_scale must be 128x4-swizzled {list(want)} for weight {list(w.shape)}, got {list(s.shape)}"
        )
    data = w.view(torch.uint8)
    if fmt == "mxfp8_e4m3":
        data = data.view(torch.float8_e4m3fn)
    gs, igs = None, None
    if fmt == "nvfp4":
        if "input_absmax" in tensors:
            # LightX2V's loader: input_global_scale = (2688.0 / input_absmax).to(float32), in input_absmax's dtype
            absmax = tensors["input_absmax"]
            if not isinstance(absmax, torch.Tensor) or absmax.numel() != 1 or not absmax.is_floating_point():
                raise ValueError(f"{where}: input_absmax must be a floating-point scalar tensor")
            igs = _fp32_scalar((LIGHTX2V_ACT_MAX / absmax.detach()).to(torch.float32), "2688 / input_absmax", where)
        elif "input_global_scale" in tensors:
            igs = _fp32_scalar(tensors["input_global_scale"], "input_global_scale", where)
        if "weight_global_scale" in tensors:
            gs = _fp32_scalar(tensors["weight_global_scale"], "weight_global_scale", where)
            if "alpha" in tensors and igs is not None and "input_absmax" not in tensors:
                alpha = _fp32_scalar(tensors["alpha"], "alpha", where)
                if not torch.equal(1.0 / (igs * gs), alpha):
                    raise ValueError(
                        f"{where}: alpha {alpha.item()!r} is not 1 / (input_global_scale * weight_global_scale) = "
                        f"{(1.0 / (igs * gs)).item()!r}; lowbit would compute another output scale"
                    )
        elif "alpha" in tensors and igs is not None:
            gs = _weight_scale_from_alpha(_fp32_scalar(tensors["alpha"], "alpha", where), igs, where)
        else:
            raise ValueError(
                f"{where}: LightX2V nvfp4 needs weight_global_scale (or alpha with input_global_scale), got keys "
                f"{sorted(tensors)}"
            )
    elif any(key in tensors for key in ("weight_global_scale", "input_global_scale", "input_absmax")):
        raise ValueError(f"{where}: {quant_scheme} weights have no global or activation scale, got keys {sorted(tensors)}")
    scheme = LIGHTX2V_SCHEMES[quant_scheme]
    q = QTensor(
        data=data,
        scale=s,
        fmt=fmt,
        shape=torch.Size((n, k)),
        dtype=dtype,
        scale_layout="swizzled",
        params=dict(scheme.weight_options),
        global_scale=None if gs is None else gs.reshape(1),
    )
    return q, None if igs is None else igs.reshape(1)


def quantize_weight(w: torch.Tensor, quant_scheme: str) -> QTensor:
    """Quantize a Linear weight exactly as LightX2V's converter does (``tools/convert/quant``).

    The weight is cast to bfloat16 first; NVFP4 takes ``weight_global_scale = (2688.0 / max|w|)`` computed on
    the bf16 tensor (so rounded to bf16) and then cast to fp32, with LightX2V's element rule
    (``convention="lightx2v"``); MX formats use RCEIL scales. Scales are swizzled. ``w`` is not modified.
    """
    from ..compat import lightx2v as lx

    quant_scheme = check_quant_scheme(quant_scheme)
    if not isinstance(w, torch.Tensor) or w.dim() != 2 or not w.is_floating_point():
        raise ValueError(f"w must be a 2-D floating-point tensor, got {getattr(w, 'shape', type(w).__name__)}")
    dtype = w.dtype
    wb = w.detach().to(torch.bfloat16)
    n, k = wb.shape
    if quant_scheme == "nvfp4":
        gs = (LIGHTX2V_ACT_MAX / torch.max(torch.abs(wb))).to(torch.float32)
        data, scale = lx.scaled_nvfp4_quant(wb, gs)
        tensors = {"weight": data, "weight_scale": scale, "weight_global_scale": gs}
    else:
        fn = {"mxfp4": lx.scaled_mxfp4_quant, "mxfp6-mxfp8": lx.scaled_mxfp6_quant, "mxfp8": lx.scaled_mxfp8_quant}
        data, scale = fn[quant_scheme](wb)
        tensors = {"weight": data, "weight_scale": scale}
    q, _ = from_lightx2v(tensors, quant_scheme, in_features=k, dtype=dtype)
    return q


def lightx2v_config(quant_scheme: str, ignore: list[str]) -> dict:
    """The ``quantization_config`` lowbit writes beside LightX2V's keys (LightX2V itself reads none)."""
    return {
        "format": "lightx2v",
        "ignore": sorted(ignore),
        "lowbit_version": __version__,
        "quant_method": "lightx2v",
        "quant_scheme": check_quant_scheme(quant_scheme),
    }


def load_lightx2v_state_dict(
    model: nn.Module,
    state_dict: Mapping[str, torch.Tensor],
    quant_scheme: str,
    *,
    strict: bool = True,
) -> nn.Module:
    """Load a LightX2V state dict into ``model``: each ``nn.Linear`` whose ``<name>.weight_scale`` is in the
    state dict becomes a :class:`QuantLinear` of ``LIGHTX2V_SCHEMES[quant_scheme]``; the other tensors load as
    usual (``strict`` as ``load_state_dict``). ``state_dict`` is not modified. Returns ``model``."""
    from ..nn.quantize import linear_layers

    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if not isinstance(state_dict, Mapping):
        raise TypeError(f"state_dict must be a mapping of name -> tensor, got {type(state_dict).__name__}")
    quant_scheme = check_quant_scheme(quant_scheme)
    scheme = LIGHTX2V_SCHEMES[quant_scheme]
    consumed: set[str] = set()
    modules = dict(model.named_modules())
    for name, lin in linear_layers(model).items():
        if f"{name}.weight_scale" not in state_dict:
            continue
        pre = f"{name}."
        local = {k[len(pre):]: v for k, v in state_dict.items() if k.startswith(pre) and "." not in k[len(pre):]}
        bias = local.pop("bias", None)
        q, igs = from_lightx2v(local, quant_scheme, in_features=lin.in_features, where=f"module {name!r}")
        if q.shape[0] != lin.out_features:
            raise ValueError(
                f"module {name!r}: the LightX2V weight has {q.shape[0]} rows, the layer out_features={lin.out_features}"
            )
        ql = QuantLinear(
            lin.in_features, lin.out_features, bias is not None, scheme=scheme, weight=q, bias_tensor=bias,
            input_global_scale=igs,
        )
        parent, _, child = name.rpartition(".")
        setattr(modules[parent] if parent else model, child, ql)
        consumed.update(pre + k for k in (*local, *(["bias"] if bias is not None else [])))
    if not consumed:
        raise ValueError(f"state_dict: no '<linear>.weight_scale' key matches a Linear layer of the model ({quant_scheme})")
    rest = {k: v for k, v in state_dict.items() if k not in consumed}
    missing, unexpected = model.load_state_dict(rest, strict=False)
    own = {n for n, m in model.named_modules() if isinstance(m, QuantLinear)}
    missing = [k for k in missing if k.rpartition(".")[0] not in own]
    if strict and (missing or unexpected):
        raise ValueError(f"state_dict: missing keys {missing[:8]}, unexpected keys {unexpected[:8]}")
    return model


__all__ = [
    "LIGHTX2V_SCHEMES",
    "QUANT_SCHEMES",
    "from_lightx2v",
    "lightx2v_config",
    "load_lightx2v_state_dict",
    "quant_scheme_of",
    "quantize_weight",
    "to_lightx2v",
    "unsupported",
]
