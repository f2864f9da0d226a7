"""Quantized model checkpoints: ``save_quantized`` and ``load_quantized``.

``save_quantized`` writes safetensors + ``config.json`` with a ``quantization_config`` in the format the
ecosystem reads (compressed-tensors, bitsandbytes, AutoAWQ, GPTQ, DeepSeek/HF FP8, ModelOpt) or, for schemes
no ecosystem format covers, lowbit's native layout. Writes are atomic: everything goes to a hidden sibling
directory that is fsynced and renamed into place, so a crash never leaves a half checkpoint at ``out_dir``.

``load_quantized`` reads those formats, whoever wrote them (lowbit, llm-compressor, ModelOpt, bitsandbytes via
transformers, AutoAWQ, GPTQ, DeepSeek), into a transformers model whose quantized Linear layers are
:class:`~lowbit.nn.QuantLinear`. Only safetensors is read, never pickle. See ``docs/models.md``.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import warnings
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..nn.modules import BUFFER_NAMES, QuantLinear
from ..nn.quantize import linear_layers
from .files import (
    CONFIG_NAME,
    TensorSource,
    atomic_dir,
    check_out_dir,
    copy_extra_files,
    dedupe_shared,
    parse_size,
    read_json,
    write_json,
    write_sharded,
)
from .layouts import DTYPE_NAMES, FORMAT_ALIASES, LAYOUTS, NAME_DTYPES, Layout, layout_for_config

FORMATS = ("auto", *LAYOUTS)
"""``save_quantized(format=...)`` values (aliases: ``ct``, ``bnb``, ``deepseek``, ``native``, ``autoawq``)."""
_QUANT_SUFFIXES = ("weight_packed", "weight_scale", "weight_global_scale", "qweight", "qzeros", "weight_scale_inv",
                   "weight_scale_2", "weight_data", "absmax", "quant_state")  # fmt: skip


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
    name = _resolve_layout(format)
    if name == "auto":
        wanted = {m.scheme.checkpoint for m in mods.values()}
        name = wanted.pop() if len(wanted) == 1 else "lowbit"
    layout = LAYOUTS[name]
    bad = [
        f"{n} ({m.scheme.name}): {why}" for n, m in mods.items() if (why := layout.unsupported(m)) is not None
    ]
    if bad:
        raise ValueError(f"format {name!r} cannot store {len(bad)} layer(s): " + "; ".join(bad[:8]))
    return layout


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
            go to ``"lowbit"``), ``"compressed-tensors"``, ``"bitsandbytes"``, ``"awq"``, ``"gptq"``, ``"fp8"``
            (DeepSeek/HF), ``"modelopt"`` or ``"lowbit"`` (native).
        source_dir: a model directory whose non-weight files (tokenizer, generation config, sentence-transformers
            modules, README) are copied alongside; ``out_dir`` must lie outside it and must not contain it.
        max_shard_size: shard the safetensors above this size (``"5GB"``, ``"500MB"``, ``"2GiB"`` or a positive
            int of bytes; anything else is a ValueError).
        overwrite: replace an existing ``out_dir`` (atomically: the old one is removed after the new one is in place).

    Returns:
        ``Path(out_dir)``.

    Raises:
        ValueError: no QuantLinear in the model, a layer with an online input transform (no format stores
            one), a tensor-parallel shard (``lowbit.parallel``), or ``format`` cannot store a layer's scheme.
        FileExistsError: ``out_dir`` exists and ``overwrite`` is False.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    mods = {n: m for n, m in model.named_modules() if isinstance(m, QuantLinear)}
    if not mods:
        raise ValueError(
            "save_quantized: the model has no QuantLinear layer (run lowbit.quantize_model first)"
        )
    shards = [n for n, m in mods.items() if getattr(m, "tp", None) is not None]
    if shards:
        # a rank's shard is a part of each weight: written as a checkpoint it would load as a wrong model
        raise ValueError(
            f"model: {len(shards)} layer(s) are tensor-parallel shards (first: {shards[0]!r}, "
            "lowbit.parallel); save the model before parallelizing it (every rank holds only its part)"
        )
    from ..algorithms.rotation import online_transform_layers

    online = online_transform_layers(model)
    if online:
        # the weights of such a layer are only right together with its transform of the input
        raise ValueError(
            f"model: {len(online)} layer(s) transform their input online (first: {online[0]!r}: smoothing "
            "with online scales or a Hadamard rotation, lowbit.algorithms); no checkpoint format stores that "
            "transform, so it cannot be saved; use it in memory, or quantize with algorithms that fold "
            "everything into the weights (SmoothQuant(online=False))"
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


# ---------------------------------------------------------------------------------------------- loading


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


_MAX_PARAMS_PER_CHECKPOINT_BYTE = 16
"""A quantized checkpoint holds at least 4 bits per weight, so config.json's model in fp32 is at most 8 times
its size; beyond twice that the config cannot describe this checkpoint."""


def _check_model_size(model: nn.Module, source: TensorSource, where: Path) -> None:
    """ValueError when the config's model (meta) is far larger than the checkpoint's tensors could fill, before
    ``build_skeleton(meta=False)`` asks the allocator for it."""
    want = sum(p.numel() * p.element_size() for p in model.parameters())
    have = sum(f.stat().st_size for f in set(source.files.values()))
    if want > _MAX_PARAMS_PER_CHECKPOINT_BYTE * have + 2**30:
        raise ValueError(
            f"{where / CONFIG_NAME}: its model has {want / 1e9:.1f} GB of parameters but the checkpoint's "
            f"safetensors hold {have / 1e6:.1f} MB (checkpoint and config.json do not match)"
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


def _device_str(device: str | torch.device) -> str:
    d = parse_device(device)
    if d.type == "cuda" and d.index is None:
        d = torch.device("cuda", torch.cuda.current_device())
    return str(d)


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


def load_quantized(
    path: str | Path,
    *,
    device: str | torch.device = "cpu",
    dtype: torch.dtype | None = None,
    model: nn.Module | None = None,
    model_class: Any = None,
    trust_remote_code: bool = False,
    device_mesh: Any = None,
    tp_plan: Mapping[str, Any] | None = None,
) -> nn.Module:
    """Load a quantized checkpoint into a model whose quantized Linear layers are :class:`QuantLinear`.

    Reads ``quantization_config`` (``config.json``; ModelOpt's ``hf_quant_config.json`` too) written by lowbit,
    llm-compressor / compressed-tensors (nvfp4-pack-quantized, mxfp4-pack-quantized, mxfp8-quantized,
    pack-quantized int4, float-quantized 128x128 FP8), ModelOpt NVFP4, bitsandbytes NF4 (transformers),
    AutoAWQ GEMM, GPTQ v1/v2 (no act-order) and DeepSeek/HF block FP8.

    With a ``device_mesh`` the model is loaded tensor-parallel (each rank of the mesh calls this): every quantized
    Linear the plan names as column- or row-parallel is read as this rank's shard only, with safetensors slice
    reads of each stored tensor (:mod:`lowbit.io.sharded`), and becomes a
    :class:`~lowbit.parallel.ColwiseQuantLinear` / :class:`~lowbit.parallel.RowwiseQuantLinear`; the plan's other
    layers (dense Linear, embeddings) get torch's styles after loading, and everything else is loaded whole
    (replicated). The result equals ``lowbit.parallel.parallelize(load_quantized(path, ...), device_mesh,
    tp_plan)`` tensor for tensor, without a whole quantized weight ever in memory; the layouts and directions
    that fall back to reading one module whole (row-parallel nf4 / bnb_fp4) are listed in ``docs/models.md``.

    Args:
        path: the checkpoint directory (``config.json`` + ``model.safetensors`` or an index and its shards).
        device: where tensors are loaded (directly, shard by shard).
        dtype: cast the non-quantized floating tensors (embeddings, norms, biases) to this dtype; None keeps
            the checkpoint's dtypes.
        model: load into this module instead of building one from the config (its Linear layers are replaced;
            parameters may be on the meta device). Required for a checkpoint that ``save_quantized`` wrote from a
            plain ``nn.Module`` (its config.json has no ``model_type``): pass a fresh instance of that module.
        model_class: the transformers class to build (default: ``config.architectures[0]``, else AutoModel).
        trust_remote_code: passed to transformers for custom architectures.
        device_mesh: a 1-D ``torch.distributed`` DeviceMesh to load tensor-parallel over (None: one process).
        tp_plan: ``{module pattern: style}`` as :func:`lowbit.parallel.parallelize` takes it (plan strings
            ``"colwise"``, ``"rowwise"``, ``"colwise_gather_output"`` or ParallelStyles); None takes a transformers
            model's own ``config.base_model_tp_plan``. Only with ``device_mesh``.

    Returns:
        The model in eval mode.

    Raises:
        FileNotFoundError: the directory, config.json or a weight file is missing.
        ValueError: corrupt/truncated safetensors, malformed or unsupported quantization_config, tensors whose
            shapes do not match the config (checked from the headers on a meta-device model before the model
            is built), missing tensors, pickle-only weights, no ``model_type`` and no ``model``, or an
            unknown ``device``. With ``device_mesh``: a mesh that is not 1-D, a plan that names an unknown style
            or matches nothing, or planned layers that cannot be split into equal shards on their blocks (every
            such layer named with the rule it breaks, before any weight is read).
    """
    if tp_plan is not None and device_mesh is None:
        raise ValueError("tp_plan is for tensor-parallel loading: pass device_mesh too")
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"{path}: checkpoint directory not found")
    cfg = read_json(path / CONFIG_NAME, "model config")
    qc = quant_config(path, cfg)
    where = str(path / CONFIG_NAME)
    layout = layout_for_config(qc, where)
    if model is not None and not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if model is None and model_class is None and "model_type" not in cfg:
        # save_quantized of a plain nn.Module writes no model description (only quantization_config):
        # nothing here says which module to build, so the caller has to give one
        raise ValueError(
            f"{path / CONFIG_NAME}: no model_type, so the checkpoint was saved from a module that is not a "
            "transformers model; pass model=<a fresh instance of that module> (its parameters may be on the "
            "meta device) to load into it"
        )
    source = TensorSource(path, device=_device_str(device))
    if model is None:
        skeleton = build_skeleton(path, model_class, trust_remote_code, meta=True)
        linear_names = set(linear_layers(skeleton))
        check_skeleton_shapes(
            skeleton,
            source,
            align_prefix(source.keys(), skeleton),
            skip=lambda mk: mk.rpartition(".")[0] in linear_names,
        )
        _check_model_size(skeleton, source, path)
        del skeleton
        model = build_skeleton(path, model_class, trust_remote_code)
    qdtype = dtype or checkpoint_dtype(cfg) or torch.bfloat16

    keymap = align_prefix(source.keys(), model)
    by_model_key = {v: k for k, v in keymap.items()}

    def local_of(name: str) -> dict[str, str]:
        pre = name + "."
        return {mk[len(pre) :]: ck for mk, ck in by_model_key.items() if mk.startswith(pre)}

    tp = None
    if device_mesh is not None:
        from .sharded import ShardedLoad

        tp = ShardedLoad(model, device_mesh, tp_plan, layout=layout, qc=qc, source=source, dtype=qdtype,
                         local_of=local_of)
    consumed: set[str] = set()
    linears = linear_layers(model)
    modules = dict(model.named_modules())
    for name, lin in linears.items():
        local = local_of(name)
        qlocal = set(local) - {"bias"}
        if not qlocal or not layout.is_quantized(qlocal):
            continue
        parent_name, _, child = name.rpartition(".")
        if tp is not None and tp.planned(name):
            try:
                q = tp.load(name, lin, dtype)
            except (ValueError, TypeError) as e:
                files = sorted({str(source.files[local[k]]) for k in qlocal})
                raise ValueError(f"{', '.join(files)}: module {name!r}: {e}") from None
            setattr(modules[parent_name] if parent_name else model, child, q)
            consumed.update(local.values())
            continue
        try:
            loaded = layout.read(name, qlocal, lambda k, _l=local: source.get(_l[k]), qc, qdtype)
        except (ValueError, TypeError) as e:
            files = sorted({str(source.files[local[k]]) for k in qlocal})
            raise ValueError(f"{', '.join(files)}: module {name!r}: {e}") from None
        if tuple(loaded.weight.shape) != (lin.out_features, lin.in_features):
            raise ValueError(
                f"{source.files[local[min(qlocal)]]}: module {name!r} holds a weight of shape "
                f"{list(loaded.weight.shape)} but the config's model has Linear [{lin.out_features}, "
                f"{lin.in_features}] (checkpoint and config.json do not match)"
            )
        bias = None
        if "bias" in local:
            bias = source.get(local["bias"])
            if dtype is not None and bias.is_floating_point():
                bias = bias.to(dtype)
        q = QuantLinear(
            lin.in_features,
            lin.out_features,
            bias is not None,
            scheme=loaded.scheme,
            weight=loaded.weight,
            bias_tensor=bias,
            input_global_scale=loaded.input_global_scale,
        )
        setattr(modules[parent_name] if parent_name else model, child, q)
        consumed.update(local.values())

    state = model.state_dict()
    buffers = {n for n, _ in model.named_buffers()}
    to_load: dict[str, torch.Tensor] = {}
    unexpected = []
    for ck, mk in keymap.items():
        if ck in consumed:
            continue
        if mk not in state:
            if mk not in buffers:  # older checkpoints hold buffers that are non-persistent now (position_ids)
                unexpected.append(ck)
            continue
        want = state[mk]
        shape = source.shape(ck)
        if list(want.shape) != shape:
            raise ValueError(
                f"{source.files[ck]}: tensor {ck!r} has shape {shape} but the config's model expects "
                f"{list(want.shape)} (checkpoint and config.json do not match)"
            )
        t = source.get(ck)
        if dtype is not None and t.is_floating_point():
            t = t.to(dtype)
        to_load[mk] = t
    quant_like = [k for k in unexpected if k.rpartition(".")[2] in _QUANT_SUFFIXES or ".weight." in k]
    if quant_like:
        raise ValueError(
            f"{path}: quantized tensors for modules that are not Linear layers of the config's model: "
            f"{quant_like[:6]} (checkpoint and config.json do not match, or an unsupported layer type)"
        )
    if unexpected:
        warnings.warn(
            f"lowbit.load_quantized: {len(unexpected)} checkpoint tensor(s) unused: {unexpected[:6]}",
            stacklevel=2,
        )
    model.load_state_dict(to_load, strict=False, assign=True)
    if hasattr(model, "tie_weights"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model.tie_weights()
    missing = [n for n, p in model.named_parameters() if p.device.type == "meta"]
    missing += [n for n, b in model.named_buffers() if b.device.type == "meta"]
    if missing:
        raise ValueError(
            f"{path}: tensors missing from the checkpoint for {len(missing)} parameter(s): {missing[:8]}"
        )
    source.close()
    model.to(torch.device(device))
    model.eval()
    if tp is not None:
        tp.finish(model)
    return model


def _module_prefix(key: str) -> str:
    # bitsandbytes keeps its state under "<module>.weight.<field>" ("<module>.weight.quant_state.bitsandbytes__nf4")
    i = key.find(".weight.")
    return key[:i] if i >= 0 else key.rpartition(".")[0]


def inspect_checkpoint(path: str | Path) -> dict[str, Any]:
    """What a quantized checkpoint holds, without building the model (tensors are read one module at a time).

    Returns:
        ``{"path", "quant_method", "layout", "producer", "modules": {name: {"scheme", "format", "shape",
        "bytes", "params"}}, "quantized_bytes", "other_bytes", "total_bytes", "dense_bytes"}`` where
        ``dense_bytes`` is what the quantized weights would take in the checkpoint's dtype (bf16 if unknown), so
        ``dense_bytes / quantized_bytes`` is the compression ratio of the quantized layers.
    """
    path = Path(path)
    cfg = read_json(path / CONFIG_NAME, "model config")
    qc = quant_config(path, cfg)
    layout = layout_for_config(qc, str(path / CONFIG_NAME))
    source = TensorSource(path)
    dtype = checkpoint_dtype(cfg) or torch.bfloat16
    groups: dict[str, dict[str, str]] = {}
    for key in list(source.files):
        prefix = _module_prefix(key)
        groups.setdefault(prefix, {})[key[len(prefix) + 1 :] if prefix else key] = key
    modules: dict[str, Any] = {}
    used: set[str] = set()
    for name, local in sorted(groups.items()):
        qlocal = set(local) - {"bias"}
        if not qlocal or not layout.is_quantized(qlocal):
            continue
        try:
            loaded = layout.read(name, qlocal, lambda k, _l=local: source.get(_l[k]), qc, dtype)
        except (ValueError, TypeError) as e:
            raise ValueError(f"{source.files[local[min(qlocal)]]}: module {name!r}: {e}") from None
        keys = [local[k] for k in qlocal]
        used.update(keys)
        nbytes = sum(source.get(k).numel() * source.get(k).element_size() for k in keys)
        w = loaded.weight
        modules[name] = {
            "scheme": loaded.scheme.name,
            "format": w.fmt,
            "shape": list(w.shape),
            "bytes": nbytes,
            "params": {k: (v.item() if isinstance(v, torch.Tensor) else v) for k, v in w.params.items()},
            "static_input_scale": loaded.input_global_scale is not None,
        }
    if not modules:
        raise ValueError(
            f"{path}: quantization_config says {qc.get('quant_method')!r} but no quantized tensors were found"
        )
    other = 0
    for key in list(source.files):
        if key not in used:
            shape = source.shape(key)
            t = source.get(key)
            other += t.numel() * t.element_size() if shape else t.element_size()
    quantized = sum(m["bytes"] for m in modules.values())
    dense = (
        sum(m["shape"][0] * m["shape"][1] for m in modules.values())
        * torch.empty((), dtype=dtype).element_size()
    )
    producer = None
    if (path / "hf_quant_config.json").is_file():
        producer = (read_json(path / "hf_quant_config.json").get("producer") or {}).get("name")
    elif layout.name == "compressed-tensors":
        producer = f"compressed-tensors {qc.get('version', '?')}"
    elif layout.name == "lowbit":
        producer = f"lowbit {qc.get('lowbit_version', '?')}"
    source.close()
    return {
        "path": str(path),
        "quant_method": qc.get("quant_method"),
        "layout": layout.name,
        "producer": producer,
        "modules": modules,
        "quantized_bytes": quantized,
        "other_bytes": other,
        "total_bytes": quantized + other,
        "dense_bytes": dense,
    }


__all__ = [
    "FORMATS",
    "build_skeleton",
    "choose_layout",
    "empty_weights",
    "inspect_checkpoint",
    "load_quantized",
    "save_quantized",
]
