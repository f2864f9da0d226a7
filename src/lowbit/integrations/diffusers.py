"""lowbit for diffusers: quantize a diffusion transformer or a pipeline's transformers, calibrate over
denoising timesteps, save in diffusers' directory layout, load back, and measure what one denoising step lost.

```python
import lowbit
from lowbit.integrations import diffusers as lbd

pipe = WanPipeline.from_pretrained(...)                              # any pipeline with .transformer
lbd.quantize_pipeline(pipe, "w4a16-nvfp4")                           # pipe.transformer (and transformer_2)
lbd.quantize_pipeline(pipe, "w4a4-nvfp4",                            # static NVFP4 activation scales from
                      calibration=lambda p: p(prompt="a cat", num_inference_steps=8))   # a whole pipeline run
lbd.save_transformer(pipe.transformer, "wan-nf4/transformer")        # config.json + diffusion_pytorch_model
model = lbd.load_transformer("wan-nf4/transformer", device="cuda")   # any layout lowbit writes
```

Checkpoints: :func:`save_transformer` writes ``config.json`` (the diffusers model config with ``_class_name``
and a ``quantization_config``) and ``diffusion_pytorch_model.safetensors`` (or shards and their index), the
file names ``ModelMixin.from_pretrained`` reads. Each scheme's tensors are in the layout
``lowbit.save_quantized`` writes for it. diffusers itself loads one of them: bitsandbytes NF4/FP4
(``w4a16-nf4``, ``w4a16-bnb-fp4``), through ``from_pretrained``, which needs a CUDA device, ``bitsandbytes``
and ``accelerate``. diffusers has no quantizer for compressed-tensors, DeepSeek FP8 or lowbit's native layout
(its ``modelopt`` quantizer restores ModelOpt's own training state, not exported NVFP4 tensors), so those load
with :func:`load_transformer` (``lowbit.load_quantized`` into the diffusers class named by the config).

Calibration: ``quantize_model``'s ``calibration=`` takes a callable ``calibration(model)`` that drives the
model itself; :class:`DenoisingCalibration` is one that runs the transformer over several timesteps of a
flow-matching trajectory (its own Euler steps, or a diffusers scheduler's), so the activation absmax behind
``w4a4-nvfp4``'s static ``input_global_scale`` and the AWQ search of ``w4a16-int4`` see the activations of
every noise level, not of one.
"""

from __future__ import annotations

import copy
import importlib
import json
import math
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..nn.modules import QuantLinear
from ..nn.quantize import quantize_model
from ..nn.schemes import Scheme, get_scheme

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

WEIGHTS_NAME = "diffusion_pytorch_model.safetensors"
WEIGHTS_INDEX_NAME = "diffusion_pytorch_model.safetensors.index.json"


def require_diffusers():
    """Import diffusers or raise ImportError saying what needs it."""
    try:
        return importlib.import_module("diffusers")
    except ImportError as e:
        raise ImportError(
            f"lowbit.integrations.diffusers needs diffusers (pip install diffusers); import failed: {e}"
        ) from None


# ---------------------------------------------------------------------------------------------- quantize


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


# ---------------------------------------------------------------------------------------------- calibration


def _sample(out: Any) -> torch.Tensor:
    """The prediction tensor of a diffusers model output (``return_dict`` either way)."""
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, (tuple, list)) and out and isinstance(out[0], torch.Tensor):
        return out[0]
    sample = getattr(out, "sample", None)
    if isinstance(sample, torch.Tensor):
        return sample
    raise TypeError(
        f"the model returned {type(out).__name__}, not a tensor, a tuple or an output with .sample"
    )


def _to(obj: Any, device: torch.device) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    return obj


def _device(model: nn.Module) -> torch.device:
    for t in model.parameters():
        return t.device
    for t in model.buffers():
        return t.device
    return torch.device("cpu")


class DenoisingCalibration:
    """A calibration callable (``quantize_model(..., calibration=DenoisingCalibration(...))``) that runs a
    diffusion transformer over ``num_steps`` timesteps of one denoising trajectory.

    At each step the transformer gets ``inputs`` with the current latents under ``latents_key`` and the
    step's timestep under ``timestep_key`` (a 1-D tensor, one value per batch row); its prediction moves the
    latents to the next step: with ``scheduler`` (a diffusers scheduler: ``set_timesteps(num_steps)`` then
    ``step(pred, t, latents).prev_sample``), or else by the flow-matching Euler step
    ``latents += (sigma_next - sigma) * pred`` with ``sigma = t / num_train_timesteps`` from 1 down to 0
    (Wan, Flux and SD3 are flow-matching models). ``update_latents=False`` keeps the given latents at every
    timestep (random latents at several noise levels, no trajectory).

    Args:
        inputs: the transformer's keyword inputs (``hidden_states``, ``encoder_hidden_states``, ...;
            tensors are moved to the model's device). Latents at the first (noisiest) step.
        num_steps: timesteps to run (>= 1).
        timesteps: explicit timesteps (numbers in ``[0, num_train_timesteps]``, noisiest first) instead of
            ``num_steps`` evenly spaced ones; not with ``scheduler``.
        scheduler: a diffusers scheduler that chooses the timesteps and steps the latents.
        latents_key, timestep_key: the keyword names of the latents and the timestep.
        num_train_timesteps: the timestep of sigma 1 (1000 for Wan, Flux, SD3).
        update_latents: step the latents between timesteps (default) or keep them.

    Attributes:
        timesteps_run: the timesteps of the last call, in order.
    """

    def __init__(
        self,
        inputs: Mapping[str, Any],
        *,
        num_steps: int = 4,
        timesteps: Sequence[float] | None = None,
        scheduler: Any = None,
        latents_key: str = "hidden_states",
        timestep_key: str = "timestep",
        num_train_timesteps: int = 1000,
        update_latents: bool = True,
    ) -> None:
        if not isinstance(inputs, Mapping):
            raise TypeError(
                f"inputs must be a dict of the transformer's keyword inputs, got {type(inputs).__name__}"
            )
        if not isinstance(inputs.get(latents_key), torch.Tensor):
            raise ValueError(f"inputs must hold the latents as a tensor under latents_key={latents_key!r}")
        if timestep_key in inputs:
            raise ValueError(f"inputs must not hold {timestep_key!r}: DenoisingCalibration sets the timestep")
        if isinstance(num_steps, bool) or not isinstance(num_steps, int) or num_steps < 1:
            raise ValueError(f"num_steps must be an int >= 1, got {num_steps!r}")
        n_train = num_train_timesteps
        if isinstance(n_train, bool) or not isinstance(n_train, int) or n_train < 1:
            raise ValueError(f"num_train_timesteps must be an int >= 1, got {num_train_timesteps!r}")
        if timesteps is not None:
            if scheduler is not None:
                raise ValueError("pass timesteps or scheduler, not both (a scheduler chooses its timesteps)")
            ts = [float(t) for t in timesteps]
            if not ts or any(not math.isfinite(t) or t < 0 or t > num_train_timesteps for t in ts):
                raise ValueError(
                    f"timesteps must be a non-empty sequence of numbers in [0, {num_train_timesteps}], "
                    f"got {timesteps!r}"
                )
            timesteps = ts
        if scheduler is not None and not (hasattr(scheduler, "set_timesteps") and hasattr(scheduler, "step")):
            raise TypeError(
                "scheduler must be a diffusers scheduler (set_timesteps, step), "
                f"got {type(scheduler).__name__}"
            )
        self.inputs = dict(inputs)
        self.num_steps = num_steps
        self.timesteps = timesteps
        self.scheduler = scheduler
        self.latents_key = latents_key
        self.timestep_key = timestep_key
        self.num_train_timesteps = num_train_timesteps
        self.update_latents = bool(update_latents)
        self.timesteps_run: list[float] = []

    def _schedule(self, device: torch.device) -> list[float]:
        if self.scheduler is not None:
            self.scheduler.set_timesteps(self.num_steps, device=device)
            return [float(t) for t in self.scheduler.timesteps]
        if self.timesteps is not None:
            return list(self.timesteps)
        n = self.num_train_timesteps
        # sigma from 1 down to 1/num_steps: the last step's prediction lands on sigma 0
        return [n * (1 - i / self.num_steps) for i in range(self.num_steps)]

    @torch.no_grad()
    def __call__(self, model: nn.Module) -> torch.Tensor:
        """Run the trajectory on ``model``; returns the final latents."""
        device = _device(model)
        kwargs = {k: _to(v, device) for k, v in self.inputs.items()}
        latents = kwargs.pop(self.latents_key).clone()
        batch = latents.shape[0]
        steps = self._schedule(device)
        self.timesteps_run = []
        if self.scheduler is not None and hasattr(self.scheduler, "init_noise_sigma"):
            latents = latents * self.scheduler.init_noise_sigma
        for i, t in enumerate(steps):
            tt = torch.full((batch,), t, device=device)
            pred = _sample(model(**{self.latents_key: latents, self.timestep_key: tt, **kwargs}))
            self.timesteps_run.append(t)
            if not self.update_latents:
                continue
            if self.scheduler is not None:
                t_sched = self.scheduler.timesteps[i]
                latents = self.scheduler.step(pred, t_sched, latents, return_dict=False)[0]
            else:
                sigma = t / self.num_train_timesteps
                sigma_next = steps[i + 1] / self.num_train_timesteps if i + 1 < len(steps) else 0.0
                latents = (latents.float() + (sigma_next - sigma) * pred.float()).to(latents.dtype)
        return latents


# ---------------------------------------------------------------------------------------------- error


def output_error(reference: torch.Tensor, output: torch.Tensor) -> dict[str, float]:
    """Cosine similarity, SQNR (dB: ``10 log10(|ref|^2 / |out - ref|^2)``, inf when equal) and max absolute
    error of ``output`` against ``reference``, in fp32 over all elements."""
    if not isinstance(reference, torch.Tensor) or not isinstance(output, torch.Tensor):
        raise TypeError("reference and output must be tensors")
    if reference.shape != output.shape:
        raise ValueError(
            f"reference and output shapes differ: {list(reference.shape)} vs {list(output.shape)}"
        )
    r = reference.detach().float().flatten()
    o = output.detach().float().flatten().to(r.device)
    err = (o - r).pow(2).sum()
    sig = r.pow(2).sum()
    cos = torch.nn.functional.cosine_similarity(o, r, dim=0)
    sqnr = math.inf if float(err) == 0 else float(10 * torch.log10(sig / err))
    return {"cosine": float(cos), "sqnr_db": sqnr, "max_abs_err": float((o - r).abs().max())}


@torch.no_grad()
def denoise_step_error(
    reference: nn.Module, quantized: nn.Module, inputs: Mapping[str, Any]
) -> dict[str, float]:
    """The error of one denoising step: ``quantized(**inputs)`` against ``reference(**inputs)`` (the
    prediction, e.g. the flow velocity), as :func:`output_error` gives it. Both run in eval mode without
    gradients."""
    if not isinstance(reference, nn.Module) or not isinstance(quantized, nn.Module):
        raise TypeError("reference and quantized must be nn.Modules (diffusion transformers)")
    if not isinstance(inputs, Mapping):
        raise TypeError(
            f"inputs must be a dict of the transformer's keyword inputs, got {type(inputs).__name__}"
        )
    outs = []
    for m in (reference, quantized):
        was = m.training
        m.eval()
        try:
            dev = _device(m)
            outs.append(_sample(m(**{k: _to(v, dev) for k, v in inputs.items()})))
        finally:
            m.train(was)
    return output_error(outs[0], outs[1])


def compare_schemes(
    transformer: nn.Module,
    schemes: Iterable[str | Scheme],
    inputs: Mapping[str, Any],
    *,
    skip: str | Iterable[str] | None = DIT_SKIP,
    calibration: Any = None,
    backend: str | None = None,
) -> dict[str, dict[str, float]]:
    """``{scheme: denoise_step_error}`` of copies of ``transformer`` quantized with each scheme (the given
    model is left as it is), on the same ``inputs``. ``calibration`` is given to every scheme (only
    ``w4a4-nvfp4`` and ``w4a16-int4`` use it)."""
    out: dict[str, dict[str, float]] = {}
    for s in schemes:
        scheme = get_scheme(s)
        q = quantize_transformer(
            copy.deepcopy(transformer), scheme, skip=skip, calibration=calibration, backend=backend
        )
        out[scheme.name] = denoise_step_error(transformer, q, inputs)
    return out


# ---------------------------------------------------------------------------------------------- checkpoints


def _diffusers_config(model: nn.Module) -> dict:
    to_json = getattr(model, "to_json_string", None)
    if not callable(to_json) or getattr(model, "config", None) is None:
        raise TypeError(
            f"model must be a diffusers model (a ModelMixin with a config), got {type(model).__name__}"
        )
    cfg = json.loads(to_json())
    cfg.pop("quantization_config", None)
    return cfg


def save_transformer(
    model: nn.Module,
    out_dir: str | Path,
    *,
    format: str = "auto",
    max_shard_size: int | str = "5GB",
    overwrite: bool = False,
) -> Path:
    """Write a quantized diffusers model in diffusers' directory layout.

    ``config.json`` is the model's diffusers config (``_class_name``, ``_diffusers_version``, its arguments)
    plus a ``quantization_config``; the tensors go to ``diffusion_pytorch_model.safetensors`` (or
    ``diffusion_pytorch_model-0000i-of-0000n.safetensors`` and
    ``diffusion_pytorch_model.safetensors.index.json`` above ``max_shard_size``). ``format`` chooses the
    tensor layout as in ``lowbit.save_quantized`` (``"auto"``: each scheme's ecosystem layout). The write is
    atomic, as ``save_quantized``'s.

    Which reader takes the result: ``w4a16-nf4`` / ``w4a16-bnb-fp4`` (bitsandbytes layout) load with
    diffusers' own ``<ModelClass>.from_pretrained(out_dir)`` on a CUDA device with bitsandbytes and
    accelerate, into bitsandbytes' ``Linear4bit``; every layout loads with :func:`load_transformer`.

    Raises:
        TypeError: ``model`` is not a diffusers model.
        ValueError: no ``QuantLinear`` in the model, a layout that cannot store its schemes, meta tensors.
        FileExistsError: ``out_dir`` exists and ``overwrite`` is False.
    """
    from ..io.files import atomic_dir, dedupe_shared, parse_size, write_json, write_sharded
    from ..io.checkpoint import choose_layout, model_dtype, quantized_state_dict

    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    config = _diffusers_config(model)
    mods = {n: m for n, m in model.named_modules() if isinstance(m, QuantLinear)}
    if not mods:
        raise ValueError("save_transformer: the model has no QuantLinear layer (quantize it first)")
    layout = choose_layout(mods, format)
    parse_size(max_shard_size)
    tensors, ignore = quantized_state_dict(model, layout)
    tensors, _ = dedupe_shared(tensors)
    meta = [k for k, t in tensors.items() if t.is_meta]
    if meta:
        raise ValueError(
            f"model: {len(meta)} tensor(s) are on the meta device and hold no data to save "
            f"(first: {meta[0]!r})"
        )
    config["quantization_config"] = layout.config(mods, ignore, model_dtype(model))
    out_dir = Path(out_dir)
    with atomic_dir(out_dir, overwrite=overwrite) as tmp:
        write_sharded(tensors, tmp, max_shard_size)
        _rename_to_diffusers(tmp)
        write_json(tmp / "config.json", config)
        for name, data in layout.extra_files(mods, ignore).items():
            write_json(tmp / name, data)
    return out_dir


def _rename_to_diffusers(tmp: Path) -> None:
    """lowbit's ``model*.safetensors`` names to diffusers' ``diffusion_pytorch_model*`` (index included)."""
    from ..io.files import INDEX_FILE, SINGLE_FILE, write_json

    single = tmp / SINGLE_FILE
    if single.is_file():
        single.rename(tmp / WEIGHTS_NAME)
        return
    index_path = tmp / INDEX_FILE
    index = json.loads(index_path.read_text())
    renamed = {}
    for shard in sorted(set(index["weight_map"].values())):
        new = "diffusion_pytorch_model" + shard.removeprefix("model")
        (tmp / shard).rename(tmp / new)
        renamed[shard] = new
    index["weight_map"] = {k: renamed[v] for k, v in index["weight_map"].items()}
    index_path.unlink()
    write_json(tmp / WEIGHTS_INDEX_NAME, index)


def load_transformer(
    path: str | Path,
    *,
    device: str | torch.device = "cpu",
    dtype: torch.dtype | None = None,
    model_class: Any = None,
) -> nn.Module:
    """Load a quantized diffusers-layout checkpoint (:func:`save_transformer`'s, or any diffusers model
    directory whose ``config.json`` has a ``quantization_config`` lowbit reads) into the diffusers model class
    its config names, with :class:`~lowbit.nn.QuantLinear` layers.

    Args:
        path: the model directory (``config.json`` + ``diffusion_pytorch_model*.safetensors``).
        device: where the tensors are loaded.
        dtype: cast the non-quantized floating tensors to this dtype (None keeps the checkpoint's).
        model_class: the diffusers class (default: ``config.json``'s ``_class_name`` from diffusers).

    Raises:
        FileNotFoundError: no directory or config.json.
        ValueError: a config without ``_class_name`` (and no ``model_class``), a class diffusers does not
            have, or what ``lowbit.load_quantized`` raises for the tensors.
    """
    from ..io.files import read_json
    from ..io.checkpoint import empty_weights, load_quantized

    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"{path}: checkpoint directory not found")
    cfg = read_json(path / "config.json", "diffusers model config")
    if model_class is None:
        name = cfg.get("_class_name")
        if not isinstance(name, str):
            raise ValueError(
                f"{path / 'config.json'}: no _class_name, so this is not a diffusers model config; "
                "pass model_class"
            )
        model_class = getattr(require_diffusers(), name, None)
        if model_class is None:
            raise ValueError(
                f"{path / 'config.json'}: _class_name {name!r} is not a class of the installed diffusers"
            )
    init = {k: v for k, v in cfg.items() if k != "quantization_config"}
    with empty_weights():
        skeleton = model_class.from_config(init)
    return load_quantized(path, model=skeleton, device=device, dtype=dtype)


__all__ = [
    "DIT_SKIP",
    "TRANSFORMER_COMPONENTS",
    "DenoisingCalibration",
    "compare_schemes",
    "denoise_step_error",
    "load_transformer",
    "output_error",
    "quantize_pipeline",
    "quantize_transformer",
    "save_transformer",
    "transformer_components",
]
