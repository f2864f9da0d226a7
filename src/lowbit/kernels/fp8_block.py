"""Triton launchers for fp8_block, with the signatures of ``lowbit.formats.fp8_block`` (plus ``scale_layout``).

``quantize_fp8_block(x, block=(1, 128), scale_fmt=None, scale_layout="linear")``: ``scale_layout=
"column_major"`` (block (1, 128), 2-D ``[M, K]`` or 3-D ``[B, M, K]`` x) writes the scales straight into
the MN-major TMA-aligned layout DeepGEMM's SM90 kernels read: storage ``[B, G, round_up(M, 4)]`` (padding
rows zero), returned as the logical ``[..., M, G]`` view, equal to
``lowbit.formats.fp8_block.column_major_scales`` of the linear scales. The QTensor records
``scale_layout="column_major"``; its ``scale`` indexes like the linear one, so every decoder reads it.

Performance: one pass. Quantize reads the input once and writes 1 byte per element plus 4 bytes per
128; dequantize reads 1 + 4/128 bytes and writes the output once. Host side, everything derived from a
shape is cached (tile sizes, grid, scale strides) and, after the first call of a shape, the compiled
kernel is launched directly (skipping Triton's per-call argument binding): two ``torch.empty`` and one
launch per call, no syncs.
"""

from __future__ import annotations

import dataclasses

import torch
import triton
from triton.runtime.jit import JITFunction

from ..formats import fp8_block as ref
from ..formats.qtensor import QTensor
from . import _fp8_block as k
from . import cdiv

SCALE_LAYOUTS = ("linear", "column_major")
_TILE_K = (1024, 512, 256, 128)
_TILE_BYTES = 16384  # input bytes per program of the (1, 128) quantize kernel
_DEQ_TILE = 8192  # elements per program of the dequantize kernel
_NUM_WARPS = 4
_OUT_KIND = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
_IN_SIG = {torch.bfloat16: "*bf16", torch.float16: "*fp16", torch.float32: "*fp32"}
_OUT_SIG = {0: "*fp32", 1: "*bf16", 2: "*fp16"}

DIRECT_LAUNCH = True
"""Launch cached compiled kernels without Triton's per-call binding (tests turn it off to compare)."""


def _tile_k(kdim: int) -> int:
    """The widest tile (1024 .. 128 columns) that wastes the fewest masked columns on K."""
    best, waste = 128, None
    for bk in _TILE_K:
        if bk > 128 and bk > 2 * kdim:
            continue
        w = cdiv(kdim, bk) * bk - kdim
        if waste is None or w < waste:
            best, waste = bk, w
    return best


class _Launch:
    """One kernel with its grid and constexprs fixed; caches the compiled kernel per device/alignment."""

    __slots__ = ("compiled", "consts", "direct", "fn", "grid", "kwargs")

    def __init__(self, fn, grid, consts: dict, num_warps: int = _NUM_WARPS):
        self.fn = fn
        self.grid = grid
        names = fn.arg_names
        # constexprs are the trailing parameters of every kernel in _fp8_block, in signature order
        self.consts = tuple(consts[n] for n in names[len(names) - len(consts):])
        self.kwargs = dict(consts, num_warps=num_warps)
        self.compiled: dict = {}
        self.direct = isinstance(fn, JITFunction)  # not under TRITON_INTERPRET=1

    def __call__(self, key, *args) -> None:
        """Launch with runtime ``args``; ``key`` (or None: do not cache) is what else the compiled
        kernel depends on (pointer alignments); every int argument must be fixed by this launch's plan."""
        if key is not None and DIRECT_LAUNCH and self.direct:
            hooks = triton.knobs.runtime
            if not hooks.launch_enter_hook.calls and not hooks.launch_exit_hook.calls:
                device = _current_device()
                ck = self.compiled.get((device, key))
                if ck is not None:
                    g = self.grid
                    ck.run(g[0], g[1], g[2], torch._C._cuda_getCurrentRawStream(device), ck.function,
                           ck.packed_metadata, None, None, None, *args, *self.consts)
                    return
                ck = self.fn[self.grid](*args, **self.kwargs)
                if hasattr(ck, "result"):
                    ck = ck.result()
                if hasattr(ck, "packed_metadata") and hasattr(ck, "function"):
                    self.compiled[(device, key)] = ck
                return
        self.fn[self.grid](*args, **self.kwargs)


def _current_device() -> int:
    # torch.cuda.current_device() minus its lazy-init check: a CUDA tensor exists, so CUDA is initialised
    return torch._C._cuda_getDevice()


def _aligned(t: torch.Tensor) -> bool:
    return t.data_ptr() % 16 == 0


# ----------------------------------------------------------------------------------------------- quantize

class _QPlan:
    """Everything a quantize call derives from (shape, dtype, options)."""

    __slots__ = (
        "batched",
        "block",
        "data_shape",
        "kdim",
        "launch",
        "m",
        "n_mblocks",
        "scale_shape",
        "scale_storage",
        "scale_strides",
        "template",
    )


def _quant_plan(x: torch.Tensor, block, scale_fmt, scale_layout) -> _QPlan:
    block = ref.check_block(block)
    scale_fmt = ref.check_scale_fmt(scale_fmt)
    ref.check_input(x, block)
    if scale_layout not in SCALE_LAYOUTS:
        raise ValueError(f"fp8_block: scale_layout must be one of {SCALE_LAYOUTS}, got {scale_layout!r}")
    column = scale_layout == "column_major"
    if column and (block != (1, 128) or x.dim() not in (2, 3)):
        raise ValueError("fp8_block: scale_layout='column_major' needs block (1, 128) and a 2-D [M, K] or "
                         f"3-D [B, M, K] x, got block {block} and shape {tuple(x.shape)}")
    p = _QPlan()
    p.block = block
    p.data_shape = x.shape
    # the template's tensors are replaced per call; meta tensors of the result's shapes pass QTensor's checks
    p.template = QTensor(data=torch.empty(x.shape, dtype=torch.float8_e4m3fn, device="meta"),
                         scale=torch.empty(ref.expected_scale_shape(x.shape, block), dtype=torch.float32, device="meta"),
                         fmt="fp8_block",
                         shape=x.shape, dtype=x.dtype, scale_layout=scale_layout,
                         params={"block": block, "scale_fmt": scale_fmt})
    p.scale_storage = p.scale_strides = None
    pow2 = scale_fmt == "ue8m0"
    kdim = x.shape[-1]
    p.kdim = kdim
    if block == (128, 128):
        n = x.shape[0]
        p.m, p.n_mblocks, p.batched = n, 1, False
        p.scale_shape = (cdiv(n, 128), cdiv(kdim, 128))
        grid = (cdiv(n, 128), cdiv(kdim, 128), 1)
        p.launch = _Launch(k.quantize_128x128_kernel, grid, {"POW2_SCALE": pow2}, num_warps=8) \
            if n and kdim else None
        return p
    groups = cdiv(kdim, 128)
    batched = column and x.dim() == 3
    b = x.shape[0] if batched else 1
    m = x.shape[1] if batched else x.shape[:-1].numel()
    p.m, p.batched = m, batched
    p.scale_shape = (*x.shape[:-1], groups)
    if column:
        mp = ref.tma_aligned_size(m, 4)
        p.scale_storage = b * groups * mp
        p.scale_strides = (groups * mp, 1, mp) if batched else (1, mp)
    bk = _tile_k(kdim)
    bm = max(1, min(64, _TILE_BYTES // x.element_size() // bk, triton.next_power_of_2(max(m, 1))))
    if column:
        bm = max(bm, 4)  # the program holding row M-1 also zeroes the padding rows up to round_up(M, 4)
    p.n_mblocks = cdiv(m, bm)
    grid = (b * p.n_mblocks, cdiv(kdim, bk), 1)
    consts = {"BLOCK_M": bm, "BLOCK_K": bk, "POW2_SCALE": pow2, "COLUMN_SCALES": column}
    p.launch = _Launch(k.quantize_1x128_kernel, grid, consts) if m and kdim and b else None
    return p


_QPLANS: dict = {}
_MAX_PLANS = 4096  # distinct shapes kept (serving sees one M per batch size); cleared when full


def quant_plan_cached(x, block, scale_fmt, scale_layout) -> _QPlan:
    try:
        key = (x.shape, x.dtype, block, scale_fmt, scale_layout)
        plan = _QPLANS.get(key)
    except (TypeError, AttributeError):  # an unhashable option (a list block) or x not a tensor
        key, plan = None, None
    if plan is None:
        plan = _quant_plan(x, block, scale_fmt, scale_layout)
        if key is not None:
            if len(_QPLANS) >= _MAX_PLANS:
                _QPLANS.clear()
            _QPLANS[key] = plan
    return plan


def _strided_rows(x: torch.Tensor, plan: _QPlan) -> tuple[torch.Tensor, int, int]:
    """(tensor, batch stride, row stride) for a non-contiguous x; copies only what the kernel cannot
    stride over (a last dim that is not contiguous, leading dims that do not merge into one stride)."""
    if x.stride(-1) != 1:
        x = x.contiguous()
        return x, plan.m * plan.kdim if plan.batched else 0, plan.kdim
    if plan.batched:
        return x, x.stride(0), x.stride(1)
    if x.dim() == 1:
        return x, 0, plan.kdim
    if x.dim() != 2:
        x = x.reshape(-1, plan.kdim)  # a view when the leading dims merge, else a copy
    return x, 0, x.stride(0)


def quantize_fp8_block(
    x: torch.Tensor, block: tuple[int, int] = (1, 128), scale_fmt: str | None = None,
    scale_layout: str = "linear",
) -> QTensor:
    """``lowbit.formats.fp8_block.quantize_fp8_block`` on CUDA tensors, bit for bit.

    Args:
        x: CUDA float32/bfloat16/float16; ``[..., K]`` for block (1, 128), ``[N, K]`` for (128, 128).
            Any strides (a last dim that is not contiguous is copied once).
        block: ``(1, 128)`` or ``(128, 128)``.
        scale_fmt: None or ``"ue8m0"``.
        scale_layout: ``"linear"`` (``[..., G]`` row-major) or ``"column_major"`` (block (1, 128) with a
            2-D or 3-D x: MN-major TMA-aligned storage, see the module docstring).

    Returns:
        QTensor as the reference returns it, with ``scale_layout`` recorded on it.
    """
    plan = quant_plan_cached(x, block, scale_fmt, scale_layout)
    dev = x.device
    data = torch.empty(plan.data_shape, dtype=torch.float8_e4m3fn, device=dev)
    if plan.scale_storage is None:
        scale = torch.empty(plan.scale_shape, dtype=torch.float32, device=dev)
    else:
        scale = torch.empty(plan.scale_storage, dtype=torch.float32, device=dev).as_strided(
            plan.scale_shape, plan.scale_strides)
    launch = plan.launch
    if launch is not None:
        if x.is_contiguous():
            xk, key = x, _aligned(x)
            sb, sm = (plan.m * plan.kdim if plan.batched else 0), plan.kdim
        else:
            (xk, sb, sm), key = _strided_rows(x, plan), None
        if plan.block == (1, 128):
            launch(key, xk, data, scale, plan.m, plan.kdim, sb, sm, plan.n_mblocks)
        else:
            launch(key, xk, data, scale, plan.m, plan.kdim, sm)
    return _qtensor(plan.template, data, scale)


# QTensor's dataclass __init__ (11 frozen fields, __post_init__) costs about as much host time as a
# kernel launch; a quantize result differs from its plan's template only in data, scale (and a fresh
# params dict), so it is made as a copy of the template's fields when QTensor keeps them in __dict__
_FAST_QTENSOR = hasattr(QTensor(data=torch.empty(0, dtype=torch.float8_e4m3fn, device="meta"),
                                scale=torch.empty(0, dtype=torch.float32, device="meta"), fmt="fp8_block", shape=(0,),
                                params={"block": (1, 128)}), "__dict__")


def _qtensor(template: QTensor, data: torch.Tensor, scale: torch.Tensor) -> QTensor:
    if not _FAST_QTENSOR:
        return dataclasses.replace(template, data=data, scale=scale, params=dict(template.params))
    fields = template.__dict__.copy()
    fields["data"] = data
    fields["scale"] = scale
    fields["params"] = dict(fields["params"])
    q = object.__new__(QTensor)
    object.__setattr__(q, "__dict__", fields)
    return q


# --------------------------------------------------------------------------------------------- dequantize

class _DPlan:
    __slots__ = ("flatten_scale", "kdim", "launch", "m", "n_mblocks")


def _dequant_plan(q: QTensor, dtype: torch.dtype) -> _DPlan:
    block = ref.check_qtensor(q)
    if dtype not in _OUT_KIND:
        raise TypeError(f"dtype must be float32, bfloat16 or float16, got {dtype}")
    p = _DPlan()
    shape = q.shape
    kdim = shape[-1] if len(shape) else 0
    p.kdim = kdim
    p.flatten_scale = False
    if block == (128, 128):
        b, m, rps = 1, shape[0], 128
    elif len(shape) == 3:
        b, m, rps = shape[0], shape[1], 1
    else:
        b, m, rps = 1, shape[:-1].numel(), 1
        p.flatten_scale = len(shape) > 2
    bk = _tile_k(kdim)
    bm = max(1, min(64, _DEQ_TILE // bk, triton.next_power_of_2(max(m, 1))))
    p.m, p.n_mblocks = m, cdiv(m, bm)
    grid = (b * p.n_mblocks, cdiv(kdim, bk), 1)
    consts = {"BLOCK_M": bm, "BLOCK_K": bk, "ROWS_PER_SCALE": rps, "OUT_KIND": _OUT_KIND[dtype]}
    p.launch = _Launch(k.dequantize_fp8_block_kernel, grid, consts) if b and m and kdim else None
    return p


_DPLANS: dict = {}


def dequantize_fp8_block(q: QTensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``lowbit.formats.fp8_block.dequantize_fp8_block`` on CUDA, bit for bit up to NaN bits.

    Every NaN is written as the canonical 0x7FC00000 / bf16 0x7FC0 / fp16 0x7E00, as every lowbit decoder
    writes it. The reference returns x86 arithmetic's NaNs there (0x7FF00000 from an E4M3 NaN code, or
    0x7FC00000 for NaN code x NaN scale depending on the element's position in a SIMD chunk,
    0xFFC00000 for 0 x Inf; bf16 0xFFFF), which no kernel can reproduce; it equals
    ``canonical_nan(reference)``.

    The scale may have any strides (linear or column-major, as ``quantize_fp8_block`` returns it)."""
    try:
        s = q.scale
        key = (q.shape, q.data.shape, s.shape, s.stride(), q.data.dtype, s.dtype, q.fmt, q.params.get("block"),
               dtype)
        plan = _DPLANS.get(key)
    except (TypeError, AttributeError):
        key, plan = None, None
    if plan is None:
        plan = _dequant_plan(q, dtype)
        if key is not None:
            if len(_DPLANS) >= _MAX_PLANS:
                _DPLANS.clear()
            _DPLANS[key] = plan
    data = q.data
    out = torch.empty(q.shape, dtype=dtype, device=data.device)
    launch = plan.launch
    if launch is not None:
        if not data.is_contiguous():
            data = data.contiguous()
        s = q.scale
        if plan.flatten_scale:
            s = s.reshape(-1, s.shape[-1])
        st = s.stride()
        if len(st) == 3:
            sb, sm, sg = st
        elif len(st) == 2:
            sb, sm, sg = 0, st[0], st[1]
        else:
            sb, sm, sg = 0, 0, st[0]
        key = (_aligned(data), _aligned(s)) if not plan.flatten_scale else None
        launch(key, data, s, out, plan.m, plan.kdim, plan.n_mblocks, sb, sm, sg)
    return out


# ------------------------------------------------------------------------------------------- compile test

def compile_variants():
    """(kernel, signature, constexprs) of every code path the launchers can start (CI compiles them for
    sm_90). Every (input dtype, scale_fmt, scale layout) path at the widest tile, and every tile shape the
    launchers pick (BLOCK_K 128..1024, BLOCK_M 1..64) once."""
    q_sig = {"q_ptr": "*fp8e4nv", "s_ptr": "*fp32", "M": "i32", "K": "i32", "stride_xb": "i64",
             "stride_xm": "i64", "n_mblocks": "i32"}
    for dt, xs in _IN_SIG.items():
        elem = torch.empty((), dtype=dt).element_size()
        for pow2 in (False, True):
            for column in (False, True):
                bm = max(4, _TILE_BYTES // elem // 1024)
                yield (k.quantize_1x128_kernel, {**q_sig, "x_ptr": xs},
                       {"BLOCK_M": bm, "BLOCK_K": 1024, "POW2_SCALE": pow2, "COLUMN_SCALES": column})
            yield (k.quantize_128x128_kernel,
                   {"x_ptr": xs, "q_ptr": "*fp8e4nv", "s_ptr": "*fp32", "N": "i32", "K": "i32", "stride_xn": "i64"},
                   {"POW2_SCALE": pow2})
    for bk in _TILE_K:
        for bm in sorted({1, 4, min(64, _TILE_BYTES // 2 // bk)}):
            if (bm, bk) != (8, 1024):
                yield (k.quantize_1x128_kernel, {**q_sig, "x_ptr": "*bf16"},
                       {"BLOCK_M": bm, "BLOCK_K": bk, "POW2_SCALE": False, "COLUMN_SCALES": False})
    d_sig = {"q_ptr": "*fp8e4nv", "s_ptr": "*fp32", "M": "i32", "K": "i32", "n_mblocks": "i32",
             "stride_sb": "i64", "stride_sm": "i64", "stride_sg": "i64"}
    for out_kind, out in _OUT_SIG.items():
        for rps in (1, 128):
            yield (k.dequantize_fp8_block_kernel, {**d_sig, "out_ptr": out},
                   {"BLOCK_M": 8, "BLOCK_K": 1024, "ROWS_PER_SCALE": rps, "OUT_KIND": out_kind})
    for bk in _TILE_K[1:]:
        yield (k.dequantize_fp8_block_kernel, {**d_sig, "out_ptr": "*bf16"},
               {"BLOCK_M": min(64, _DEQ_TILE // bk), "BLOCK_K": bk, "ROWS_PER_SCALE": 1, "OUT_KIND": 1})
