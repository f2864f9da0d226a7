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

from .calibration import DenoisingCalibration
from .checkpoints import load_transformer, save_transformer
from .error import compare_schemes, denoise_step_error, output_error
from .quantize import (
    DIT_SKIP,
    TRANSFORMER_COMPONENTS,
    quantize_pipeline,
    quantize_transformer,
    transformer_components,
)

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
