"""Quantizing a diffusion transformer, or the transformers of a diffusers pipeline, with a diffusion
transformer's defaults (:data:`DIT_SKIP`)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from torch import nn

from ...nn.quantize import quantize_model
from ...nn.schemes import Scheme, get_scheme
from .calibration import DenoisingCalibration

DIT_SKIP = (
    "proj_out",
    "norm_out.*",
    "condition_embedder.*",
    "time_text_embed.*",
    "time_embed.*",
    "time_embedding.*",
    "context_embedder",
    "x_embedder",
    "pos_embed.*",
    "caption_projection.*",
    "adaln_single.*",
)
"""Module-name patterns (fnmatch) a diffusion transformer keeps in full precision by default: the input and
output projections and the timestep/text embedders (Wan ``condition_embedder``, Flux/SD3 ``time_text_embed``,
``context_embedder``, ``x_embedder``, ``norm_out``, ``proj_out``). They run once per step on few rows, hold a
small share of the weights, and their errors reach every block (LightX2V quantizes the blocks only)."""

TRANSFORMER_COMPONENTS = ("transformer", "transformer_2")
"""Pipeline attributes holding denoising transformers (Wan 2.2 has a second one for the low-noise steps)."""


def quantize_transformer(
    transformer: nn.Module,
    scheme: str | Scheme,
    *,
    skip: str | Iterable[str] | None = DIT_SKIP,
    calibration: Any = None,
    awq: bool | None = None,
    backend: str | None = None,
) -> nn.Module:
    """``lowbit.quantize_model`` with a diffusion transformer's defaults: the blocks' Linear layers are
    quantized, the embedders and the output projection (:data:`DIT_SKIP`) are not.

    ``calibration`` is what ``quantize_model`` takes: model inputs, or a callable of the model such as a
    :class:`DenoisingCalibration`. Returns ``transformer`` (changed in place).
    """
    return quantize_model(transformer, scheme, skip=skip, calibration=calibration, awq=awq, backend=backend)


def transformer_components(pipe: Any) -> list[str]:
    """Names of the pipeline's denoising transformers (those of :data:`TRANSFORMER_COMPONENTS` present)."""
    return [n for n in TRANSFORMER_COMPONENTS if isinstance(getattr(pipe, n, None), nn.Module)]


def quantize_pipeline(
    pipe: Any,
    scheme: str | Scheme,
    *,
    components: str | Sequence[str] | None = None,
    skip: str | Iterable[str] | None = DIT_SKIP,
    calibration: Any = None,
    awq: bool | None = None,
    backend: str | None = None,
) -> Any:
    """Quantize a diffusers pipeline's transformer(s) in place and return the pipeline.

    Args:
        pipe: a diffusers pipeline, or any object whose ``transformer`` attribute is an ``nn.Module``.
        scheme: a name from ``lowbit.SCHEMES`` or a :class:`~lowbit.nn.Scheme`.
        components: the attributes to quantize (default: ``transformer`` and, where present,
            ``transformer_2``). The text encoder and the VAE are left alone.
        skip: module-name patterns kept in full precision (default :data:`DIT_SKIP`).
        calibration: None; a :class:`DenoisingCalibration` (run on each component); model inputs as
            ``quantize_model`` takes them (given to each component); or any other callable, run as
            ``calibration(pipe)``: a pipeline call, whose every transformer step is seen, for each component
            in turn (the components quantized before it are already quantized then).
        awq, backend: as ``lowbit.quantize_model``.

    Raises:
        TypeError: ``pipe`` has no transformer, or a component is not an ``nn.Module``.
        ValueError: an unknown scheme or component name, or a calibration callable that never runs a
            component it is calibrating.
    """
    scheme = get_scheme(scheme)
    if components is None:
        names = transformer_components(pipe)
        if not names:
            raise TypeError(
                f"pipe must have a 'transformer' attribute holding an nn.Module (a diffusers pipeline), got "
                f"{type(pipe).__name__}"
            )
    else:
        names = [components] if isinstance(components, str) else list(components)
        if not names or not all(isinstance(n, str) for n in names):
            raise TypeError(f"components must be a non-empty str or sequence of str, got {components!r}")
        for n in names:
            if not hasattr(pipe, n):
                raise ValueError(f"components: {type(pipe).__name__} has no attribute {n!r}")
            if not isinstance(getattr(pipe, n), nn.Module):
                raise TypeError(
                    f"components: {type(pipe).__name__}.{n} is {type(getattr(pipe, n)).__name__}, "
                    "not an nn.Module"
                )
    if (
        callable(calibration)
        and not isinstance(calibration, (nn.Module, DenoisingCalibration))
    ):
        user = calibration

        def calibration(model, _user=user):  # the pipeline runs the model; the hooks sit on its layers
            return _user(pipe)

    for n in names:
        quantize_transformer(
            getattr(pipe, n), scheme, skip=skip, calibration=calibration, awq=awq, backend=backend
        )
    return pipe
