"""What ``lowbit.ops.linear`` and ``lowbit.ops.scaled_mm`` share: kernel lookup, the common dispatch rules, the
check of the activation x, the plan's common fields and one-line form, and passing a QTensor through a
``torch.library`` custom op.

A QTensor is not a tensor, so each custom op takes it flattened into its tensors plus ``meta``: the
QTensor's non-tensor fields as ``key=T:value`` items joined by ';' (T: b bool, i int, f float, s str, n None,
p a tuple of ints ``"1,128"``, t an index into the param tensors); ``@dtype`` and ``@scale_layout`` are the
QTensor fields, the other keys its params. A plain string, so dynamo builds it at trace time and the graph
holds it as a constant. Which tensors an op takes, and which value kinds it accepts, is each module's own
(``lowbit.linear`` encodes no None and no int tuples).
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import Enum
from types import ModuleType
from typing import Any

import torch

from .. import kernels as _kernels
from ..formats.qtensor import QTensor

DTYPES = {str(d).removeprefix("torch."): d for d in (torch.float32, torch.bfloat16, torch.float16)}
"""``"float32"`` etc. -> the QTensor dtype (``@dtype`` in ``meta``)."""


# ---------------------------------------------------------------------------------------------- dispatch


@functools.cache
def kernel_module(name: str) -> ModuleType | None:
    """``lowbit.kernels.<name>`` if that module exists, else None (import errors inside it propagate)."""
    full = f"lowbit.kernels.{name}"
    if importlib.util.find_spec(full) is None:
        return None
    return importlib.import_module(full)


def kernel_choice(
    lookup: Callable[[str], ModuleType | None], name: str, *operands: Any
) -> tuple[ModuleType | None, str | None]:
    """(module, None) when kernel ``name`` can run ``operands`` (its ``supports(*operands)`` returns None),
    else (None, why not). ``lookup`` is the caller's ``kernel_module`` (looked up there on every call, so a
    test can replace it per module)."""
    module = lookup(name)
    if module is None:
        return None, f"no module lowbit.kernels.{name}"
    why = module.supports(*operands)
    if why is not None:
        return None, why
    return module, None


def decide_common(backend: str, device: torch.device, empty: bool) -> tuple[str, Any, tuple] | None:
    """The dispatch rules both operators share, before a kernel is chosen: ``(path, target, facts)`` for
    the reference, ``"unavailable"`` (triton off CUDA, no triton) or ``"empty"``; None when a kernel should
    be looked for."""
    if backend == "torch":
        return "reference", None, ("torch",)
    if device.type != "cuda":
        if backend == "triton":
            return "unavailable", ValueError, ("triton_off_cuda",)
        return "reference", None, ("off_cuda",)
    if empty:
        return "empty", None, ()
    no_triton = _kernels.triton_available()
    if no_triton:
        return "unavailable", RuntimeError, ("no_triton", no_triton)
    return None


@dataclass(frozen=True)
class Plan:
    """What an operator does for one call: the fields ``lowbit.ops.LinearPlan`` and ``lowbit.ops.ScaledMMPlan``
    share (each adds what describes its operands and the exception class of an ``"unavailable"`` call).

    Attributes:
        path: the path the call takes (each operator lists its own); ``"unavailable"``: the call raises.
        reason: one sentence saying why.
        backend: the resolved backend (``"auto"``, ``"triton"`` or ``"torch"``).
        device: the operands' device (as a string).
        m, n, k: the product's M (activation rows), N (output features) and K.
    """

    path: str
    reason: str
    backend: str
    device: str
    m: int
    n: int
    k: int


def check_x(x: Any, w: QTensor, op: str, dtypes: tuple, dtype_names: str) -> None:
    """TypeError / ValueError (messages prefixed with ``op``) unless ``x`` is a tensor of one of ``dtypes``
    (``dtype_names`` in words) whose last dim is the weight's K."""
    k = w.shape[-1]
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{op}: x must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in dtypes:
        raise TypeError(f"{op}: x must be {dtype_names}, got {x.dtype}")
    if x.dim() < 1 or x.shape[-1] != k:
        raise ValueError(
            f"{op}: K mismatch: x.shape[-1] must equal w.shape[-1] = {k} (w is [N, K] = "
            f"{tuple(w.shape)}), got x.shape = {tuple(x.shape)}"
        )


def plan_str(op: str, operands: str, plan: Any) -> str:
    """The one-line form of a ``LinearPlan`` / ``ScaledMMPlan`` (``op``: ``"linear"`` or ``"scaled_mm"``)."""
    head = f"lowbit.{op} {operands} [M={plan.m}, K={plan.k}] x [N={plan.n}, K={plan.k}] on {plan.device}"
    if plan.path == "unavailable":
        return f"{head}, backend={plan.backend!r}: raises {plan.error.__name__}: {plan.reason}"
    return f"{head}, backend={plan.backend!r}: {plan.path} ({plan.reason})"


# ---------------------------------------------------------------------------------------------- custom ops


def encode(key: str, value: Any, tensors: list[torch.Tensor], *, op: str, what: str, extended: bool) -> str:
    """One ``meta`` item; a tensor value is appended to ``tensors``. ``extended``: None and int tuples too.
    Anything else raises ``TypeError("<op>: cannot pass <what> <key>=<value!r> through the custom op")``."""
    if isinstance(value, Enum):
        value = value.value
    if extended and value is None:
        return f"{key}=n:"
    if isinstance(value, torch.Tensor):
        tensors.append(value)
        return f"{key}=t:{len(tensors) - 1}"
    if isinstance(value, bool):
        return f"{key}=b:{int(value)}"
    if isinstance(value, int):
        return f"{key}=i:{_decimal(value)}"
    if isinstance(value, float):
        return f"{key}=f:{value!r}"
    if extended and isinstance(value, (tuple, list)) and all(
        isinstance(v, int) and not isinstance(v, bool) for v in value
    ):
        return f"{key}=p:{','.join(_decimal(v) for v in value)}"
    if isinstance(value, str) and ";" not in value and "=" not in value:
        return f"{key}=s:{value}"
    raise TypeError(f"{op}: cannot pass {what} {key}={value!r} through the custom op")


def _decimal(value: int) -> str:
    """``str(value)`` that dynamo can trace for a SymInt.

    Under ``torch.compile(dynamic=True)`` torch 2.11 hands ints read from a QTensor's params over as SymInts,
    and dynamo cannot trace ``str()`` (or ``int()`` then ``str()``) of one. Branching on a comparison is what it
    can trace: each ``==`` guards, so the digits come out as constants (the params are format constants)."""
    if value < 0:
        return "-" + _decimal(-value)
    digits = ""
    while True:
        last = value % 10
        for d in range(10):
            if last == d:
                digits = "0123456789"[d] + digits
                break
        value = value // 10
        if value == 0:
            return digits


def flatten_meta(q: QTensor, encode_item: Callable[[str, Any, list[torch.Tensor]], str]) -> tuple[list, str]:
    """``(param_tensors, meta)`` of a QTensor, each item made by ``encode_item(key, value, param_tensors)``."""
    param_tensors: list[torch.Tensor] = []
    items = [
        encode_item("@dtype", str(q.dtype).removeprefix("torch."), param_tensors),
        encode_item("@scale_layout", q.scale_layout, param_tensors),
    ]
    for key in sorted(q.params):
        items.append(encode_item(key, q.params[key], param_tensors))
    return param_tensors, ";".join(items)


@functools.lru_cache(maxsize=256)
def decode_meta(meta: str) -> tuple[tuple[str, str, str], ...]:
    out = []
    for item in meta.split(";") if meta else ():
        key, typed = item.split("=", 1)
        kind, value = typed.split(":", 1)
        out.append((key, kind, value))
    return tuple(out)


def decode_items(meta: str, tensors: Sequence[torch.Tensor]) -> list[tuple[str, Any]]:
    """``[(key, value), ...]`` of a ``meta`` string, tensor items taken from ``tensors``."""
    out = []
    for key, kind, value in decode_meta(meta):
        if kind == "t":
            v: Any = tensors[int(value)]
        elif kind == "n":
            v = None
        elif kind == "b":
            v = value == "1"
        elif kind == "i":
            v = int(value)
        elif kind == "f":
            v = float(value)
        elif kind == "p":
            v = tuple(int(p) for p in value.split(",")) if value else ()
        else:
            v = value
        out.append((key, v))
    return out


def unflatten(
    data: torch.Tensor,
    scale: torch.Tensor,
    param_tensors: Sequence[torch.Tensor],
    fmt: str,
    shape: Sequence[int],
    meta: str,
    **tensor_fields: torch.Tensor | None,
) -> QTensor:
    """The QTensor back from its flattened form; ``tensor_fields`` are its optional tensors (global_scale...)."""
    fields: dict[str, Any] = {}
    params: dict[str, Any] = {}
    for key, v in decode_items(meta, param_tensors):
        if key.startswith("@"):
            fields[key[1:]] = v
        else:
            params[key] = v
    return QTensor(
        data=data,
        scale=scale,
        fmt=fmt,
        shape=torch.Size(shape),
        dtype=DTYPES.get(fields.get("dtype"), torch.float32),
        scale_layout=fields.get("scale_layout", "linear"),
        params=params,
        **tensor_fields,
    )
