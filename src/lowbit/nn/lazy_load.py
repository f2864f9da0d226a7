"""Lazy (per-block) loading of a quantized checkpoint into a user-built module, optionally through block offload.

:func:`lazy_load_quantized` reads everything outside the blocks at once and each block's tensors from the
memory-mapped safetensors files on its first forward (see :mod:`lowbit.nn.offload` for the offload it can
combine with)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch
from torch import nn

from .modules import QuantLinear
from .offload import BlockOffloader, check_blocks, enable_block_offload


def lazy_load_quantized(
    path: str | Path,
    model: nn.Module,
    blocks: Sequence[nn.Module] | str,
    *,
    device: str | torch.device = "cpu",
    offload: bool = False,
    prefetch: int = 1,
    dtype: torch.dtype | None = None,
) -> BlockOffloader | None:
    """Load a quantized checkpoint (any layout :func:`lowbit.load_quantized` reads) into ``model`` lazily.

    Everything outside ``blocks`` is read now; each block's tensors stay in the memory-mapped safetensors files
    until the block's first forward, which reads them (``safe_open``), builds its :class:`QuantLinear` layers
    and moves them to ``device`` (or, with ``offload=True``, into pinned host buffers that
    :func:`enable_block_offload` streams through the device slots). ``model`` is modified in place (its block
    tensors may be on the meta device).

    Returns:
        The :class:`BlockOffloader` with ``offload=True``, else None.
    """
    from ..io.checkpoint import checkpoint_dtype, parse_device, quant_config
    from ..io.files import CONFIG_NAME, TensorSource, read_json
    from ..io.layouts import layout_for_config
    from .quantize import linear_layers

    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"{path}: checkpoint directory not found")
    dev = parse_device(device)
    cfg = read_json(path / CONFIG_NAME, "model config")
    qc = quant_config(path, cfg)
    layout = layout_for_config(qc, str(path / CONFIG_NAME))
    qdtype = dtype or checkpoint_dtype(cfg) or torch.bfloat16
    block_list = check_blocks(model, blocks)
    names = {id(m): n for n, m in model.named_modules()}
    prefixes = [names[id(b)] + "." for b in block_list]
    source = TensorSource(path, device="cpu")  # safe_open: memory-mapped, read per tensor
    keys = source.keys()

    def load_into(root: nn.Module, prefix: str, keyset: list[str], target: torch.device | str) -> None:
        local_keys = {k[len(prefix):]: k for k in keyset}
        consumed: set[str] = set()
        mods = dict(root.named_modules())
        for name, lin in linear_layers(root).items():
            pre = name + "."
            local = {k[len(pre):]: ck for k, ck in local_keys.items() if k.startswith(pre) and "." not in k[len(pre):]}
            qlocal = set(local) - {"bias"}
            if not qlocal or not layout.is_quantized(qlocal):
                continue
            loaded = layout.read(prefix + name, qlocal, lambda k, _l=local: source.get(_l[k]), qc, qdtype)
            bias = source.get(local["bias"]) if "bias" in local else None
            if bias is not None and dtype is not None and bias.is_floating_point():
                bias = bias.to(dtype)
            q = QuantLinear(
                lin.in_features, lin.out_features, bias is not None, scheme=loaded.scheme, weight=loaded.weight,
                bias_tensor=bias, input_global_scale=loaded.input_global_scale,
            )
            parent, _, child = name.rpartition(".")
            setattr(mods[parent] if parent else root, child, q.to(target))
            consumed.update(local.values())
        rest = {}
        for k, ck in local_keys.items():
            if ck in consumed:
                continue
            t = source.get(ck)
            if dtype is not None and t.is_floating_point():
                t = t.to(dtype)
            rest[k] = t.to(target)
        root.load_state_dict(rest, strict=False, assign=True)
        missing = [n for n, t in (*root.named_parameters(), *root.named_buffers()) if t.device.type == "meta"]
        if missing:
            raise ValueError(f"{path}: tensors missing from the checkpoint for {prefix}{missing[0]} and others")

    in_block = [[k for k in keys if k.startswith(p)] for p in prefixes]
    outside = [k for k in keys if not any(k.startswith(p) for p in prefixes)]

    # the rest of the model, now: blocks are swapped out of the module tree while it loads
    holder = {}
    for b in block_list:
        for n, m in model.named_modules():
            for cn, c in list(m._modules.items()):
                if c is b:
                    holder[(id(m), cn)] = (m, cn, c)
    for m, cn, _ in holder.values():
        m._modules[cn] = nn.Identity()
    try:
        load_into(model, "", outside, dev)
    finally:
        for m, cn, c in holder.values():
            m._modules[cn] = c

    host = "cpu" if offload else dev
    loaded = [False] * len(block_list)

    def materialize(i: int) -> None:
        if not loaded[i]:
            load_into(block_list[i], prefixes[i], in_block[i], host)
            loaded[i] = True

    if offload:
        return enable_block_offload(model, block_list, dev, prefetch, _materialize=materialize)

    def pre(i):
        def hook(module, args):
            materialize(i)

        return hook

    for i, b in enumerate(block_list):
        b.register_forward_pre_hook(pre(i))
    return None


__all__ = ["lazy_load_quantized"]
