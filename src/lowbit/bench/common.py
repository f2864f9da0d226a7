"""Helpers the op modules share (inputs, weight copies rotated out of L2, tolerance checks, optional baselines)
and the command-line benchmarks (``--modes`` and ``--device``, errors in result rows).

Nothing here runs at import; torch is imported by the callers anyway (``lowbit`` needs it).
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable, Sequence
from typing import Any

import torch

from .registry import Baseline

REL_FRO = 1e-2
"""Largest relative Frobenius error of a matmul case against its fp32 reference (lowbit's GPU tests' bound)."""
REL_MAX = 2e-2
"""Largest ``max |error| / max |reference|`` of a matmul case."""
L2_FALLBACK = 50 << 20
"""L2 size assumed where the device does not report one (an H100 has 50 MB)."""
L2_MULTIPLE = 3
"""Rotated copies of a weight add up to at least this many L2 caches, so every call reads from HBM."""


def randn(shape: Sequence[int], device: str, seed: int = 0, scale: float = 1.0,
          dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """``scale * N(0, 1)`` of ``shape`` in ``dtype``, the same values on every run for a given ``seed``."""
    g = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(tuple(shape), generator=g, device=device, dtype=torch.float32)
    return (x * scale).to(dtype) if scale != 1.0 else x.to(dtype)


def l2_bytes(device: str | torch.device) -> int:
    """The L2 cache of a CUDA device (0 elsewhere: no copies needed)."""
    dev = torch.device(device)
    if dev.type != "cuda":
        return 0
    props = torch.cuda.get_device_properties(dev)
    return int(getattr(props, "L2_cache_size", 0) or L2_FALLBACK)


def copies(nbytes: int, device: str | torch.device) -> int:
    """How many copies of a tensor of ``nbytes`` fill :data:`L2_MULTIPLE` L2 caches (1 off CUDA, or when one
    copy is already that large): calls that cycle through them read every byte from HBM, also in CUDA-graph
    replays, where nothing flushes L2 between calls."""
    l2 = l2_bytes(device)
    return max(1, math.ceil(L2_MULTIPLE * l2 / max(int(nbytes), 1))) if l2 else 1


def rotating(fns: Sequence[Callable[[], Any]]) -> Callable[[], Any]:
    """One callable that calls ``fns[0]``, ``fns[1]``, ... in turn (a CUDA graph captured over several calls
    holds them in that order)."""
    fns = list(fns)
    if len(fns) == 1:
        return fns[0]
    state = [0]

    def call():
        i = state[0]
        state[0] = (i + 1) % len(fns)
        return fns[i]()

    return call


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of the parameters and persistent buffers, each tensor once (tied ones too): what a checkpoint of the
    model holds (the KV cache and RoPE tables, non-persistent buffers, are not weights; a tensor subclass such
    as torchao's counts its inner tensors). ``state_dict(keep_vars=True)`` hands out the module's own tensor
    objects; a plain ``state_dict()`` detaches them into new ones, which no identity check can pair with the
    parameters."""
    seen: set[int] = set()
    total = 0
    for t in model.state_dict(keep_vars=True).values():
        if not isinstance(t, torch.Tensor) or id(t) in seen:
            continue
        seen.add(id(t))
        if hasattr(t, "__tensor_flatten__"):
            names, _ = t.__tensor_flatten__()
            total += sum(getattr(t, n).numel() * getattr(t, n).element_size() for n in names)
        else:
            total += t.numel() * t.element_size()
    return total


def rel_errors(out: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    """(relative Frobenius error, max |error| / max |ref|) of ``out`` against ``ref``, in fp32."""
    o, r = out.float(), ref.float()
    err = o - r
    rn = r.norm().item()
    rm = r.abs().max().item() if r.numel() else 0.0
    fro = err.norm().item() / rn if rn else (0.0 if err.norm().item() == 0 else math.inf)
    mx = err.abs().max().item() / rm if rm else (0.0 if not err.numel() or err.abs().max().item() == 0 else math.inf)
    return fro, mx


def close(out: torch.Tensor, ref: torch.Tensor, what: str = "output", rel_fro: float = REL_FRO,
          rel_max: float = REL_MAX) -> str:
    """The check of a matmul case: raises AssertionError unless ``out`` is within the bounds of ``ref`` (and
    finite, of the same shape); returns the measured errors as the row's ``check`` text."""
    assert tuple(out.shape) == tuple(ref.shape), f"{what}: shape {tuple(out.shape)}, reference {tuple(ref.shape)}"
    assert bool(torch.isfinite(out).all()), f"{what}: non-finite values"
    fro, mx = rel_errors(out, ref)
    text = f"rel_fro {fro:.1e} <= {rel_fro:.0e}, rel_max {mx:.1e} <= {rel_max:.0e}"
    assert fro <= rel_fro and mx <= rel_max, f"{what}: {text.replace('<=', 'must be <=')}"
    return text


def _raise_dynamo_limits() -> None:
    # the same reference function is compiled for several formats and shapes; past the default recompile
    # limit dynamo would silently run it eagerly and the baseline would be meaningless
    import torch._dynamo

    cfg = torch._dynamo.config
    for name, floor in (
        ("recompile_limit", 256),
        ("cache_size_limit", 256),
        ("accumulated_recompile_limit", 4096),
        ("accumulated_cache_size_limit", 4096),
    ):
        if hasattr(cfg, name):
            setattr(cfg, name, max(getattr(cfg, name), floor))


def compiled(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``torch.compile(fn, dynamic=False)`` with the recompile limits raised (compiles on first call)."""
    _raise_dynamo_limits()
    return torch.compile(fn, dynamic=False)


def optional(build: Callable[[], Callable[[], Any]], package: str) -> Baseline:
    """``build()``, or the reason it cannot run here (package missing, or its setup raising)."""
    try:
        return build()
    except ImportError as e:
        return f"{package} not installed ({e})"
    except Exception as e:  # noqa: BLE001 - a baseline that cannot be set up is reported, never fatal
        return f"{package} setup failed: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]


def lowbit_config(config: str, modes: Sequence[str], known: str) -> tuple[str, str]:
    """``(scheme, mode)`` of a model benchmark's config ``lowbit:<scheme>`` or ``lowbit:<scheme>+<mode>`` (mode
    one of ``modes``; ``""`` without one). ValueError naming the config and ``known`` (the accepted forms)
    for anything else."""
    kind, _, name = config.partition(":")
    scheme, _, mode = name.partition("+")
    if kind != "lowbit" or not scheme or mode not in ("", *modes):
        raise ValueError(f"unknown config {config!r}; known: {known}")
    return scheme, mode


def fuse_or_fail(model: torch.nn.Module, config: str, gated_mlp: bool = False) -> None:
    """``lowbit.nn.fuse_projections(model, gated_mlp=...)`` for a ``+fused`` / ``+gated`` config; ValueError if
    nothing could be fused (a scheme whose weights do not stack), or, with ``gated_mlp``, no MLP became gated,
    so that such a config never runs as something else under its name."""
    from ..nn import GatedMLP, fuse_projections

    if not fuse_projections(model, gated_mlp=gated_mlp):
        raise ValueError(f"config {config!r}: no projections of this scheme could be fused")
    if gated_mlp and not any(isinstance(m, GatedMLP) for m in model.modules()):
        raise ValueError(f"config {config!r}: no MLP of this scheme could be gated")


def on_cuda(device: str) -> bool:
    return torch.device(device).type == "cuda"


def short_error(e: BaseException) -> str:
    """``"<ExceptionType>: <first line of the message, at most 300 characters>"``, as result rows hold errors."""
    return f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"


def modes_and_device(args: Any, prog: str, known: Sequence[str], cuda_only: Sequence[str]) -> torch.device | None:
    """The torch device of a benchmark command's ``args.device``; ``args.modes`` (comma-separated, each one of
    ``known``) becomes the list of modes, less those of ``cuda_only`` off CUDA. None after printing why to
    stderr: an unknown mode, or CUDA asked for on a machine without it."""
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    bad = [m for m in modes if m not in known]
    if bad:
        print(f"{prog}: unknown modes {bad}; known: {', '.join(known)}", file=sys.stderr)
        return None
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print(f"{prog}: needs a CUDA GPU (or --device cpu with --shape tiny)", file=sys.stderr)
        return None
    args.modes = modes if device.type == "cuda" else [m for m in modes if m not in cuda_only]
    return device
