"""Weight-only 4-bit GEMV for the decode regime (M <= 16): ``gemv_w4(x, w, bias, activation)``.

``out = act(x @ dequant(w).T + bias)`` with fp32 accumulation, for ``w`` in nvfp4, mxfp4, fp4_b32, nf4 (plain
or double-quantized absmax) and int4_awq; the weight is decoded in registers, never written to HBM.

Pre-layout (:func:`prepare_w4`, done once per QTensor and cached; the QTensor is never modified):

- nvfp4 / mxfp4 / fp4_b32 / nf4: zero-copy. The packed bytes ``[N, K/2]`` are read as int32 words
  ``[N, K/8]`` (8 consecutive K elements per word; nf4 keeps bitsandbytes' high-nibble-first order and the
  kernel decodes it as is). Swizzled scales are unswizzled once (a copy of the scales only).
- int4_awq: ``qweight [K, N/8]`` (AutoAWQ interleave, N-major nibbles) is repacked to N-major, K-contiguous
  words ``[N, K/8]`` (nibble j = element 8w + j), so that a row of W is one contiguous run of 16-byte
  loads; scales and zero points become one int32 per (row, group): fp16 scale bits | (0x6400 + z) << 16.
  This copy (0.5 byte per weight) is what the cache holds; the QTensor still holds the AutoAWQ tensors.

The cache is keyed weakly on ``w.data`` (the entry goes when that tensor goes; torch.compile rebuilds the
QTensor around the same tensors on every call, so the QTensor object itself is no key) and checks the
identity and version counter of every tensor of ``w``: a replaced tensor or an in-place update of
``q.data`` / ``q.scale`` is re-prepared. The prepared tensors alias the QTensor's storage where no copy is
needed (nvfp4 / mxfp4 / fp4_b32 / nf4: no extra memory; int4_awq: one extra 0.5 byte per weight).

Kernels: NVFP4 / MXFP4 with bf16 x, and int4_awq (group a multiple of 64) and nf4 (blocksize a multiple of
64) with bf16 or fp16 x, at
``MMA["min_m"] <= M <= 16`` run the tensor-core GEMV (``_gemv_mma``: mma.sync over a weight laid out once by
:func:`mma_layout`, a further copy of the 4-bit words; at M = 1 only for large weights, see :data:`MMA`);
otherwise
M <= ``TILE["fma_max_m"]`` runs the CUDA-core FMA kernel (``_gemv_w4``; M rows of x per program, so the
weights are read once) and larger M the ``tl.dot`` kernel with M padded to 16. Both split K across programs when there are too few N tiles to fill the GPU, and reduce the
split-K partials inside the same launch (last-arriving program, self-resetting counter), so a call is
one kernel launch: safe to capture in a CUDA graph.

Bytes per weight element read from HBM (bf16 weights are 2 bytes, so the ideal speedup over a bf16 GEMV
is 2 / these): nvfp4 0.5 + 1/16 (E4M3 per 16; 3.56x), mxfp4 0.5 + 1/32 (3.76x), fp4_b32 0.5 + 4/32 (3.2x),
nf4 0.5 + 4/bs (fp32 absmax; bs 64: 3.56x) or 0.5 + 1/bs (double quant; 3.88x), int4_awq 0.5 + 4/g
(packed scale + zero; g 128: 3.76x, g 32: 3.2x). At M=1 the FMA loop issues about 4.5 instructions per
weight (nf4 about 6), close to what the SMs can issue while HBM streams the weights, so the kernel is
bandwidth-bound only just; the tl.dot path issues about 6.5 per weight for any M.
"""

from __future__ import annotations

import functools
import math
import weakref
from dataclasses import dataclass, field

import torch
from triton.runtime.jit import JITFunction

from ..formats import int4_awq as ref_awq
from ..formats import nf4 as ref_nf4
from ..formats.codecs import codebook_table
from ..formats.packing import unpack_fp4, unpack_nibbles_high_first, unswizzle_scales
from ..formats.qtensor import QTensor
from ..formats.registry import formats_with
from ..formats.shards import plan_rows
from ..formats.spec import NF4
from . import _gemv_w4 as k
from . import _gemv_mma as km
from . import interpreting as _interpreting
from . import scratch_per_call, tensor_version
from ._launch import Launch
from .device import GS_DIVIDE, GS_MULTIPLY, GS_NONE
from .scratch import KeptScratch, split_k_scratch


FORMATS = formats_with("gemv_w4")  # nvfp4, mxfp4, fp4_b32, nf4, int4_awq
ACTIVATIONS = {None: 0, "gelu": 1, "gelu_tanh": 2, "silu": 3}
MAX_M = 16

TILE = {
    # M <= fma_max_m: CUDA-core FMA kernel (MP = 1, 2 or 4 rows of x per program); else the tl.dot kernel
    # (MP = 16)
    "fma_max_m": 4,
    # bn: output rows per program; chunks: 16-byte chunks (32 weights) per row per iteration;
    # stages: cp.async pipeline depth (stages - 1 tiles in flight while one is decoded)
    "fma": {"bn": 16, "chunks": 32, "warps": 4, "stages": 3},
    "dot": {"bn": 64, "chunks": 8, "warps": 4, "stages": 3},
    # split K until about ctas_per_sm programs per SM exist, at most max_split ways, each split at least
    # min_iters iterations long, the fp32 partials (split * M * N * 4 bytes, written and read back) at most
    # ws_ratio of the weight bytes
    "ctas_per_sm": 4,
    "max_split": 16,
    "min_iters": 2,
    "ws_ratio": 0.25,
}
"""Tile configuration per regime (data, no autotuning). ``benchmarks/experiments/sweep_w4a16_tiles.py gemv`` tries
variants; ``gemv_w4(..., config=...)`` overrides it per call."""


_FMT = {"nvfp4": k.FMT_NVFP4.value, "mxfp4": k.FMT_MXFP4.value, "fp4_b32": k.FMT_FP4_B32.value,
        "nf4": k.FMT_NF4.value, "nf4_dq": k.FMT_NF4_DQ.value, "int4_awq": k.FMT_AWQ.value}
_X_DTYPES = (torch.bfloat16, torch.float16)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


# --------------------------------------------------------------------------------------------- pre-layout

@dataclass(eq=False)
class PreparedW4:
    """A 4-bit weight laid out for the GEMV kernels (see the module docstring). Its tensors alias the
    QTensor's storage where no copy is needed, without referencing the QTensor's tensor objects (so the
    cache entry can die with them); the QTensor itself is never modified (save that one)."""

    fmt: str
    fmt_code: int
    n: int
    k: int
    words: torch.Tensor          # int32 [N, K/8]
    scales: torch.Tensor         # [N, SK]: uint8 (E4M3 / E8M0 / nf4 dq codes), fp32, or int32 (awq)
    words_per_block: int         # WPB: int32 words per scale block
    post: float                  # constant multiplier of the accumulator (2^6 for the FP4 decode)
    gs_kind: int                 # what the epilogue does with gs (GS_*)
    gs: torch.Tensor             # fp32 [1] (global scale S or per_tensor_scale p; unused for GS_NONE)
    nested: torch.Tensor         # fp32 nested absmax (nf4 double quant), else a dummy
    tab: torch.Tensor            # fp32 [288]: NF4 levels, dynamic map, nested offset (64-byte aligned)
    sig: tuple = field(default=(), repr=False)  # identity and version counters of the source tensors
    plans: dict = field(default_factory=dict, repr=False)  # launch plans under the default TILE
    mma: object = field(default=None, repr=False)  # MmaLayout, made on first use (False: not applicable)
    plan_n: int = 0              # rows the launches are planned for (lowbit.formats.shards.plan_rows; 0: n)

    device: torch.device = field(default=None, repr=False)

    def __post_init__(self) -> None:
        self.device = self.words.device
        self.plan_n = self.plan_n or self.n

    @property
    def sk(self) -> int:
        return self.scales.shape[1]


def _why_not(w: QTensor) -> str | None:
    if not isinstance(w, QTensor):
        return f"w must be a QTensor, got {type(w).__name__}"
    if w.fmt not in FORMATS:
        return f"gemv_w4 covers {FORMATS}, not {w.fmt!r}"
    if len(w.shape) != 2:
        return f"w must be a 2-D [N, K] weight, got shape {tuple(w.shape)}"
    n, kdim = w.shape
    if n < 1 or kdim < 32 or kdim % 32:
        return f"K must be a positive multiple of 32 (16-byte chunks of packed weights), got K={kdim}"
    if w.fmt in ("nvfp4", "mxfp4", "fp4_b32"):
        if w.data.dtype != torch.uint8 or w.data.numel() != n * kdim // 2:
            return f"{w.fmt}: data must be uint8 with N*K/2 bytes, got {w.data.dtype} {tuple(w.data.shape)}"
        if w.fmt == "fp4_b32" and (w.scale.dtype != torch.float32 or w.scale.numel() != n * kdim // 32):
            return "fp4_b32: scale must be fp32 [N, K/32]"
        if w.fmt == "nvfp4":
            pts = w.params.get("per_tensor_scale")
            if pts is not None and isinstance(pts, torch.Tensor) and pts.numel() != 1:
                return "nvfp4: per_tensor_scale must be a scalar"
            if w.global_scale is not None and w.global_scale.numel() != 1:
                return "nvfp4: global_scale must hold one value"
    elif w.fmt == "nf4":
        try:
            _, blocksize, _ = ref_nf4.check_nf4_qtensor(w)
        except (TypeError, ValueError) as e:
            return str(e)
        if kdim % blocksize:
            return f"nf4: K ({kdim}) must be a multiple of the blocksize ({blocksize}) so no block spans two rows"
    else:
        try:
            _, _, g = ref_awq.check_int4_awq(w)
        except (TypeError, ValueError) as e:
            return str(e)
        if not ref_awq.decodes_in_fp16(w):
            return (f"int4_awq: the kernel decodes (q - z) * s in float16; these {w.scale.dtype} scales "
                    f"(convention {ref_awq.int4_awq_convention(w)!r}) decode in {w.scale.dtype}")
        if g % 32:
            return f"int4_awq: group_size must be a multiple of 32 (a 32-weight chunk in one group), got {g}"
    return None


def supports(w: QTensor) -> str | None:
    """None if :func:`gemv_w4` covers ``w``, else the reason it does not (cheap for a prepared weight)."""
    if isinstance(w, PreparedW4):
        return None
    if isinstance(w, QTensor):
        hit = _PREPARED.get(id(w.data))
        if hit is not None and hit[0]() is w.data and hit[1].sig == _sig_of(w):
            return None
    return _why_not(w)


@functools.lru_cache(maxsize=16)
def dummy_tensor(device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    return torch.zeros(16, dtype=dtype, device=device)


def _unused(device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """A pointer for a per-call argument the kernel's constexprs make it skip (no bias, no row scale, no
    split-K): allocated without a fill, so it costs no launch."""
    return torch.empty(16, dtype=dtype, device=device)


def _epilogue_buffers(plan, n: int, row_scale, device: torch.device, dev_index: int):
    """(split-K partials, arrival counters, row scales) for a launch of ``plan``; dummies where unused."""
    if plan.split > 1:
        ws, cnt = split_k_scratch(device, dev_index, plan.split * plan.mp * n, plan.n_tiles)
    else:
        ws, cnt = _unused(device, torch.float32), _unused(device, torch.int32)
    return ws, cnt, row_scale if row_scale is not None else _unused(device, torch.float32)


def _tab(device: torch.device, offset: torch.Tensor | None) -> torch.Tensor:
    tab = torch.zeros(288, dtype=torch.float32, device=device)
    tab[:16] = codebook_table(NF4).to(device)
    tab[k.TAB_DMAP.value:k.TAB_DMAP.value + 256] = ref_nf4.dynamic_map(device)
    if offset is not None:
        tab[k.TAB_OFFSET.value] = offset.reshape(()).to(device=device, dtype=torch.float32)
    return tab


def _alias(t: torch.Tensor, dtype: torch.dtype, shape: tuple) -> torch.Tensor:
    """A contiguous ``dtype`` tensor of ``shape`` over t's bytes, copying only when t is not contiguous or
    not 16-byte aligned. A fresh tensor on the same storage (``set_``), not a view: it keeps the memory
    alive but not the tensor object ``t`` (whose death drops the cache entry)."""
    t = t.reshape(-1)
    esize = torch.empty((), dtype=dtype).element_size()
    if not t.is_contiguous() or t.data_ptr() % 16:
        t = t.clone()
    offset = t.storage_offset() * t.element_size()
    out = torch.empty(0, dtype=dtype, device=t.device)
    stride = tuple(math.prod(shape[i + 1:]) for i in range(len(shape)))
    return out.set_(t.untyped_storage(), offset // esize, shape, stride)


def _as_words(data: torch.Tensor, n: int, kdim: int) -> torch.Tensor:
    return _alias(data, torch.int32, (n, kdim // 8))


def _to_int32(words: torch.Tensor) -> torch.Tensor:
    return torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)


def _awq_layout(q: QTensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(words int32 [N, K/8] N-major with nibble j = element 8w + j, sz int32 [N, K/g])."""
    n, kdim, _ = ref_awq.check_int4_awq(q)
    dev = q.data.device
    words = torch.empty(n, kdim // 8, dtype=torch.int32, device=dev)
    shifts = torch.arange(0, 32, 4, dtype=torch.int64, device=dev)
    step = max(8, min(kdim, (1 << 22) // max(n, 1) // 8 * 8))  # bounded temporaries
    for k0 in range(0, kdim, step):
        k1 = min(kdim, k0 + step)
        nib = ref_awq.unpack_awq(q.data[k0:k1])                      # [k1-k0, N] natural column order
        t = nib.t().reshape(n, (k1 - k0) // 8, 8).to(torch.int64)
        words[:, k0 // 8:k1 // 8] = _to_int32((t << shifts).sum(dim=-1))
    z = ref_awq.unpack_awq(q.zeros).t()                              # [N, K/g]
    s_bits = q.scale.t().contiguous().view(torch.int16).to(torch.int32) & 0xFFFF
    sz = (s_bits | ((0x6400 + z) << 16)).contiguous()
    return words, sz


def _sig_of(q: QTensor) -> tuple:
    """What a prepared layout depends on besides ``q.data``'s identity: format, shape, the tensors' identities,
    the version counters of the tensors whose values the layout copies, and the per-tensor scale value. An
    in-place update of ``q.data`` / ``q.scale`` / ``q.zeros`` / ``q.nested_offset`` or a swapped tensor
    invalidates the layout (``q.global_scale`` and ``q.nested_scale`` are aliased, read at each launch)."""
    d, sc, z, no = q.data, q.scale, q.zeros, q.nested_offset
    pts = q.params.get("per_tensor_scale")
    return (q.fmt, q.shape, q.scale_layout, tensor_version(d), id(sc), tensor_version(sc),
            None if z is None else (id(z), tensor_version(z)),
            None if no is None else (id(no), tensor_version(no)),
            id(q.global_scale), id(q.nested_scale), id(pts) if isinstance(pts, torch.Tensor) else pts,
            plan_rows(q))


def _prepare(q: QTensor) -> PreparedW4:
    reason = _why_not(q)
    if reason:
        raise ValueError(f"gemv_w4: {reason}")
    n, kdim = q.shape
    dev = q.data.device
    dummy = dummy_tensor(dev, torch.float32)
    gs_kind, gs, post = GS_NONE.value, dummy, 1.0
    nested, tab = dummy, None
    if q.fmt in ("nvfp4", "mxfp4", "fp4_b32"):
        fmt = q.fmt
        block = 16 if q.fmt == "nvfp4" else 32
        scales = unswizzle_scales(q.scale, n, kdim // block) if q.scale_layout == "swizzled" else q.scale
        scales = _alias(scales, torch.float32 if q.fmt == "fp4_b32" else torch.uint8, (n, kdim // block))
        words = _as_words(q.data, n, kdim)
        post = 64.0  # the E4M3 route decodes e2m1 * 2^-6
        if q.fmt == "nvfp4":
            pts = q.params.get("per_tensor_scale")
            if pts is not None:
                gs_kind = GS_MULTIPLY.value
                gs = torch.as_tensor(pts, dtype=torch.float32).reshape(1).to(dev)
            elif q.global_scale is not None:
                gs_kind = GS_DIVIDE.value
                gs = _alias(q.global_scale.to(device=dev, dtype=torch.float32), torch.float32, (1,))
        wpb = block // 8
    elif q.fmt == "nf4":
        _, blocksize, dq = ref_nf4.check_nf4_qtensor(q)
        fmt = "nf4_dq" if dq else "nf4"
        words = _as_words(q.data, n, kdim)
        scales = _alias(q.scale, q.scale.dtype, (n, kdim // blocksize))
        if dq:
            nested = _alias(q.nested_scale.to(torch.float32), torch.float32, (q.nested_scale.numel(),))
        tab = _tab(dev, q.nested_offset if dq else None)
        wpb = blocksize // 8
    else:
        fmt = "int4_awq"
        words, scales = _awq_layout(q)
        wpb = q.params["group_size"] // 8
    if tab is None:
        tab = dummy
    return PreparedW4(fmt=fmt, fmt_code=_FMT[fmt], n=n, k=kdim, words=words, scales=scales,
                      words_per_block=wpb, post=post, gs_kind=gs_kind, gs=gs, nested=nested, tab=tab,
                      sig=_sig_of(q), plan_n=plan_rows(q))


# id(w.data) -> (weakref to w.data, PreparedW4). Keyed on w.data, not on the QTensor: torch.compile
# rebuilds the QTensor around the same tensors on every call. The entry goes when w.data goes.
_PREPARED: dict = {}


def _forget(data_id: int):
    def drop(_ref):
        _PREPARED.pop(data_id, None)
    return drop


def prepare_w4(w: QTensor) -> PreparedW4:
    """The kernel layout of ``w``, made once and cached for as long as ``w.data`` lives; re-made when a
    tensor of ``w`` is replaced or modified in place (see ``_sig_of``). Call it at load time to keep the
    first ``gemv_w4`` call cheap (int4_awq repacks the weight)."""
    if type(w) is PreparedW4:
        return w
    if not isinstance(w, QTensor):
        raise TypeError(f"gemv_w4: w must be a QTensor or PreparedW4, got {type(w).__name__}")
    data = w.data
    hit = _PREPARED.get(id(data))
    if hit is not None and hit[0]() is data:
        p = hit[1]
        if p.sig == _sig_of(w):
            return p
    p = _prepare(w)
    if _no_caching():
        # inside the custom op (maybe a CUDA-graph warmup whose allocations land in the graph's pool, where a
        # cached tensor is an untracked live allocation) or a graph capture: use this layout for this call
        # only. Layouts made in eager mode (QuantLinear warms them, see warm()) are found by later calls.
        return p
    _PREPARED[id(data)] = (weakref.ref(data, _forget(id(data))), p)
    return p


def _no_caching() -> bool:
    return scratch_per_call() or (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing())


def warm(w: QTensor) -> None:
    """Make and cache every layout the GEMV kernels use for ``w`` (call it in eager mode, e.g. at load; a
    compiled call with a cold cache builds them per call, or leaves the tensor-core GEMV out)."""
    if _why_not(w) is None:
        mma_layout(prepare_w4(w))


def clear_cache() -> None:
    """Drop every cached prepared weight and launch plan (call it after editing :data:`TILE` in place)."""
    for _, p in _PREPARED.values():
        p.plans.clear()
        p.mma = None
    _PREPARED.clear()
    _PLANS.clear()


# ------------------------------------------------------------------------------------- tensor-core layout

MMA = {"min_m": 1, "max_m": 16, "m1_min_weights": {"nf4": 1 << 25, "other": 1 << 27}, "rg": 2, "j": 4,
       "warps": 4, "ctas_per_sm": (8, 4)}
"""The tensor-core GEMV (``_gemv_mma``): used for min_m <= M <= max_m where the weight allows it (see
:func:`mma_layout`), at M = 1 only for weights of at least m1_min_weights elements (an int, or per format with
"other" for the rest: the FMA kernel's NF4 table loads make it slower, so NF4 switches on smaller
weights; H100: 8192x8192 27.8 against 33.5 us, 4096x14336 26.6 against 33.2,
6144x4096 and 4096x4096 within 0.2 us of the FMA kernel, which they keep); rg: 16-row groups per
program, j: 64-column chunks per iteration (one per warp), ctas_per_sm: the split-K target for M <= 8 and for
M > 8 (an int for both). ``min_m=17`` turns it off. H200 sweeps (NVFP4, CUDA graphs): at M = 1 it beats the
row-major FMA kernel on 28672x8192 and 8192x28672 (42.0 / 44.2 us against 47.5 / 50.0) but not on the smaller
shapes
(8192x8192: 18.5 against 16.9 us); from M = 2 on it wins everywhere (28672x8192, M = 16: 52 against 168 us)."""

# bit positions (m, e0, e1, sign) of element (row g + 8 h, column 4 i + c) of a lane's word: three of the four
# bf16x2 A registers are then one shift and one AND (see _gemv_mma)
_MMA_BITS = {(0, 0): (6, 7, 8, 15), (0, 1): (22, 23, 24, 31), (1, 0): (3, 4, 5, 12), (1, 1): (19, 20, 21, 28),
             (0, 2): (0, 1, 2, 9), (0, 3): (16, 17, 18, 25), (1, 2): (10, 11, 13, 14), (1, 3): (26, 27, 29, 30)}


def _mma_format(fmt: str, kdim: int, group: int | None = None) -> bool:
    """Whether the tensor-core layout exists for this format, K and (int4_awq) group size: a 64-column chunk
    must lie in one group (NF4: one absmax block), since the int4 scale and the NF4 absmax are applied per
    chunk after its mmas (MXFP4 scale codes are checked apart)."""
    if fmt in ("int4_awq", "nf4", "nf4_dq"):
        return kdim % 64 == 0 and group is not None and group % 64 == 0
    return fmt in ("nvfp4", "mxfp4") and kdim % 64 == 0


def _mma_x_dtypes(fmt: str) -> tuple:
    """x dtypes the tensor-core GEMV takes for a format: the FP4 decode builds bf16 operands; int4's
    ``MAGIC + q - (MAGIC + z)`` is exact in bf16 and fp16 alike; the NF4 table is kept in both."""
    return (torch.bfloat16, torch.float16) if fmt in ("int4_awq", "nf4", "nf4_dq") else (torch.bfloat16,)


def _mma_regime(n: int, kdim: int, m: int, cfg: dict, fmt: str = "") -> bool:
    """Whether ``cfg`` (an :data:`MMA`-shaped dict) sends M = ``m`` on an N x K weight to the tensor-core GEMV."""
    floor = cfg.get("m1_min_weights", 0)
    if isinstance(floor, dict):
        floor = floor.get("nf4" if fmt.startswith("nf4") else fmt, floor.get("other", 0))
    return cfg["min_m"] <= m <= cfg["max_m"] and (m > 1 or n * kdim >= floor)


@dataclass(eq=False)
class MmaLayout:
    words: torch.Tensor    # int32 [N16, K/64, 32, 4]
    scales: torch.Tensor   # int16 [N16, K/SB, 8]: (row g, row g + 8) scale codes; int4: int32 [N16, K/G, 8, 2]
    fmt_code: int
    cpg: int = 1           # int4 / NF4: 64-column chunks per group (block)
    plans: dict = field(default_factory=dict, repr=False)

    def table(self, x_dtype: torch.dtype) -> tuple:
        return _mma_table(self.fmt_code, x_dtype)


def _mma_table(fmt_code: int, x_dtype: torch.dtype) -> tuple:
    """The tensor-core kernel's T0..T7: NF4's level table for the mma operand type as signed int32 values,
    else 0s."""
    if fmt_code != km.FMT_NF4.value:
        return _NO_TABLE
    return _NF4_TABLE_F16 if x_dtype == torch.float16 else _NF4_TABLE_BF16


def _signed_words(lo: tuple, hi: tuple) -> tuple:
    return tuple(v - (1 << 32) if v >= 1 << 31 else v for v in lo + hi)


_NO_TABLE = (0,) * 8
_NF4_TABLE_BF16 = _signed_words(*km.nf4_table_words(False))
_NF4_TABLE_F16 = _signed_words(*km.nf4_table_words(True))

# int4: nibble bit position of element (row g + 8 h, column 4 i + c) of a lane's word (see _gemv_mma)
_MMA_INT4_BITS = {(h, c): 4 * (h + 2 * (c // 2)) + 16 * (c % 2) for h in range(2) for c in range(4)}
# NF4: the low half-word holds A registers 0 and 1 (rows g, g + 8 at c = 0, 1), the high one registers 2 and 3
_MMA_NF4_BITS = {(h, c): 4 * (2 * h + c % 2) + 16 * (c // 2) for h in range(2) for c in range(4)}


def _mma_words(codes: torch.Tensor, nibbles: dict | None = None) -> torch.Tensor:
    """E2M1 codes (or, with ``nibbles``, int4 / NF4 codes placed whole at those bit positions) uint8 [16 G, K]
    (G row groups) -> int32 words [G, K/64, 32, 4]."""
    g16, kdim = codes.shape
    c = codes.reshape(g16 // 16, 2, 8, kdim // 64, 4, 4, 4).to(torch.int64)   # [G, h, g, kq, t, i, c]
    word = torch.zeros(g16 // 16, 8, kdim // 64, 4, 4, dtype=torch.int64, device=codes.device)
    for (h, col), pos in (nibbles or {}).items():
        word |= c[:, h, :, :, :, :, col] << pos
    for (h, col), pos in ({} if nibbles else _MMA_BITS).items():
        v = c[:, h, :, :, :, :, col]                                          # [G, g, kq, t, i]
        for b, bit in enumerate(pos):
            word |= ((v >> b) & 1) << bit
    word = word.permute(0, 2, 1, 3, 4).reshape(g16 // 16, kdim // 64, 32, 4)  # lane = 4 g + t
    return _to_int32(word)


def mma_layout(p: PreparedW4) -> MmaLayout | None:
    """The tensor-core layout of a prepared NVFP4 / MXFP4 / int4_awq / nf4 weight (made once, cached on ``p``),
    or None where the tensor-core GEMV does not apply: other formats, K not a multiple of 64 (int4 / nf4: a
    group or block not a multiple of 64 columns), MXFP4 scale codes outside
    [-62, 191] - 127 (their 2^63-offset bf16 form would overflow; such weights use the FMA kernel)."""
    if p.mma is not None:
        return p.mma or None
    if _no_caching():
        # not built inside the custom op or a capture (see prepare_w4; the MXFP4 check reads the scales on the
        # host): the FMA / dot kernels run instead
        return None
    ok = _mma_format(p.fmt, p.k, 8 * p.words_per_block)
    if ok and p.fmt == "mxfp4":
        ok = int(p.scales.max()) <= 191
    if not ok:
        p.mma = False
        return None
    if p.fmt == "int4_awq":
        p.mma = _mma_int4_layout(p)
        return p.mma
    if p.fmt in ("nf4", "nf4_dq"):
        p.mma = _mma_nf4_layout(p)
        return p.mma
    n, kdim = p.n, p.k
    n16 = _cdiv(n, 16)
    codes_packed = p.words.view(torch.uint8).reshape(n, kdim // 2)
    words = _layout_words(p, lambda r0, r1: unpack_fp4(codes_packed[r0:r1]))
    scales = p.scales.reshape(n, -1)
    sb = scales.shape[1]
    sc = torch.zeros(16 * n16, sb, dtype=torch.int32, device=p.device)
    sc[:n] = scales.view(torch.uint8).to(torch.int32)
    sc = sc.reshape(n16, 2, 8, sb)
    pairs = (sc[:, 0] | (sc[:, 1] << 8)).permute(0, 2, 1).to(torch.int16).contiguous()   # [N16, SB, 8]
    p.mma = MmaLayout(words=words, scales=pairs,
                      fmt_code=km.FMT_NVFP4.value if p.fmt == "nvfp4" else km.FMT_MXFP4.value)
    return p.mma


def _layout_words(p: PreparedW4, codes_of, nibbles: dict | None = None) -> torch.Tensor:
    """The words [N16, K/64, 32, 4] of :func:`_mma_words`, made over slices of row groups (bounded int64
    temporaries); ``codes_of(r0, r1)``: the uint8 codes [r1 - r0, K] of rows r0..r1. Padding rows get code 0."""
    n, kdim = p.n, p.k
    n16 = _cdiv(n, 16)
    words = torch.empty(n16, kdim // 64, 32, 4, dtype=torch.int32, device=p.device)
    step = max(1, (1 << 24) // kdim)
    for g0 in range(0, n16, step):
        g1 = min(n16, g0 + step)
        r0, r1 = 16 * g0, min(n, 16 * g1)
        codes = torch.zeros(16 * (g1 - g0), kdim, dtype=torch.uint8, device=p.device)
        codes[: r1 - r0] = codes_of(r0, r1)
        words[g0:g1] = _mma_words(codes, nibbles)
    return words


def _mma_int4_layout(p: PreparedW4) -> MmaLayout:
    """Words from the N-major int4 words (nibble j of word w = element 8 w + j), and per group the lane's
    (fp16 scale of row g | row g + 8 << 16, zero of row g | row g + 8 << 16) from the ``sz`` pairs
    (fp16 scale bits | (0x6400 + z) << 16). Padding rows get zero words and scales."""
    n, kdim, group = p.n, p.k, 8 * p.words_per_block
    n16, ng = _cdiv(n, 16), kdim // group
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=p.device)
    words = _layout_words(
        p, lambda r0, r1: ((p.words[r0:r1, :, None] >> shifts) & 0xF).reshape(r1 - r0, kdim).to(torch.uint8),
        _MMA_INT4_BITS)
    sz = torch.full((16 * n16, ng), 0x6400 << 16, dtype=torch.int64, device=p.device)   # padding: s = z = 0
    sz[:n] = p.scales.to(torch.int64) & 0xFFFFFFFF
    scale, zero = sz & 0xFFFF, (sz >> 16) - 0x6400
    scale, zero = scale.reshape(n16, 2, 8, ng), zero.reshape(n16, 2, 8, ng)
    pairs = torch.stack([scale[:, 0] | (scale[:, 1] << 16), zero[:, 0] | (zero[:, 1] << 16)], dim=-1)
    pairs = _to_int32(pairs.permute(0, 2, 1, 3).contiguous())                   # [N16, NG, 8, 2]
    return MmaLayout(words=words, scales=pairs, fmt_code=km.FMT_INT4.value, cpg=group // 64)


def _nf4_block_absmax(p: PreparedW4) -> torch.Tensor:
    """fp32 absmax [N, K / blocksize] of a prepared nf4 weight, double quantization decoded as
    ``formats.nf4.nf4_absmax`` does (bitsandbytes' ``dequantize_4bit``)."""
    n, nb = p.n, p.k // (8 * p.words_per_block)
    if p.fmt == "nf4":
        return p.scales.reshape(n, nb)
    absmax = ref_nf4.dequantize_blockwise_8bit(p.scales.reshape(-1), p.nested, None, ref_nf4.NESTED_BLOCKSIZE)
    return (absmax + p.tab[k.TAB_OFFSET.value]).reshape(n, nb)


def _mma_nf4_layout(p: PreparedW4) -> MmaLayout:
    """Words from bitsandbytes' bytes (element 2 i in the high nibble), nibbles at :data:`_MMA_NF4_BITS`, and
    per block the lane's (absmax of row g, absmax of row g + 8) as fp32 bits; double quantization is decoded
    here, once (4 bytes per block instead of 1 + 4/256: the same bytes per weight as NVFP4 at blocksize 64).
    Padding rows get zero words and absmax."""
    n, kdim, block = p.n, p.k, 8 * p.words_per_block
    n16, nb = _cdiv(n, 16), kdim // block
    packed = p.words.view(torch.uint8).reshape(n, kdim // 2)
    words = _layout_words(
        p, lambda r0, r1: unpack_nibbles_high_first(packed[r0:r1], (r1 - r0) * kdim).reshape(r1 - r0, kdim),
        _MMA_NF4_BITS)
    absmax = torch.zeros(16 * n16, nb, dtype=torch.float32, device=p.device)
    absmax[:n] = _nf4_block_absmax(p)
    bits = absmax.view(torch.int32).reshape(n16, 2, 8, nb)
    pairs = torch.stack([bits[:, 0], bits[:, 1]], dim=-1).permute(0, 2, 1, 3).contiguous()   # [N16, NB, 8, 2]
    return MmaLayout(words=words, scales=pairs, fmt_code=km.FMT_NF4.value, cpg=block // 64)


def _mma_plan(m: int, n: int, kdim: int, fmt_code: int, cpg: int, gs_kind: int, post: float, has_bias: bool,
              act: int, x_dtype: torch.dtype, dev_index: int, cfg: dict, rs_mode: int = 0,
              plan_n: int | None = None) -> _Plan:
    """The launch plan of the tensor-core GEMV (static facts only: no tensor is read, so the compiled path can
    build it from fake tensors). K is split as for a weight of ``plan_n`` rows (default ``n``)."""
    nt = 1 if m <= 8 else 2
    kq = kdim // 64
    rg = cfg["rg"]
    j = cfg["j"]
    while j > 1 and kq % j:
        j //= 2
    iters = kq // j
    n_tiles = _cdiv(_cdiv(n, 16), rg)
    cps = cfg.get("ctas_per_sm", TILE["ctas_per_sm"])
    cps = cps if isinstance(cps, int) else cps[nt - 1]
    split = _split_k(iters, _cdiv(_cdiv(plan_n or n, 16), rg), kdim, 8 * nt, _num_sms(dev_index),
                     {**TILE, "ctas_per_sm": cps})
    consts = {"FMT": fmt_code, "RG": rg, "J": j, "IPS": iters // split, "NT": nt,
              "SPLIT": split, "HAS_BIAS": has_bias, "ACT": act, "GS_KIND": gs_kind,
              "ROW_SCALE": rs_mode, "CPG": cpg, "XF16": x_dtype == torch.float16,
              "POST": 1.0 if fmt_code in (km.FMT_INT4.value, km.FMT_NF4.value) else 2.0 ** 63 * (post / 64.0)}
    # the warps split the J chunks (then the row groups): a warp's 32 lanes must hold dim 2 whole, which
    # the mma asm relies on
    return _Plan(fn=km.gemv_mma_kernel, grid=(n_tiles, split, 1), consts=consts,
                 num_warps=min(cfg["warps"], rg * j), ints=(m, n, kdim, kq), split=split,
                 mp=8 * nt, n_tiles=n_tiles * nt)


def _mma_launch(x: torch.Tensor, p: PreparedW4, lay: MmaLayout, bias, act: int, out: torch.Tensor,
                dev_index: int, cfg: dict, row_scale: torch.Tensor | None = None, rs_mode: int = 0) -> None:
    m = x.shape[0]
    key = (m, bias is None, None if bias is None else bias.dtype, act, x.dtype,
           tuple((k_, v) for k_, v in cfg.items() if k_ != "m1_min_weights"), rs_mode, out.dtype)
    plan = lay.plans.get(key)
    if plan is None:
        plan = lay.plans[key] = _mma_plan(m, p.n, p.k, lay.fmt_code, lay.cpg, p.gs_kind, p.post, bias is not None,
                                          act, x.dtype, dev_index, cfg, rs_mode, p.plan_n)
    dev = x.device
    ws, cnt, rs = _epilogue_buffers(plan, p.n, row_scale, dev, dev_index)
    args = (x, lay.words, lay.scales, p.gs, rs, _unused(dev, x.dtype) if bias is None else bias, out, ws, cnt,
            *plan.ints, *lay.table(x.dtype))
    _launch(plan, args, dev_index)


# ------------------------------------------------------------------------------------------------ launch

@functools.lru_cache(maxsize=16)
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _chunks(kw: int, want: int) -> int:
    """Largest power of two <= want whose 4 c words divide the row (kw is a multiple of 4)."""
    c = want
    while c > 1 and kw % (4 * c):
        c //= 2
    return c


def _split_k(iters: int, n_tiles: int, kdim: int, mp: int, sms: int, cfg: dict) -> int:
    """Ways to split the K loop of ``iters`` iterations: until about ctas_per_sm programs per SM exist, at
    most max_split, each split at least min_iters long and dividing iters (equal splits: no tail
    iterations). The split-K partials (split * MP * N fp32, written and read back in L2) stay under
    ws_ratio of the N * K / 2 weight bytes."""
    ws_cap = max(1, int(cfg.get("ws_ratio", 0.25) * kdim / (16 * mp)))
    want = max(1, min(cfg["max_split"], ws_cap, (cfg["ctas_per_sm"] * sms) // n_tiles,
                      iters // max(1, cfg["min_iters"])))
    return max(d for d in range(1, want + 1) if iters % d == 0)


@dataclass
class _Plan:
    fn: object
    grid: tuple
    consts: dict
    num_warps: int
    ints: tuple              # M, N, KW, SK
    split: int
    mp: int
    n_tiles: int
    launch: Launch = field(default=None, repr=False)

    def __post_init__(self) -> None:
        self.launch = Launch(self.fn, self.grid, self.consts, self.num_warps)


def _make_plan(fmt_code: int, wpb: int, post: float, gs_kind: int, n: int, kdim: int, sk: int, m: int,
               x_fp16: bool, has_bias: bool, act: int, device_index: int | None, cfg: dict,
               rs_mode: int = 0, plan_n: int | None = None) -> _Plan:
    use_fma = m <= cfg["fma_max_m"]
    t = cfg["fma"] if use_fma else cfg["dot"]
    kw = kdim // 8
    c = _chunks(kw, t["chunks"])
    bn = t["bn"]
    iters = kw // (4 * c)
    n_tiles = _cdiv(n, bn)
    sms = _num_sms(device_index) if device_index is not None else 4
    mp = (1 if m == 1 else 2 if m == 2 else 4) if use_fma else 16
    split = _split_k(iters, _cdiv(plan_n or n, bn), kdim, mp, sms, cfg)
    ips = iters // split
    consts = {"FMT": fmt_code, "WPB": wpb, "IPS": ips, "MP": mp, "BN": bn, "C": c, "STAGES": t["stages"], "SPLIT": split,
              "HAS_BIAS": has_bias, "ACT": act, "GS_KIND": gs_kind, "ROW_SCALE": rs_mode, "POST": post,
              "X_FP16": x_fp16,
              "ON_GPU": not _interpreting()}
    fn = k.gemv_w4_fma_kernel if use_fma else k.gemv_w4_dot_kernel
    return _Plan(fn=fn, grid=(n_tiles, split, 1), consts=consts, num_warps=t["warps"],
                 ints=(m, n, kw, sk), split=split, mp=mp, n_tiles=n_tiles)


_PLANS: dict = {}
_MAX_PLANS = 4096


def _cfg_key(cfg: dict) -> tuple:
    return (cfg["fma_max_m"], tuple(cfg["fma"].values()), tuple(cfg["dot"].values()), cfg["ctas_per_sm"],
            cfg["max_split"], cfg["min_iters"], cfg.get("ws_ratio", 0.25))




def _launch(plan: _Plan, args: tuple, device: int | None) -> None:
    """Launch on ``device`` (made current for the launch if it is not); ``None``: the interpreter."""
    if device is None or type(plan.fn) is not JITFunction:
        plan.fn[plan.grid](*args, **plan.consts, num_warps=plan.num_warps)
    elif torch._C._cuda_getDevice() != device:
        with torch.cuda.device(device):
            plan.launch.run(device, *args)
    else:
        plan.launch.run(device, *args)


def _check_x(x: torch.Tensor, p: PreparedW4) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"gemv_w4: x must be a tensor, got {type(x).__name__}")
    if x.dtype not in _X_DTYPES:
        raise TypeError(f"gemv_w4: x must be bfloat16 or float16, got {x.dtype}")
    if x.dim() != 2:
        raise ValueError(f"gemv_w4: x must be 2-D [M, K], got shape {tuple(x.shape)}")
    if x.shape[1] != p.k:
        raise ValueError(f"gemv_w4: x has K={x.shape[1]}, the weight has K={p.k}")
    if x.shape[0] > MAX_M:
        raise ValueError(f"gemv_w4: M={x.shape[0]} rows; the GEMV covers M <= {MAX_M}")
    if x.device != p.device:
        raise ValueError(f"gemv_w4: x is on {x.device}, the weight on {p.device}")


_OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _check_row_scale(rs, x: torch.Tensor) -> int:
    """1 for one factor, 2 for one per x row; clear errors otherwise."""
    if not isinstance(rs, torch.Tensor) or rs.dtype != torch.float32:
        raise TypeError(f"gemv_w4: row_scale must be a float32 tensor, got {getattr(rs, 'dtype', type(rs).__name__)}")
    if rs.device != x.device:
        raise ValueError(f"gemv_w4: row_scale is on {rs.device}, x on {x.device}")
    if not rs.is_contiguous():
        raise ValueError("gemv_w4: row_scale must be contiguous")
    if rs.numel() == 1:
        return 1
    if rs.numel() == x.shape[0]:
        return 2
    raise ValueError(f"gemv_w4: row_scale must have 1 or M = {x.shape[0]} elements, got {rs.numel()}")


def _check_bias(bias, x: torch.Tensor, n: int) -> torch.Tensor:
    if not isinstance(bias, torch.Tensor) or bias.shape != (n,) or not bias.dtype.is_floating_point:
        raise ValueError(f"gemv_w4: bias must be a float tensor of shape ({n},), got "
                         f"{getattr(bias, 'dtype', type(bias).__name__)} {tuple(getattr(bias, 'shape', ()))}")
    if bias.device != x.device:
        raise ValueError(f"gemv_w4: bias is on {bias.device}, x on {x.device}")
    # a cached compiled kernel assumes 16-byte aligned pointers (Triton specializes on it): copy others
    return bias if bias.is_contiguous() and bias.data_ptr() % 16 == 0 else bias.clone()


def describe(w: QTensor, m: int) -> str:
    """Which GEMV kernel the default configuration runs for ``w`` at M = ``m`` (what :func:`gemv_w4` chooses,
    for ``lowbit.explain``; it reads no tensor)."""
    n, kdim = plan_rows(w), w.shape[-1]
    params = getattr(w, "params", {})
    group = params.get("blocksize") if w.fmt == "nf4" else params.get("group_size")
    if _mma_format(w.fmt, kdim, group) and _mma_regime(n, kdim, m, MMA, w.fmt):
        if w.fmt in ("int4_awq", "nf4"):
            return "tensor-core mma.sync GEMV (bf16 or fp16 x)"
        other = "CUDA-core FMA" if m <= TILE["fma_max_m"] else "tl.dot"
        return (f"tensor-core mma.sync GEMV for bf16 x ({other} GEMV for fp16 x"
                + (" or MXFP4 scale codes above 191)" if w.fmt == "mxfp4" else ")"))
    return "CUDA-core FMA GEMV" if m <= TILE["fma_max_m"] else "tl.dot GEMV"


def gemv_w4(x: torch.Tensor, w: QTensor | PreparedW4, bias: torch.Tensor | None = None,
            activation: str | None = None, config: dict | None = None,
            mma_config: dict | bool | None = None, *, row_scale: torch.Tensor | None = None,
            divide_by: torch.Tensor | None = None, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """``act(x @ dequant(w).T + bias)`` in x's dtype, accumulated in fp32, for M <= 16.

    Args:
        x: ``[M, K]`` bfloat16/float16 CUDA tensor (CPU under ``TRITON_INTERPRET=1``), ``M <= 16``; a
            non-contiguous or misaligned x is copied.
        w: QTensor with logical shape ``[N, K]`` (see :func:`supports`), or :func:`prepare_w4`'s result.
        bias: None or ``[N]`` (any float dtype; added in fp32).
        activation: None, ``"gelu"`` (erf), ``"gelu_tanh"`` or ``"silu"``.
        config: a TILE-shaped dict overriding :data:`TILE` (sweeps). Without it the plan is cached on the
            prepared weight: call :func:`clear_cache` after editing :data:`TILE` in place.
        mma_config: an :data:`MMA`-shaped dict overriding it, or False for the FMA / dot kernels only (a
            ``config`` without ``mma_config`` also leaves the tensor-core GEMV out).
        row_scale: None, or a float32 tensor on x's device with 1 element (one factor) or M elements (one per
            x row) multiplying the fp32 product before the bias: what x's own scales leave over
            (``lowbit.scaled_mm`` passes an FP8 activation's per-token scale, or alpha / an nvfp4
            activation's global scale, this way).
        divide_by: instead of row_scale, a 1-element float32 tensor the fp32 product is divided by (IEEE
            division; an nvfp4 activation's global scale).
        out_dtype: the result dtype (default x's): bfloat16, float16 or float32.

    Returns:
        ``[M, N]`` tensor of x's dtype.
    """
    p = w if type(w) is PreparedW4 else prepare_w4(w)
    if not isinstance(x, torch.Tensor) or x.dtype not in _X_DTYPES or x.dim() != 2 or x.shape[1] != p.k \
            or x.shape[0] > MAX_M or x.device != p.device:
        _check_x(x, p)
    act = ACTIVATIONS.get(activation, -1) if activation is None or type(activation) is str else -1
    if act < 0:
        raise ValueError(f"gemv_w4: activation must be one of {list(ACTIVATIONS)}, got {activation!r}")
    m, n = x.shape[0], p.n
    if bias is not None:
        bias = _check_bias(bias, x, n)
    out_dtype = x.dtype if out_dtype is None else out_dtype
    if out_dtype not in _OUT_DTYPES:
        raise TypeError(f"gemv_w4: out_dtype must be bfloat16, float16 or float32, got {out_dtype}")
    if divide_by is not None:
        if row_scale is not None:
            raise ValueError("gemv_w4: give row_scale or divide_by, not both")
        if isinstance(divide_by, torch.Tensor) and divide_by.numel() != 1:
            raise ValueError(f"gemv_w4: divide_by must have 1 element, got {divide_by.numel()}")
        _check_row_scale(divide_by, x)
        row_scale, rs_mode = divide_by, 3
    else:
        rs_mode = 0 if row_scale is None else _check_row_scale(row_scale, x)
    out = torch.empty(m, n, dtype=out_dtype, device=x.device)
    if m == 0:
        return out
    if not x.is_contiguous() or x.data_ptr() % 16:
        x = x.clone(memory_format=torch.contiguous_format)
    dev_index = p.device.index if p.device.type == "cuda" else None
    if (dev_index is not None and x.dtype in _mma_x_dtypes(p.fmt) and mma_config is not False
            and (config is None or mma_config is not None) and not _interpreting()):
        mcfg = MMA if mma_config is None else mma_config
        if _mma_regime(p.plan_n, p.k, m, mcfg, p.fmt):
            lay = mma_layout(p)
            if lay is not None:
                _mma_launch(x, p, lay, bias, act, out, dev_index, mcfg, row_scale, rs_mode)
                return out
    bias_dtype = None if bias is None else bias.dtype
    if config is None:
        pk = (m, x.dtype, bias_dtype, act, rs_mode, out_dtype)
        plan = p.plans.get(pk)
        if plan is None:
            plan = p.plans[pk] = _make_plan(p.fmt_code, p.words_per_block, p.post, p.gs_kind, n, p.k, p.sk, m,
                                            x.dtype == torch.float16, bias is not None, act, dev_index, TILE,
                                            rs_mode, p.plan_n)
    else:
        pkey = (p.fmt_code, p.words_per_block, p.post, p.gs_kind, n, p.k, p.sk, m, x.dtype, bias_dtype, act,
                dev_index, _cfg_key(config), rs_mode, out_dtype, p.plan_n)
        plan = _PLANS.get(pkey)
        if plan is None:
            plan = _make_plan(p.fmt_code, p.words_per_block, p.post, p.gs_kind, n, p.k, p.sk, m,
                              x.dtype == torch.float16, bias is not None, act, dev_index, config, rs_mode, p.plan_n)
            if len(_PLANS) >= _MAX_PLANS:
                _PLANS.clear()
            _PLANS[pkey] = plan
    dev = x.device
    ws, cnt, rs = _epilogue_buffers(plan, n, row_scale, dev, dev_index)
    args = (x, p.words, p.scales, p.nested, p.tab, p.gs, rs, _unused(dev, x.dtype) if bias is None else bias, out,
            ws, cnt, *plan.ints)
    _launch(plan, args, dev_index)
    return out


# ------------------------------------------------------------------------------------ prepared-layer calls
#
# A layer that owns its weight decides everything once: the layouts (prepare_w4, mma_layout), then per row
# count M and x dtype a GemvRunner with the plan, the compiled kernel and every argument but x, the output
# and the split-K scratch. Its call allocates the output and launches the cached kernel: nothing else. The
# same plans, built from the static facts alone, serve the compiled path (traced_gemv), where the tensors
# arrive as fake tensors and the launch goes through wrap_triton.


@dataclass(frozen=True)
class GemvFacts:
    """What the GEMV plan of a prepared weight depends on (no tensors): format, shape, decode constants and
    the tensor-core layout's format code (-1: none) and chunks per group."""

    fmt: str
    fmt_code: int
    n: int
    k: int
    sk: int
    wpb: int
    post: float
    gs_kind: int
    mma_fmt: int
    cpg: int
    plan_n: int = 0
    """Rows the plans are made for (0: ``n``; a column shard's whole weight, see ``lowbit.formats.shards``)."""


def facts(p: PreparedW4) -> GemvFacts:
    """The static facts of ``p``; builds its tensor-core layout first (call in eager mode, at load time)."""
    lay = mma_layout(p)
    return GemvFacts(p.fmt, p.fmt_code, p.n, p.k, p.sk, p.words_per_block, p.post, p.gs_kind,
                     -1 if lay is None else lay.fmt_code, 1 if lay is None else lay.cpg, p.plan_n)


def mma_rule(f: GemvFacts) -> tuple[tuple, int, int, bool]:
    """(x dtypes, smallest M, largest M, whether M = 1 qualifies) of the tensor-core GEMV on a weight with facts
    ``f`` under :data:`MMA`: plain values, so that traced code can apply the rule to a symbolic M."""
    if f.mma_fmt < 0 or _interpreting():
        return (), 1, 0, False
    return (_mma_x_dtypes(f.fmt), MMA["min_m"], MMA["max_m"],
            _mma_regime(f.plan_n or f.n, f.k, 1, {**MMA, "min_m": 1}, f.fmt))


def uses_mma(f: GemvFacts, m: int, x_dtype: torch.dtype) -> bool:
    """Whether the default plan of ``m`` rows of ``x_dtype`` runs the tensor-core GEMV (else the FMA or dot
    kernel on the row-major layout)."""
    dtypes, lo, hi, m1 = mma_rule(f)
    return x_dtype in dtypes and lo <= m <= hi and (m > 1 or m1)


def _default_plan(f: GemvFacts, m: int, x_dtype: torch.dtype, has_bias: bool, act: int,
                  dev_index: int, rs_mode: int = 0) -> tuple[bool, _Plan]:
    """(tensor-core?, plan) that :func:`gemv_w4` picks under the default :data:`TILE` and :data:`MMA`
    (``rs_mode``: its row-scale mode, 0 none, 1 one factor, 3 one divisor)."""
    if uses_mma(f, m, x_dtype):
        return True, _mma_plan(m, f.n, f.k, f.mma_fmt, f.cpg, f.gs_kind, f.post, has_bias, act, x_dtype,
                               dev_index, MMA, rs_mode, f.plan_n)
    return False, _make_plan(f.fmt_code, f.wpb, f.post, f.gs_kind, f.n, f.k, f.sk, m, x_dtype == torch.float16,
                             has_bias, act, dev_index, TILE, rs_mode, f.plan_n)


class GemvRunner:
    """``runner(x, bias) -> out`` for one prepared weight, row count M, x dtype, bias presence and activation:
    ``x`` is ``[M, K]`` contiguous and 16-byte aligned on the weight's device, ``bias`` None or ``[N]`` of x's
    dtype, contiguous and aligned (the caller checks; nothing is checked here). With ``rs_mode`` (as
    :func:`gemv_w4`'s ``row_scale`` / ``divide_by``: 1 one factor, 3 one divisor) the call takes ``rs``, a
    1-element float32 tensor on the device."""

    __slots__ = ("launch", "w_args", "tail", "rs", "no_bias", "ws", "cnt", "split", "ws_numel", "n_cnt",
                 "m", "n", "dtype", "device", "dev_index", "scratch")

    def __init__(self, p: PreparedW4, m: int, x_dtype: torch.dtype, has_bias: bool, act: int,
                 rs_mode: int = 0) -> None:
        dev = p.device
        self.dev_index = dev.index if dev.index is not None else torch.cuda.current_device()
        mma, plan = _default_plan(facts(p), m, x_dtype, has_bias, act, self.dev_index, rs_mode)
        if mma:
            lay = mma_layout(p)
            self.w_args = (lay.words, lay.scales, p.gs)
            self.tail = (*plan.ints, *lay.table(x_dtype))
        else:
            self.w_args = (p.words, p.scales, p.nested, p.tab, p.gs)
            self.tail = plan.ints
        self.launch = plan.launch
        self.split, self.ws_numel, self.n_cnt = plan.split, plan.split * plan.mp * p.n, plan.n_tiles
        self.rs = torch.empty(16, dtype=torch.float32, device=dev)
        self.no_bias = torch.empty(16, dtype=x_dtype, device=dev)
        self.ws = torch.empty(16, dtype=torch.float32, device=dev)
        self.cnt = torch.empty(16, dtype=torch.int32, device=dev)
        self.m, self.n, self.dtype, self.device = m, p.n, x_dtype, dev
        self.scratch = KeptScratch(dev, self.dev_index, self.ws_numel, self.n_cnt)

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None, rs: torch.Tensor | None = None) -> torch.Tensor:
        out = torch.empty((self.m, self.n), dtype=self.dtype, device=self.device)
        stream = torch._C._cuda_getCurrentRawStream(self.dev_index)
        if self.split > 1:
            ws, cnt = self.scratch.get(stream)
        else:
            ws, cnt = self.ws, self.cnt
        self.launch.run_on(stream, x, *self.w_args, self.rs if rs is None else rs,
                           self.no_bias if bias is None else bias, out, ws, cnt, *self.tail)
        return out


def traced_gemv(x: torch.Tensor, words: torch.Tensor | None, scales: torch.Tensor | None,
                nested: torch.Tensor | None, tab: torch.Tensor | None, gs: torch.Tensor,
                mma_words: torch.Tensor | None, mma_scales: torch.Tensor | None,
                ws: torch.Tensor, cnt: torch.Tensor, rs: torch.Tensor, no_bias: torch.Tensor,
                bias: torch.Tensor | None, f: GemvFacts, act: int) -> torch.Tensor:
    """The GEMV as ``torch.compile`` traces it (inside a ``triton_op`` body): the plan of :func:`gemv_w4`'s
    default configuration, built from ``f`` and x's shape alone. The layouts of the kernel the plan does not
    run may be None (:func:`uses_mma` says which one runs). ``ws`` / ``cnt``: the layer's split-K
    workspace and zeroed counters (``lowbit.kernels.scratch.traced_scratch``; a plan needing more than they
    hold gets its own, allocated by the graph); ``rs``: an fp32 placeholder for the unused row scale;
    ``no_bias``: a placeholder of x's dtype for the bias pointer when ``bias`` is None."""
    m, dev = x.shape[0], x.device
    mma, plan = _default_plan(f, m, x.dtype, bias is not None, act, dev.index)
    out = torch.empty((m, f.n), dtype=x.dtype, device=dev)
    if plan.split > 1 and (ws.numel() < plan.split * plan.mp * f.n or cnt.numel() < plan.n_tiles):
        ws = torch.empty(plan.split * plan.mp * f.n, dtype=torch.float32, device=dev)
        cnt = torch.zeros(plan.n_tiles, dtype=torch.int32, device=dev)
    b = no_bias if bias is None else bias
    if (mma_words is None) if mma else (words is None):
        raise ValueError("traced_gemv: the layouts of the kernel this plan runs were not passed")
    if mma:
        plan.launch.traced(x, mma_words, mma_scales, gs, rs, b, out, ws, cnt, *plan.ints,
                           *_mma_table(f.mma_fmt, x.dtype))
    else:
        plan.launch.traced(x, words, scales, nested, tab, gs, rs, b, out, ws, cnt, *plan.ints)
    return out


def traced_scratch_size(n: int, k: int) -> tuple[int, int]:
    """(workspace floats, counters) that cover every GEMV plan of an [N, K] weight: :func:`_split_k` keeps
    split * MP * N fp32 partials under ``ws_ratio`` of the weight's bytes (at least one split of MP <= 16
    rows), and a plan has at most one counter per 8 output rows per tile row."""
    ratio = max(TILE.get("ws_ratio", 0.25), MMA.get("ws_ratio", 0.25))
    return n * max(16, int(ratio * k / 16) + 16), n + 64


# ------------------------------------------------------------------------------------------- compile test

def _sig(fmt: str, x_dtype: str, bias_dtype: str) -> dict:
    s_ty = {"nvfp4": "*u8", "mxfp4": "*u8", "fp4_b32": "*fp32", "nf4": "*fp32", "nf4_dq": "*u8",
            "int4_awq": "*i32"}[fmt]
    return {"x_ptr": x_dtype, "w_ptr": "*i32", "s_ptr": s_ty, "nested_ptr": "*fp32", "tab_ptr": "*fp32",
            "gs_ptr": "*fp32", "rs_ptr": "*fp32", "bias_ptr": bias_dtype, "out_ptr": x_dtype, "ws_ptr": "*fp32",
            "cnt_ptr": "*i32",
            "M": "i32", "N": "i32", "KW": "i32", "SK": "i32"}


_WPB = {"nvfp4": 2, "mxfp4": 4, "fp4_b32": 4, "nf4": 8, "nf4_dq": 8, "int4_awq": 16}
_POST = {"nvfp4": 64.0, "mxfp4": 64.0, "fp4_b32": 64.0, "nf4": 1.0, "nf4_dq": 1.0, "int4_awq": 1.0}


def compile_variants():
    """(kernel, signature, constexprs) of the code paths the launcher starts (CI compiles them for sm_90):
    every format through both kernels (FMA at M = 1, 2, 4 and dot), bf16 and fp16 x, split-K, each
    activation, bias, each global-scale kind, and the other nf4 / int4 block sizes."""
    # the last field is ROW_SCALE (lowbit.scaled_mm's decode route): every mode on both kernels
    cases = []
    for fmt in _FMT:
        gs = GS_DIVIDE.value if fmt == "nvfp4" else GS_NONE.value
        cases += [
            (fmt, "fma", 1, "*bf16", 1, False, 0, gs, _WPB[fmt], 3 if fmt == "nvfp4" else 0),
            (fmt, "fma", 2, "*fp16", 4, True, 1, gs, _WPB[fmt], 1),
            (fmt, "dot", 16, "*bf16", 2, True, 3, gs, _WPB[fmt], 2),
            (fmt, "dot", 16, "*fp16", 1, False, 0, gs, _WPB[fmt], 3 if fmt == "nvfp4" else 0),
        ]
    cases += [
        ("nvfp4", "fma", 4, "*bf16", 2, True, 2, GS_MULTIPLY.value, 2, 2),
        ("nvfp4", "fma", 1, "*bf16", 1, False, 0, GS_NONE.value, 2, 0),
        ("int4_awq", "fma", 1, "*bf16", 1, True, 1, GS_NONE.value, 4, 0),   # group 32
        ("int4_awq", "dot", 16, "*bf16", 1, False, 0, GS_NONE.value, 8, 1),  # group 64
        ("nf4_dq", "fma", 1, "*fp16", 1, False, 0, GS_NONE.value, 4, 0),     # blocksize 32
    ]
    for fmt, path, mp, xd, split, has_bias, act, gs_kind, wpb, rs in cases:
        t = TILE["fma"] if path == "fma" else TILE["dot"]
        consts = {"FMT": _FMT[fmt], "WPB": wpb, "IPS": 16 // split, "MP": mp, "BN": t["bn"], "C": t["chunks"], "STAGES": t["stages"],
                  "SPLIT": split, "HAS_BIAS": has_bias, "ACT": act, "GS_KIND": gs_kind, "ROW_SCALE": rs,
                  "POST": _POST[fmt], "X_FP16": xd == "*fp16", "ON_GPU": True}
        fn = k.gemv_w4_fma_kernel if path == "fma" else k.gemv_w4_dot_kernel
        yield fn, _sig(fmt, xd, "*fp32" if has_bias and act == 1 else xd), consts
    mma_sig = {"x_ptr": "*bf16", "w_ptr": "*i32", "s_ptr": "*i16", "gs_ptr": "*fp32", "rs_ptr": "*fp32",
               "bias_ptr": "*bf16",
               "out_ptr": "*bf16", "ws_ptr": "*fp32", "cnt_ptr": "*i32", "M": "i32", "N": "i32", "K": "i32",
               "KQ": "i32", **{f"T{i}": "i32" for i in range(8)}}
    for fmt_code, nt, split, has_bias, act, gs_kind, rs in [(0, 1, 1, False, 0, 1, 0), (0, 2, 4, True, 1, 1, 2),
                                                            (1, 1, 4, True, 3, 0, 1), (1, 2, 1, False, 2, 0, 0),
                                                            (0, 1, 2, False, 0, 2, 2), (0, 2, 1, True, 0, 1, 3)]:
        consts = {"FMT": fmt_code, "RG": MMA["rg"], "J": MMA["j"], "IPS": 4, "NT": nt,
                  "SPLIT": split, "HAS_BIAS": has_bias, "ACT": act, "GS_KIND": gs_kind, "ROW_SCALE": rs,
                  "POST": 2.0 ** 63}
        yield km.gemv_mma_kernel, mma_sig, consts
    # the post-scaled formats: int4 groups of 128 (2 chunks) and 64, NF4 blocks of 64 and 128; bf16 and fp16 x
    for fmt, nt, split, has_bias, act, cpg, xf16 in [
        (km.FMT_INT4, 1, 1, False, 0, 2, False), (km.FMT_INT4, 2, 4, True, 1, 2, False),
        (km.FMT_INT4, 1, 4, True, 3, 1, True), (km.FMT_INT4, 2, 1, False, 2, 2, True),
        (km.FMT_NF4, 1, 1, False, 0, 1, False), (km.FMT_NF4, 2, 4, True, 1, 1, False),
        (km.FMT_NF4, 1, 4, True, 3, 2, True), (km.FMT_NF4, 2, 1, False, 2, 1, True),
    ]:
        xd = "*fp16" if xf16 else "*bf16"
        sig = dict(mma_sig, x_ptr=xd, s_ptr="*i32", bias_ptr=xd, out_ptr=xd)
        consts = {"FMT": fmt.value, "RG": MMA["rg"], "J": MMA["j"], "IPS": 4, "NT": nt,
                  "SPLIT": split, "HAS_BIAS": has_bias, "ACT": act, "GS_KIND": GS_NONE.value, "ROW_SCALE": 0,
                  "POST": 1.0, "CPG": cpg, "XF16": xf16}
        yield km.gemv_mma_kernel, sig, consts
