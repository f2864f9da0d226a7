"""Which operations read the outputs of a model's norms and Linear layers, from one traced forward.

Smoothing (:mod:`lowbit.algorithms.smoothing`) may fold ``1/s`` into the module that produces a Linear layer's
input only if nothing else reads that output. Module names do not say that (post-norm models reuse a norm's
output as the residual stream), so one calibration forward is traced at the level of torch functions (a
``TorchFunctionMode``), following every candidate producer's output through views and eval-mode dropout to the
operations that read it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode


def is_foldable_norm(m: nn.Module) -> bool:
    """A module that may be a ``normalized * weight (+ bias)`` norm: a 1-D weight of its output width (the
    fold is checked numerically afterwards; Gemma's ``(1 + weight)`` RMSNorm is excluded by name too)."""
    if isinstance(m, nn.Linear) or "Gemma" in type(m).__name__:
        return False
    w = getattr(m, "weight", None)
    return isinstance(w, torch.Tensor) and w.dim() == 1 and w.is_floating_point()


_TRANSPARENT = {
    torch.Tensor.view, torch.Tensor.reshape, torch.reshape, torch.Tensor.contiguous, torch.Tensor.to,
    torch.Tensor.float, torch.Tensor.half, torch.Tensor.bfloat16, torch.Tensor.type_as, torch.Tensor.clone,
    torch.Tensor.detach, torch.clone,
}
"""Operations whose output keeps the input's channels along the last dim (checked: same last-dim size)."""
_METADATA = {"size", "dim", "numel", "stride", "is_contiguous", "element_size", "get_device", "__len__",
             "is_floating_point", "is_complex", "data_ptr", "untyped_storage", "storage_offset", "__get__"}
"""Operations that read a tensor's metadata only (they return no tensor)."""


def _tensors(obj: Any, depth: int = 0):
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)) and depth < 2:
        for o in obj:
            yield from _tensors(o, depth + 1)
    elif isinstance(obj, Mapping) and depth < 2:
        for o in obj.values():
            yield from _tensors(o, depth + 1)


def _name(func: Any) -> str:
    return getattr(func, "__name__", None) or str(func)


class ReaderTrace(TorchFunctionMode):
    """Records, during one forward, which operations read the outputs of the candidate producers."""

    def __init__(self, linear_names: Mapping[nn.Module, str]) -> None:
        super().__init__()
        self.linear_names = linear_names
        self.tracked: dict[int, tuple[str, torch.Tensor]] = {}
        self.readers: dict[str, set[str]] = {}  # producer -> readers ("linear:<name>" or "op:<func>")
        self.inputs: dict[str, list[str | None]] = {}  # linear -> producer of each call's input (None: other)
        self.input_ids: dict[str, int] = {}  # linear -> id of its first call's input
        self.stack: list[nn.Module] = []
        self.keep: list[torch.Tensor] = []  # inputs kept alive so that ids stay unique
        self.paused = 0  # > 0 while lowbit's own statistics hooks run: their reads are not the model's

    def track(self, producer: str, out: Any) -> None:
        if isinstance(out, torch.Tensor) and out.is_floating_point() and out.dim() >= 1:
            self.tracked[id(out)] = (producer, out)
            self.readers.setdefault(producer, set())

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self.paused:
            return out
        srcs = [(t, self.tracked[id(t)]) for t in _tensors((args, kwargs)) if id(t) in self.tracked]
        if func is torch.nn.functional.linear and self.stack and args:
            lin = self.stack[-1]
            name = self.linear_names.get(lin)
            x = args[0]
            if name is not None and len(args) > 1 and args[1] is lin.weight:
                if isinstance(x, torch.Tensor) and name not in self.input_ids:
                    self.input_ids[name] = id(x)
                    self.keep.append(x)
                hit = self.tracked.get(id(x)) if isinstance(x, torch.Tensor) else None
                self.inputs.setdefault(name, []).append(hit[0] if hit is not None else None)
                for t, (producer, _) in srcs:
                    self.readers[producer].add(f"linear:{name}" if t is x else f"op:{_name(func)}")
                return out
        if not srcs:
            return out
        fname = _name(func)
        eval_dropout = func is torch.nn.functional.dropout and not (
            kwargs.get("training", args[2] if len(args) > 2 else True)
        )
        if (func in _TRANSPARENT or eval_dropout) and len(srcs) == 1 and isinstance(out, torch.Tensor):
            t, (producer, _) = srcs[0]
            if args and args[0] is t and out.dim() >= 1 and out.shape[-1] == t.shape[-1]:
                self.track(producer, out)
                return out
        if fname in _METADATA and not any(isinstance(o, torch.Tensor) for o in _tensors(out)):
            return out
        for _, (producer, _) in srcs:
            self.readers[producer].add(f"op:{fname}")
        return out


def trace_readers(
    model: nn.Module, run: Callable[[], Any], pre_hooks: Mapping[nn.Module, Callable] | None = None
) -> tuple[ReaderTrace, dict[str, tuple]]:
    """Run ``run`` (which calls ``model``) and trace the first call of ``model``; returns the trace and, per
    candidate producer, ``(args, output)`` of its first traced call (for the fold check). ``pre_hooks``
    (module -> forward pre-hook) run on every call, outside the trace."""
    modules = dict(model.named_modules())
    linear_names = {m: n for n, m in modules.items() if isinstance(m, nn.Linear)}
    trace = ReaderTrace(linear_names)
    samples: dict[str, tuple] = {}
    state = {"active": False, "done": False}
    handles = []

    def untraced(fn):
        def hook(module, args):
            trace.paused += 1
            try:
                return fn(module, args)
            finally:
                trace.paused -= 1
        return hook

    for m, fn in (pre_hooks or {}).items():
        handles.append(m.register_forward_pre_hook(untraced(fn)))

    def producer_hook(name):
        def fn(module, args, out):
            if state["active"]:
                trace.track(name, out)
                if name not in samples and isinstance(out, torch.Tensor):
                    # copies: later in-place operations of the model must not change the check's reference
                    trace.paused += 1
                    samples[name] = (tuple(a.clone() if isinstance(a, torch.Tensor) else a for a in args),
                                     out.detach().clone())
                    trace.paused -= 1
        return fn

    def push(module, args):
        if state["active"]:
            trace.stack.append(module)

    def pop(module, args, out):
        if state["active"] and trace.stack and trace.stack[-1] is module:
            trace.stack.pop()

    def start(module, args, kwargs):
        if not state["done"] and not state["active"]:
            trace.__enter__()
            state["active"] = True

    def stop(module, args, kwargs, out):
        if state["active"]:
            state["active"] = False
            state["done"] = True
            trace.__exit__(None, None, None)

    for name, m in modules.items():
        if isinstance(m, nn.Linear):
            handles.append(m.register_forward_pre_hook(push))
            handles.append(m.register_forward_hook(pop))
        if is_foldable_norm(m) or isinstance(m, nn.Linear):
            handles.append(m.register_forward_hook(producer_hook(name)))
    handles.append(model.register_forward_pre_hook(start, with_kwargs=True, prepend=True))
    handles.append(model.register_forward_hook(stop, with_kwargs=True))
    try:
        run()
    finally:
        if state["active"]:
            state["active"] = False
            trace.__exit__(None, None, None)
        for h in handles:
            h.remove()
    return trace, samples


__all__ = ["ReaderTrace", "is_foldable_norm", "trace_readers"]
