"""``inspect_checkpoint``: what a quantized checkpoint holds per module (scheme, format, shape, bytes), read
through its layout one module at a time, without building the model."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from .checkpoint import checkpoint_dtype, quant_config
from .files import CONFIG_NAME, TensorSource, read_json
from .layouts import layout_for_config


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


__all__ = ["inspect_checkpoint"]
