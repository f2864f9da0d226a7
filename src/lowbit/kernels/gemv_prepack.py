"""The weight side of the 4-bit GEMV: what a weight must be for the kernels (:func:`why_not`), the layout they
read (:class:`PreparedW4`, made by :func:`prepare_w4`) and the cache that keeps one layout per weight.

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
"""

from __future__ import annotations

import functools
import math
import weakref
from dataclasses import dataclass, field, replace

import torch

from ..formats import int4_awq as ref_awq
from ..formats import nf4 as ref_nf4
from ..formats.codecs import codebook_table
from ..formats.packing import unswizzle_scales
from ..formats.qtensor import QTensor
from ..formats.registry import formats_with
from ..formats.shards import plan_rows
from ..formats.spec import NF4
from . import _gemv_w4 as k
from . import scratch_per_call, tensor_version
from .device import GS_DIVIDE, GS_MULTIPLY, GS_NONE
from .w4_checks import int4_awq_group, nf4_blocksize


FORMATS = formats_with("gemv_w4")  # nvfp4, mxfp4, fp4_b32, nf4, int4_awq
FMT_CODES = {"nvfp4": k.FMT_NVFP4.value, "mxfp4": k.FMT_MXFP4.value, "fp4_b32": k.FMT_FP4_B32.value,
             "nf4": k.FMT_NF4.value, "nf4_dq": k.FMT_NF4_DQ.value, "int4_awq": k.FMT_AWQ.value}
"""Format code of each layout (``PreparedW4.fmt``) in the FMA / dot kernels (``_gemv_w4``'s ``FMT``)."""


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
    gated: object = field(default=None, repr=False)  # the gated layout (gated_layout), made on first use

    device: torch.device = field(default=None, repr=False)

    def __post_init__(self) -> None:
        self.device = self.words.device
        self.plan_n = self.plan_n or self.n

    @property
    def sk(self) -> int:
        return self.scales.shape[1]


def why_not(w: QTensor) -> str | None:
    """None if the GEMV kernels can lay out and run ``w``, else the reason they cannot."""
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
        blocksize, why = nf4_blocksize(w)
        if why is not None:
            return why
        if kdim % blocksize:
            return f"nf4: K ({kdim}) must be a multiple of the blocksize ({blocksize}) so no block spans two rows"
    else:
        g, why = int4_awq_group(w)
        if why is not None:
            return why
        if g % 32:
            return f"int4_awq: group_size must be a multiple of 32 (a 32-weight chunk in one group), got {g}"
    return None


def cached(w: QTensor) -> PreparedW4 | None:
    """The cached layout of ``w`` while it is valid (``w.data`` alive, no tensor of ``w`` replaced or changed in
    place since, see ``layout_signature``), else None; makes nothing."""
    hit = _PREPARED.get(id(w.data))
    if hit is not None and hit[0]() is w.data and hit[1].sig == layout_signature(w):
        return hit[1]
    return None


@functools.lru_cache(maxsize=16)
def dummy_tensor(device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    return torch.zeros(16, dtype=dtype, device=device)


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


def to_int32(words: torch.Tensor) -> torch.Tensor:
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
        words[:, k0 // 8:k1 // 8] = to_int32((t << shifts).sum(dim=-1))
    z = ref_awq.unpack_awq(q.zeros).t()                              # [N, K/g]
    s_bits = q.scale.t().contiguous().view(torch.int16).to(torch.int32) & 0xFFFF
    sz = (s_bits | ((0x6400 + z) << 16)).contiguous()
    return words, sz


def layout_signature(q: QTensor) -> tuple:
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
    reason = why_not(q)
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
    return PreparedW4(fmt=fmt, fmt_code=FMT_CODES[fmt], n=n, k=kdim, words=words, scales=scales,
                      words_per_block=wpb, post=post, gs_kind=gs_kind, gs=gs, nested=nested, tab=tab,
                      sig=layout_signature(q), plan_n=plan_rows(q))


# id(w.data) -> (weakref to w.data, PreparedW4). Keyed on w.data, not on the QTensor: torch.compile
# rebuilds the QTensor around the same tensors on every call. The entry goes when w.data goes.
_PREPARED: dict = {}


def _forget(data_id: int):
    def drop(_ref):
        _PREPARED.pop(data_id, None)
    return drop


def prepare_w4(w: QTensor) -> PreparedW4:
    """The kernel layout of ``w``, made once and cached for as long as ``w.data`` lives; re-made when a
    tensor of ``w`` is replaced or modified in place (see ``layout_signature``). Call it at load time to keep the
    first ``gemv_w4`` call cheap (int4_awq repacks the weight)."""
    if type(w) is PreparedW4:
        return w
    if not isinstance(w, QTensor):
        raise TypeError(f"gemv_w4: w must be a QTensor or PreparedW4, got {type(w).__name__}")
    data = w.data
    p = cached(w)
    if p is not None:
        return p
    p = _prepare(w)
    if no_caching():
        # inside the custom op (maybe a CUDA-graph warmup whose allocations land in the graph's pool, where a
        # cached tensor is an untracked live allocation) or a graph capture: use this layout for this call
        # only. Layouts made in eager mode (QuantLinear warms them, see gemv_w4.warm) are found by later calls.
        return p
    _PREPARED[id(data)] = (weakref.ref(data, _forget(id(data))), p)
    return p


def gated_why_not(p: PreparedW4) -> str | None:
    """None if the GEMV kernels can run the gated activations (``silu_and_mul`` ...) on ``p``, else why not."""
    if p.n % 16:
        return f"the gated GEMV pairs gate and up rows in blocks of 8: N must be a multiple of 16, got {p.n}"
    if p.plan_n != p.n:
        return "a column shard's launches are planned for its whole weight; gated shards are not laid out"
    if p.fmt_code == FMT_CODES["nf4_dq"]:
        return "double-quantized nf4 absmax blocks would be cut by the row interleave"
    return None


def gated_layout(p: PreparedW4) -> PreparedW4:
    """``p`` with its rows interleaved for the gated GEMV (``lowbit.kernels.device.ACT_GATED``): for a weight
    ``[gate; up]`` of N rows, fused rows 16j .. 16j+7 are gate rows 8j .. 8j+7 and 16j+8 .. 16j+15 up rows 8j ..
    8j+7, so each 16-row tile holds the pairs its epilogue multiplies. A copy of the words and scales, made once
    and kept on ``p`` (ValueError where :func:`gated_why_not` says no)."""
    if p.gated is not None:
        return p.gated
    why = gated_why_not(p)
    if why is not None:
        raise ValueError(f"gemv_w4: {why}")
    half = p.n // 2
    j = torch.arange(half // 8, device=p.device).view(-1, 1, 1) * 8
    i = torch.arange(8, device=p.device).view(1, 1, -1)
    h = torch.arange(2, device=p.device).view(1, -1, 1) * half
    perm = (h + j + i).reshape(-1)                    # fused row -> source row
    g = replace(p, words=p.words[perm].contiguous(), scales=p.scales[perm].contiguous(), plans={}, mma=None,
                gated=None)
    if not no_caching():
        p.gated = g
    return g


def no_caching() -> bool:
    """Whether a layout made now is for this call only: inside the custom op (per-call scratch) or a CUDA-graph
    capture (see :func:`prepare_w4`)."""
    return scratch_per_call() or (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing())


def clear_prepared() -> None:
    """Drop every cached layout, and the plans and tensor-core layouts kept on them."""
    for _, p in _PREPARED.values():
        p.plans.clear()
        p.mma = None
        p.gated = None
    _PREPARED.clear()
