"""``convert_checkpoint``: quantize a safetensors model directory tensor by tensor, never loading the whole model.

Memory: one source tensor at a time on ``device`` (the fused q/k/v or gate/up siblings are read one by one for
their shared NVFP4 global scale), plus the output of the shard being written (about a quarter of a source
shard for 4-bit schemes) on the CPU. Output shards mirror the source shards, so a checkpoint larger than RAM
converts as long as its largest shard fits.

Resumable: work happens in ``.<out_name>.lowbit-convert.tmp`` next to ``out_dir``; each finished output shard
is recorded in ``progress.json`` there (after the shard file is fsynced and renamed into place). A rerun with
the same source, scheme and format skips the finished shards. The last step renames the temp directory to
``out_dir`` in one operation, so ``out_dir`` never holds a half checkpoint.
"""

from __future__ import annotations

import shutil
import sys
import warnings
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from ..api import quantize
from ..formats.blockscaled import finite_amax, nvfp4_default_global_scale
from ..nn.modules import QuantLinear
from ..nn.quantize import DEFAULT_SKIP, _patterns, fused_groups, is_skipped, linear_layers
from ..nn.schemes import Scheme, get_scheme
from ._files import (
    CONFIG_NAME,
    INDEX_FILE,
    SINGLE_FILE,
    TensorSource,
    check_out_dir,
    copy_extra_files,
    publish,
    read_json,
    safetensors_keys,
    save_safetensors,
    temp_dir_for,
    tensor_nbytes,
    write_json,
)
from ._layouts import DTYPE_NAMES, NAME_DTYPES, _params_from_json, _params_to_json
from .checkpoint import _align_prefix, build_skeleton, check_skeleton_shapes, choose_layout, parse_device

MANIFEST = "progress.json"
_LINEAR_FALLBACK_SKIP = ("*embed*", "*norm*", "*wte*", "*wpe*", "*lm_head*", "*ln_*", "*layernorm*")


def _progress(total: int, enabled: bool):
    if not enabled:
        return None
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return None
    return tqdm(total=total, desc="lowbit convert", unit="tensor", file=sys.stderr)


def _fingerprint(source: TensorSource) -> dict[str, list[int]]:
    out = {}
    for f in sorted(set(source.files.values())):
        st = f.stat()
        out[f.name] = [st.st_size, int(st.st_mtime)]
    return out


def check_unquantized_config(cfg: dict, where: Path) -> None:
    """ValueError unless ``cfg`` (a parsed config.json) describes an unquantized model: a source that is
    already quantized cannot be quantized again, and a quantization_config of another type is not a config."""
    qc = cfg.get("quantization_config")
    if qc is None:
        return
    if not isinstance(qc, dict):
        raise ValueError(  # noqa: TRY004 (a malformed file, reported as bad input)
            f"{where}: quantization_config must be a JSON object, got {type(qc).__name__} {qc!r:.60}; "
            "a model with any quantization_config is already quantized: convert an unquantized model"
        )
    raise ValueError(
        f"{where}: the source is already quantized (quant_method {qc.get('quant_method')!r}); "
        "convert an unquantized model"
    )


def check_source(src_dir: str | Path, model_class: Any = None, trust_remote_code: bool = False) -> None:
    """Check an unquantized safetensors model directory: config.json against its safetensors headers.

    The config's model is built on the meta device (nothing allocated, whatever its dimensions) and every
    checkpoint tensor it has is compared by shape with the safetensors header; a mismatch, a quantized source
    or a malformed config is a ValueError naming the file. Without transformers only config.json is checked.
    """
    src_dir = Path(src_dir)
    check_unquantized_config(read_json(src_dir / CONFIG_NAME, "model config"), src_dir / CONFIG_NAME)
    try:
        skeleton = build_skeleton(src_dir, model_class, trust_remote_code, meta=True)
    except ImportError:
        return
    source = TensorSource(src_dir)
    try:
        check_skeleton_shapes(skeleton, source, _align_prefix(source.keys(), skeleton))
    finally:
        source.close()


def _linear_weights(
    src_dir: Path, source: TensorSource, model_class, trust_remote_code
) -> dict[str, tuple[str, int, int]]:
    """``{module name: (checkpoint key of its weight, out_features, in_features)}`` for every nn.Linear."""
    try:
        # meta: only names and shapes are read, and a config with huge dimensions allocates nothing
        skeleton = build_skeleton(src_dir, model_class, trust_remote_code, meta=True)
    except ImportError:
        skeleton = None
    if skeleton is None:
        warnings.warn(
            "lowbit.convert_checkpoint: transformers is not installed; treating every 2-D '*.weight' tensor "
            f"outside {_LINEAR_FALLBACK_SKIP} as a Linear weight",
            stacklevel=3,
        )
        out = {}
        for key in list(source.files):
            shape = source.shape(key)
            if key.endswith(".weight") and len(shape) == 2 and not is_skipped(key, _LINEAR_FALLBACK_SKIP):
                out[key[: -len(".weight")]] = (key, shape[0], shape[1])
        return out
    keymap = _align_prefix(source.keys(), skeleton)
    check_skeleton_shapes(skeleton, source, keymap)
    by_model = {v: k for k, v in keymap.items()}
    out = {}
    for name, lin in linear_layers(skeleton).items():
        key = by_model.get(f"{name}.weight")
        if key is None:
            continue  # tied or absent (e.g. lm_head tied to the embeddings)
        shape = source.shape(key)
        if shape != [lin.out_features, lin.in_features]:
            raise ValueError(
                f"{source.files[key]}: {key!r} has shape {shape} but config.json's model has Linear "
                f"[{lin.out_features}, {lin.in_features}] (checkpoint and config.json do not match)"
            )
        out[name] = (key, lin.out_features, lin.in_features)
    return out


def _stub(name: str, info: dict) -> QuantLinear:
    """A QuantLinear without tensors carrying what ``layout.config`` reads (scheme, shape, format options)."""
    out_f, in_f = info["shape"]
    m = QuantLinear(in_f, out_f, False, scheme=info["scheme"])
    m._meta = {
        "dtype": NAME_DTYPES.get(info["dtype"], torch.bfloat16),
        "scale_layout": info.get("scale_layout", "linear"),
        "params": _params_from_json(info.get("params", {})),
    }
    return m


def _convert_shard(
    keys: list[str],
    source: TensorSource,
    targets: dict[str, tuple[str, str]],
    scheme: Scheme,
    layout,
    device: torch.device,
    global_scale,
    bar,
) -> tuple[dict[str, torch.Tensor], dict[str, dict]]:
    """Quantize the Linear weights among ``keys`` and copy the rest; returns (output tensors, module infos)."""
    out: dict[str, torch.Tensor] = {}
    infos: dict[str, dict] = {}
    for key in keys:
        t = source.get(key)
        if key in targets:
            name, prefix = targets[key]
            w = t.to(device)
            opts = scheme.weight_quantize_options(w.shape[1])
            g = global_scale(name)
            if g is not None:
                opts["global_scale"] = g.to(device)
            q = quantize(w, scheme.weight_format, **opts)
            m = QuantLinear(w.shape[1], w.shape[0], False, scheme=scheme, weight=q)
            for k, v in layout.export(m).items():
                out[f"{prefix}{k}"] = v.detach().to("cpu")
            infos[name] = {
                "scheme": scheme.name,
                "shape": [w.shape[0], w.shape[1]],
                "dtype": DTYPE_NAMES.get(t.dtype, "float32"),
                "scale_layout": q.scale_layout,
                "params": _params_to_json(q.params),
            }
            del w, q, m
        else:
            out[key] = t
        if bar is not None:
            bar.update(1)
    return out, infos


def convert_checkpoint(
    src_dir: str | Path,
    out_dir: str | Path,
    scheme: str | Scheme,
    *,
    device: str | torch.device | None = None,
    skip: str | Iterable[str] | None = DEFAULT_SKIP,
    progress: bool = True,
    format: str = "auto",
    overwrite: bool = False,
    model_class: Any = None,
    trust_remote_code: bool = False,
) -> Path:
    """Quantize the Linear weights of a safetensors model directory into a new checkpoint directory.

    Args:
        src_dir: a transformers-style model directory (``config.json`` and ``model.safetensors`` or
            ``model.safetensors.index.json`` + shards). It is only read.
        out_dir: the checkpoint to create (same layout rules as :func:`lowbit.save_quantized`); it must lie
            outside ``src_dir`` and must not contain it.
        scheme: a name from ``lowbit.SCHEMES``.
        device: where each tensor is quantized (None: CUDA if available, else CPU); ValueError if torch does
            not know it.
        skip: fnmatch patterns of module names kept in full precision (default ``lm_head``).
        progress: show a tqdm bar (or a line per shard on stderr without tqdm).
        format: checkpoint layout, as ``save_quantized(format=...)``.
        overwrite: replace an existing ``out_dir``.
        model_class, trust_remote_code: for building the model skeleton (meta device) that says which tensors
            are Linear weights; without transformers, 2-D ``*.weight`` tensors outside embeddings/norms/lm_head.

    Returns:
        ``Path(out_dir)``.

    Activation scales are dynamic (no calibration data here); fused q/k/v and gate/up NVFP4 weights share one
    global scale as in :func:`lowbit.quantize_model`, so a checkpoint converted here and a model quantized in
    memory and saved hold the same bytes.
    """
    scheme = get_scheme(scheme)
    dev = (
        parse_device(device)
        if device is not None
        else torch.device("cuda" if torch.cuda.is_available() else "cpu")
    )
    src_dir, out_dir = Path(src_dir), Path(out_dir)
    check_out_dir(out_dir, src_dir)
    if (out_dir.exists() or out_dir.is_symlink()) and not overwrite:
        raise FileExistsError(f"{out_dir}: already exists (pass overwrite=True to replace it)")
    cfg = read_json(src_dir / CONFIG_NAME, "model config")
    check_unquantized_config(cfg, src_dir / CONFIG_NAME)
    source = TensorSource(src_dir)
    patterns = _patterns(skip)

    linears = _linear_weights(src_dir, source, model_class, trust_remote_code)
    targets: dict[str, tuple[str, str]] = {}
    unsupported, ignore = [], []
    for name, (key, out_f, in_f) in linears.items():
        if is_skipped(name, patterns):
            ignore.append(name)
            continue
        why = scheme.unsupported(out_f, in_f)
        if why is not None:
            unsupported.append(f"{name} [{out_f}, {in_f}]: {why}")
            ignore.append(name)
            continue
        targets[key] = (name, key[: -len("weight")])
    if not targets:
        detail = f"; unsupported shapes: {'; '.join(unsupported)}" if unsupported else ""
        raise ValueError(
            f"convert_checkpoint: no Linear weight in {src_dir} can take scheme {scheme.name} "
            f"({len(linears)} Linear layers, skip={list(patterns)}){detail}"
        )
    if unsupported:
        warnings.warn(
            f"lowbit.convert_checkpoint: {len(unsupported)} layer(s) left unquantized, their shapes do not fit "
            f"{scheme.name}: " + "; ".join(unsupported),
            stacklevel=2,
        )
    probe = QuantLinear(16, 16, False, scheme=scheme)
    layout = choose_layout({"probe": probe}, format)

    # fused siblings share one NVFP4 global scale: computed from each member's absmax, one tensor at a time
    name_to_key = {name: key for key, (name, _) in targets.items()}
    group_of = {n: g for g in (fused_groups(name_to_key) if scheme.shared_global_scale else []) for n in g}
    cache: dict[tuple[str, ...], torch.Tensor] = {}

    def global_scale(name: str) -> torch.Tensor | None:
        group = group_of.get(name)
        if group is None:
            return None
        if group not in cache:
            amax = torch.stack([finite_amax(source.get(name_to_key[n]).to(dev)).float().cpu() for n in group])
            cache[group] = nvfp4_default_global_scale(amax)
        return cache[group]

    # resumable temp dir
    tmp = temp_dir_for(out_dir, "convert")
    ident = {
        "source": str(src_dir.resolve()),
        "fingerprint": _fingerprint(source),
        "scheme": scheme.name,
        "format": layout.name,
        "skip": list(patterns),
    }
    manifest: dict[str, Any] = {**ident, "shards": {}}
    if tmp.exists():
        try:
            old = read_json(tmp / MANIFEST, "conversion manifest")
        except (FileNotFoundError, ValueError):
            old = None
        if old is not None and all(old.get(k) == v for k, v in ident.items()):
            manifest["shards"] = {
                f: info
                for f, info in old.get("shards", {}).items()
                if _shard_ok(tmp / f, info.get("keys", []))
            }
        else:
            warnings.warn(
                f"lowbit.convert_checkpoint: {tmp} is from another conversion; starting over", stacklevel=2
            )
            shutil.rmtree(tmp)
    tmp.mkdir(parents=True, exist_ok=True)

    shard_keys: dict[Path, list[str]] = {}
    for key, f in source.files.items():
        shard_keys.setdefault(f, []).append(key)
    single = source.index is None and len(shard_keys) == 1
    total = sum(len(v) for v in shard_keys.values())
    done_count = sum(
        len(shard_keys.get(src_dir / info["source"], [])) for info in manifest["shards"].values()
    )
    bar = _progress(total, progress)
    if bar is not None:
        bar.update(done_count)
    try:
        for i, (src_file, keys) in enumerate(sorted(shard_keys.items())):
            out_name = SINGLE_FILE if single else src_file.name
            if out_name in manifest["shards"]:
                continue
            tensors, infos = _convert_shard(keys, source, targets, scheme, layout, dev, global_scale, bar)
            save_safetensors(tensors, tmp / out_name)
            manifest["shards"][out_name] = {
                "source": src_file.name,
                "keys": list(tensors),
                "bytes": sum(tensor_nbytes(t) for t in tensors.values()),
                "modules": infos,
            }
            write_json(tmp / MANIFEST, manifest)
            if bar is None and progress:
                print(f"lowbit convert: shard {i + 1}/{len(shard_keys)} {out_name} done", file=sys.stderr)
            del tensors
    finally:
        if bar is not None:
            bar.close()
        source.close()

    # finalize: index, config, extra files, then one rename
    infos = {n: info for s in manifest["shards"].values() for n, info in s["modules"].items()}
    stubs = {n: _stub(n, info) for n, info in infos.items()}
    ignore = sorted(set(ignore) | {n for n in linears if n not in stubs})
    layout = choose_layout(stubs, layout.name)
    if not single:
        wmap = {k: f for f, s in manifest["shards"].items() for k in s["keys"]}
        total_size = sum(s["bytes"] for s in manifest["shards"].values())
        write_json(tmp / INDEX_FILE, {"metadata": {"total_size": total_size}, "weight_map": wmap})
    src_dtype = NAME_DTYPES.get(str(cfg.get("dtype", cfg.get("torch_dtype"))).removeprefix("torch."))
    config = dict(cfg)
    config["quantization_config"] = layout.config(stubs, ignore, src_dtype)
    write_json(tmp / CONFIG_NAME, config)
    for name, data in layout.extra_files(stubs, ignore).items():
        write_json(tmp / name, data)
    copy_extra_files(src_dir, tmp)
    (tmp / MANIFEST).unlink()
    try:
        publish(tmp, out_dir, overwrite)
    except BaseException:
        write_json(tmp / MANIFEST, manifest)  # keep the finished shards for a rerun
        raise
    return out_dir


def _shard_ok(path: Path, keys: list[str]) -> bool:
    try:
        return path.is_file() and set(safetensors_keys(path)) == set(keys)
    except (ValueError, OSError):
        return False


__all__ = ["check_source", "check_unquantized_config", "convert_checkpoint"]
