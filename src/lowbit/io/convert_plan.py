"""Planning a conversion: what :func:`lowbit.convert_checkpoint` derives from its arguments and the source
before it writes anything.

- :func:`check_source` / :func:`check_unquantized_config`: an unquantized safetensors model directory, its
  config.json matching its headers;
- :func:`plan_conversion`: the output path checked, the Linear weights to quantize chosen (from the
  config's model built on the meta device, or by the name and shape rules of :mod:`lowbit.io.rules` for a
  diffusers or bare folder), the checkpoint layout, the shared NVFP4 global scale of fused siblings, the
  output files and the pieces of work (:mod:`lowbit.io.convert_layout`), and the identity of the conversion
  that a resumed run must match (:class:`ConversionPlan`).
"""

from __future__ import annotations

import hashlib
import json
import warnings
from pathlib import Path
from typing import Any

import torch

from ..formats.nvfp4 import finite_amax, nvfp4_default_global_scale
from ..nn.modules import QuantLinear
from ..nn.quantize import fused_groups, is_skipped, linear_layers, skip_patterns
from ..nn.schemes import Scheme
from . import convert_layout
from .checkpoint import align_prefix, build_skeleton, check_skeleton_shapes, choose_layout
from .files import CONFIG_NAME, TensorSource, check_out_dir, read_json
from .rules import matches, select_linear_weights

_LINEAR_FALLBACK_SKIP = ("*embed*", "*norm*", "*wte*", "*wpe*", "*lm_head*", "*ln_*", "*layernorm*")


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
        check_skeleton_shapes(skeleton, source, align_prefix(source.keys(), skeleton))
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
    keymap = align_prefix(source.keys(), skeleton)
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


class SharedScales:
    """The NVFP4 global scale fused siblings (q/k/v, gate/up) share, as :func:`lowbit.quantize_model` computes
    it: from each member's finite absmax. ``scale(name, amax)`` takes the absmaxes the caller already has (the
    members it holds on the device) and reads the others from the source, one tensor at a time; a group's scale
    is computed once."""

    def __init__(self, source: TensorSource, dev: torch.device, group_of: dict[str, tuple[str, ...]],
                 name_to_key: dict[str, str]) -> None:
        self.source, self.dev, self.group_of, self.name_to_key = source, dev, group_of, name_to_key
        self._cache: dict[tuple[str, ...], torch.Tensor] = {}

    def group(self, name: str) -> tuple[str, ...] | None:
        return self.group_of.get(name)

    def __call__(self, name: str, amax: dict[str, torch.Tensor] | None = None) -> torch.Tensor | None:
        group = self.group_of.get(name)
        if group is None:
            return None
        if group not in self._cache:
            known = amax or {}
            values = [known[n] if n in known else self.amax(self.source.get(self.name_to_key[n]).to(self.dev))
                      for n in group]
            self._cache[group] = nvfp4_default_global_scale(torch.stack(values))
        return self._cache[group]

    @staticmethod
    def amax(w: torch.Tensor) -> torch.Tensor:
        return finite_amax(w).float().cpu()


class ConversionPlan:
    """What every rank of a conversion derives from its arguments and the source, before writing anything."""

    def __init__(self, **kw: Any) -> None:
        self.__dict__.update(kw)


def plan_conversion(
    src_dir: Path,
    out_dir: Path,
    scheme: Scheme,
    dev: torch.device,
    *,
    skip,
    include_p,
    exclude_p,
    format: str,
    overwrite: bool,
    limit: int,
    model_class,
    trust_remote_code: bool,
) -> ConversionPlan:
    """Check the source and the output path, select the Linear weights to quantize and the layout."""
    check_out_dir(out_dir, src_dir)
    if (out_dir.exists() or out_dir.is_symlink()) and not overwrite:
        raise FileExistsError(f"{out_dir}: already exists (pass overwrite=True to replace it)")
    if not src_dir.is_dir():
        raise FileNotFoundError(f"{src_dir}: source directory not found")
    cfg_path = src_dir / CONFIG_NAME
    cfg = read_json(cfg_path, "model config") if (cfg_path.exists() or cfg_path.is_symlink()) else None
    if cfg is not None:
        check_unquantized_config(cfg, cfg_path)
    # only a transformers config (model_type) can be built into a model; diffusers' (_class_name) and none
    # at all go by the tensor-name rules
    by_model = cfg is not None and ("model_type" in cfg or model_class is not None)
    source = TensorSource(src_dir)
    try:
        patterns = skip_patterns(skip)
        if by_model:
            linears = _linear_weights(src_dir, source, model_class, trust_remote_code)
        else:
            shapes = {k: (source.shape(k), source.dtype(k)) for k in source.keys()}
            linears, _ = select_linear_weights(shapes, lambda o, i: None, include_p, exclude_p)
        targets: dict[str, tuple[str, str]] = {}
        unsupported, ignore = [], []
        for name, (key, out_f, in_f) in linears.items():
            if is_skipped(name, patterns) or (include_p and not matches(name, include_p)) or matches(name, exclude_p):
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
            what = "Linear layers" if by_model else "2-D '.weight' tensors passing the name rules of lowbit.io.rules"
            raise ValueError(
                f"convert_checkpoint: no Linear weight in {src_dir} can take scheme {scheme.name} "
                f"({len(linears)} {what}, skip={list(patterns)}, include={list(include_p)}, "
                f"exclude={list(exclude_p)}){detail}"
            )
        if unsupported:
            warnings.warn(
                f"lowbit.convert_checkpoint: {len(unsupported)} layer(s) left unquantized, their shapes do not "
                f"fit {scheme.name}: " + "; ".join(unsupported),
                stacklevel=3,
            )
        probe = QuantLinear(16, 16, False, scheme=scheme)
        layout = choose_layout({"probe": probe}, format)

        # fused siblings share one NVFP4 global scale, from each member's absmax
        name_to_key = {name: key for key, (name, _) in targets.items()}
        shared = scheme.shared_global_scale and layout.name != "lightx2v"  # LightX2V: one scale per weight
        group_of = {n: g for g in (fused_groups(name_to_key) if shared else []) for n in g}
        global_scale = SharedScales(source, dev, group_of, name_to_key)

        ident = {
            "source": str(src_dir.resolve()),
            "fingerprint": _fingerprint(source),
            "scheme": scheme.name,
            "format": layout.name,
            "skip": list(patterns),
            "include": list(include_p),
            "exclude": list(exclude_p),
            "max_shard_size": limit,
            "piece_bytes": convert_layout.PIECE_BYTES,
        }
        shard_keys: dict[Path, list[str]] = {}
        for key, f in source.files.items():
            shard_keys.setdefault(f, []).append(key)
        shard_keys = dict(sorted(shard_keys.items()))
        single = source.index is None and len(shard_keys) == 1
        outputs = convert_layout.plan_outputs(shard_keys, source.shape, source.dtype, targets,
                                              lambda n: n in group_of, scheme, layout, limit, single,
                                              convert_layout.PIECE_BYTES)
    except BaseException:
        source.close()
        raise
    return ConversionPlan(
        src_dir=src_dir, out_dir=out_dir, scheme=scheme, cfg=cfg, source=source, linears=linears, targets=targets,
        ignore=ignore, layout=layout, global_scale=global_scale, ident=ident,
        ident_hash=hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest(),
        shard_keys=shard_keys, single=single, limit=limit, outputs=outputs,
    )


__all__ = ["ConversionPlan", "check_source", "check_unquantized_config", "plan_conversion"]
