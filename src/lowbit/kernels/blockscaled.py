"""Triton launchers for NVFP4 / MX / fp4_b32, with the same signatures as ``lowbit.formats.blockscaled``.

Performance notes: quantize reads K*in_bytes and writes K*bits/8 + K/group scale bytes per row;
dequantize the reverse. Both are one pass; the default NVFP4 global scale costs one extra read of x.
"""

from __future__ import annotations

import functools

import torch

from ..formats import blockscaled as ref
from ..formats.checks import positive_fp32_scalar
from ..formats.packing import swizzled_scale_shape
from ..formats.qtensor import QTensor
from ..formats.spec import E2M1, FORMATS, MinifloatSpec, NVFP4Convention, ScaleRounding
from . import _blockscaled as k
from . import cdiv
from . import _mx_fold
from ._launch import KernelCall, Launch, kept_launch, launch, same_memory
from . import interpreting as _interpreting


_ELEM_KIND = {"e4m3": k.ELEM_E4M3, "e5m2": k.ELEM_E5M2}


def _elem_args(elem: MinifloatSpec) -> dict:
    return dict(
        ELEM_KIND=_ELEM_KIND.get(elem.name, k.ELEM_MINIFLOAT),
        EBITS=elem.ebits, MBITS=elem.mbits, BIAS=elem.bias,
        PACK_BITS=8 if elem.torch_dtype is not None else elem.bits,
    )


# elements per program and warps; tuned on H100/H200 (see benchmarks/gpu_check.py --sweep)
TILE = {"elems": 4096, "warps": 4}


def _block_g(group: int) -> int:
    return TILE["elems"] // group


def quantize_variants():
    """(kernel, signature, constexprs) of every quantize code path the launchers can start."""
    sig = {"x_ptr": "*bf16", "data_ptr": "*u8", "scale_ptr": "*u8", "gscale_ptr": "*fp32", "amax_ptr": "*i32",
           "n_groups": "i64", "groups_per_row": "i32", "n_scale_cols_padded4": "i32"}
    for fmt, group, kinds, has_g in _FORMAT_VARIANTS:
        elem = FORMATS[fmt].element
        for kind in kinds:
            for swizzled in ((False,) if kind == k.SCALE_FP32 else (False, True)):
                consts = dict(BLOCK_G=_block_g(group), GROUP=group, SCALE_KIND=kind, MAX=elem.max_normal,
                              RCP_MAX=1.0 / elem.max_normal, EMAX=elem.emax, HAS_GSCALE=has_g,
                              SWIZZLED=swizzled, NAN_FIXUP=False, E4M3_ORDER=k.ORDER_VLLM, **_elem_args(elem))
                yield k.quantize_blockscaled_kernel, dict(sig, scale_ptr=_scale_sig(kind)), consts
                if fmt == "nvfp4" and not has_g:
                    yield (k.quantize_blockscaled_kernel, dict(sig, scale_ptr=_scale_sig(kind)),
                           dict(consts, GSCALE_FROM_AMAX=True))
                if fmt == "nvfp4":
                    # the LightX2V multiplier order, with a given global scale and with the default one
                    lx = dict(consts, E4M3_ORDER=k.ORDER_LIGHTX2V)
                    yield k.quantize_blockscaled_kernel, dict(sig, scale_ptr=_scale_sig(kind)), lx
                    if not has_g:
                        yield (k.quantize_blockscaled_kernel, dict(sig, scale_ptr=_scale_sig(kind)),
                               dict(lx, GSCALE_FROM_AMAX=True))
                if fmt == "nvfp4" and not swizzled:
                    # quantize_nvfp4_decoded: bf16 values out, both orders, every kind of global scale
                    decoded = dict(sig, data_ptr="*i16", scale_ptr="*i16")
                    for order in (k.ORDER_VLLM, k.ORDER_LIGHTX2V):
                        for from_amax in ((False,) if has_g else (True, False)):  # given; derived, "none"
                            yield (k.quantize_blockscaled_kernel, decoded,
                                   dict(consts, E4M3_ORDER=order, GSCALE_FROM_AMAX=from_amax, DECODED=True))


def dequantize_variants():
    sig = {"data_ptr": "*u8", "scale_ptr": "*u8", "gscale_ptr": "*fp32", "out_ptr": "*i16",
           "n_groups": "i64", "groups_per_row": "i32", "n_scale_cols_padded4": "i32"}
    for fmt, group, kinds, has_g in _FORMAT_VARIANTS:
        elem = FORMATS[fmt].element
        for swizzled in ((False,) if kinds[0] == k.SCALE_FP32 else (False, True)):
            outs = ((1, "*i16"), (2, "*i16"), (0, "*i32")) if fmt == "mxfp4" else ((1, "*i16"),)
            for out_kind, out in outs:
                consts = dict(BLOCK_G=_block_g(group), GROUP=group, SCALE_KIND=kinds[0], HAS_GSCALE=has_g,
                              SWIZZLED=swizzled, OUT_KIND=out_kind, **_elem_args(elem))
                yield k.dequantize_blockscaled_kernel, dict(sig, out_ptr=out, scale_ptr=_scale_sig(kinds[0])), consts


def _scale_sig(kind: int) -> str:
    return "*fp32" if kind == k.SCALE_FP32 else "*u8"


def compile_variants():
    yield from quantize_variants()
    yield from dequantize_variants()
    for swizzled in (False, True):
        for rows_per_scale in (1, FOLD_BLOCK_R):
            yield (_mx_fold.mxfp4_as_fp8_block_kernel,
                   {"data_ptr": "*i32", "scale_ptr": "*u8", "out_ptr": "*i32", "out_scale_ptr": "*fp32",
                    "flag_ptr": "*i32", **{n: "i32" for n in ("R", "K", "stride_d", "stride_s0", "s_cols4",
                                                             "stride_o", "stride_os", "stride_os_k")}},
                   {"SWIZZLED": swizzled, "BLOCK_R": FOLD_BLOCK_R, "ROWS_PER_SCALE": rows_per_scale, "ON_GPU": True})
    for dtype in ("*bf16", "*fp16", "*fp32"):
        yield (k.finite_absmax_kernel, {"x_ptr": dtype, "out_ptr": "*i32", "N": "i64"},
               {"CHUNK": _ABSMAX_CHUNK, "CHUNKS": _ABSMAX_CHUNKS})
    # the w4a4-nvfp4 dequant runner's shared launch: a bf16 / fp16 / fp32 activation, an nvfp4 weight decoded
    # to bf16 without its global scale, linear or swizzled scales
    for dtype in ("*bf16", "*fp16", "*fp32"):
        for swizzled in (False, True):
            yield (k.absmax_and_dequantize_kernel,
                   {"x_ptr": dtype, "amax_ptr": "*i32", "N": "i64", "absmax_programs": "i32", "data_ptr": "*u8",
                    "scale_ptr": "*u8", "gscale_ptr": "*u8", "out_ptr": "*i16", "n_groups": "i64",
                    "groups_per_row": "i32", "n_scale_cols_padded4": "i32"},
                   dict(CHUNK=_ABSMAX_CHUNK, CHUNKS=_ABSMAX_CHUNKS, BLOCK_G=_block_g(16), GROUP=16,
                        SCALE_KIND=k.SCALE_E4M3, HAS_GSCALE=False, SWIZZLED=swizzled, OUT_KIND=1, **_elem_args(E2M1)))
    for block, convention in ((4096, "vllm"), (16384, "vllm"), (1024, "lightx2v")):
        yield (k.nvfp4_roundtrip_small_kernel, {"x_ptr": "*bf16", "gscale_ptr": "*fp32", "out_ptr": "*i16",
                                                "N": "i32"},
               dict(_roundtrip_consts(block, convention), NAN_FIXUP=False))


_MX_KINDS = (k.SCALE_E8M0_RCEIL, k.SCALE_E8M0_FLOOR)
_FORMAT_VARIANTS = (
    ("nvfp4", 16, (k.SCALE_E4M3,), True),
    ("nvfp4", 16, (k.SCALE_E4M3,), False),
    *((f, 32, _MX_KINDS, False) for f in ("mxfp4", "mxfp6_e2m3", "mxfp6_e3m2", "mxfp8_e4m3", "mxfp8_e5m2")),
    ("fp4_b32", 32, (k.SCALE_FP32,), False),
)


class _QuantizeLaunch:
    """What a quantize call on a tensor of one shape decides (buffer shapes, grid, constexprs, the QTensor's
    format fields), made once per (shape, options) by :func:`_quantize_launch`; ``run`` allocates, launches
    and builds the QTensor. The compiled kernel is kept per device, input dtype and argument alignment (what
    Triton specializes on besides the fixed sizes), so a repeated call binds no arguments; the QTensor of a
    repeated call is not checked again (the first one with these shapes was)."""

    __slots__ = ("checked", "cols", "consts", "data_shape", "fmt", "grid", "launches", "layout", "n_groups",
                 "params", "scale_dtype", "scale_shape", "scale_view", "shape", "swizzled", "view", "zeroed")

    def __init__(self, shape: torch.Size, fmt: str, params: tuple, elem: MinifloatSpec, group: int,
                 scale_kind: int, has_gscale: bool, swizzled: bool, scale_dtype: torch.dtype, from_amax: bool,
                 e4m3_order: int) -> None:
        lead = shape[:-1]
        m, kdim = lead.numel(), shape[-1]
        self.shape, self.fmt, self.params = shape, fmt, params
        self.cols = kdim // group
        self.n_groups = m * self.cols
        # the buffers in their final shapes: the kernel sees them (and a contiguous x) as flat sequences
        self.data_shape = (*lead, kdim if elem.torch_dtype is not None else kdim * elem.bits // 8)
        self.view = elem.torch_dtype
        self.swizzled = swizzled
        self.layout = "swizzled" if swizzled else "linear"
        self.scale_shape = swizzled_scale_shape(m, self.cols) if swizzled else (*lead, self.cols)
        # padding bytes of the 128x4 tiles must be zero and the kernel writes only real scales: a swizzled
        # buffer with padding starts zeroed (one memset more), one without (rows % 128 == 0, cols % 4 == 0) is
        # all real scales
        self.zeroed = swizzled and self.scale_shape != (m, self.cols)
        self.scale_dtype = scale_dtype
        self.scale_view = _SCALE_VIEW.get(scale_kind)
        block_g = _block_g(group)
        self.grid = (cdiv(self.n_groups, block_g),)
        self.consts = dict(
            BLOCK_G=block_g, GROUP=group, SCALE_KIND=scale_kind, MAX=elem.max_normal,
            RCP_MAX=1.0 / elem.max_normal, EMAX=elem.emax, HAS_GSCALE=has_gscale, SWIZZLED=swizzled,
            NAN_FIXUP=_interpreting(),  # the interpreter's min() keeps NaN: test for it (see _encode_minifloat)
            GSCALE_FROM_AMAX=from_amax, E4M3_ORDER=e4m3_order, num_warps=TILE["warps"], **_elem_args(elem),
        )
        self.launches: dict = {}
        self.checked = False

    def run(self, x: torch.Tensor, gscale: torch.Tensor | None, amax: torch.Tensor | None, keep: list | None,
            global_scale: torch.Tensor | None = None) -> QTensor:
        # other layouts are copied first
        x2 = x if x.is_contiguous() else x.contiguous()
        device = x.device
        data = torch.empty(self.data_shape, dtype=torch.uint8, device=device)
        scale = (torch.zeros if self.zeroed else torch.empty)(self.scale_shape, dtype=self.scale_dtype,
                                                                device=device)
        if self.n_groups:
            args = (x2, data, scale, gscale if gscale is not None else scale, amax if amax is not None else scale,
                    self.n_groups, self.cols, -(-self.cols // 4) * 4)
            # as launch() does: the current device's current stream
            key = (torch._C._cuda_getDevice(), x2.dtype, x2.data_ptr() & 15,
                   0 if gscale is None else gscale.data_ptr() & 15) if device.type == "cuda" else None
            ran = kept_launch(self.launches, key, k.quantize_blockscaled_kernel, self.grid, args, **self.consts)
            if keep is not None:
                keep.append(ran)
        if self.view is not None:
            data = data.view(self.view)
        if self.scale_view is not None:
            scale = scale.view(self.scale_view)
        if self.checked:
            return QTensor._unchecked(data, scale, self.fmt, self.shape, x.dtype, global_scale, self.layout,
                                      dict(self.params))
        q = QTensor(data=data, scale=scale, fmt=self.fmt, shape=self.shape, dtype=x.dtype, global_scale=global_scale,
                    scale_layout=self.layout, params=dict(self.params))
        self.checked = True
        return q


_SCALE_VIEW = {k.SCALE_E4M3: torch.float8_e4m3fn, k.SCALE_E8M0_RCEIL: torch.float8_e8m0fnu,
               k.SCALE_E8M0_FLOOR: torch.float8_e8m0fnu}
"""The dtype a QTensor holds its block scales in, by the kernel's scale kind (fp32 scales: as written)."""
_QUANTIZE_LAUNCHES: dict = {}
_MAX_QUANTIZE_LAUNCHES = 256


def _quantize_launch(shape: torch.Size, *decided) -> _QuantizeLaunch:
    """The :class:`_QuantizeLaunch` of ``shape`` and the decided options (its constructor's arguments)."""
    key = (shape, *decided)
    hit = _QUANTIZE_LAUNCHES.get(key)
    if hit is None:
        if len(_QUANTIZE_LAUNCHES) >= _MAX_QUANTIZE_LAUNCHES:
            _QUANTIZE_LAUNCHES.clear()
        hit = _QUANTIZE_LAUNCHES[key] = _QuantizeLaunch(shape, *decided)
    return hit


_ABSMAX_CHUNK = 2048
_ABSMAX_CHUNKS = 8


def finite_absmax_and_dequantize(x: torch.Tensor, q: QTensor, dtype: torch.dtype) -> tuple[torch.Tensor,
                                                                                             torch.Tensor]:
    """``(the int32 [1] absmax bits of x, q dequantized to dtype)``: what the absmax pass of a derived nvfp4
    global scale (:func:`quantize_nvfp4_decoded`'s ``amax``) and :func:`dequantize_call` give, bit for bit, in
    one launch (``absmax_and_dequantize_kernel``): the ``"dequant"`` route's two passes that do not depend on
    each other, each too short at DiT sizes to reach the copy bandwidth alone."""
    return absmax_and_dequantize(x, dequantize_call(q, dtype))


def absmax_and_dequantize(x: torch.Tensor, dq: KernelCall) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`finite_absmax_and_dequantize` with the weight's decode call ``dq`` (:func:`dequantize_call`) made
    once by the caller, who launches it again per call without rebuilding its arguments."""
    flat = x.view(-1) if x.is_contiguous() else x.contiguous().view(-1)
    n = flat.numel()
    lc = dq.launch
    if lc is None or not n or not x.is_cuda or _interpreting():
        return _finite_absmax_bits(x), dq()
    amax = torch.zeros(1, dtype=torch.int32, device=x.device)
    out = torch.empty(dq.shape, dtype=dq.dtype, device=x.device)
    programs = cdiv(n, _ABSMAX_CHUNK * _ABSMAX_CHUNKS)
    args = (flat, amax, n, programs, *dq.args[:3], out.view(dq.view), *dq.args[4:])
    launch(k.absmax_and_dequantize_kernel, (programs + lc.grid[0],), args, CHUNK=_ABSMAX_CHUNK,
           CHUNKS=_ABSMAX_CHUNKS, **lc.consts, **lc.options)
    return amax, out.reshape(dq.result_shape)


def _finite_absmax_bits(x: torch.Tensor, keep: list | None = None) -> torch.Tensor:
    """int32 [1] holding the fp32 bits of max |x| over finite elements (no host sync); ``keep``: a list that
    receives the launch it ran (None where it went through Triton alone)."""
    flat = x.view(-1) if x.is_contiguous() else x.contiguous().view(-1)
    out = torch.zeros(1, dtype=torch.int32, device=x.device)
    n = flat.numel()
    if n:
        # the compiled launch kept per size, dtype and alignment
        key = (torch._C._cuda_getDevice(), n, flat.dtype, flat.data_ptr() & 15) if x.is_cuda else None
        ran = kept_launch(_ABSMAX_LAUNCHES, key, k.finite_absmax_kernel, (cdiv(n, _ABSMAX_CHUNK * _ABSMAX_CHUNKS),),
                          (flat, out, n), CHUNK=_ABSMAX_CHUNK, CHUNKS=_ABSMAX_CHUNKS, num_warps=4)
        if keep is not None:
            keep.append(ran)
    return out


_ABSMAX_LAUNCHES: dict = {}


def finite_absmax(x: torch.Tensor) -> torch.Tensor:
    """fp32 max |x| over finite elements, on x's device, without a host sync."""
    return _finite_absmax_bits(x).view(torch.float32).reshape(())


def _device_global_scale(g: torch.Tensor) -> torch.Tensor:
    """The QTensor keeps a view of a CUDA global scale (no copy, no sync), as static activation scales are
    shared buffers in serving engines."""
    if g.dtype != torch.float32:
        raise TypeError(f"global_scale must be float32, got {g.dtype}")
    if g.numel() != 1:
        raise ValueError(f"global_scale must hold one value, got shape {tuple(g.shape)}")
    return g.detach().reshape(1)


_KERNEL_ORDER = {NVFP4Convention.VLLM: k.ORDER_VLLM, NVFP4Convention.LIGHTX2V: k.ORDER_LIGHTX2V}
"""The nvfp4 conventions the quantize kernel implements, and its multiplier order for each."""


def quantize_nvfp4(
    x: torch.Tensor,
    global_scale: torch.Tensor | float | str | None = None,
    convention: NVFP4Convention | str = "vllm",
    scale_layout: str = "linear",
    *,
    keep: list | None = None,
) -> QTensor:
    """``keep``: receives the launches it ran (the absmax pass when the global scale is derived, then the
    quantize kernel; see :func:`quantize_mx`)."""
    ref.check_input(x, 16, "nvfp4")
    convention, order, swizzled = _decided(_nvfp4_options, convention, scale_layout)
    s, amax = _nvfp4_global(x, global_scale, keep)
    plan = _quantize_launch(x.shape, "nvfp4", (("convention", convention),), E2M1, 16, k.SCALE_E4M3,
                            s is not None and amax is None, swizzled, torch.uint8, amax is not None, order)
    return plan.run(x, s, amax, keep, s)


def _nvfp4_global(x: torch.Tensor, global_scale, keep: list | None, amax: torch.Tensor | None = None
                  ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(the fp32 [1] global scale the kernel reads or, derived, writes; the absmax bits it derives it from:
    ``amax`` where the caller ran the absmax pass, else this function runs it)."""
    if isinstance(global_scale, str):
        if global_scale != "none":
            raise ValueError(f"global_scale must be a tensor, a float, 'none' or None, got {global_scale!r}")
        s = None
    elif global_scale is None:
        s = None
    elif isinstance(global_scale, torch.Tensor) and global_scale.is_cuda:
        # a CUDA scale is checked for dtype and size only: reading its value would stall the stream
        s = _device_global_scale(global_scale)
    else:
        s = positive_fp32_scalar(global_scale, "global_scale").to(x.device)
    if global_scale is None:
        # default 2688/amax: one absmax pass, then the quantize kernel derives and stores the scale
        if amax is None:
            amax = _finite_absmax_bits(x, keep)
        s = torch.empty(1, dtype=torch.float32, device=x.device)
        if not x.numel():
            s.fill_(1.0)
        return s, amax
    if s is not None and s.dim() != 1:
        s = s.reshape(1)
    return s, None


def quantize_nvfp4_decoded(x: torch.Tensor, global_scale: torch.Tensor | float | str | None = None,
                           convention: NVFP4Convention | str = "vllm", *, amax: torch.Tensor | None = None
                           ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(values, global_scale)``: ``x`` quantized as ``quantize_nvfp4(x, global_scale, convention)`` quantizes
    it and the codes decoded *without* the global scale, as the dequantize kernel decodes them (bf16, x's
    shape), bit for bit, in one pass (after the absmax pass where the global scale is derived): the activation
    operand of ``lowbit.kernels.scaled_mm``'s ``"dequant"`` route without the packed tensor in between. The
    global scale is the QTensor's (fp32 [1]; None for ``"none"``); the product's exact value is
    ``values / global_scale``. ``amax``: with a derived global scale, x's absmax bits from
    :func:`finite_absmax_and_dequantize` (its pass not run again)."""
    ref.check_input(x, 16, "nvfp4")
    convention, order, _ = _decided(_nvfp4_options, convention, "linear")
    if amax is not None and (global_scale is not None or amax.dtype != torch.int32 or amax.numel() != 1
                             or amax.device != x.device):
        raise ValueError("amax must be the int32 [1] absmax bits of x on x's device, with a derived global scale "
                         "(global_scale None)")
    s, amax = _nvfp4_global(x, global_scale, None, amax)
    plan = _quantize_launch(x.shape, "nvfp4", (("convention", convention),), E2M1, 16, k.SCALE_E4M3,
                            s is not None and amax is None, False, torch.uint8, amax is not None, order)
    x2 = x if x.is_contiguous() else x.contiguous()
    out = torch.empty(x.shape, dtype=torch.bfloat16, device=x.device)
    if plan.n_groups:
        bits = out.view(torch.int16)
        args = (x2, bits, bits, s if s is not None else bits, amax if amax is not None else bits, plan.n_groups,
                plan.cols, -(-plan.cols // 4) * 4)
        key = (torch._C._cuda_getDevice(), x2.dtype, x2.data_ptr() & 15, 0 if s is None else s.data_ptr() & 15,
               "decoded") if x.is_cuda else None
        kept_launch(plan.launches, key, k.quantize_blockscaled_kernel, plan.grid, args, **plan.consts, DECODED=True)
    return out, s


def _decided(options, *args):
    """``options(*args)`` through its cache; arguments it cannot hash go to the function itself (which raises
    the error that names the argument)."""
    try:
        return options(*args)
    except TypeError:
        return options.__wrapped__(*args)


@functools.lru_cache(maxsize=64)
def _nvfp4_options(convention: NVFP4Convention | str, scale_layout: str) -> tuple[str, int, bool]:
    """(convention name, the kernel's multiplier order, swizzled) of valid options, else a ValueError."""
    conv = NVFP4Convention(convention)
    if conv not in _KERNEL_ORDER:
        raise ValueError(f"convention: the triton nvfp4 kernel implements 'vllm' and 'lightx2v', got {conv.value!r}")
    ref.check_layout(scale_layout)
    return conv.value, _KERNEL_ORDER[conv], scale_layout == "swizzled"


ROUNDTRIP_MAX = 16384
"""The most elements :func:`nvfp4_roundtrip_launch`'s one program takes (a decode step's activation rows)."""


def nvfp4_roundtrip_launch(n: int, convention: NVFP4Convention | str = "vllm") -> Launch:
    """The one-program launch that quantizes ``n`` contiguous elements (``n <= ROUNDTRIP_MAX``, ``n % 16 ==
    0``) to NVFP4 with the default global scale and decodes them without it: ``run(dev, x, gs, out_int16,
    n)`` writes the bf16 values that :func:`quantize_nvfp4` then the dequantize kernel of the codes (no
    global scale) give, bit for bit, and the global scale into ``gs`` (fp32 [1])."""
    if not 0 < n <= ROUNDTRIP_MAX or n % 16:
        raise ValueError(f"n must be a multiple of 16 in 16 .. {ROUNDTRIP_MAX}, got {n}")
    block = max(16, 1 << (n - 1).bit_length())
    return Launch(k.nvfp4_roundtrip_small_kernel, (1,), _roundtrip_consts(block, convention),
                  4 if block <= 4096 else 8)


def _roundtrip_consts(block: int, convention: NVFP4Convention | str) -> dict:
    conv = NVFP4Convention(convention)
    if conv not in _KERNEL_ORDER:
        raise ValueError(f"convention: the nvfp4 round trip implements 'vllm' and 'lightx2v', got {conv.value!r}")
    return dict(BLOCK_N=block, E4M3_ORDER=_KERNEL_ORDER[conv], NAN_FIXUP=_interpreting(),
                MAX=E2M1.max_normal, RCP_MAX=1.0 / E2M1.max_normal, EMAX=E2M1.emax, EBITS=E2M1.ebits,
                MBITS=E2M1.mbits, BIAS=E2M1.bias)


def nvfp4_roundtrip_small(x: torch.Tensor, convention: NVFP4Convention | str = "vllm"
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    """(bf16 values, fp32 [1] global scale) of :func:`nvfp4_roundtrip_launch` on contiguous ``x`` (float32,
    bf16 or fp16; CUDA, or the CPU under ``TRITON_INTERPRET=1``)."""
    ref.check_input(x, 16, "nvfp4")
    if not x.is_contiguous():
        raise ValueError("x must be contiguous")
    n = x.numel()
    lc = nvfp4_roundtrip_launch(n, convention)
    out = torch.empty(x.shape, dtype=torch.bfloat16, device=x.device)
    gs = torch.empty(1, dtype=torch.float32, device=x.device)
    if x.is_cuda:
        lc.run(x.device.index if x.device.index is not None else torch.cuda.current_device(), x, gs,
               out.view(torch.int16), n)
    else:  # the interpreter
        lc.fn[lc.grid](x, gs, out.view(torch.int16), n, **lc.consts, **lc.options)
    return out, gs


def quantize_mx(
    x: torch.Tensor, fmt: str, scale_rounding: ScaleRounding | str = "rceil", scale_layout: str = "linear",
    *, keep: list | None = None,
) -> QTensor:
    """``keep``: receives the quantize kernel's launch (None where it went through Triton alone), for a caller
    that launches the same kernel again (a prepared layer keeps the launch of its activations)."""
    ref.check_input(x, 32, fmt)
    elem, kind, rounding, swizzled = _decided(_mx_options, fmt, scale_rounding, scale_layout)
    plan = _quantize_launch(x.shape, fmt, (("scale_rounding", rounding),), elem, 32, kind, False, swizzled,
                            torch.uint8, False, 0)
    return plan.run(x, None, None, keep)


@functools.lru_cache(maxsize=64)
def _mx_options(fmt: str, scale_rounding: ScaleRounding | str, scale_layout: str
                ) -> tuple[MinifloatSpec, int, str, bool]:
    """(element, the kernel's scale kind, rounding name, swizzled) of valid options, else a ValueError."""
    ref.check_layout(scale_layout)
    rounding = ScaleRounding(scale_rounding)
    kind = k.SCALE_E8M0_RCEIL if rounding is ScaleRounding.RCEIL else k.SCALE_E8M0_FLOOR
    return FORMATS[fmt].element, kind, rounding.value, scale_layout == "swizzled"


def quantize_fp4_b32(x: torch.Tensor) -> QTensor:
    ref.check_input(x, 32, "fp4_b32")
    plan = _quantize_launch(x.shape, "fp4_b32", (), E2M1, 32, k.SCALE_FP32, False, False, torch.float32, False, 0)
    return plan.run(x, None, None, None)


_OUT_KIND = {torch.float32: (0, torch.int32), torch.bfloat16: (1, torch.int16), torch.float16: (2, torch.int16)}


def _dequantize_call(q: QTensor, elem, group, scale_kind, dtype) -> KernelCall:
    kdim = q.shape[-1]
    m = q.shape[:-1].numel()
    out_kind, int_view = _OUT_KIND[dtype]
    swizzled = q.scale_layout == "swizzled"
    cols = kdim // group
    n_groups = m * cols
    call, args, copies = None, (None,), False
    if n_groups:
        block_g = _block_g(group)
        gscale = q.global_scale
        scale = q.scale if scale_kind == k.SCALE_FP32 else q.scale.view(torch.uint8)
        call = Launch(k.dequantize_blockscaled_kernel, (cdiv(n_groups, block_g),),
                        dict(BLOCK_G=block_g, GROUP=group, SCALE_KIND=scale_kind, HAS_GSCALE=gscale is not None,
                             SWIZZLED=swizzled, OUT_KIND=out_kind, **_elem_args(elem)), TILE["warps"])
        data, scale = q.data.view(torch.uint8).contiguous(), scale.contiguous()
        args = (data, scale, gscale if gscale is not None else scale, None, n_groups, cols, -(-cols // 4) * 4)
        copies = not same_memory((data, q.data), (scale, q.scale))
    return KernelCall(call, args, 3, (m, kdim), dtype, int_view, q.data.device, q.shape, copies)


def _launch_dequantize(q: QTensor, elem, group, scale_kind, dtype):
    return _dequantize_call(q, elem, group, scale_kind, dtype)()


def dequantize_call(q: QTensor, dtype: torch.dtype) -> KernelCall:
    """The kernel call behind :func:`dequantize_nvfp4` / :func:`dequantize_mx` / :func:`dequantize_fp4_b32`
    for ``q`` (its format decides), to launch again without argument binding."""
    if q.fmt == "nvfp4":
        if "per_tensor_scale" in q.params:
            raise ValueError("the triton nvfp4 dequantize kernel does not implement the torchao convention")
        return _dequantize_call(q, E2M1, 16, k.SCALE_E4M3, dtype)
    if q.fmt == "fp4_b32":
        return _dequantize_call(q, E2M1, 32, k.SCALE_FP32, dtype)
    return _dequantize_call(q, q.spec.element, 32, k.SCALE_E8M0_RCEIL, dtype)


def dequantize_nvfp4(q: QTensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    if "per_tensor_scale" in q.params:
        raise ValueError("the triton nvfp4 dequantize kernel does not implement the torchao convention")
    return _launch_dequantize(q, E2M1, 16, k.SCALE_E4M3, dtype)


def dequantize_mx(q: QTensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return _launch_dequantize(q, q.spec.element, 32, k.SCALE_E8M0_RCEIL, dtype)


def dequantize_fp4_b32(q: QTensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return _launch_dequantize(q, E2M1, 32, k.SCALE_FP32, dtype)


FOLD_BLOCK_R = 128
"""Rows per program of the MXFP4 -> fp8_block re-encoding (one 128-column tile each; also the row extent of
a (128, 128) block)."""
FOLD_WARPS = 8


def mxfp4_as_fp8_block(q: QTensor, block: tuple[int, int] = (1, 128),
                       dropped_flag: torch.Tensor | None = None) -> tuple[QTensor, torch.Tensor]:
    """``lowbit.formats.blockscaled.mxfp4_as_fp8_block`` on the GPU (bit-identical). ``dropped_flag``: an int32
    [1] tensor set to 1 when a block could not be folded (it is only ever set: zero it before the call); one
    is made when None. The second result is ``dropped_flag == 0``."""
    block = ref.check_fold_args(q, block)
    if dropped_flag is None:
        dropped_flag = torch.zeros(1, dtype=torch.int32, device=q.data.device)
    return mxfp4_fold(q, block, dropped_flag), dropped_flag[0] == 0


def mxfp4_fold(q: QTensor, block: tuple[int, int], dropped_flag: torch.Tensor, cublas_scales: bool = False
               ) -> QTensor:
    """:func:`mxfp4_as_fp8_block` without the flag's comparison (one launch less on scaled_mm's path).

    ``cublas_scales``: lay the scales out as cuBLASLt's block-scaled GEMM reads them
    (:mod:`lowbit.kernels.cublas_fp8_block`): (1, 128) scales M-major (strides (1, rows)); (128, 128) scales
    in rows of ``round_up(K/128, 4)`` with zeros after the last K tile (the QTensor's scale is the [:, :K/128]
    view). Same values either way."""
    block = ref.check_fold_args(q, block)
    rows, kdim = q.shape
    device = q.data.device
    tiles = -(-kdim // 128)
    data = q.data.view(torch.uint8).reshape(rows, kdim // 2)
    # read as 32-bit words: 4-byte aligned base and rows (K / 2 bytes per row, a multiple of 16)
    if data.stride(-1) != 1 or data.data_ptr() % 4 or data.stride(0) % 4:
        data = data.clone(memory_format=torch.contiguous_format)
    swizzled = q.scale_layout == "swizzled"
    scale = q.scale.view(torch.uint8)
    scale = (scale if swizzled else scale.reshape(rows, kdim // 32)).contiguous()
    out = torch.empty(rows, kdim, dtype=torch.float8_e4m3fn, device=device)
    scale_rows = rows if block[0] == 1 else -(-rows // 128)
    if not cublas_scales:
        out_scale = torch.empty(scale_rows, tiles, dtype=torch.float32, device=device)
    elif block[0] == 1:
        out_scale = torch.empty_strided((rows, tiles), (1, rows), dtype=torch.float32, device=device)
    else:
        tiles4 = -(-tiles // 4) * 4
        alloc = torch.empty if tiles4 == tiles else torch.zeros
        out_scale = alloc(scale_rows, tiles4, dtype=torch.float32, device=device)[:, :tiles]
    if rows and kdim:
        words = data.view(torch.int32)
        launch(_mx_fold.mxfp4_as_fp8_block_kernel, (cdiv(rows, FOLD_BLOCK_R), tiles), (
                words, scale, out.view(torch.int32), out_scale, dropped_flag, rows, kdim, words.stride(0),
                scale.stride(0) if not swizzled else 0, -(-(kdim // 32) // 4) * 4, kdim // 4,
                out_scale.stride(0), out_scale.stride(1),
            ),
            SWIZZLED=swizzled, BLOCK_R=FOLD_BLOCK_R, ROWS_PER_SCALE=block[0], ON_GPU=not _interpreting(),
            num_warps=FOLD_WARPS,
        )
    return QTensor(data=out, scale=out_scale, fmt="fp8_block", shape=q.shape, dtype=q.dtype, params={"block": block})
