"""Block-level CPU offload with prefetch, and lazy (per-block) loading of quantized checkpoints.

A diffusion transformer runs the same stack of blocks once per denoising step; its weights need not all sit
on the GPU. :func:`enable_block_offload` keeps every block's tensors in host memory (pinned when the device is
CUDA) and gives the device ``prefetch + 1`` *slots*, each a persistent set of device tensors shaped like one
block's. While a block computes in its slot, the copies of the next ``prefetch`` blocks (cyclically, so block 0
of the next step follows the last block) into the slots that finished earliest run on a side CUDA stream (LightX2V's block offload, which keeps two
CUDA buffers the same way). At most ``prefetch + 1`` blocks are resident, and nothing is allocated per step.

Ordering, per slot (CUDA):

- a copy into a slot waits (on the side stream) for the event recorded on the compute stream right after the
  slot's previous block finished its forward, so a slot is never overwritten while a kernel may still read it;
- the block's forward waits (on the compute stream) for the event recorded after its copy, so it never reads a
  half-copied slot;
- the host tensors are pinned and never written while copies are in flight, so ``non_blocking`` copies are
  safe. Slots are never freed, so the caching allocator cannot hand their memory to another stream early (the
  reason ``record_stream`` would be needed for per-step allocations).

The blocks must be alike (same tensor names, shapes and dtypes: the blocks of Wan, Flux, HunyuanVideo are), so
one slot can hold any of them. A block's parameters and buffers point at its slot while it runs and back at
the host copies afterwards; :class:`~lowbit.nn.QuantLinear` layers re-prepare their kernel layouts on their
first call after each load (their prepared state is dropped when the tensors move).

On a CPU device the same schedule runs with synchronous copies and no streams (useful for tests and to keep
one code path); on a CUDA device without a CUDA build nothing can run, and that is a ValueError up front.

:func:`lowbit.nn.lazy_load.lazy_load_quantized` (also reachable here) loads a quantized checkpoint into a
user-built module with everything outside the blocks read at once and each block's tensors read from the
memory-mapped safetensors files (``safe_open``) on its first forward; combined with offload (``offload=True``)
a block is read from disk straight into its pinned host buffers, and only the slots live on the device.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from .modules import QuantLinear


def _tensors(block: nn.Module) -> list[tuple[nn.Module, str, bool]]:
    """``(module, name, is_parameter)`` of every non-None parameter and buffer of ``block``, in a fixed order."""
    out = []
    for _, m in block.named_modules():
        for n, p in m._parameters.items():
            if p is not None:
                out.append((m, n, True))
        for n, b in m._buffers.items():
            if b is not None:
                out.append((m, n, False))
    return out


def _get(m: nn.Module, name: str, is_param: bool) -> torch.Tensor:
    return m._parameters[name] if is_param else m._buffers[name]


def _set(m: nn.Module, name: str, is_param: bool, t: torch.Tensor) -> None:
    if is_param:
        old = m._parameters[name]
        m._parameters[name] = nn.Parameter(t, requires_grad=old.requires_grad if old is not None else False)
    else:
        m._buffers[name] = t
    if isinstance(m, QuantLinear):
        m._prepared = None  # its prepared layouts read the tensors it had before


def _signature(block: nn.Module) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
    names = {id(m): n for n, m in block.named_modules()}
    return [(f"{names[id(m)]}.{n}", tuple(_get(m, n, p).shape), _get(m, n, p).dtype) for m, n, p in _tensors(block)]


class _CudaStreams:
    """The side stream and events of the CUDA path."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.side = torch.cuda.Stream(device)

    def compute(self):
        return torch.cuda.current_stream(self.device)

    def on_side(self):
        return torch.cuda.stream(self.side)

    def record(self, stream) -> Any:
        ev = torch.cuda.Event()
        ev.record(stream)
        return ev

    def wait(self, stream, event) -> None:
        if event is not None:
            stream.wait_event(event)


class _SyncStreams:
    """CPU stand-in: one stream, copies run inline, events are complete when recorded."""

    side = "side"

    def compute(self):
        return "compute"

    def on_side(self):
        return contextlib.nullcontext()

    def record(self, stream) -> Any:
        return (stream,)

    def wait(self, stream, event) -> None:
        pass


class BlockOffloader:
    """The state of :func:`enable_block_offload` (see the module docstring). ``log``, when given, receives
    ``("load", block, slot)``, ``("run", block, slot)`` and ``("evict", block, slot)`` in program order."""

    def __init__(
        self,
        blocks: Sequence[nn.Module],
        device: torch.device,
        prefetch: int,
        *,
        pin_memory: bool,
        streams: Any = None,
        log: Callable[[tuple], None] | None = None,
        materialize: Callable[[int], None] | None = None,
    ) -> None:
        self.blocks = list(blocks)
        self.device = device
        self.prefetch = prefetch
        self.n_slots = min(prefetch + 1, len(self.blocks))
        self.streams = streams if streams is not None else (
            _CudaStreams(device) if device.type == "cuda" else _SyncStreams()
        )
        self.log = log
        self.pin_memory = pin_memory
        self._materialize = materialize
        self._host: list[list[torch.Tensor] | None] = [None] * len(self.blocks)
        self._entries = [_tensors(b) for b in self.blocks]
        self._slots: list[list[torch.Tensor] | None] = [None] * self.n_slots
        self._slot_block: list[int | None] = [None] * self.n_slots  # block whose copy the slot holds/receives
        self._slot_of: dict[int, int] = {}
        self._touched = [0] * self.n_slots
        self._clock = 0
        self._loaded_ev: dict[int, Any] = {}
        self._free_ev: list[Any] = [None] * self.n_slots
        self._handles: list[Any] = []
        self._ref_sig: list | None = None
        self._ref_block = 0
        self.resident: set[int] = set()
        self.max_resident = 0
        for i, block in enumerate(self.blocks):
            if materialize is None:
                self._adopt(i)
            self._handles.append(block.register_forward_pre_hook(self._pre_hook(i)))
            self._handles.append(block.register_forward_hook(self._post_hook(i)))

    # ------------------------------------------------------------------ host side

    def _adopt(self, i: int) -> None:
        """Take block ``i``'s tensors as the host copies (pinned on CUDA) and point the block at them."""
        entries = _tensors(self.blocks[i])
        sig = _signature(self.blocks[i])
        if self._ref_sig is None:
            self._ref_sig, self._ref_block = sig, i
        elif sig != self._ref_sig:
            diff = next((a, b) for a, b in zip([*sig, None], [*self._ref_sig, None]) if a != b)
            raise ValueError(
                f"blocks: block {i} differs from block {self._ref_block} ({diff[0]} vs {diff[1]}); offloaded "
                "blocks must have the same tensor names, shapes and dtypes so that one device slot can hold any"
            )
        host = []
        for m, n, p in entries:
            t = _get(m, n, p).detach()
            if t.device.type == "meta":
                raise ValueError(f"blocks: block {i} tensor {n!r} is on the meta device (load weights first)")
            t = t.to("cpu")
            if self.pin_memory and not t.is_pinned():
                t = t.pin_memory()
            host.append(t)
            _set(m, n, p, t)
        self._entries[i] = entries
        self._host[i] = host

    def _slot_tensors(self, s: int, i: int) -> list[torch.Tensor]:
        if self._slots[s] is None:
            self._slots[s] = _slot_views(self._host[i], self.device)
        return self._slots[s]

    # ------------------------------------------------------------------ schedule

    def _pick_slot(self) -> int:
        """The slot touched longest ago (loaded or run) that holds no resident block: with ``prefetch + 1``
        slots that is the slot of the block that finished earliest, whatever the number of blocks (a fixed
        ``block % slots`` map would put the last block and block 0 of the next step in one slot)."""
        busy = {self._slot_of[b] for b in self.resident if b in self._slot_of}
        free = [s for s in range(self.n_slots) if s not in busy]
        return min(free, key=lambda s: self._touched[s])

    def _load(self, i: int) -> None:
        """Start copying block ``i`` into a slot (after the slot's previous block finished)."""
        if i in self._slot_of:
            return
        if self._host[i] is None:
            self._materialize(i)
            self._adopt(i)
        s = self._pick_slot()
        old = self._slot_block[s]
        if old is not None:
            del self._slot_of[old]
        dst = self._slot_tensors(s, i)
        side = self.streams.side
        self.streams.wait(side, self._free_ev[s])
        with self.streams.on_side():
            for d, h in zip(dst, self._host[i], strict=True):
                d.copy_(h, non_blocking=True)
            self._loaded_ev[i] = self.streams.record(side)
        self._slot_block[s] = i
        self._slot_of[i] = s
        self._clock += 1
        self._touched[s] = self._clock
        if self.log is not None:
            self.log(("load", i, s))

    def _pre_hook(self, i: int):
        def hook(module, args):
            self._load(i)
            s = self._slot_of[i]
            self.streams.wait(self.streams.compute(), self._loaded_ev.pop(i, None))
            for (m, n, p), t in zip(self._entries[i], self._slots[s], strict=True):
                _set(m, n, p, t)
            self.resident.add(i)
            self._clock += 1
            self._touched[s] = self._clock
            self.max_resident = max(self.max_resident, len(self.resident) + self._pending())
            if self.log is not None:
                self.log(("run", i, s))
            # prefetch the next blocks (cyclically: the next step starts again at block 0)
            for j in range(1, self.prefetch + 1):
                nxt = (i + j) % len(self.blocks)
                if nxt != i:
                    self._load(nxt)
            self.max_resident = max(self.max_resident, len(self.resident) + self._pending())

        return hook

    def _pending(self) -> int:
        return sum(1 for b in self._slot_block if b is not None and b not in self.resident)

    def _post_hook(self, i: int):
        def hook(module, args, output):
            s = self._slot_of[i]
            self._free_ev[s] = self.streams.record(self.streams.compute())
            for (m, n, p), t in zip(self._entries[i], self._host[i], strict=True):
                _set(m, n, p, t)
            # the slot keeps block i's copy until another block is loaded into it (a re-run of i needs no copy)
            self.resident.discard(i)
            if self.log is not None:
                self.log(("evict", i, s))

        return hook

    def remove(self) -> None:
        """Remove the hooks; the blocks keep their host tensors (move the model where you want it)."""
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self._slots = [None] * self.n_slots
        self._slot_block = [None] * self.n_slots
        self._slot_of = {}

    @property
    def slot_bytes(self) -> int:
        """Device bytes of the slots allocated so far (a slot's one buffer, alignment padding included)."""
        total = 0
        for slot in self._slots:
            if not slot:
                continue
            bases = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in slot}
            total += sum(bases.values())
        return total


SLOT_ALIGN = 512
"""Byte alignment of each tensor inside a slot's buffer: what a separate allocation of the caching allocator
gets, so kernels see the same alignment as for tensors of their own."""


def _slot_views(host: list[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    """Device tensors shaped like ``host``: views into one buffer (each at a ``SLOT_ALIGN``-aligned offset).
    One allocation per slot, not one per tensor: the caching allocator rounds each large allocation up to its
    2 MiB segments and leaves a remainder of up to 1 MiB unsplit (a 13824 x 5120 bf16 weight takes 136 MiB for
    its 135), which per-tensor slots paid for every such weight. Non-contiguous host tensors (rare) keep
    their strides in tensors of their own."""
    if not all(t.is_contiguous() for t in host):
        return [torch.empty_like(t, device=device) for t in host]
    offsets, end = [], 0
    for t in host:
        offsets.append(end)
        end += -(-(t.numel() * t.element_size()) // SLOT_ALIGN) * SLOT_ALIGN
    buf = torch.empty(max(end, 1), dtype=torch.uint8, device=device)
    return [buf[o:o + t.numel() * t.element_size()].view(t.dtype).view(t.shape) for o, t in zip(offsets, host)]


def check_blocks(model: nn.Module, blocks: Any) -> list[nn.Module]:
    """``blocks`` (a submodule name, an ``nn.ModuleList`` / ``nn.Sequential`` or a sequence of modules) as a
    non-empty list of submodules of ``model``; TypeError / ValueError naming the rule otherwise."""
    if isinstance(blocks, str):
        try:
            blocks = model.get_submodule(blocks)
        except AttributeError:
            raise ValueError(f"blocks: model has no submodule {blocks!r}") from None
    if isinstance(blocks, nn.Module) and not isinstance(blocks, (nn.ModuleList, nn.Sequential)):
        raise TypeError(f"blocks must be a sequence of modules (nn.ModuleList), got {type(blocks).__name__}")
    try:
        out = list(blocks)
    except TypeError:
        raise TypeError(f"blocks must be a sequence of modules, got {type(blocks).__name__}") from None
    if not out or not all(isinstance(b, nn.Module) for b in out):
        raise ValueError("blocks must be a non-empty sequence of nn.Module")
    inside = {id(m) for m in model.modules()}
    if any(id(b) not in inside for b in out):
        raise ValueError("blocks must be submodules of model")
    return out


def enable_block_offload(
    model: nn.Module,
    blocks: Sequence[nn.Module] | str,
    device: str | torch.device = "cuda",
    prefetch: int = 1,
    *,
    pin_memory: bool | None = None,
    _streams: Any = None,
    _log: Callable[[tuple], None] | None = None,
    _materialize: Callable[[int], None] | None = None,
) -> BlockOffloader:
    """Run ``blocks`` from host memory through ``prefetch + 1`` device slots; everything else of ``model`` moves
    to ``device``.

    Args:
        model: the module (it is modified: its non-block tensors move to ``device``, the blocks' to host
            memory).
        blocks: the blocks (``model.blocks``) or the submodule name (``"blocks"``); they must be alike (same
            tensor names, shapes, dtypes) and run in order each step.
        device: the compute device (``"cuda"``, ``"cuda:1"``; ``"cpu"`` runs the same schedule synchronously).
        prefetch: blocks copied ahead on the side stream (>= 1); peak device memory is ``prefetch + 1`` blocks'
            weights plus the rest of the model and the activations.
        pin_memory: pin the host copies (default: on for CUDA), needed for asynchronous copies.

    Returns:
        The :class:`BlockOffloader` (``.remove()`` undoes the hooks; ``.max_resident`` counts the blocks that
        were resident or in flight at once).
    """
    from ..io.checkpoint import parse_device

    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    dev = parse_device(device)
    if dev.type == "cuda" and _streams is None and not torch.cuda.is_available():
        raise ValueError(f"device {str(dev)!r}: CUDA is not available here; use device='cpu' or a CUDA machine")
    if isinstance(prefetch, bool) or not isinstance(prefetch, int) or prefetch < 1:
        raise ValueError(f"prefetch must be an int >= 1 (blocks copied ahead), got {prefetch!r}")
    block_list = check_blocks(model, blocks)
    if pin_memory is None:
        pin_memory = dev.type == "cuda" and _streams is None
    in_blocks = {id(t) for b in block_list for t in (*b.parameters(), *b.buffers())}
    # everything outside the blocks goes to the device once
    for m in model.modules():
        if any(m is b for b in block_list):
            continue
        for n, p in list(m._parameters.items()):
            if p is not None and id(p) not in in_blocks and p.device != dev and p.device.type != "meta":
                _set(m, n, True, p.detach().to(dev))
        for n, b in list(m._buffers.items()):
            if b is not None and id(b) not in in_blocks and b.device != dev and b.device.type != "meta":
                _set(m, n, False, b.to(dev))
    return BlockOffloader(
        block_list, dev, prefetch, pin_memory=pin_memory, streams=_streams, log=_log, materialize=_materialize
    )


def __getattr__(name: str):
    # lazy_load_quantized lives in lowbit.nn.lazy_load (it imports this module); reachable here as before
    if name == "lazy_load_quantized":
        from .lazy_load import lazy_load_quantized

        return lazy_load_quantized
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["BlockOffloader", "check_blocks", "enable_block_offload"]
