"""What quantization lost in one denoising step: the error of a quantized transformer's prediction against the
float one's (cosine, SQNR, max absolute error), for one scheme or several."""

from __future__ import annotations

import copy
import math
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import nn

from ...nn.quantize import model_device, to_device
from ...nn.schemes import Scheme, get_scheme
from .calibration import prediction
from .quantize import DIT_SKIP, quantize_transformer

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
            dev = model_device(m)
            outs.append(prediction(m(**{k: to_device(v, dev) for k, v in inputs.items()})))
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
