"""What saving, loading, converting and inspecting quantized checkpoints share: the layout a model's
QuantLinear layers are written in (:func:`choose_layout`), a checkpoint's ``quantization_config`` and dtype, the
transformers model skeleton a checkpoint is read into and the alignment of its keys with the checkpoint's.

``save_quantized`` lives in :mod:`lowbit.io.save`, ``load_quantized`` in :mod:`lowbit.io.load`,
``inspect_checkpoint`` in :mod:`lowbit.io.inspection`; see ``docs/models.md``.
"""

from __future__ import annotations

import contextlib
import importlib
import warnings
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..nn.modules import QuantLinear
from .files import CONFIG_NAME, TensorSource, read_json
from .layouts import FORMAT_ALIASES, LAYOUTS, NAME_DTYPES, Layout

FORMATS = ("auto", *LAYOUTS)
"""``save_quantized(format=...)`` values (aliases: ``ct``, ``bnb``, ``deepseek``, ``native``, ``autoawq``)."""


def require_transformers():
    """Import transformers or raise ImportError saying what needs it."""
    try:
        return importlib.import_module("transformers")
    except ImportError as e:
        raise ImportError(
            "lowbit model loading/conversion needs transformers (pip install transformers); "
            f"import failed: {e}"
        ) from None


def _resolve_layout(format: str) -> str:
    if not isinstance(format, str):
        raise TypeError(f"format must be a str, got {type(format).__name__}")
    name = FORMAT_ALIASES.get(format.lower(), format.lower())
    if name != "auto" and name not in LAYOUTS:
        raise ValueError(
            f"format must be one of {FORMATS} (or an alias {sorted(FORMAT_ALIASES)}), got {format!r}"
        )
    return name


def choose_layout(mods: Mapping[str, QuantLinear], format: str = "auto") -> Layout:
    """The layout ``save_quantized`` uses for these modules (ValueError if ``format`` cannot store them all)."""
    from ..algorithms.rotation import input_transform_of

    name = _resolve_layout(format)
    online = [n for n, m in mods.items() if input_transform_of(m) is not None]
    if name == "auto":
        wanted = {m.scheme.checkpoint for m in mods.values()}
        # only the native layout stores an online input transform (no ecosystem format has one)
        name = wanted.pop() if len(wanted) == 1 and not online else "lowbit"
    if online and name != "lowbit":
        raise ValueError(
            f"format {name!r} cannot store the online input transforms of {len(online)} layer(s) (first: "
            f"{online[0]!r}: smoothing scales or a Hadamard rotation applied to the input at run time, "
            "lowbit.algorithms); format='lowbit' (or 'auto') stores them"
        )
    layout = LAYOUTS[name]
    bad = [
        f"{n} ({m.scheme.name}): {why}" for n, m in mods.items() if (why := layout.unsupported(m)) is not None
    ]
    if bad:
        raise ValueError(f"format {name!r} cannot store {len(bad)} layer(s): " + "; ".join(bad[:8]))
    return layout


@contextlib.contextmanager
def empty_weights() -> Iterator[None]:
    """Create parameters on the meta device (buffers stay real), like accelerate's ``init_empty_weights``."""
    original = nn.Module.register_parameter

    def register(module, name, param):
        original(module, name, param)
        if param is not None and param.device.type != "meta":
            p = module._parameters[name]
            module._parameters[name] = nn.Parameter(p.to("meta"), requires_grad=p.requires_grad)

    nn.Module.register_parameter = register
    try:
        yield
    finally:
        nn.Module.register_parameter = original


def build_skeleton(
    model_dir: str | Path, model_class: Any = None, trust_remote_code: bool = False, *, meta: bool = False
) -> nn.Module:
    """The transformers model of ``model_dir/config.json`` with its parameters on the meta device.

    The class is ``model_class`` if given, else ``config.architectures[0]`` from transformers, else ``AutoModel``.
    ``meta=True`` builds every tensor, buffers included, on the meta device: nothing is allocated whatever
    dimensions config.json claims (``empty_weights`` alone still runs each parameter's ``torch.empty`` on the
    CPU before moving it, 65 GB for one 128000-wide Linear). Such a model only says names and shapes.
    """
    transformers = require_transformers()
    model_dir = Path(model_dir)
    try:
        config = transformers.AutoConfig.from_pretrained(str(model_dir), trust_remote_code=trust_remote_code)
    except (ValueError, KeyError, OSError) as e:
        raise ValueError(
            f"{model_dir / CONFIG_NAME}: transformers cannot build a config from it: {e}"
        ) from None
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    cls = model_class
    if cls is None:
        for arch in getattr(config, "architectures", None) or ():
            cls = getattr(transformers, arch, None)
            if cls is not None:
                break
    device_ctx = torch.device("meta") if meta else contextlib.nullcontext()
    with device_ctx, empty_weights(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if cls is None:
            model = transformers.AutoModel.from_config(config, trust_remote_code=trust_remote_code)
        elif hasattr(cls, "_from_config"):
            model = cls._from_config(config)
        else:
            model = cls(config)
    return model


def check_skeleton_shapes(
    model: nn.Module, source: TensorSource, keymap: Mapping[str, str], skip: Callable[[str], bool] | None = None
) -> None:
    """ValueError naming the file and tensor whose safetensors header shape differs from the config's model.

    Meant for a ``build_skeleton(meta=True)`` model, so a config.json whose dimensions do not match the
    checkpoint fails from the headers alone, before anything real is allocated. ``skip(model key)`` leaves
    out tensors stored in another shape (quantized Linear weights).
    """
    state = model.state_dict(keep_vars=True)
    for ck, mk in keymap.items():
        if mk not in state or (skip is not None and skip(mk)):
            continue
        want, shape = list(state[mk].shape), source.shape(ck)
        if want != shape:
            raise ValueError(
                f"{source.files[ck]}: tensor {ck!r} has shape {shape} but config.json's model expects {want} "
                "(checkpoint and config.json do not match)"
            )


def quant_config(model_dir: Path, cfg: dict) -> dict:
    qc = cfg.get("quantization_config")
    if qc is None and (model_dir / "hf_quant_config.json").is_file():
        hf = read_json(model_dir / "hf_quant_config.json", "ModelOpt hf_quant_config.json")
        qc = {"quant_method": "modelopt", **(hf.get("quantization") or {})}
    if qc is None:
        raise ValueError(
            f"{model_dir / CONFIG_NAME}: no quantization_config (and no hf_quant_config.json): not a quantized "
            "checkpoint; quantize it with lowbit.convert_checkpoint or lowbit.quantize_model first"
        )
    if not isinstance(qc, dict):
        raise ValueError(f"{model_dir / CONFIG_NAME}: quantization_config must be a JSON object")  # noqa: TRY004
    if str(qc.get("quant_method", "")).lower() == "modelopt" and "quant_algo" not in qc:
        quant = qc.get("quantization")
        if isinstance(quant, dict):
            qc = {"quant_method": "modelopt", **quant}
    return qc


def checkpoint_dtype(cfg: dict) -> torch.dtype | None:
    name = cfg.get("dtype", cfg.get("torch_dtype"))
    return NAME_DTYPES.get(str(name).removeprefix("torch.")) if name is not None else None


def parse_device(device: str | torch.device) -> torch.device:
    """``torch.device(device)`` with a ValueError naming the argument (torch raises a bare RuntimeError)."""
    if isinstance(device, torch.device):
        return device
    if not isinstance(device, (str, int)) or isinstance(device, bool):
        raise TypeError(f"device must be a str or torch.device, got {type(device).__name__}")
    try:
        return torch.device(device)
    except (RuntimeError, ValueError) as e:
        raise ValueError(f"device must name a torch device such as 'cpu' or 'cuda:0', got {device!r} ({e})") from None


def align_prefix(keys: list[str], model: nn.Module) -> dict[str, str]:
    """Map checkpoint keys to model keys, adding or removing the base-model prefix when only that differs."""
    model_keys = set(model.state_dict())
    ident = {k: k for k in keys}
    if any(k in model_keys for k in keys):
        return ident
    prefix = getattr(model, "base_model_prefix", "")
    if prefix:
        stripped = {k: k[len(prefix) + 1 :] for k in keys if k.startswith(prefix + ".")}
        if stripped and any(v in model_keys for v in stripped.values()):
            return {k: stripped.get(k, k) for k in keys}
        added = {k: f"{prefix}.{k}" for k in keys}
        if any(v in model_keys for v in added.values()):
            return added
    return ident


__all__ = [
    "FORMATS",
    "align_prefix",
    "build_skeleton",
    "check_skeleton_shapes",
    "checkpoint_dtype",
    "choose_layout",
    "empty_weights",
    "parse_device",
    "quant_config",
    "require_transformers",
]
