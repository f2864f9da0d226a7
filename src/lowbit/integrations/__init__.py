"""Integrations with other libraries' models. Each submodule imports its library only when called.

- :mod:`lowbit.integrations.diffusers`: diffusers transformers (Wan, Flux, SD3, ...) and pipelines:
  quantization, calibration over denoising timesteps, checkpoints in diffusers' directory layout and the
  error of a quantized denoising step.
"""
