"""Calibration over denoising timesteps: :class:`DenoisingCalibration` runs a diffusion transformer along one
flow-matching trajectory (its own Euler steps, or a diffusers scheduler's), so the statistics calibration
collects see the activations of every noise level."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from ...nn.quantize import model_device, to_device

def prediction(out: Any) -> torch.Tensor:
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
        device = model_device(model)
        kwargs = {k: to_device(v, device) for k, v in self.inputs.items()}
        latents = kwargs.pop(self.latents_key).clone()
        batch = latents.shape[0]
        steps = self._schedule(device)
        self.timesteps_run = []
        if self.scheduler is not None and hasattr(self.scheduler, "init_noise_sigma"):
            latents = latents * self.scheduler.init_noise_sigma
        for i, t in enumerate(steps):
            tt = torch.full((batch,), t, device=device)
            pred = prediction(model(**{self.latents_key: latents, self.timestep_key: tt, **kwargs}))
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
