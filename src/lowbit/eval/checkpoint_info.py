"""What a checkpoint holds, from its safetensors headers and ``config.json`` only (``lowbit inspect``).

No tensor is loaded: the header of each ``*.safetensors`` file (8-byte length + JSON) gives every tensor's
dtype, shape and byte range, and a few tensors of at most a few hundred bytes whose values say a layer's
shape (compressed-tensors ``weight_shape``, bitsandbytes' ``quant_state`` JSON) are read by offset. Truncated
or corrupt files raise :class:`CheckpointError` (the CLI prints it and exits 2).

Each module's tensors are classified by the names and dtypes the producers write (``docs/formats.md``):

=====================  ======================================================================
producer convention    module tensors
=====================  ======================================================================
compressed-tensors     ``weight_packed`` + ``weight_scale`` (+ ``weight_global_scale``, ``weight_shape``,
                       ``weight_zero_point``), or fp8 ``weight`` + uint8 ``weight_scale`` (mxfp8)
ModelOpt               uint8 ``weight`` + e4m3 ``weight_scale`` + ``weight_scale_2``
bitsandbytes           uint8 ``weight`` + ``weight.absmax`` + ``weight.quant_map`` + ``weight.quant_state.*``
AutoAWQ / GPTQ         ``qweight`` + ``qzeros`` + ``scales`` (+ ``g_idx`` for GPTQ)
DeepSeek / HF FP8      e4m3 ``weight`` + fp32 ``weight_scale_inv``
lowbit-native          ``weight_data`` + ``weight_scale`` (+ ...), formats in ``quantization_config.modules``
=====================  ======================================================================
"""

from __future__ import annotations

import json
import math
import os
import struct
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .safetensors_header import CheckpointError, TensorInfo, read_header, read_small, regular_file_size

FLOAT_DTYPES = {"F64", "F32", "F16", "BF16"}
_LOCAL_HEADS = {
    "weight", "qweight", "qzeros", "scales", "g_idx", "bias", "input_scale", "input_global_scale",
    "weight_packed", "weight_scale", "weight_scale_inv", "weight_scale_2", "weight_global_scale",
    "weight_zero_point", "weight_shape", "weight_g_idx", "k_scale", "v_scale", "output_scale",
    "input_zero_point", "weight_format", "SCB", "weight_data", "weight_zeros", "weight_nested_scale",
    "weight_nested_offset",
}  # fmt: skip


def _split_key(key: str) -> tuple[str, str]:
    parts = key.split(".")
    for i in range(len(parts) - 1, -1, -1):
        if parts[i] in _LOCAL_HEADS:
            return ".".join(parts[:i]), ".".join(parts[i:])
    return ".".join(parts[:-1]), parts[-1]


@dataclass
class Layer:
    name: str
    format: str
    """A lowbit format name (``nvfp4``, ``mxfp4``, ``mxfp6_e2m3``, ``mxfp8_e4m3``, ``fp8_block``, ``nf4``,
    ``int4_awq`` for every zero-point INT4 layout, ``fp4_b32``), ``float`` (not quantized), ``quantized?``
    (unrecognized integer tensors) or ``other`` (norms, biases only)."""
    convention: str
    shape: tuple[int, ...] | None
    params: int
    nbytes: int
    tensors: dict[str, tuple[str, tuple[int, ...]]] = field(default_factory=dict)
    bias_params: int = 0


def _ints(raw: bytes, dtype: str) -> list[int]:
    code = {"I64": "q", "I32": "i", "U8": "B", "I16": "h", "U32": "I", "U64": "Q"}.get(dtype)
    if code is None:
        return []
    n = len(raw) // struct.calcsize(code)
    return list(struct.unpack(f"<{n}{code}", raw[: n * struct.calcsize(code)]))


def _lowbit_native(name: str, qcfg: dict | None) -> tuple[str, tuple[int, ...] | None]:
    """(weight format, shape) of a lowbit-native module from ``quantization_config.modules``."""
    meta = ((qcfg or {}).get("modules") or {}).get(name) or {}
    shape = meta.get("shape")
    shape = tuple(shape) if isinstance(shape, list) and all(isinstance(d, int) for d in shape) else None
    try:
        from ..nn import SCHEMES

        return SCHEMES[meta["scheme"]].weight_format, shape
    except (KeyError, TypeError):
        return "quantized?", shape


def _classify(
    name: str, t: dict[str, TensorInfo], quant_method: str | None, qcfg: dict | None = None
) -> Layer:
    def dt(k):
        return t[k].dtype if k in t else None

    def sh(k):
        return t[k].shape if k in t else None

    nbytes = sum(v.nbytes for k, v in t.items() if k != "bias")
    fmt, conv, shape = None, "", None
    if "weight_data" in t and "weight_scale" in t:
        fmt, shape = _lowbit_native(name, qcfg)
        conv = "lowbit-native"
    elif "weight_packed" in t and "weight_scale" in t:
        conv = "compressed-tensors"
        rows, cols = sh("weight_packed")[0], sh("weight_packed")[-1]
        if dt("weight_packed") == "I32":
            fmt = "int4_awq"
            shape = (rows, cols * 8)
            if "weight_shape" in t and t["weight_shape"].nbytes <= 64:
                vals = _ints(read_small(t["weight_shape"]), dt("weight_shape"))
                if len(vals) == 2:
                    shape = tuple(vals)
        elif dt("weight_scale") == "F8_E4M3" or "weight_global_scale" in t:
            fmt, shape = "nvfp4", (rows, cols * 2)
        else:
            k = sh("weight_scale")[-1] * 32
            if cols * 4 == k * 3:
                fmt, shape = "mxfp6_e2m3", (rows, k)
            else:
                fmt, shape = "mxfp4", (rows, cols * 2)
    elif dt("weight") == "U8" and len(sh("weight")) == 2 and (
        (quant_method == "lightx2v" and "weight_scale" in t)
        or ("weight_global_scale" in t and dt("weight_scale") == "F8_E4M3")
    ):
        # LightX2V: packed uint8 ``weight`` + swizzled ``weight_scale`` (+ NVFP4 scalars); the MX kinds are told
        # apart by quantization_config.quant_scheme (LightX2V's dit_quant_scheme)
        rows, cols = sh("weight")
        kind = (qcfg or {}).get("quant_scheme", "nvfp4" if dt("weight_scale") == "F8_E4M3" else None)
        fmt, k = {"nvfp4": ("nvfp4", 2 * cols), "mxfp4": ("mxfp4", 2 * cols),
                  "mxfp6-mxfp8": ("mxfp6_e3m2", 4 * cols // 3), "mxfp8": ("mxfp8_e4m3", cols)}.get(
                      kind, ("quantized?", cols))  # fmt: skip
        conv, shape = "LightX2V", (rows, k)
    elif "weight_scale_inv" in t and dt("weight") in ("F8_E4M3", "F8_E5M2"):
        fmt, conv, shape = "fp8_block", "DeepSeek/HF FP8", sh("weight")
    elif "weight_scale_2" in t and dt("weight") == "U8":
        rows, cols = sh("weight")
        fmt, conv, shape = "nvfp4", "ModelOpt", (rows, cols * 2)
    elif dt("weight") in ("F8_E4M3", "F8_E5M2") and dt("weight_scale") in ("U8", "F8_E8M0"):
        fmt, conv, shape = "mxfp8_e4m3", "compressed-tensors", sh("weight")
    elif "weight.absmax" in t and dt("weight") == "U8":
        qs = next((k for k in t if k.startswith("weight.quant_state.bitsandbytes__")), None)
        fmt, conv = (qs.rsplit("__", 1)[1] if qs else "nf4"), "bitsandbytes"
        shape = None
        if qs is not None:
            try:
                meta = json.loads(read_small(t[qs]).decode("utf-8"))
                shape = tuple(meta["shape"])
            except (ValueError, KeyError, CheckpointError):
                pass
        if shape is None:
            shape = (t["weight"].numel * 2,)
    elif "qweight" in t and "qzeros" in t and "scales" in t:
        q = sh("qweight")
        gptq = quant_method == "gptq" or (quant_method != "awq" and "g_idx" in t)
        if gptq:
            fmt, conv, shape = "int4_awq", "GPTQ", (q[1], q[0] * 8)
        else:
            fmt, conv, shape = "int4_awq", "AutoAWQ", (q[1] * 8, q[0])
    elif "weight" in t and dt("weight") in FLOAT_DTYPES and len(sh("weight")) >= 2:
        fmt, conv, shape = "float", dt("weight").lower(), sh("weight")
    elif any(k.startswith("weight") and v.dtype not in FLOAT_DTYPES for k, v in t.items()):
        w = next(k for k, v in t.items() if k.startswith("weight") and v.dtype not in FLOAT_DTYPES)
        fmt, conv, shape = "quantized?", "unrecognized", sh(w)
    else:
        fmt, conv = "other", ""
    params = math.prod(shape) if shape and fmt not in ("other",) else sum(v.numel for v in t.values())
    tensors = {k: (v.dtype, v.shape) for k, v in sorted(t.items())}
    bias = t["bias"].numel if "bias" in t and fmt != "other" else 0
    return Layer(name, fmt, conv, tuple(shape) if shape else None, params, nbytes, tensors, bias)


_PRODUCERS = {
    "compressed-tensors": "compressed-tensors (llm-compressor)",
    "modelopt": "NVIDIA ModelOpt",
    "bitsandbytes": "bitsandbytes",
    "awq": "AutoAWQ",
    "gptq": "GPTQ",
    "fp8": "DeepSeek / HF FP8 (weight_scale_inv)",
    "lowbit": "lowbit (native layout)",
    "lightx2v": "LightX2V",
}
# quant_method -> (quantization_config key, label) of the detail the summary names after the producer
_PRODUCER_DETAIL = {
    "compressed-tensors": ("format", "format "),
    "fp8": ("weight_block_size", "weight_block_size "),
    "bitsandbytes": ("bnb_4bit_quant_type", ""),
    "awq": ("version", "version "),
    "modelopt": ("quant_algo", ""),
    "lowbit": ("schemes", "schemes "),
    "lightx2v": ("quant_scheme", ""),
}


INDEX_FILE = "model.safetensors.index.json"


def _read_json_object(path: Path, what: str) -> dict:
    regular_file_size(path, what)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError):
        raise CheckpointError(f"{path}: not valid JSON") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: {what} must hold a JSON object, got {type(data).__name__}")
    return data


def _from_index(root: Path) -> list[Path]:
    """The shards ``model.safetensors.index.json`` lists, all present (CheckpointError naming the missing)."""
    index_path = root / INDEX_FILE
    wmap = _read_json_object(index_path, "safetensors index").get("weight_map")
    if not isinstance(wmap, dict) or not wmap:
        raise CheckpointError(f"{index_path}: 'weight_map' must be a non-empty object of tensor name -> shard")
    shards = set()
    for name, shard in wmap.items():
        if not isinstance(shard, str) or "/" in shard or "\\" in shard or shard.startswith("."):
            raise CheckpointError(f"{index_path}: shard of {name!r} must be a plain file name, got {shard!r}")
        shards.add(shard)
    missing = sorted(s for s in shards if not (root / s).exists())
    if missing:
        raise CheckpointError(
            f"{index_path}: {len(missing)} of {len(shards)} shards listed are missing: {', '.join(missing[:5])}"
            + (", ..." if len(missing) > 5 else "")
        )
    return [root / s for s in sorted(shards)]


def _checkpoint_subdirs(path: Path) -> list[Path]:
    """Sub-folders holding a checkpoint (``lowbit quantize --scheme all`` writes one per scheme)."""
    out = []
    for d in sorted(p for p in path.iterdir() if p.is_dir() and not p.name.startswith(".")):
        if (d / "config.json").is_file() and any(d.glob("*.safetensors")):
            out.append(d)
    return out


def _files(path: Path) -> tuple[list[Path], Path | None]:
    if not path.exists():
        raise CheckpointError(f"{path} does not exist")
    if not path.is_dir():
        regular_file_size(path, "checkpoint path")
        if path.suffix != ".safetensors":
            raise CheckpointError(f"{path}: not a .safetensors file (lowbit never unpickles .bin/.pt files)")
        return [path], path.parent
    if (path / INDEX_FILE).exists():
        return _from_index(path), path
    files = sorted(path.glob("*.safetensors"))
    if not files:
        subdirs = _checkpoint_subdirs(path)
        if subdirs:
            names = ", ".join(d.name for d in subdirs)
            raise CheckpointError(
                f"{path} is not a checkpoint but holds {len(subdirs)} (one per scheme?): {names}; "
                f"inspect one of them, e.g. lowbit inspect {subdirs[0]}"
            )
        raise CheckpointError(f"{path} has no *.safetensors file")
    return files, path


def inspect_checkpoint(path: str | os.PathLike) -> dict[str, Any]:
    """Summary of a checkpoint directory (or one ``.safetensors`` file) without loading its weights.

    Returns a JSON-able dict: ``producer``, ``quantization_config``, ``files``, ``total_bytes``, ``params``,
    ``formats`` (per format: layers, params, bytes, bits per weight, shapes), ``ratio_vs_bf16`` /
    ``ratio_vs_fp32`` (the checkpoint against the same parameters stored in 16/32-bit floats),
    ``quantized_ratio_vs_bf16`` (quantized layers only) and ``layers`` (one entry per module).
    """
    path = Path(path)
    files, root = _files(path)
    tensors: dict[str, TensorInfo] = {}
    for f in files:
        tensors.update(read_header(f))
    if root is not None and (root / INDEX_FILE).exists() and path.is_dir():
        wmap = _read_json_object(root / INDEX_FILE, "safetensors index")["weight_map"]
        absent = sorted(k for k in wmap if k not in tensors)
        if absent:
            raise CheckpointError(
                f"{root / INDEX_FILE}: {len(absent)} tensor(s) listed are in none of the shards: {absent[:5]}"
            )
    config = {}
    if root is not None and (root / "config.json").exists():
        config = _read_json_object(root / "config.json", "config.json")
    qcfg = config.get("quantization_config") or config.get("compression_config")
    if qcfg is None and root is not None and (root / "hf_quant_config.json").exists():
        try:
            qcfg = {"quant_method": "modelopt", **_read_json_object(root / "hf_quant_config.json", "it")}
        except CheckpointError:
            qcfg = None  # an unreadable ModelOpt side file only loses the producer name
    if qcfg is not None and not isinstance(qcfg, dict):
        raise CheckpointError(
            f"{root / 'config.json'}: quantization_config must be a JSON object, got {type(qcfg).__name__} "
            f"{qcfg!r:.60}"
        )
    quant_method = (qcfg or {}).get("quant_method")
    if quant_method is not None and not isinstance(quant_method, str):
        raise CheckpointError(f"{root / 'config.json'}: quant_method must be a string, got {quant_method!r}")

    modules: dict[str, dict[str, TensorInfo]] = defaultdict(dict)
    for key, info in tensors.items():
        mod, local = _split_key(key)
        modules[mod][local] = info
    layers = [_classify(name, t, quant_method, qcfg) for name, t in modules.items()]

    formats: dict[str, dict[str, Any]] = {}
    for layer in layers:
        if layer.format == "other":
            continue
        key = layer.format if layer.format != "float" else f"float ({layer.convention})"
        f = formats.setdefault(
            key, {"layers": 0, "params": 0, "bytes": 0, "shapes": Counter(), "conventions": set()}
        )
        f["layers"] += 1
        f["params"] += layer.params
        f["bytes"] += layer.nbytes
        f["shapes"][str(list(layer.shape)) if layer.shape else "?"] += 1
        if layer.convention and layer.format != "float":
            f["conventions"].add(layer.convention)
    for f in formats.values():
        f["bits_per_weight"] = 8 * f["bytes"] / f["params"] if f["params"] else None
        f["shapes"] = dict(f["shapes"])
        f["conventions"] = sorted(f["conventions"])

    total_bytes = sum(t.nbytes for t in tensors.values())
    params = sum(layer.params + layer.bias_params for layer in layers)
    q_layers = [x for x in layers if x.format not in ("float", "other")]
    q_params = sum(x.params for x in q_layers)
    q_bytes = sum(x.nbytes for x in q_layers)
    conventions = sorted({x.convention for x in q_layers})
    if quant_method in _PRODUCERS:
        producer = _PRODUCERS[quant_method]
        key, label = _PRODUCER_DETAIL.get(quant_method, (None, ""))
        detail = qcfg.get(key) if key else None
        if detail:
            detail = ", ".join(detail) if quant_method == "lowbit" else detail
            producer += f", {label}{detail}"
    elif quant_method:
        producer = str(quant_method)
    elif conventions:
        producer = " + ".join(conventions) + " (from tensor names; no quantization_config)"
    else:
        producer = "none (not quantized)"
    return {
        "path": str(path),
        "files": [str(f) for f in files],
        "producer": producer,
        "quant_method": quant_method,
        "quantization_config": qcfg,
        "architecture": (
            config["architectures"][0]
            if isinstance(config.get("architectures"), list) and config["architectures"]
            else None
        ),
        "tensors": len(tensors),
        "total_bytes": total_bytes,
        "params": params,
        "quantized_layers": len(q_layers),
        "quantized_params": q_params,
        "quantized_bytes": q_bytes,
        "quantized_bits_per_weight": 8 * q_bytes / q_params if q_params else None,
        "quantized_ratio_vs_bf16": 2 * q_params / q_bytes if q_bytes else None,
        "ratio_vs_bf16": 2 * params / total_bytes if total_bytes else None,
        "ratio_vs_fp32": 4 * params / total_bytes if total_bytes else None,
        "formats": formats,
        "layers": [
            {
                "name": x.name,
                "format": x.format,
                "convention": x.convention,
                "shape": list(x.shape) if x.shape else None,
                "params": x.params,
                "bytes": x.nbytes,
                "tensors": {k: {"dtype": d, "shape": list(s)} for k, (d, s) in x.tensors.items()},
            }
            for x in layers
            if x.format != "other"
        ],
    }


def _mb(n: float) -> str:
    return f"{n / 1e6:.2f} MB"


def format_inspect(info: dict[str, Any], *, layers: bool = False) -> str:
    """The text ``lowbit inspect`` prints."""
    lines = [
        (
            f"path       {info['path']}  ({len(info['files'])} file{'s' * (len(info['files']) != 1)}, "
            f"{info['tensors']} tensors)"
        ),
        f"producer   {info['producer']}",
    ]
    if info["architecture"]:
        lines.append(f"model      {info['architecture']}")
    lines.append(
        f"size       {_mb(info['total_bytes'])} for {info['params'] / 1e6:.2f} M parameters: "
        f"compression {info['ratio_vs_fp32']:.2f}x vs fp32, {info['ratio_vs_bf16']:.2f}x vs bf16"
    )
    if info["quantized_layers"]:
        lines.append(
            f"quantized  {info['quantized_layers']} layers, {info['quantized_params'] / 1e6:.2f} M weights in "
            f"{_mb(info['quantized_bytes'])} = {info['quantized_bits_per_weight']:.2f} bits/weight "
            f"({info['quantized_ratio_vs_bf16']:.2f}x vs bf16)"
        )
    lines.append("")
    lines.append(
        f"{'format':18} {'layers':>6} {'params':>10} {'bytes':>12} {'bits/w':>7}  convention / shapes"
    )
    for fmt, f in sorted(info["formats"].items(), key=lambda kv: -kv[1]["bytes"]):
        bpw = f"{f['bits_per_weight']:.2f}" if f["bits_per_weight"] else "-"
        shapes = ", ".join(f"{s} x{n}" for s, n in f["shapes"].items())
        conv = "; ".join(f["conventions"])
        lines.append(
            f"{fmt:18} {f['layers']:>6} {f['params']:>10} {f['bytes']:>12} {bpw:>7}  "
            + (f"{conv}: " if conv else "")
            + shapes
        )
    if layers:
        lines.append("")
        lines.append(f"{'layer':48} {'format':10} {'shape':>14} {'bytes':>10}  tensors")
        for x in info["layers"]:
            ts = ", ".join(f"{k} {v['dtype']}{v['shape']}" for k, v in x["tensors"].items())
            lines.append(f"{x['name']:48} {x['format']:10} {x['shape']!s:>14} {x['bytes']:>10}  {ts}")
    return "\n".join(lines)
