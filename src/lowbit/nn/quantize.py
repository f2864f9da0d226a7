"""``quantize_model``: swap a model's ``nn.Linear`` layers for ``QuantLinear`` in place, with calibration."""

from __future__ import annotations

import contextlib
import fnmatch
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from ..formats.blockscaled import finite_amax, nvfp4_default_global_scale
from .modules import QuantLinear
from .schemes import Scheme, get_scheme

DEFAULT_SKIP = ("lm_head", "*.lm_head")
"""Module-name patterns (fnmatch) left in full precision unless ``skip=`` says otherwise."""
FUSED_GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"), ("query", "key", "value"))
"""Sibling projections that serving engines fuse into one GEMM; NVFP4 weights of the siblings present under
one parent share one global scale (llm-compressor's ``update_fused_layer_weight_global_scales``)."""


def skip_patterns(skip: str | Iterable[str] | None) -> tuple[str, ...]:
    if skip is None:
        return ()
    if isinstance(skip, str):
        return (skip,)
    if not isinstance(skip, Iterable):
        raise TypeError(
            f"skip must be None, a module-name pattern (str) or an iterable of patterns, got {type(skip).__name__}"
        )
    out = tuple(skip)
    bad = [p for p in out if not isinstance(p, str)]
    if bad:
        raise TypeError(f"skip must hold module-name patterns (str), got {bad[:3]}")
    return out


def is_skipped(name: str, patterns: Iterable[str]) -> bool:
    """True if the module name matches one of the fnmatch patterns."""
    return any(fnmatch.fnmatchcase(name, p) for p in patterns)


def linear_layers(model: nn.Module) -> dict[str, nn.Linear]:
    """The ``nn.Linear`` modules ``quantize_model`` may replace, by qualified name (not yet quantized ones;
    ``nn.MultiheadAttention.out_proj`` is left out: MultiheadAttention reads its weight directly)."""
    out: dict[str, nn.Linear] = {}
    for parent_name, parent in model.named_modules():
        if isinstance(parent, nn.MultiheadAttention):
            continue
        for child_name, child in parent.named_children():
            if isinstance(child, nn.Linear):
                out[f"{parent_name}.{child_name}" if parent_name else child_name] = child
    return out


def fused_groups(names: Iterable[str]) -> list[tuple[str, ...]]:
    """Groups of sibling module names (same parent, names from :data:`FUSED_GROUPS`), two or more each."""
    present = set(names)
    parents = {n.rpartition(".")[0] for n in present}
    groups = []
    for parent in sorted(parents):
        prefix = f"{parent}." if parent else ""
        for members in FUSED_GROUPS:
            found = tuple(prefix + m for m in members if prefix + m in present)
            if len(found) >= 2:
                groups.append(found)
    return groups


def _check_calibration(calibration: Any) -> None:
    # a str is iterable, but its characters are not model inputs: refused here, not deep inside the model
    if calibration is None or isinstance(calibration, (torch.Tensor, Mapping)):
        return
    if isinstance(calibration, nn.Module):
        # a module is callable, but passing one (the model itself, a pipeline component) is a mix-up, not a
        # function that drives the model
        raise TypeError(
            "calibration must be model inputs or a function of the model, got a module "
            f"({type(calibration).__name__})"
        )
    if callable(calibration):
        return
    if isinstance(calibration, (str, bytes)) or not isinstance(calibration, Iterable):
        raise TypeError(
            "calibration must be None, a tensor, a dict or an iterable of batches (dicts, tuples or tensors), "
            f"or a callable taking the model, got {type(calibration).__name__}"
        )


def _batches(calibration: Iterable[Any]):
    if isinstance(calibration, (torch.Tensor, Mapping)):
        yield calibration
        return
    yield from calibration


def to_device(obj: Any, device: torch.device) -> Any:
    """``obj`` with every tensor in it (through dicts, lists and tuples) moved to ``device``."""
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if isinstance(obj, Mapping):
        return {k: to_device(v, device) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(to_device(v, device) for v in obj)
    return obj


def model_device(model: nn.Module) -> torch.device:
    """The device of the model's first parameter (else first buffer; CPU for a model holding neither)."""
    for t in model.parameters():
        return t.device
    for t in model.buffers():
        return t.device
    return torch.device("cpu")


def _run_callable(model: nn.Module, calibration: Any) -> int:
    calls = [0]

    def count(module, args, kwargs):
        calls[0] += 1

    handle = model.register_forward_pre_hook(count, with_kwargs=True)
    was_training = model.training
    model.eval()
    try:
        calibration(model)
    finally:
        handle.remove()
        model.train(was_training)
    if calls[0] == 0:
        # hooks on the model's layers saw nothing: the callable ran some other module (a copy of the model, a
        # pipeline whose transformer is another object)
        raise ValueError(
            f"calibration: the callable never ran the model ({type(model).__name__}); it must call the model "
            "it is given, or a pipeline holding that same object"
        )
    return calls[0]


class StopForward(Exception):
    """Raised by a calibration hook once a pass has recorded everything it needs of the current batch:
    :func:`run_calibration` ends that batch's forward there and goes on with the next batch."""


@torch.no_grad()
def run_calibration(model: nn.Module, calibration: Iterable[Any]) -> int:
    """Run ``model`` (in eval mode, no grad) on every batch; returns the number of batches.

    A batch that is a dict runs ``model(**batch)``, a tuple/list ``model(*batch)``, anything else ``model(batch)``;
    tensors are moved to the model's device. A callable ``calibration`` is called as ``calibration(model)``
    and drives the model itself (a denoising loop over several timesteps, a whole pipeline call); the count
    is then the number of forward calls of ``model`` it made, and ValueError if it made none. A
    :class:`StopForward` raised during a batch's forward ends that batch (hooks that stop early are only
    installed for iterable calibrations: a callable's own loop could not go on).
    """
    _check_calibration(calibration)
    if callable(calibration):
        return _run_callable(model, calibration)
    device = model_device(model)
    was_training = model.training
    model.eval()
    n = 0
    try:
        for batch in _batches(calibration):
            batch = to_device(batch, device)
            try:
                if isinstance(batch, Mapping):
                    model(**batch)
                elif isinstance(batch, (tuple, list)):
                    model(*batch)
                else:
                    model(batch)
            except StopForward:
                pass
            n += 1
    finally:
        model.train(was_training)
    if n == 0:
        raise ValueError("calibration is empty: pass an iterable of model inputs (dicts, tuples or tensors)")
    return n


@torch.no_grad()
def calibrate_absmax(
    model: nn.Module, layers: Mapping[str, nn.Module], calibration: Iterable[Any]
) -> dict[str, torch.Tensor]:
    """Run ``model`` on every calibration batch (see :func:`run_calibration`) and return each layer's input
    absmax (fp32 scalar over the finite values). Layers that never ran are missing from the result."""
    absmax: dict[str, torch.Tensor] = {}

    def record(name: str, x: torch.Tensor) -> None:
        a = finite_amax(x).float()
        absmax[name] = a if name not in absmax else torch.maximum(absmax[name], a)

    with recording_inputs(layers, record):
        run_calibration(model, calibration)
    return absmax


@contextlib.contextmanager
def recording_inputs(
    layers: Mapping[str, nn.Module], record: Callable[[str, torch.Tensor], None]
) -> Iterator[None]:
    """While open, every call of a module of ``layers`` first hands its name and its first positional input to
    ``record`` (forward pre-hooks, removed on exit): how calibration sees each layer's inputs."""

    def hook(name):
        def fn(module, args):
            record(name, args[0])

        return fn

    handles = [m.register_forward_pre_hook(hook(n)) for n, m in layers.items()]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def activation_global_scale(absmax: torch.Tensor) -> torch.Tensor:
    """Static NVFP4 activation multiplier ``2688 / absmax`` in fp32 (LightX2V's rule; 1.0 for absmax 0),
    shape ``[1]``."""
    return nvfp4_default_global_scale(absmax.float().reshape(1)).reshape(1)


def _targets(model: nn.Module, scheme: Scheme, patterns: tuple[str, ...], caller: str) -> dict[str, nn.Linear]:
    """The Linear layers ``scheme`` quantizes (not skipped, shape supported); one warning lists the others."""
    layers = linear_layers(model)
    targets: dict[str, nn.Linear] = {}
    unsupported: list[str] = []
    for name, lin in layers.items():
        if is_skipped(name, patterns):
            continue
        why = scheme.unsupported(lin.out_features, lin.in_features)
        if why is not None:
            unsupported.append(f"{name} [{lin.out_features}, {lin.in_features}]: {why}")
            continue
        targets[name] = lin
    if not targets:
        detail = f"; unsupported shapes: {'; '.join(unsupported)}" if unsupported else ""
        raise ValueError(
            f"{caller}: no nn.Linear layer can take scheme {scheme.name} "
            f"({len(layers)} Linear layers, skip={list(patterns)}){detail}"
        )
    warn_layers(f"lowbit.{caller}", f"left unquantized, their shapes do not fit {scheme.name}", unsupported,
                stacklevel=3)
    return targets


def warn_layers(prefix: str, what: str, layers: Sequence[str], stacklevel: int) -> None:
    """One warning about several layers, ``"<prefix>: <n> layer(s) <what>: <layer>; <layer>; ..."`` (none when
    ``layers`` is empty); ``stacklevel`` counts from the caller, as ``warnings.warn``'s does."""
    if layers:
        warnings.warn(f"{prefix}: {len(layers)} layer(s) {what}: " + "; ".join(layers),
                      stacklevel=stacklevel + 1)


def _apply_transforms(model: nn.Module, targets: Mapping[str, nn.Linear], scheme: Scheme, plan: Any,
                      calibration: Any) -> None:
    """Smoothing, then rotation, of ``targets`` (the float function of ``model`` stays the same)."""
    if not plan.transforms:
        return
    if any(lin.weight.is_meta for lin in targets.values()):
        raise ValueError(
            f"algorithm {plan.name!r} needs a model with real weights; this model is on the meta device"
        )
    if plan.smooth is not None:
        from ..algorithms.smoothing import apply_smoothing

        apply_smoothing(model, targets, scheme, lambda: run_calibration(model, calibration), plan.smooth)
    if plan.rotate is not None:
        from ..algorithms.rotation import apply_rotation

        apply_rotation(model, targets, scheme, plan.rotate)


def transform_model(
    model: nn.Module,
    scheme: str | Scheme,
    *,
    algorithm: Any,
    skip: str | Iterable[str] | None = DEFAULT_SKIP,
    calibration: Iterable[Any] | None = None,
) -> nn.Module:
    """Only the input transforms of ``algorithm`` (smoothing, rotation), in place: what :func:`quantize_model`
    does to the float model before rounding, for the same ``scheme``, ``skip`` and ``calibration``. The
    model computes the same function (up to float rounding); ``quantize_model(model, scheme,
    algorithm=<the rest>)`` then quantizes it, keeping the online transforms. Weight rounding entries of
    ``algorithm`` (``"gptq"``, ``"rtn"``) are accepted and ignored here.

    Useful to compare each quantized layer with a float layer that reads the same (transformed) input.
    """
    scheme = get_scheme(scheme)
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    patterns = skip_patterns(skip)
    _check_calibration(calibration)
    from ..algorithms.pipeline import resolve

    plan = resolve(algorithm, None, calibration)
    plan.check_scheme(scheme)
    _apply_transforms(model, _targets(model, scheme, patterns, "transform_model"), scheme, plan, calibration)
    return model


def quantize_model(
    model: nn.Module,
    scheme: str | Scheme,
    *,
    skip: str | Iterable[str] | None = DEFAULT_SKIP,
    calibration: Iterable[Any] | None = None,
    awq: bool | None = None,
    backend: str | None = None,
    algorithm: str | Any = "rtn",
) -> nn.Module:
    """Replace the model's ``nn.Linear`` layers by :class:`QuantLinear` in place and return the model.

    Args:
        model: any ``nn.Module`` (e.g. a transformers model); layers are quantized on their own device.
        scheme: a name from ``lowbit.SCHEMES`` (``"w4a16-nvfp4"``, ...) or a :class:`Scheme`.
        skip: fnmatch patterns of module names to keep in full precision (default :data:`DEFAULT_SKIP`:
            ``lm_head``); None or ``()`` quantizes every Linear.
        calibration: optional iterable of model inputs (dicts -> ``model(**batch)``, tuples -> ``model(*batch)``,
            tensors -> ``model(t)``), or a callable run as ``calibration(model)`` that drives the model itself
            (several denoising timesteps, a whole pipeline call: see
            :class:`lowbit.integrations.diffusers.DenoisingCalibration`). For NVFP4 activations
            (``w4a4-nvfp4``) each layer's input absmax over all batches gives a static activation global scale
            ``2688 / absmax`` (LightX2V's rule; ``alpha = 1 / (gs_in * gs_w)`` follows in the GEMM). Without
            calibration activations are scaled dynamically per tensor. For ``w4a16-int4`` the data drives the
            AWQ scale search (``awq``). Other schemes have no static activation scales and ignore it.
        awq: ``w4a16-int4`` only: search AWQ activation-aware scales on the calibration data and fold them into
            the preceding norms/projections before rounding (:mod:`lowbit.nn.awq_search`; this modifies those float
            weights of ``model``). None (default): on when calibration data is given; False: round-to-nearest.
        backend: lowbit backend for quantization and for the layers' forward.
        algorithm: how weights are rounded: ``"rtn"`` (default, round-to-nearest), ``"gptq"`` or a
            :class:`lowbit.algorithms.GPTQ` with its options (Hessian error compensation on the calibration
            data, for nvfp4, mxfp4, fp4_b32, nf4, bnb_fp4 and int4_awq weights; needs ``calibration``;
            AWQ then runs only with ``awq=True``), or ``"awq"`` (``awq=True``). For schemes that quantize
            activations, ``"smoothquant"`` / :class:`lowbit.algorithms.SmoothQuant` (needs ``calibration``)
            and ``"rotate"`` / :class:`lowbit.algorithms.Rotate` transform the layers' inputs first; combine
            them with a weight rounding as a tuple (``("smoothquant", "gptq")``) or ``"smoothquant+gptq"``
            (:mod:`lowbit.algorithms.pipeline`). Smoothing folded into norms and projections changes only
            float weights of ``model``; online transforms (``SmoothQuant(online=True)`` for inputs with no
            foldable producer, rotations not folded) stay as an ``input_transform`` child of the quantized
            layer, cost time on every call and are not stored by :func:`lowbit.save_quantized`.

    Fused projections (q/k/v, gate/up, BERT query/key/value under one parent) share one NVFP4 weight global
    scale ``2688 / max(amax)``, as llm-compressor writes them for vLLM's fused layers.

    Layers whose shape the scheme cannot take are left as they are, with one warning listing them.

    A model on the meta device is quantized shape-only: its ``QuantLinear`` buffers are meta tensors of the
    shapes and dtypes real weights would have (a skeleton to ``to_empty`` and ``load_state_dict`` into).
    Calibration needs real weights and is refused for it.

    Raises:
        ValueError: unknown scheme, no layer could be quantized, calibration of a meta model, or an
            ``algorithm`` that does not fit (unknown name, smoothing/GPTQ without calibration, smoothing or
            rotation with a weight-only scheme).
        TypeError: ``skip``, ``calibration``, ``awq`` or ``algorithm`` of the wrong type (a str is not
            calibration data).
    """
    scheme = get_scheme(scheme)
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    patterns = skip_patterns(skip)
    _check_calibration(calibration)
    if awq is not None and not isinstance(awq, bool):
        raise TypeError(f"awq must be None, True or False, got {type(awq).__name__}")
    from ..algorithms.pipeline import resolve

    plan = resolve(algorithm, awq, calibration)
    plan.check_scheme(scheme)
    algorithm, awq = plan.gptq, plan.awq
    targets = _targets(model, scheme, patterns, "quantize_model")

    if calibration is not None and any(lin.weight.is_meta for lin in targets.values()):
        # a meta model has no weights to run: it can be quantized shape-only, but not calibrated
        raise ValueError(
            "calibration needs a model with real weights; this model is on the meta device (quantize it "
            "without calibration to build a shape-only skeleton, then load quantized weights)"
        )
    _apply_transforms(model, targets, scheme, plan, calibration)
    if awq and (calibration is None or scheme.weight_format != "int4_awq"):
        raise ValueError("awq=True needs scheme w4a16-int4 (int4_awq weights) and calibration data")
    if calibration is not None and scheme.weight_format == "int4_awq" and awq is not False:
        from .awq_search import apply_awq

        apply_awq(model, targets, scheme.group_size, lambda: run_calibration(model, calibration))

    input_scales: dict[str, torch.Tensor] = {}
    if calibration is not None and scheme.static_act_scale:
        for name, a in calibrate_absmax(model, targets, calibration).items():
            input_scales[name] = activation_global_scale(a)

    global_scales: dict[str, torch.Tensor] = {}
    if scheme.shared_global_scale:
        for group in fused_groups(targets):
            weights = [targets[n].weight.detach() for n in group]
            # gathered on the CPU, or on meta for a shape-only (meta) model, which has no values to read
            where = "meta" if any(w.is_meta for w in weights) else "cpu"
            amax = torch.stack([finite_amax(w).float().to(where) for w in weights])
            g = nvfp4_default_global_scale(amax)
            for n in group:
                global_scales[n] = g.to(targets[n].weight.device)

    if algorithm is not None:
        from ..algorithms.gptq import apply_gptq_scheme

        apply_gptq_scheme(model, targets, scheme, lambda: run_calibration(model, calibration), algorithm,
                          global_scales, input_scales, backend,
                          calibrate_on=lambda m: run_calibration(m, calibration),
                          stop_early=not callable(calibration))
        return model
    from ..algorithms.rotation import carry_input_transform

    modules = dict(model.named_modules())
    for name, lin in targets.items():
        parent_name, _, child = name.rpartition(".")
        parent = modules[parent_name] if parent_name else model
        q = QuantLinear.from_linear(
            lin,
            scheme,
            global_scale=global_scales.get(name),
            input_global_scale=input_scales.get(name),
            backend=backend,
        )
        setattr(parent, child, carry_input_transform(lin, q))
    return model


__all__ = [
    "DEFAULT_SKIP",
    "FUSED_GROUPS",
    "StopForward",
    "activation_global_scale",
    "calibrate_absmax",
    "fused_groups",
    "is_skipped",
    "linear_layers",
    "quantize_model",
    "run_calibration",
    "transform_model",
]
