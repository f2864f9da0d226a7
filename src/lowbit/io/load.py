"""``load_quantized``: a quantized checkpoint, whoever wrote it (lowbit, llm-compressor, ModelOpt, bitsandbytes
via transformers, AutoAWQ, GPTQ, DeepSeek), into a transformers model whose quantized Linear layers are
:class:`~lowbit.nn.QuantLinear`, optionally tensor-parallel. Only safetensors is read, never pickle. See
``docs/models.md``.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..nn.modules import QuantLinear
from ..nn.quantize import linear_layers
from .checkpoint import (
    align_prefix,
    build_skeleton,
    check_skeleton_shapes,
    checkpoint_dtype,
    parse_device,
    quant_config,
)
from .files import CONFIG_NAME, TensorSource, read_json
from .layouts import layout_for_config

_QUANT_SUFFIXES = ("weight_packed", "weight_scale", "weight_global_scale", "qweight", "qzeros", "weight_scale_inv",
                   "weight_scale_2", "weight_data", "absmax", "quant_state")  # fmt: skip


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


def _device_str(device: str | torch.device) -> str:
    d = parse_device(device)
    if d.type == "cuda" and d.index is None:
        d = torch.device("cuda", torch.cuda.current_device())
    return str(d)


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
            if (qc.get("modules") or {}).get(name, {}).get("input_transform") is not None:
                # a row shard sees part of K: the transform (and a rotation's blocks) would have to be split too
                raise ValueError(f"{where}: module {name!r} transforms its input online (lowbit.algorithms), "
                                 "which tensor-parallel loading does not support; load it whole")
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
        if loaded.input_transform is not None:
            from ..algorithms.rotation import attach_input_transform

            attach_input_transform(q, loaded.input_transform)
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


__all__ = ["load_quantized"]
