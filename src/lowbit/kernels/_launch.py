"""One kernel launch, fixed once (kernel, grid, constexprs, warps) and run two ways:

- :meth:`Launch.run` (eager): the first call goes through Triton's launcher (``kernel[grid](...)``, which
  binds the arguments, specializes and compiles); later calls run the compiled kernel directly
  (``CompiledKernel.run``), a few microseconds of host time instead of tens. The cached kernel is only valid
  for arguments with the same specialization, so a ``Launch`` belongs to one weight, one row count bucket
  and one device, and its callers pass 16-byte aligned tensors (they copy misaligned inputs).
- :meth:`Launch.traced` (inside a ``torch.library.triton_op`` body): ``wrap_triton(kernel)[grid](...)``, so
  that ``torch.compile`` sees the kernel and launches it from its generated code.

Host TMA descriptors: a caller passes a :class:`LazyDescriptor` (the tensor and the block, nothing built) where
the kernel takes a ``triton.tools.tensor_descriptor.TensorDescriptor``. Through Triton it becomes one; a compiled
launch bound to the launcher's C entry encodes it itself, keeping the encoded ``CUtensorMap`` of the last few
(address, shape, strides), which is all that a descriptor of a fixed block and dtype depends on: no descriptor
object, no per-argument Python loop of Triton's wrapper per call.

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


class LazyDescriptor:
    """A host TMA descriptor of ``base`` (``shape`` and ``strides`` its own, or given) with block ``block_shape``,
    built only where a launch goes through Triton (:meth:`materialize`); see the module's docstring. ``layout``:
    the shared-memory layout of a Gluon kernel's descriptor (then a Gluon ``TensorDescriptor``)."""

    __slots__ = ("base", "block_shape", "layout", "shape", "strides")
    padding = "zero"

    def __init__(self, base: torch.Tensor, block_shape: list, shape=None, strides=None, layout=None) -> None:
        self.base, self.block_shape, self.layout = base, block_shape, layout
        self.shape = tuple(base.shape) if shape is None else tuple(shape)
        self.strides = tuple(base.stride()) if strides is None else tuple(strides)

    def materialize(self):
        if self.layout is not None:
            from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as GluonDescriptor

            return GluonDescriptor(self.base, list(self.shape), list(self.strides), list(self.block_shape),
                                   self.layout)
        from triton.tools.tensor_descriptor import TensorDescriptor

        return TensorDescriptor(self.base, list(self.shape), list(self.strides), list(self.block_shape))


def _materialized(args: tuple) -> tuple:
    if not any(type(a) is LazyDescriptor for a in args):
        return args
    return tuple(a.materialize() if type(a) is LazyDescriptor else a for a in args)


_MAX_ENCODED = 8
"""Encoded descriptors a launch keeps per descriptor argument (the addresses an eager loop's activations cycle
through)."""


class Launch:
    """``fn[grid](*args, **consts, num_warps=..., num_stages=...)`` with everything but ``args`` fixed."""

    __slots__ = ("fn", "grid", "consts", "options", "compiled", "_tail", "_c_launch", "_c_head", "_desc",
                 "_encoded")

    def __init__(self, fn, grid: tuple, consts: dict, num_warps: int, num_stages: int | None = None,
                 **options) -> None:
        self.fn = fn
        self.grid = tuple(int(g) for g in grid) + (1,) * (3 - len(grid))
        self.consts = dict(consts)
        self.options = {"num_warps": num_warps, **({} if num_stages is None else {"num_stages": num_stages}),
                        **options}
        self.compiled = None
        self._tail = _constexpr_tail(fn, self.consts)
        self._c_launch = None  # the launcher's C entry point, where the kernel needs no scratch of Triton's
        self._c_head = ()
        # (argument index, Triton's descriptor metadata, its encoder) where _c_launch takes encoded descriptors
        self._desc = ()
        self._encoded: dict = {}

    def run(self, device_index: int, *args) -> None:
        """Launch on the current stream of CUDA device ``device_index`` (the current device)."""
        self.run_on(torch._C._cuda_getCurrentRawStream(device_index), *args)

    def run_on(self, stream: int, *args) -> None:
        """Launch on the raw CUDA stream ``stream`` of the current device."""
        ck = self.compiled
        if ck is not None and DIRECT_LAUNCH:
            hooks = _RUNTIME[0] if _RUNTIME else _hooks()
            if not hooks.launch_enter_hook.calls and not hooks.launch_exit_hook.calls:
                g = self.grid
                c = self._c_launch
                if c is not None:
                    if self._desc:
                        args = self._encode(args)
                    c(g[0], g[1], g[2], stream, *self._c_head, *args, *self._tail)
                else:
                    ck.run(g[0], g[1], g[2], stream, ck.function, ck.packed_metadata, None, None, None, *args,
                           *self._tail)
                return
        ck = self.fn[self.grid](*_materialized(args), **self.consts, **self.options)
        if hasattr(ck, "result"):
            ck = ck.result()
        if self.compiled is None and hasattr(ck, "packed_metadata") and hasattr(ck, "function"):
            self.compiled = ck
            self._bind_c_launch(ck)

    def _bind_c_launch(self, ck) -> None:
        """Call the compiled launcher's C ``launch`` directly where its Python ``__call__`` would only pass
        arguments through (no global or profile scratch to allocate): one Python frame less per launch."""
        r = ck.run
        c = getattr(r, "launch", None)
        if (c is None or getattr(r, "global_scratch_size", 1) or getattr(r, "profile_scratch_size", 1)
                or not hasattr(r, "launch_cooperative_grid") or not hasattr(r, "launch_pdl")):
            return
        if getattr(c, "__name__", "") == "inner" and getattr(c, "__closure__", None):
            # Triton's wrapper that expands host descriptors argument by argument: bind the C launcher under it
            # and encode the descriptors here (each with its own metadata), or keep the wrapper
            cells = dict(zip(c.__code__.co_freevars, (x.cell_contents for x in c.__closure__)))
            idx, meta, raw = cells.get("tensordesc_indices"), cells.get("tensordesc_meta"), cells.get("launcher")
            if raw is not None and idx is not None and meta and len(meta) == len(idx) and None not in meta:
                from triton.backends.nvidia.driver import make_tensordesc_arg

                self._desc = tuple((i, m, make_tensordesc_arg) for i, m in zip(sorted(idx), meta))
                c = raw
        self._c_launch = c
        self._c_head = (ck.function, r.launch_cooperative_grid, r.launch_pdl, None, None, ck.packed_metadata,
                        None, None, None)

    def _encode(self, args: tuple) -> list:
        """``args`` with each descriptor argument replaced by what Triton's wrapper would pass for it."""
        out = list(args)
        for i, meta, make_tensordesc_arg in reversed(self._desc):
            d = args[i]
            key = (i, d.base.data_ptr(), tuple(d.shape), tuple(d.strides), d.padding)
            enc = self._encoded.get(key)
            if enc is None:
                if len(self._encoded) >= _MAX_ENCODED * len(self._desc):
                    self._encoded.clear()
                enc = self._encoded[key] = make_tensordesc_arg(d, meta)
            out[i:i + 1] = enc
        return out

    def traced(self, *args) -> None:
        """The launch as ``torch.compile`` traces it (call inside a ``triton_op`` body)."""
        from torch.library import wrap_triton

        wrap_triton(self.fn)[self.grid](*_materialized(args), **self.consts, **self.options)


class KernelCall:
    """A launch whose arguments are all fixed but one output, allocated per call: ``call() -> out``.

    A dequantize launcher returns one (``lowbit.kernels.blockscaled`` / ``nf4`` / ``int4_awq``); calling it
    once is the plain launch, and a prepared layer keeps it to launch the same decode again with no argument
    binding (the fixed arguments keep their alignment, the output comes from the caching allocator).
    """

    __slots__ = ("launch", "args", "out_index", "shape", "dtype", "view", "device", "dev_index", "result_shape",
                 "copies")

    def __init__(self, launch: Launch | None, args: tuple, out_index: int, shape: tuple, dtype: torch.dtype,
                 view: torch.dtype, device: torch.device, result_shape: tuple | None = None,
                 copies: bool = True) -> None:
        """``copies``: False where every argument that comes from the decoded QTensor is that tensor's own
        memory (no copy made for alignment or layout), so the call stays right after in-place updates of it."""
        self.copies = copies
        self.launch, self.args, self.out_index = launch, args, out_index
        self.shape, self.dtype, self.view, self.device = tuple(shape), dtype, view, device
        self.dev_index = device.index if device.type == "cuda" else None
        self.result_shape = tuple(shape) if result_shape is None else tuple(result_shape)

    def __call__(self) -> torch.Tensor:
        out = torch.empty(self.shape, dtype=self.dtype, device=self.device)
        if self.launch is not None:
            i = self.out_index
            args = self.args[:i] + (out.view(self.view),) + self.args[i + 1:]
            lc = self.launch
            if self.dev_index is None:  # the interpreter
                lc.fn[lc.grid](*args, **lc.consts, **lc.options)
            elif lc.compiled is None:
                # first call: through the shared cache (a one-off call finds the kernel an earlier call of the
                # same kind compiled); a kept call then holds that launch and runs it directly
                self.launch = launch(lc.fn, lc.grid, args, **lc.consts, **lc.options) or lc
            else:
                lc.run(self.dev_index, *args)
        return out.reshape(self.result_shape)


def same_memory(*pairs: tuple[torch.Tensor, torch.Tensor]) -> bool:
    """True where each (argument, source) pair starts at the same address: the argument is the source's own
    memory, not a copy."""
    return all(a.data_ptr() == b.data_ptr() for a, b in pairs)


_OPTIONS = frozenset({"num_warps", "num_stages", "num_ctas", "maxnreg", "enable_fp_fusion", "launch_cooperative_grid",
                      "launch_pdl"})
_CACHE: dict = {}
_MAX_CACHE = 4096
_SCALARS = (int, float, bool, str)


def _arg_key(args: tuple):
    """What Triton specializes a launch on, or finer: each tensor's dtype and 16-byte alignment, each scalar's
    type and exact value, each host tensor descriptor's base dtype and alignment, shape, strides and block.
    None where an argument is of another kind (then the launch goes through Triton)."""
    key = []
    for a in args:
        if isinstance(a, torch.Tensor):
            key.append((a.dtype, a.data_ptr() & 15 == 0))
        elif a is None or type(a) in _SCALARS:
            key.append((type(a), a))
        elif type(a) is LazyDescriptor or (type(a).__name__ == "TensorDescriptor" and hasattr(a, "block_shape")):
            base = a.base
            key.append((base.dtype, base.data_ptr() & 15 == 0, tuple(a.shape), tuple(a.strides),
                        tuple(a.block_shape), getattr(a, "padding", None), getattr(a, "layout", None), type(a)))
        else:
            return None
    return tuple(key)


def launch(fn, grid: tuple, args: tuple, **kwargs) -> Launch | None:
    """``fn[grid](*args, **kwargs)`` (constexprs and compile options as keywords, every other argument
    positional), through a cached compiled kernel when an earlier launch had the same kernel, device, grid,
    keywords and argument key (:func:`_arg_key`): then no argument binding, a few microseconds of host time.
    Returns the :class:`Launch` it ran (None where it went through Triton alone)."""
    if not DIRECT_LAUNCH or type(fn).__name__ not in ("JITFunction", "GluonJITFunction"):
        fn[grid](*_materialized(args), **kwargs)
        return None
    dev = torch._C._cuda_getDevice()
    akey = _arg_key(args)
    try:
        key = (fn, dev, tuple(grid), tuple(kwargs.items()), akey) if akey is not None else None
        hit = _CACHE.get(key) if key is not None else None
    except TypeError:  # an unhashable keyword value
        key = hit = None
    if hit is None:
        consts = {k: v for k, v in kwargs.items() if k not in _OPTIONS}
        options = {k: v for k, v in kwargs.items() if k in _OPTIONS}
        hit = Launch(fn, grid, consts, options.pop("num_warps", 4), options.pop("num_stages", None), **options)
        if key is not None:
            if len(_CACHE) >= _MAX_CACHE:
                _CACHE.clear()
            _CACHE[key] = hit
    hit.run(dev, *args)
    return hit


def kept_launch(store: dict, key: tuple | None, fn, grid: tuple, args: tuple, **kwargs) -> Launch | None:
    """:func:`launch` under the caller's own key: a caller that knows what its launches specialize on (it
    fixed the sizes) keys ``store`` on the rest, ``key[0]`` the current device's index, and skips the
    argument key of :func:`launch`. ``key`` None (not on CUDA): a plain :func:`launch`, nothing kept."""
    hit = store.get(key) if key is not None else None
    if hit is not None:
        hit.run(key[0], *args)
        return hit
    ran = launch(fn, grid, args, **kwargs)
    if ran is not None and key is not None:
        if len(store) >= _MAX_CACHE:
            store.clear()
        store[key] = ran
    return ran


_RUNTIME: list = []


def _hooks():
    import triton

    _RUNTIME.append(triton.knobs.runtime)
    return _RUNTIME[0]


__all__ = ["DIRECT_LAUNCH", "KernelCall", "Launch", "LazyDescriptor", "kept_launch", "launch", "same_memory"]
