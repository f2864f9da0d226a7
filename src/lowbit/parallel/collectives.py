"""The sum a row-parallel layer's partial outputs go through.

- :class:`NcclAllReduce` (default): ``torch.distributed.all_reduce`` in place on the layer's fresh output
  (whatever backend the group has: NCCL on GPUs, gloo on CPU); under ``torch.compile`` the functional
  all-reduce, which Inductor schedules.
- :class:`SymmMemAllReduce`: for small messages (decode: one token's hidden state), torch's symmetric-memory
  one-shot all-reduce (``torch.ops.symm_mem.one_shot_all_reduce_copy``): each rank copies its partial sum into
  a buffer every rank can read over NVLink and one kernel sums them, which avoids NCCL's per-call protocol
  latency. It uses peer loads only, never NVLink multicast. Larger messages (prefill) and dtypes without a
  buffer go to NCCL. The buffers are allocated and exchanged once, at setup, on every rank together.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

ALL_REDUCES = ("nccl", "symm_mem")


class NcclAllReduce:
    """Sum over the group with the process group's own all-reduce (module docstring)."""

    name = "nccl"

    def __init__(self, group) -> None:
        self.group = group

    def __call__(self, y: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():
            import torch.distributed._functional_collectives as funcol

            return funcol.all_reduce(y, "sum", self.group)
        dist.all_reduce(y, group=self.group)
        return y


class SymmMemAllReduce(NcclAllReduce):
    """One-shot all-reduce through symmetric memory for messages up to ``max_bytes`` (module docstring).

    Args:
        group: the tensor-parallel process group (NCCL, CUDA devices).
        device: this rank's CUDA device.
        max_bytes: the largest message summed this way; larger ones go to NCCL.
        dtypes: output dtypes that get a buffer.
    """

    name = "symm_mem"

    def __init__(self, group, device: torch.device, max_bytes: int = 1 << 20,
                 dtypes: tuple[torch.dtype, ...] = (torch.bfloat16, torch.float16)) -> None:
        super().__init__(group)
        import torch.distributed._symmetric_memory as symm_mem

        if device.type != "cuda":
            raise ValueError(f"all_reduce='symm_mem' needs CUDA devices, got {device}")
        self.group_name = group.group_name
        self.max_bytes = int(max_bytes)
        self.buffers: dict[torch.dtype, torch.Tensor] = {}
        for dtype in dtypes:
            numel = self.max_bytes // torch.empty((), dtype=dtype).element_size()
            buf = symm_mem.empty(numel, dtype=dtype, device=device)
            symm_mem.rendezvous(buf, self.group_name)
            self.buffers[dtype] = buf
        self._op = torch.ops.symm_mem.one_shot_all_reduce_copy

    def __call__(self, y: torch.Tensor) -> torch.Tensor:
        buf = self.buffers.get(y.dtype)
        if buf is None or torch.compiler.is_compiling() or y.numel() > buf.numel() or not y.is_contiguous():
            return super().__call__(y)
        n = y.numel()
        return self._op(buf[:n], y.view(-1), "sum", self.group_name).view(y.shape)


_SHARED: dict[tuple, NcclAllReduce] = {}


def all_reduce_for(kind: str, group, device: torch.device) -> NcclAllReduce:
    """The all-reduce of ``kind`` (:data:`ALL_REDUCES`) for ``group``, made once per group and device (a
    symmetric-memory one allocates its buffers on every rank at that moment: call it on all ranks alike)."""
    if kind not in ALL_REDUCES:
        raise ValueError(f"all_reduce must be one of {ALL_REDUCES}, got {kind!r}")
    key = (kind, id(group), str(device))
    out = _SHARED.get(key)
    if out is None:
        out = _SHARED[key] = NcclAllReduce(group) if kind == "nccl" else SymmMemAllReduce(group, device)
    return out


__all__ = ["ALL_REDUCES", "NcclAllReduce", "SymmMemAllReduce", "all_reduce_for"]
