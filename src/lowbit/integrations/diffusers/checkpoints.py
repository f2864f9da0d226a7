"""Quantized diffusers models in diffusers' directory layout: ``config.json`` (the diffusers config with a
``quantization_config``) and ``diffusion_pytorch_model*.safetensors``, written and read back."""

from __future__ import annotations

import importlib
import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ...nn.modules import QuantLinear

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
        ValueError: no ``QuantLinear`` in the model, or one ``lowbit.save_quantized`` refuses (a layout that
            cannot store its schemes, meta tensors, online input transforms, tensor-parallel shards).
        FileExistsError: ``out_dir`` exists and ``overwrite`` is False.
    """
    from ...io.files import atomic_dir, write_json, write_sharded
    from ...io.save import checkpoint_tensors, model_dtype

    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    config = _diffusers_config(model)
    mods = {n: m for n, m in model.named_modules() if isinstance(m, QuantLinear)}
    if not mods:
        raise ValueError("save_transformer: the model has no QuantLinear layer (quantize it first)")
    layout, tensors, ignore = checkpoint_tensors(model, mods, format, max_shard_size)
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
    from ...io.files import INDEX_FILE, SINGLE_FILE, write_json

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
    from ...io.files import read_json
    from ...io.checkpoint import empty_weights
    from ...io.load import load_quantized

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
