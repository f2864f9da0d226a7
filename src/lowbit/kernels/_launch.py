"""One kernel launch, fixed once (kernel, grid, constexprs, warps) and run two ways:

- :meth:`Launch.run` (eager): the first call goes through Triton's launcher (``kernel[grid](...)``, which
  binds the arguments, specializes and compiles); later calls run the compiled kernel directly
  (``CompiledKernel.run``), a few microseconds of host time instead of tens. The cached kernel is only valid
  for arguments with the same specialization, so a ``Launch`` belongs to one weight, one row count bucket
  and one device, and its callers pass 16-byte aligned tensors (they copy misaligned inputs).
- :meth:`Launch.traced` (inside a ``torch.library.triton_op`` body): ``wrap_triton(kernel)[grid](...)``, so
  that ``torch.compile`` sees the kernel and launches it from its generated code.

Triton's launch hooks (profilers) are honoured: while one is set, every call goes through Triton.
"""

from __future__ import annotations

import torch

DIRECT_LAUNCH = True
"""Run cached compiled kernels directly (tests turn it off to compare against Triton's own launches)."""


def _constexpr_tail(fn, consts: dict) -> tuple:
    """The constexpr values in the kernel's parameter order (defaults where ``consts`` has none): the compiled
    launcher takes every parameter positionally and ignores the constexpr ones."""
    params = getattr(fn, "params", None)
    if params is None:
        return tuple(consts.values())
    return tuple(consts.get(p.name, p.default) for p in params if p.is_constexpr)


class Launch:
    """``fn[grid](*args, **consts, num_warps=..., num_stages=...)`` with everything but ``args`` fixed."""

    __slots__ = ("fn", "grid", "consts", "num_warps", "num_stages", "compiled", "_tail")

    def __init__(self, fn, grid: tuple, consts: dict, num_warps: int, num_stages: int | None = None) -> None:
        self.fn = fn
        self.grid = tuple(int(g) for g in grid) + (1,) * (3 - len(grid))
        self.consts = dict(consts)
        self.num_warps = num_warps
        self.num_stages = num_stages
        self.compiled = None
        self._tail = _constexpr_tail(fn, self.consts)

    def _options(self) -> dict:
        opts = {"num_warps": self.num_warps}
        if self.num_stages is not None:
            opts["num_stages"] = self.num_stages
        return opts

    def run(self, device_index: int, *args) -> None:
        """Launch on the current stream of CUDA device ``device_index`` (the current device)."""
        ck = self.compiled
        if ck is not None and DIRECT_LAUNCH:
            hooks = _hooks()
            if not hooks.launch_enter_hook.calls and not hooks.launch_exit_hook.calls:
                g = self.grid
                ck.run(g[0], g[1], g[2], torch._C._cuda_getCurrentRawStream(device_index), ck.function,
                       ck.packed_metadata, None, None, None, *args, *self._tail)
                return
        ck = self.fn[self.grid](*args, **self.consts, **self._options())
        if hasattr(ck, "result"):
            ck = ck.result()
        if self.compiled is None and hasattr(ck, "packed_metadata") and hasattr(ck, "function"):
            self.compiled = ck

    def traced(self, *args) -> None:
        """The launch as ``torch.compile`` traces it (call inside a ``triton_op`` body)."""
        from torch.library import wrap_triton

        wrap_triton(self.fn)[self.grid](*args, **self.consts, **self._options())


def _hooks():
    import triton

    return triton.knobs.runtime


__all__ = ["DIRECT_LAUNCH", "Launch"]
