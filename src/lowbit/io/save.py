"""``save_quantized``: a quantized model as safetensors + ``config.json`` with a ``quantization_config``.

The tensors are in the layout the ecosystem reads (compressed-tensors, bitsandbytes, AutoAWQ, GPTQ,
DeepSeek/HF FP8, ModelOpt) or, for schemes no ecosystem format covers, lowbit's native layout. Writes are
atomic: everything goes to a hidden sibling directory that is fsynced and renamed into place, so a crash never
leaves a half checkpoint at ``out_dir``. See ``docs/models.md``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

import torch
from torch import nn

from ..nn.modules import BUFFER_NAMES, QuantLinear
from ..nn.quantize import linear_layers
from .checkpoint import choose_layout
from .files import (
    CONFIG_NAME,
    atomic_dir,
    check_out_dir,
    copy_extra_files,
    dedupe_shared,
    parse_size,
    write_json,
    write_sharded,
)
from .layouts import DTYPE_NAMES, Layout


def model_dtype(model: nn.Module) -> torch.dtype | None:
    for p in model.parameters():
        if p.is_floating_point():
            return p.dtype
    return None


def _config_dict(model: nn.Module) -> dict:
    cfg = getattr(model, "config", None)
    if cfg is not None and hasattr(cfg, "to_json_string"):
        data = json.loads(cfg.to_json_string(use_diff=False))
        data["architectures"] = [type(model).__name__]
        return data
    return {}


def quantized_state_dict(model: nn.Module, layout: Layout) -> tuple[dict[str, torch.Tensor], list[str]]:
    """The model's state dict with every QuantLinear written in ``layout``; also the names of the Linear layers
    left unquantized (the ``ignore`` list)."""
    mods = {n: m for n, m in model.named_modules() if isinstance(m, QuantLinear)}
    own = {f"{n}.{b}" for n in mods for b in (*BUFFER_NAMES, "input_global_scale")}
    out: dict[str, torch.Tensor] = {}
    done: set[str] = set()
    for key, t in model.state_dict().items():
        prefix = key.rpartition(".")[0]
        if prefix in mods and prefix not in done:
            done.add(prefix)
            out.update({f"{prefix}.{k}": v for k, v in layout.export(mods[prefix]).items()})
        if key in own:
            continue
        out[key] = t
    ignore = sorted(linear_layers(model))
    return out, ignore


def checkpoint_tensors(
    model: nn.Module, mods: Mapping[str, QuantLinear], format: str, max_shard_size: int | str
) -> tuple[Layout, dict[str, torch.Tensor], list[str]]:
    """The layout a checkpoint of ``model`` is written in, its tensors (shared ones once) and the Linear layers
    left unquantized, for ``save_quantized`` and the savers of other directory layouts (diffusers'). ``mods``
    are the model's QuantLinear layers by name.

    Everything that makes the model unsavable raises ValueError here, before anything is written:
    fused projections (``lowbit.nn.fuse_projections``), tensor-parallel shards, a float layer with an online
    input transform, a ``format`` that cannot store a layer's scheme or a QuantLinear's online input transform
    (only ``"lowbit"`` does), a bad ``max_shard_size``, tensors on the meta device.
    """
    from ..nn.fuse import refuse_fused

    refuse_fused(model, "model")
    shards = [n for n, m in mods.items() if getattr(m, "tp", None) is not None]
    if shards:
        # a rank's shard is a part of each weight: written as a checkpoint it would load as a wrong model
        raise ValueError(
            f"model: {len(shards)} layer(s) are tensor-parallel shards (first: {shards[0]!r}, "
            "lowbit.parallel); save the model before parallelizing it (every rank holds only its part)"
        )
    from ..algorithms.rotation import online_transform_layers

    online = [n for n in online_transform_layers(model) if n not in mods]
    if online:
        # the native layout stores a QuantLinear's transform with its weight; a float layer's has no place
        raise ValueError(
            f"model: {len(online)} layer(s) that are not QuantLinear transform their input online (first: "
            f"{online[0]!r}, lowbit.algorithms); no checkpoint format stores that transform on a float layer"
        )
    layout = choose_layout(mods, format)
    parse_size(max_shard_size)  # a bad size fails here, before anything is written
    tensors, ignore = quantized_state_dict(model, layout)
    tensors, _tied = dedupe_shared(tensors)
    meta = [k for k, t in tensors.items() if t.is_meta]
    if meta:
        # a model quantized on the meta device is a shape-only skeleton: refused before anything is written
        raise ValueError(
            f"model: {len(meta)} tensor(s) are on the meta device and hold no data to save (first: {meta[0]!r}); "
            "load real weights into the model first (model.to_empty(...) then load_state_dict)"
        )
    return layout, tensors, ignore


def save_quantized(
    model: nn.Module,
    out_dir: str | Path,
    *,
    format: str = "auto",
    source_dir: str | Path | None = None,
    max_shard_size: int | str = "5GB",
    overwrite: bool = False,
) -> Path:
    """Write a quantized model (one that went through :func:`lowbit.quantize_model`) as a checkpoint directory.

    Args:
        model: a model holding :class:`QuantLinear` layers (transformers models get their config written).
        out_dir: the directory to create. It must not exist unless ``overwrite``.
        format: ``"auto"`` (each scheme's ecosystem format, see ``lowbit.SCHEMES[...].checkpoint``; mixed schemes
            and models with online input transforms go to ``"lowbit"``), ``"compressed-tensors"``, ``"bitsandbytes"``, ``"awq"``, ``"gptq"``, ``"fp8"``
            (DeepSeek/HF), ``"modelopt"`` or ``"lowbit"`` (native).
        source_dir: a model directory whose non-weight files (tokenizer, generation config, sentence-transformers
            modules, README) are copied alongside; ``out_dir`` must lie outside it and must not contain it.
        max_shard_size: shard the safetensors above this size (``"5GB"``, ``"500MB"``, ``"2GiB"`` or a positive
            int of bytes; anything else is a ValueError).
        overwrite: replace an existing ``out_dir`` (atomically: the old one is removed after the new one is in place).

    Returns:
        ``Path(out_dir)``.

    Raises:
        ValueError: no QuantLinear in the model, a tensor-parallel shard (``lowbit.parallel``), ``format``
            cannot store a layer's scheme, or a layer transforms its input online (``lowbit.algorithms``:
            online smoothing, rotations) and ``format`` is not ``"lowbit"``/``"auto"``, or the layer is not a
            QuantLinear.
        FileExistsError: ``out_dir`` exists and ``overwrite`` is False.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    mods = {n: m for n, m in model.named_modules() if isinstance(m, QuantLinear)}
    if not mods:
        raise ValueError(
            "save_quantized: the model has no QuantLinear layer (run lowbit.quantize_model first)"
        )
    layout, tensors, ignore = checkpoint_tensors(model, mods, format, max_shard_size)
    dtype = model_dtype(model)
    config = _config_dict(model)
    config["quantization_config"] = layout.config(mods, ignore, dtype)
    if dtype is not None and config:
        config["dtype"] = DTYPE_NAMES.get(dtype, str(dtype).removeprefix("torch."))
    out_dir = Path(out_dir)
    if source_dir is not None:
        check_out_dir(out_dir, Path(source_dir))
    with atomic_dir(out_dir, overwrite=overwrite) as tmp:
        write_sharded(tensors, tmp, max_shard_size)
        write_json(tmp / CONFIG_NAME, config)
        for name, data in layout.extra_files(mods, ignore).items():
            write_json(tmp / name, data)
        if source_dir is not None:
            copy_extra_files(Path(source_dir), tmp)
    return out_dir


__all__ = ["checkpoint_tensors", "model_dtype", "quantized_state_dict", "save_quantized"]
