"""Prefill-regime W4A16 GEMM launcher: ``gemm_w4(x, w, bias, activation) = act(x @ dequant(w).T + bias)``.

``x`` is a contiguous bf16/fp16 [M, K] CUDA tensor (CPU under ``TRITON_INTERPRET=1``), ``w`` a QTensor with
logical shape [N, K] in nvfp4, mxfp4, fp4_b32, nf4 or int4_awq. The weight is decoded tile by tile in
registers and multiplied on the tensor cores (see ``_gemm_w4``); the dequantized matrix never exists in
memory. Accumulation is fp32; bias and activation are applied to the fp32 accumulator before the one
rounding to x's dtype.

Tile configurations are data, in ``lowbit.kernels.gemm_w4_tiles`` (re-exported here): ``CONFIGS`` per M
regime, ``FORMAT_CONFIGS`` per format, and ``choose_config``, which adds split-K (fp32 partials, then a small
reduce+epilogue kernel) when the (M, N) tiles alone cannot fill the GPU. Nothing is autotuned at run time. A
sweep can edit these dicts in place or pass ``config=`` to ``gemm_w4`` (``X_TMA`` there switches x between
TMA and pointer loads).

Weights are used as stored, except int4_awq: its codes are transposed once into a K-packed copy
(``prelayout_int4_awq``, N*K/2 bytes, cached per weight and keyed on ``w.data``, since lowbit.linear may
rebuild the QTensor object on every call). No host synchronization anywhere; x, outputs and split-K
workspaces are plain allocations, so calls can be captured in CUDA graphs once the per-weight caches and the
nf4 tables are warm (first call outside the capture).
"""

from __future__ import annotations

import functools
import math
import weakref

import torch

from ..formats import int4_awq as ref_awq
from ..formats import nf4 as ref_nf4
from ..formats.codecs import codebook_table
from ..formats.packing import swizzled_scale_shape
from ..formats.qtensor import QTensor
from ..formats.registry import formats_with
from ..formats.shards import plan_rows
from ..formats.spec import NF4
from . import _gemm_w4 as k
from . import cdiv
from . import interpreting as _interpreting
from ._launch import LazyDescriptor, kept_launch
from .gemm_w4_tiles import (  # noqa: F401 - re-exported: the tables are the launcher's
    CONFIGS,
    FORMAT_CONFIGS,
    M_REGIMES,
    SPLIT_K_MAX,
    SPLIT_K_MIN_TILES,
    choose_config,
    fit_tile,
    nonempty_split,
    regime,
)
from . import tensor_version
from .w4_checks import int4_awq_group, nf4_blocksize


FORMATS = formats_with("gemm_w4")  # nvfp4, mxfp4, fp4_b32, nf4, int4_awq
_FMT_ID = {"nvfp4": 0, "mxfp4": 1, "fp4_b32": 2, "nf4": 3, "int4_awq": 4}
ACTIVATIONS = {None: 0, "gelu": 1, "gelu_tanh": 2, "silu": 3}
# x tiles through TMA (host tensor descriptors) where x allows it (16-byte aligned base and row stride);
# a config may set "X_TMA" to override
X_TMA = True


def supports(w) -> str | None:
    """None if ``gemm_w4`` runs this weight, else the reason it does not."""
    if not isinstance(w, QTensor):
        return f"w must be a QTensor, got {type(w).__name__}"
    if w.fmt not in _FMT_ID:
        return f"no W4A16 GEMM kernel for format {w.fmt!r} (have {', '.join(FORMATS)})"
    if len(w.shape) != 2:
        return f"w must be a 2-D [N, K] weight, got shape {tuple(w.shape)}"
    n, k_dim = w.shape
    if w.fmt == "nf4":
        _, why = nf4_blocksize(w)
        if why is not None:
            return why
        if k_dim % 2:
            return f"nf4: K = {k_dim} is odd (packed bytes would straddle rows)"
    elif w.fmt == "int4_awq":
        group, why = int4_awq_group(w)
        if why is not None:
            return why
        if group % 16:
            return f"int4_awq: group_size {group} is not a multiple of 16"
    else:
        block = 16 if w.fmt == "nvfp4" else 32
        if k_dim % block:
            return f"{w.fmt}: K = {k_dim} is not a multiple of {block}"
        if w.data.dtype not in (torch.uint8, getattr(torch, "float4_e2m1fn_x2", torch.uint8)) or tuple(
                w.data.shape) != (n, k_dim // 2):
            return f"{w.fmt}: data must be uint8 [{n}, {k_dim // 2}], got {w.data.dtype} {tuple(w.data.shape)}"
        if w.scale_layout not in ("linear", "swizzled"):
            return f"{w.fmt}: unknown scale layout {w.scale_layout!r}"
        cols = k_dim // block
        if w.fmt == "fp4_b32":
            ok_dtypes, layouts = (torch.float32,), ("linear",)
        else:
            ok_dtypes = (torch.uint8, torch.float8_e4m3fn if w.fmt == "nvfp4" else torch.float8_e8m0fnu)
            layouts = ("linear", "swizzled")
        want = n * cols if w.scale_layout == "linear" else math.prod(swizzled_scale_shape(n, cols))
        if w.scale.dtype not in ok_dtypes or w.scale_layout not in layouts or w.scale.numel() != want:
            return (f"{w.fmt}: scale must be {ok_dtypes[-1]} with {want} elements ({w.scale_layout}), got "
                    f"{w.scale.dtype} {tuple(w.scale.shape)}")
        if w.global_scale is not None and w.global_scale.numel() != 1:
            return f"nvfp4: global_scale must hold one value, got shape {tuple(w.global_scale.shape)}"
    return None


@functools.lru_cache(maxsize=16)
def _nf4_tables(device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(NF4 levels in ``dtype`` [16], bitsandbytes dynamic map fp32 [256]) on ``device``."""
    return codebook_table(NF4).to(device=device, dtype=dtype), ref_nf4.dynamic_map(device)


def _check_inputs(x: torch.Tensor, w: QTensor, bias, activation) -> None:
    reason = supports(w)
    if reason:
        raise ValueError(f"gemm_w4: {reason}")
    if not isinstance(x, torch.Tensor) or x.dim() != 2:
        raise ValueError(f"gemm_w4: x must be a 2-D [M, K] tensor, got {getattr(x, 'shape', type(x).__name__)}")
    if x.dtype not in (torch.bfloat16, torch.float16):
        raise TypeError(f"gemm_w4: x must be bfloat16 or float16, got {x.dtype}")
    if x.shape[1] != w.shape[1]:
        raise ValueError(f"gemm_w4: x has K = {x.shape[1]} but w has shape {tuple(w.shape)} ([N, K])")
    if x.device != w.data.device:
        raise ValueError(f"gemm_w4: x is on {x.device}, w on {w.data.device}")
    if activation not in ACTIVATIONS:
        raise ValueError(f"gemm_w4: activation must be one of {list(ACTIVATIONS)}, got {activation!r}")
    if bias is not None:
        if not isinstance(bias, torch.Tensor) or tuple(bias.shape) != (w.shape[0],):
            raise ValueError(f"gemm_w4: bias must have shape ({w.shape[0]},), got {getattr(bias, 'shape', bias)}")
        if bias.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise TypeError(f"gemm_w4: bias must be a float tensor, got {bias.dtype}")
        if bias.device != x.device:
            raise ValueError(f"gemm_w4: bias is on {bias.device}, x on {x.device}")


# Per-weight derived tensors (int4 pre-layout, padded nf4 codes, a per-tensor divisor on the device), keyed
# weakly on a tensor of the weight: lowbit.linear rebuilds the QTensor from the same tensors on every call
# under torch.compile, so a QTensor key would miss every time. An entry is rebuilt when one of the tensors it
# was derived from is replaced or modified in place (version counter).
_CACHE: dict[int, tuple[weakref.ref, dict]] = {}   # id(key tensor) -> (weak reference to it, entries)
_PRELAYOUT_CHUNK = 1024


def _stamp(deps) -> tuple:
    out = []
    for t in deps:
        if isinstance(t, torch.Tensor):
            out.append((id(t), tensor_version(t)))
        else:
            out.append(t)
    return tuple(out)


def _entries(key: torch.Tensor) -> dict:
    # not a WeakKeyDictionary: it compares keys with ==, which is elementwise for tensors
    k = id(key)
    hit = _CACHE.get(k)
    if hit is not None and hit[0]() is key:
        return hit[1]

    def forget(ref, k=k):
        if _CACHE.get(k, (None,))[0] is ref:
            del _CACHE[k]

    entries: dict = {}
    _CACHE[k] = (weakref.ref(key, forget), entries)
    return entries


def _cached(key: torch.Tensor, tag: str, deps: tuple, build):
    stamp = _stamp(deps)
    entries = _entries(key)
    hit = entries.get(tag)
    if hit is not None and hit[0] == stamp:
        return hit[1]
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        # a layout made during a capture lives in the graph's memory pool and its build is part of the graph
        # (it runs on every replay): it serves this call only, and is not kept. Call a weight once before
        # capturing it, so that the capture finds the kept layout.
        return build()
    value = build()
    entries[tag] = (stamp, value)
    return value


def prelayout_int4_awq(w: QTensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The GEMM layout of an int4_awq weight, computed once and cached while ``w.data`` lives:
    (codes uint8 [N, K/2] with element 2i in the low nibble, int32 [N, K/g] words ``fp16 scale bits |
    zero point << 16``).

    AutoAWQ packs eight output channels per int32 along N; the tensor-core operand needs pairs of
    consecutive K per register, so the codes are transposed once (N*K/2 bytes more memory, the size of
    ``qweight``, plus 4 bytes per group). ``w`` itself is not modified and stays the format that is saved.
    Call it at load time to keep the first forward pass (and CUDA-graph capture) free of the conversion.
    """
    n, k_dim, _ = ref_awq.check_int4_awq(w)

    def build():
        codes = torch.empty(n, k_dim // 2, dtype=torch.uint8, device=w.data.device)
        for k0 in range(0, k_dim, _PRELAYOUT_CHUNK):
            q = ref_awq.unpack_awq(w.data[k0:k0 + _PRELAYOUT_CHUNK])          # int32 [kc, N]
            codes[:, k0 // 2:(k0 + q.shape[0]) // 2] = (q[0::2] | (q[1::2] << 4)).t().to(torch.uint8)
        zeros = ref_awq.unpack_awq(w.zeros)                                     # int32 [K/g, N]
        scale_bits = w.scale.view(torch.int16).to(torch.int32) & 0xFFFF
        return codes, (scale_bits | (zeros << 16)).t().contiguous()

    return _cached(w.data, "int4", (w.data, w.zeros, w.scale), build)


def _nf4_codes(w: QTensor) -> torch.Tensor:
    """Double-quantized nf4 absmax codes, read by the kernel as int32 words: 4-byte aligned and padded to a
    multiple of 4 bytes (a padded copy, made once per weight, when the stored tensor is not)."""
    codes = w.scale.reshape(-1)
    if codes.is_contiguous() and codes.data_ptr() % 4 == 0 and codes.numel() % 4 == 0:
        return codes

    def build():
        padded = torch.zeros(-(-codes.numel() // 4) * 4, dtype=torch.uint8, device=codes.device)
        padded[:codes.numel()] = codes
        return padded

    return _cached(w.data, "nf4_codes", (w.scale,), build)


def _per_tensor_scale(w: QTensor, device: torch.device) -> torch.Tensor:
    pts = w.params["per_tensor_scale"]
    if isinstance(pts, torch.Tensor) and pts.device == device and pts.dtype == torch.float32 and pts.numel() == 1:
        return pts.reshape(1)
    return _cached(w.data, "pts", (pts,) if isinstance(pts, torch.Tensor) else (float(pts),),
                   lambda: torch.as_tensor(pts, dtype=torch.float32).reshape(1).to(device))


def _global_scale(w: QTensor, device: torch.device) -> tuple[torch.Tensor | None, int]:
    """(fp32 [1] tensor, GSCALE_MODE) of an nvfp4 weight's per-tensor factor for the epilogue: 2 with an exact
    per-tensor divisor ``params["per_tensor_scale"]`` (multiplied), 1 with a global scale S (times 1 / S);
    (None, 0) without one or for the other formats."""
    if w.fmt != "nvfp4":
        return None, 0
    if w.params.get("per_tensor_scale") is not None:
        return _per_tensor_scale(w, device), 2
    if w.global_scale is not None:
        return w.global_scale.reshape(1).to(device=device, dtype=torch.float32), 1
    return None, 0


def _format_args(w: QTensor, device: torch.device, dtype: torch.dtype) -> tuple[list, dict]:
    """Pointer/int arguments (w_ptr, s_ptr, z_ptr, nested_ptr, offset_ptr, lut_ptr, dmap_ptr, gscale_ptr,
    stride_wn, stride_sn, s_cols4) and constexprs of the weight format, for x on ``device`` in ``dtype``."""
    k_dim = w.shape[1]
    fmt = w.fmt
    consts = dict(FMT=_FMT_ID[fmt], SCALE_SWIZZLED=False, SCALE_WORDS=False, GROUP=1, DOUBLE_QUANT=False,
                  NF4_MODE=0, GSCALE_MODE=0)
    if fmt in ("nvfp4", "mxfp4", "fp4_b32"):
        block = 16 if fmt == "nvfp4" else 32
        data = w.data.view(torch.uint8).contiguous()
        scale = w.scale.contiguous()
        if fmt != "fp4_b32":
            scale = scale.view(torch.uint8)
        consts["SCALE_SWIZZLED"] = w.scale_layout == "swizzled"
        consts["GROUP"] = block
        # one-byte scales are fetched as aligned int32 words where rows start on a 4-byte boundary
        consts["SCALE_WORDS"] = fmt != "fp4_b32" and (consts["SCALE_SWIZZLED"] or (k_dim // block) % 4 == 0) \
            and scale.data_ptr() % 4 == 0
        gscale, consts["GSCALE_MODE"] = _global_scale(w, device)
        if gscale is None:
            gscale = scale
        cols = k_dim // block
        args = [data, scale, scale, scale, scale, scale, scale, gscale, k_dim // 2, cols, -(-cols // 4) * 4]
    elif fmt == "nf4":
        _, blocksize, dq = ref_nf4.check_nf4_qtensor(w)
        lut, dmap = _nf4_tables(device, dtype)
        data = w.data.reshape(-1)
        scale = _nf4_codes(w) if dq else w.scale.reshape(-1).contiguous()
        if dq:
            nested = w.nested_scale.reshape(-1).contiguous()
            offset = w.nested_offset.reshape(1).to(device=device, dtype=torch.float32)
        else:
            nested = offset = scale
        consts.update(GROUP=blocksize, DOUBLE_QUANT=dq)
        args = [data, scale, scale, nested, offset, lut, dmap, scale, 0, 0, 0]
    else:
        codes, sz = prelayout_int4_awq(w)
        group = w.params["group_size"]
        consts["GROUP"] = group
        args = [codes, sz, sz, sz, sz, sz, sz, sz, k_dim // 2, k_dim // group, 0]
    return args, consts


def _tma_ok(x: torch.Tensor) -> bool:
    return x.data_ptr() % 16 == 0 and (x.stride(0) * x.element_size()) % 16 == 0 and x.stride(1) == 1


def _nf4_mode(k_dim: int, blocksize: int, block_k: int) -> int:
    if k_dim % blocksize:
        return 2
    return 0 if block_k <= blocksize else 1


def gemm_w4(x: torch.Tensor, w: QTensor, bias: torch.Tensor | None = None, activation: str | None = None,
            config: dict | None = None) -> torch.Tensor:
    """``act(x @ dequant(w).T + bias)`` with fp32 accumulation, returned in x's dtype.

    Args:
        x: [M, K] bfloat16/float16 CUDA tensor (row stride may exceed K; the last dim must be contiguous).
        w: QTensor of logical shape [N, K] (nvfp4, mxfp4, fp4_b32, nf4, int4_awq; see ``supports``).
        bias: None or [N] (fp32/bf16/fp16), added in fp32.
        activation: None, "gelu" (erf), "gelu_tanh" or "silu".
        config: launch configuration (keys of ``CONFIGS`` entries plus SPLIT_K); default ``choose_config``.

    Returns:
        [M, N] tensor of x's dtype.
    """
    _check_inputs(x, w, bias, activation)
    if x.stride(1) != 1:
        x = x.contiguous()
    m, k_dim = x.shape
    n = w.shape[0]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out
    if k_dim == 0:
        return out.copy_(_torch_epilogue(torch.zeros(m, n, device=x.device), bias, activation))
    GemmPlan(w, m, x.device, x.dtype, activation, config).launch(x, None if bias is None else bias.contiguous(), out)
    return out


class GemmPlan:
    """Everything :func:`gemm_w4` decides for a weight, a row count M, x's device and dtype and an activation:
    the weight's kernel arguments, the tile configuration, split-K and grid. ``launch`` then reads x (and
    makes its TMA descriptor) and launches; a :class:`GemmRunner` keeps one plan to skip the decisions on
    every call. M > 0, N > 0 and K > 0."""

    __slots__ = ("act", "args", "bk", "bm", "bn", "consts", "grid", "group_m", "k", "m", "n", "split", "stages",
                 "tma", "warps")

    def __init__(self, w: QTensor, m: int, device: torch.device, dtype: torch.dtype, activation: str | None,
                 config: dict | None = None) -> None:
        k_dim = w.shape[1]
        n = w.shape[0]
        args, consts = _format_args(w, device, dtype)
        cfg = dict(config) if config is not None else choose_config(m, n, k_dim, w.fmt, consts["GROUP"], device,
                                                                    plan_rows(w))
        cfg.setdefault("SPLIT_K", 1)
        cfg = fit_tile(w.fmt, cfg, consts["GROUP"])
        if w.fmt == "nf4":
            consts["NF4_MODE"] = _nf4_mode(k_dim, consts["GROUP"], cfg["BLOCK_K"])
        self.args, self.consts, self.m, self.n, self.k = args, consts, m, n, k_dim
        self.bm, self.bn, self.bk = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"]
        self.group_m, self.warps, self.stages = cfg["GROUP_M"], cfg["num_warps"], cfg["num_stages"]
        self.split = nonempty_split(cdiv(k_dim, self.bk), cfg["SPLIT_K"])
        self.grid = (cdiv(m, self.bm) * cdiv(n, self.bn), self.split)
        self.tma = cfg.get("X_TMA", X_TMA)
        self.act = ACTIVATIONS[activation]

    def launch(self, x: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor, store: dict | None = None,
               key: tuple | None = None) -> None:
        """``out[:] = act(x @ dequant(w).T + bias)``: ``x`` [M, K] with a contiguous last dim, ``bias`` None or
        contiguous [N], ``out`` [M, N] of x's dtype. ``store`` / ``key``: keep the compiled launches there under
        ``key`` (a caller whose x, bias and out keep their strides and alignment; see ``_launch.kept_launch``)."""
        m, n, k_dim = self.m, self.n, self.k
        has_bias = bias is not None
        b = bias if has_bias else out
        on_gpu = not _interpreting()
        target = out if self.split == 1 else torch.empty(self.split, m, n, dtype=torch.float32, device=x.device)
        x_tma = self.tma and _tma_ok(x)
        # built only where the launch goes through Triton (a kept launch encodes it itself, once per address)
        x_desc = LazyDescriptor(x, [self.bm, self.bk]) if x_tma else x
        a = self.args
        kept_launch(store, None if key is None else (*key, x_tma, has_bias), k.gemm_w4_kernel, self.grid, (
                x, x_desc, *a[:8], b, target, m, n, k_dim, x.stride(0), out.stride(0), *a[8:],
            ),
            BLOCK_M=self.bm, BLOCK_N=self.bn, BLOCK_K=self.bk, GROUP_M=self.group_m, SPLIT_K=self.split,
            EVEN_K=k_dim % self.bk == 0, X_TMA=x_tma, HAS_BIAS=has_bias, ACT=self.act, ON_GPU=on_gpu,
            num_warps=self.warps, num_stages=self.stages, **self.consts,
        )
        if self.split > 1:
            rm, rn = 32, 128
            kept_launch(store, None if key is None else (*key, "reduce", has_bias), k.split_k_reduce_kernel,
                        (cdiv(m, rm), cdiv(n, rn)), (target, a[7], b, out, m, n, out.stride(0)),
                        SPLIT_K=self.split, BLOCK_M=rm, BLOCK_N=rn, GSCALE_MODE=self.consts["GSCALE_MODE"],
                        HAS_BIAS=has_bias, ACT=self.act, ON_GPU=on_gpu, num_warps=4)


class GemmRunner:
    """``run(x, bias) -> out``: :func:`gemm_w4` for one weight at one M, x dtype, bias presence and activation,
    decided once (:class:`GemmPlan`) and launched through kept compiled kernels: the call a prepared layer
    makes in the GEMM regime. ``x`` [M, K] contiguous and 16-byte aligned, ``bias`` None or a contiguous,
    16-byte aligned [N] (the caller checks both once); the same bits as :func:`gemm_w4`."""

    __slots__ = ("dtype", "launches", "plan")

    def __init__(self, w: QTensor, m: int, dtype: torch.dtype, activation: str | None) -> None:
        self.plan = GemmPlan(w, m, w.data.device, dtype, activation)
        self.dtype = dtype
        self.launches: dict = {}

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        p = self.plan
        out = torch.empty(p.m, p.n, dtype=self.dtype, device=x.device)
        # the kept launches are per device (x's, the current one in a call) and read nothing else per call
        key = (torch._C._cuda_getDevice(),) if x.is_cuda else None
        p.launch(x, bias, out, self.launches, key)
        return out


def _torch_epilogue(acc: torch.Tensor, bias, activation) -> torch.Tensor:
    if bias is not None:
        acc = acc + bias.float()
    if activation == "gelu":
        acc = torch.nn.functional.gelu(acc)
    elif activation == "gelu_tanh":
        acc = torch.nn.functional.gelu(acc, approximate="tanh")
    elif activation == "silu":
        acc = torch.nn.functional.silu(acc)
    return acc


# ---------------------------------------------------------------------------------------------------------
# compile coverage

def _variant(fmt: str, dtype: str, regime_name: str, *, swizzled=False, words=True, group=0, double_quant=False,
             nf4_mode=0, gscale=0, bias=False, act=0, even_k=True, split=1, tma=True):
    cfg = dict(CONFIGS[regime_name])
    cfg.update(FORMAT_CONFIGS.get((fmt, regime_name), {}))
    group = group or {"nvfp4": 16, "mxfp4": 32, "fp4_b32": 32, "nf4": 64, "int4_awq": 128}[fmt]
    cfg = fit_tile(fmt, cfg, group)
    x_t = "*bf16" if dtype == "bf16" else "*fp16"
    if fmt in ("nvfp4", "mxfp4"):
        w_t, s_t, z_t, n_t, o_t, l_t, d_t = "*u8", "*u8", "*u8", "*u8", "*u8", "*u8", "*u8"
    elif fmt == "fp4_b32":
        w_t, s_t, z_t, n_t, o_t, l_t, d_t = "*u8", "*fp32", "*fp32", "*fp32", "*fp32", "*fp32", "*fp32"
    elif fmt == "nf4":
        w_t, s_t = "*u8", "*u8" if double_quant else "*fp32"
        z_t, n_t, o_t, l_t, d_t = s_t, "*fp32", "*fp32", x_t, "*fp32"
    else:
        w_t, s_t, z_t, n_t, o_t, l_t, d_t = "*u8", "*i32", "*i32", "*i32", "*i32", "*i32", "*i32"
    desc_t = f"tensordesc<{x_t[1:]}[{cfg['BLOCK_M']}, {cfg['BLOCK_K']}]>" if tma else x_t
    sig = {"x_ptr": x_t, "x_desc": desc_t, "w_ptr": w_t, "s_ptr": s_t, "z_ptr": z_t, "nested_ptr": n_t,
           "offset_ptr": o_t, "lut_ptr": l_t, "dmap_ptr": d_t, "gscale_ptr": "*fp32" if gscale else s_t,
           "bias_ptr": x_t, "out_ptr": x_t if split == 1 else "*fp32",
           "M": "i32", "N": "i32", "K": "i32", "stride_xm": "i32", "stride_om": "i32",
           "stride_wn": "i32", "stride_sn": "i32", "s_cols4": "i32"}
    consts = dict(FMT=_FMT_ID[fmt], BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], BLOCK_K=cfg["BLOCK_K"],
                  GROUP_M=cfg["GROUP_M"], SPLIT_K=split, EVEN_K=even_k, X_TMA=tma, SCALE_SWIZZLED=swizzled,
                  SCALE_WORDS=words and fmt in ("nvfp4", "mxfp4"),
                  GROUP=group, DOUBLE_QUANT=double_quant, NF4_MODE=nf4_mode, GSCALE_MODE=gscale,
                  HAS_BIAS=bias, ACT=act, ON_GPU=True)
    return k.gemm_w4_kernel, sig, consts, cfg


def compile_variants():
    """(kernel, signature, constexprs) covering the launcher's code paths: every format in both activation
    dtypes, each regime's tiles, each epilogue, masked K, byte-wise and swizzled scales, the nf4 absmax modes
    and double quantization, int4 group sizes, split-K and its reduction kernel.

    The CI compile test builds these with its default 4 warps, so the per-format cases use the 128x128 tiles
    of the "m512" regime (valid with one warpgroup); the 8-warp large-M tiles appear once."""
    cases = [("nvfp4", "bf16", "large", {})]
    for fmt in FORMATS:
        for dtype in ("bf16", "fp16"):
            cases.append((fmt, dtype, "m512", {}))
    for name in CONFIGS:
        if name not in ("large", "m512"):
            cases.append(("nvfp4", "bf16", name, {}))
    cases += [
        ("nvfp4", "bf16", "m512", dict(swizzled=True, gscale=1, bias=True, act=1)),
        ("nvfp4", "fp16", "m128", dict(gscale=2, bias=True, act=2, even_k=False)),
        ("mxfp4", "bf16", "m512", dict(swizzled=True, act=3)),
        ("mxfp4", "fp16", "m512", dict(words=False, even_k=False, tma=False)),
        ("int4_awq", "bf16", "m512", dict(tma=False)),
        ("nvfp4", "bf16", "m64", dict(words=False, swizzled=True)),
        ("fp4_b32", "bf16", "m64", dict(bias=True, even_k=False, split=2)),
        ("nf4", "bf16", "m512", dict(double_quant=True)),
        ("nf4", "fp16", "m128", dict(double_quant=True, group=32, nf4_mode=1, even_k=False)),
        ("nf4", "bf16", "m512", dict(group=64, nf4_mode=2, even_k=False)),
        ("nf4", "bf16", "m32", dict(group=4096, nf4_mode=0, split=2)),
        ("int4_awq", "bf16", "m512", dict(group=32, bias=True, act=3)),
        ("int4_awq", "fp16", "m128", dict(group=64, even_k=False)),
        ("int4_awq", "bf16", "m32", dict(group=14336, split=2)),
        ("int4_awq", "fp16", "m512", dict(group=96)),
    ]
    for fmt, dtype, name, kw in cases:
        fn, sig, consts, _ = _variant(fmt, dtype, name, **kw)
        yield fn, sig, consts
    yield from _ws_compile_variants()
    yield from ra_compile_variants()
    yield from ra_compile_variants(fragments=True)
    for dtype in ("*bf16", "*fp16"):
        for gscale, bias, act in ((0, False, 0), (1, True, 1), (2, True, 3)):
            yield k.split_k_reduce_kernel, {
                "ws_ptr": "*fp32", "gscale_ptr": "*fp32", "bias_ptr": "*fp32", "out_ptr": dtype,
                "M": "i32", "N": "i32", "stride_om": "i32"}, dict(
                SPLIT_K=2, BLOCK_M=32, BLOCK_N=128, GSCALE_MODE=gscale, HAS_BIAS=bias, ACT=act, ON_GPU=True)


# ---------------------------------------------------------------------------------------------------------
# the warp-specialized decoded-operand GEMM (``_gemm_w4_ws``)

WS_FORMATS = ("nvfp4", "mxfp4", "int4_awq")
WS_CONFIG = dict(BN=128, BK=64, STAGES=4, RSTAGES=6, RLAG=3, GROUP_M=8, CONSUMER_REGS=168, LOADER_REGS=24,
                 DECODER_REGS=152)
"""128 x BN output tiles (two consumer warpgroups of 64 rows), BK-wide K steps; x and decoded-weight rings of
STAGES slots, the packed weight's ring of RSTAGES slots loaded RLAG steps ahead. Registers: see
``_gemm_w4_ws.launch_options``."""


def ra_weight_supports(w: QTensor) -> str | None:
    """None if the Gluon GEMMs (warp-specialized, register-operand) read weight ``w``, else the reason they do
    not; they also need x bfloat16/float16 with a 16-byte aligned base and row stride (``ws_supports``)."""
    why = supports(w)
    if why is not None:
        return why
    if w.fmt not in WS_FORMATS:
        return f"no warp-specialized kernel for {w.fmt!r} (have {', '.join(WS_FORMATS)})"
    if w.shape[1] % 32:
        return f"K = {w.shape[1]} is not a multiple of 32 (the packed weight's rows must be 16-byte multiples)"
    if w.fmt != "int4_awq":
        data = w.data.view(torch.uint8)
        if not data.is_contiguous() or data.data_ptr() % 16:
            return "the packed weight must be contiguous with a 16-byte aligned base"
    return None


def ws_supports(x: torch.Tensor, w: QTensor) -> str | None:
    """None if the warp-specialized GEMM runs ``x @ dequant(w).T``, else the reason it does not."""
    why = ra_weight_supports(w)
    if why is not None:
        return why
    if x.dtype not in (torch.bfloat16, torch.float16):
        return f"x must be bfloat16 or float16, got {x.dtype}"
    if not _tma_ok(x):
        return "x must have a 16-byte aligned base and row stride and a contiguous last dim"
    return None


def _gluon_call(name: str, x: torch.Tensor, w: QTensor, bias: torch.Tensor | None, activation: str | None,
                defaults: dict, config: dict | None) -> tuple[dict, torch.Tensor]:
    """The checks of a Gluon W4A16 launcher (``name`` in its errors), its config over ``defaults`` and its
    output [M, N]."""
    _check_inputs(x, w, bias, activation)
    why = ws_supports(x, w)
    if why is not None:
        raise ValueError(f"{name}: {why}")
    cfg = dict(defaults)
    cfg.update(config or {})
    return cfg, torch.empty(x.shape[0], w.shape[0], dtype=x.dtype, device=x.device)


def _w4_operands(w: QTensor):
    """(packed codes as int32 [N, K / 8], scales, scale row stride, global scale, constexprs) of a W4A16 weight
    for the Gluon kernels, cached per weight."""
    k_dim = w.shape[1]

    def build():
        consts = dict(FMT=_FMT_ID[w.fmt], SCALE_SWIZZLED=False, GSCALE_MODE=0)
        if w.fmt == "int4_awq":
            codes, sz = prelayout_int4_awq(w)
            consts["GROUP"] = w.params["group_size"]
            scales, stride_sn, gscale = sz, sz.stride(0), sz
        else:
            codes = w.data.view(torch.uint8)
            block = 16 if w.fmt == "nvfp4" else 32
            consts["GROUP"] = block
            scales = w.scale.contiguous().view(torch.uint8)
            consts["SCALE_SWIZZLED"] = w.scale_layout == "swizzled"
            cols = k_dim // block
            stride_sn = -(-cols // 4) * 4 if consts["SCALE_SWIZZLED"] else cols
            gscale, consts["GSCALE_MODE"] = _global_scale(w, codes.device)
            if gscale is None:
                gscale = scales
        return codes.view(torch.int32), scales, stride_sn, gscale, consts

    return _cached(w.data, "w4_operands", (w.data, w.scale, w.zeros, w.global_scale), build)


def _ws_weight(w: QTensor, bn: int, bk: int):
    """:func:`_w4_operands` with the packed weight's TMA descriptor ([bn, bk / 8] boxes) after the codes, cached
    per weight: the descriptor is built once."""
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as GluonDescriptor

    def build():
        words, scales, stride_sn, gscale, consts = _w4_operands(w)
        n, k_dim = w.shape
        layout = gl.NVMMASharedLayout.get_default_for([bn, bk // 8], gl.int32)
        desc = GluonDescriptor(words, [n, k_dim // 8], [words.stride(0), 1], [bn, bk // 8], layout)
        return words, desc, scales, stride_sn, gscale, consts

    deps = (w.data, w.scale, w.zeros, w.global_scale, bn, bk)
    return _cached(w.data, f"ws{bn}x{bk}", deps, build)


def gemm_w4_ws(x: torch.Tensor, w: QTensor, bias: torch.Tensor | None = None, activation: str | None = None,
               config: dict | None = None) -> torch.Tensor:
    """``act(x @ dequant(w).T + bias)`` through the warp-specialized Gluon kernel (``_gemm_w4_ws``): the weight
    decoded into shared memory by its own warpgroup, both wgmma operands from shared memory. Same contract as
    ``gemm_w4``; ``ws_supports(x, w)`` says which calls it takes."""
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as GluonDescriptor

    from . import _gemm_w4_ws as kw

    cfg, out = _gluon_call("gemm_w4_ws", x, w, bias, activation, WS_CONFIG, config)
    m, k_dim = x.shape
    n = w.shape[0]
    if m == 0 or n == 0:
        return out
    bn, bk = cfg["BN"], cfg["BK"]
    _, w_desc, scales, stride_sn, gscale, consts = _ws_weight(w, bn, bk)
    gl_dt = gl.bfloat16 if x.dtype == torch.bfloat16 else gl.float16
    x_desc = GluonDescriptor(x, [m, k_dim], [x.stride(0), 1], [64, bk],
                             gl.NVMMASharedLayout.get_default_for([64, bk], gl_dt))
    tiles = cdiv(m, 128) * cdiv(n, bn)
    # one program per tile: the kernel's persistent walk (several tiles per program) gave nondeterministic
    # outputs on an H200, cause not found; "PROGRAMS" reproduces it for the probe
    programs = cfg.get("PROGRAMS") or tiles
    has_bias = bias is not None
    kw.gemm_w4_ws_kernel[(programs,)](
        x_desc, w_desc, scales, gscale, bias.contiguous() if has_bias else out, out, m, n, k_dim, stride_sn,
        out.stride(0), HAS_BIAS=has_bias, ACT=ACTIVATIONS[activation], BN=bn, BK=bk, STAGES=cfg["STAGES"],
        RSTAGES=cfg["RSTAGES"], RLAG=cfg["RLAG"], GROUP_M=cfg["GROUP_M"], CONSUMER_REGS=cfg["CONSUMER_REGS"],
        LOADER_REGS=cfg["LOADER_REGS"], DECODER_REGS=cfg["DECODER_REGS"], DEBUG=cfg.get("DEBUG", 0), **consts,
        **kw.launch_options(),
    )
    return out


def _gluon_desc_signature(dtype: torch.dtype, gl_dtype, block: list) -> str:
    """The signature type the JIT writes for a Gluon host descriptor of a ``dtype`` tensor with ``block`` boxes
    (for the compile variants)."""
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import BaseBackend
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as GluonDescriptor

    t = torch.empty(256, 256, dtype=dtype)
    d = GluonDescriptor.from_tensor(t, block, gl.NVMMASharedLayout.get_default_for(block, gl_dtype))
    return native_specialize_impl(BaseBackend, d, False, True, True)[0]


def _ws_compile_variants():
    """The warp-specialized kernel: each format, both activation dtypes, swizzled scales, both nvfp4 global
    scale modes, the epilogues. Descriptor signatures come from host descriptors over small CPU tensors, as the
    JIT would write them."""
    from triton.experimental.gluon import language as gl

    from . import _gemm_w4_ws as kw

    cfg = WS_CONFIG
    cases = [("nvfp4", "bf16", dict(GSCALE_MODE=1, HAS_BIAS=True, ACT=1)),
             ("nvfp4", "fp16", dict(SCALE_SWIZZLED=True, GSCALE_MODE=2, ACT=2)),
             ("mxfp4", "bf16", dict(SCALE_SWIZZLED=True, ACT=3)), ("mxfp4", "fp16", {}),
             ("int4_awq", "bf16", dict(HAS_BIAS=True)), ("int4_awq", "fp16", dict(GROUP=64))]
    for fmt, dtype, extra in cases:
        tdt, gdt = (torch.bfloat16, gl.bfloat16) if dtype == "bf16" else (torch.float16, gl.float16)
        sig = {"x_desc": _gluon_desc_signature(tdt, gdt, [64, cfg["BK"]]),
               "w_desc": _gluon_desc_signature(torch.int32, gl.int32, [cfg["BN"], cfg["BK"] // 8]),
               "s_ptr": "*i32" if fmt == "int4_awq" else "*u8", "gscale_ptr": "*fp32", "bias_ptr": f"*{dtype}",
               "out_ptr": f"*{dtype}", "M": "i32", "N": "i32", "K": "i32", "stride_sn": "i32", "stride_om": "i32"}
        consts = dict(FMT=_FMT_ID[fmt], GROUP={"nvfp4": 16, "mxfp4": 32, "int4_awq": 128}[fmt],
                      SCALE_SWIZZLED=False, GSCALE_MODE=0, HAS_BIAS=False, ACT=0,
                      **{k: cfg[k] for k in ("BN", "BK", "STAGES", "RSTAGES", "RLAG", "GROUP_M", "CONSUMER_REGS",
                                             "LOADER_REGS", "DECODER_REGS")}, DEBUG=0)
        consts.update(extra)
        yield kw.gemm_w4_ws_kernel, sig, consts


# ---------------------------------------------------------------------------------------------------------
# the register-operand GEMM (``_gemm_w4_ra``)

RA_CONFIG = dict(BK=64, STAGES=4, GROUP_M=8, WG=1, SPLIT=1)
"""BK-wide K steps through a ring of STAGES slots (>= 3), GROUP_M weight-row tiles per group of programs, WG
warpgroups per program (64 weight rows each), SPLIT programs per output tile (split K); the x tile is BM = 64
rows up to M = 64, else 128 (``config`` may set BM to 64, 128 or 256)."""

_split_counters: dict = {}


def _tile_counters(device: torch.device, tiles: int) -> torch.Tensor:
    """One int32 arrival counter per output tile for the split-K kernel, zero between launches (the kernel
    resets what it uses); kept per device and stream (launches on one stream run one after the other; two
    streams' kernels must not share counters), grown, never shrunk."""
    if torch.cuda.is_current_stream_capturing():
        # a graph gets counters of its own (in its pool, zeroed on each replay): replays may run on any stream
        return torch.zeros(max(tiles, 4096), dtype=torch.int32, device=device)
    idx = device.index if device.index is not None else torch.cuda.current_device()
    key = (idx, torch._C._cuda_getCurrentRawStream(idx))
    cnt = _split_counters.get(key)
    if cnt is None or cnt.numel() < tiles:
        if len(_split_counters) >= 64:
            _split_counters.clear()
        cnt = _split_counters[key] = torch.zeros(max(tiles, 4096), dtype=torch.int32, device=device)
    return cnt


def gemm_w4_ra(x: torch.Tensor, w: QTensor, bias: torch.Tensor | None = None, activation: str | None = None,
               config: dict | None = None) -> torch.Tensor:
    """``act(x @ dequant(w).T + bias)`` through the Gluon kernel with the decoded weight as the wgmma's register
    operand (``_gemm_w4_ra``). Same contract as ``gemm_w4``; takes the calls ``ws_supports(x, w)`` takes;
    ``config`` over :data:`RA_CONFIG`."""
    return _register_operand_gemm("gemm_w4_ra", False, x, w, bias, activation, config)


def _register_operand_gemm(name: str, fragments: bool, x: torch.Tensor, w: QTensor, bias: torch.Tensor | None,
                           activation: str | None, config: dict | None) -> torch.Tensor:
    """:func:`gemm_w4_ra` or, ``fragments``, :func:`gemm_w4_rf` (``name`` in the errors)."""
    cfg, out = _gluon_call(name, x, w, bias, activation, RA_CONFIG, config)
    if x.shape[0] == 0 or w.shape[0] == 0:
        return out
    RaPlan(w, x.shape[0], x.dtype, activation, cfg, fragments).launch(
        x, None if bias is None else bias.contiguous(), out)
    return out


class RaPlan:
    """Everything :func:`gemm_w4_ra` (or, ``fragments``, :func:`gemm_w4_rf`) decides for a weight, a row count M,
    x's dtype, an activation and a config (complete: :data:`RA_CONFIG` keys): tiles, grid, the weight's
    descriptor or fragment words and arguments. ``launch`` then reads x and launches; a :class:`RaRunner` keeps
    one plan and its compiled launch. M > 0, N > 0."""

    __slots__ = ("act", "bk", "bm", "consts", "fragments", "grid", "k", "kernel", "m", "n", "split", "stride_sn",
                 "tiles", "w_args", "wg", "x_layout")

    def __init__(self, w: QTensor, m: int, dtype: torch.dtype, activation: str | None, cfg: dict,
                 fragments: bool = False) -> None:
        from triton.experimental.gluon import language as gl

        name = "gemm_w4_rf" if fragments else "gemm_w4_ra"
        bm = cfg.get("BM") or (64 if m <= 64 else 128)
        bk, wg, split = cfg["BK"], cfg["WG"], cfg["SPLIT"]
        if (bm not in (64, 128, 256) or cfg["STAGES"] < 3 or bk not in ((64,) if fragments else (32, 64, 128))
                or wg not in (1, 2) or split not in range(1, 9)):
            raise ValueError(f"{name}: config needs BM in (64, 128, 256), BK in "
                             f"{'(64,)' if fragments else '(32, 64, 128)'}, STAGES >= 3, WG in (1, 2) and SPLIT "
                             f"in 1..8, got {cfg}")
        if fragments:
            w_desc = None
            _, scales, stride_sn, gscale, consts = _w4_operands(w)
        else:
            _, w_desc, scales, stride_sn, gscale, consts = _ws_weight(w, 64 * wg, bk)
        self.fragments = fragments
        self.m, self.n, self.k = m, w.shape[0], w.shape[1]
        self.bm, self.bk, self.wg, self.split = bm, bk, wg, split
        self.w_args = (_fragment_words(w) if fragments else w_desc, scales, gscale)
        self.stride_sn = stride_sn
        self.x_layout = gl.NVMMASharedLayout.get_default_for([bm, bk], gl.bfloat16 if dtype == torch.bfloat16
                                                             else gl.float16)
        self.tiles = cdiv(m, bm) * cdiv(self.n, 64 * wg)
        self.grid = (self.tiles * split,)
        self.act = ACTIVATIONS[activation]
        self.consts = dict(consts, ACT=self.act, BM=bm, STAGES=cfg["STAGES"], GROUP_M=cfg["GROUP_M"], WG=wg,
                           SPLIT=split)
        if fragments:  # BK is the kernel's own constant
            from ._gemm_w4_rf import gemm_w4_rf_kernel as kernel

            self.consts["DEEP"] = bool(cfg.get("DEEP"))
        else:
            from ._gemm_w4_ra import gemm_w4_ra_kernel as kernel

            self.consts["BK"] = bk
        self.kernel = kernel

    def launch(self, x: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor, store: dict | None = None,
               key: tuple | None = None) -> None:
        """``out[:] = act(x @ dequant(w).T + bias)``: ``x`` [M, K] contiguous and 16-byte aligned, ``bias`` None
        or contiguous [N], ``out`` [M, N] of x's dtype. ``store`` / ``key``: keep the compiled launch there under
        ``key`` (a caller whose x, bias and out keep their strides and alignment; see ``_launch.kept_launch``)."""
        has_bias = bias is not None
        if self.split > 1:
            ws = torch.empty(self.tiles * self.split * 64 * self.wg * self.bm, dtype=torch.float32, device=x.device)
            cnt = _tile_counters(x.device, self.tiles)
        else:
            ws = cnt = out
        x_desc = LazyDescriptor(x, [self.bm, self.bk], layout=self.x_layout)
        w_arg, scales, gscale = self.w_args
        kept_launch(store, None if key is None else (*key, has_bias), self.kernel, self.grid, (
            x_desc, w_arg, scales, gscale, bias if has_bias else out, out, ws, cnt, self.m, self.n, self.k,
            self.stride_sn, out.stride(0)), HAS_BIAS=has_bias, **self.consts, num_warps=4 * self.wg)


def _fragment_words(w: QTensor) -> torch.Tensor:
    """The weight's codes as wgmma register fragments (``w4_fragments.fragment_words``), made once per weight."""
    from .w4_fragments import fragment_words

    def build():
        codes = prelayout_int4_awq(w)[0] if w.fmt == "int4_awq" else w.data.contiguous().view(torch.uint8)
        return fragment_words(codes, w.shape[1])

    return _cached(w.data, "fragments", (w.data, w.zeros, w.scale), build)


def gemm_w4_rf(x: torch.Tensor, w: QTensor, bias: torch.Tensor | None = None, activation: str | None = None,
               config: dict | None = None) -> torch.Tensor:
    """``act(x @ dequant(w).T + bias)`` through the Gluon kernel that reads the weight as wgmma register fragments
    (``_gemm_w4_rf``; the layout made once per weight). Same contract and config keys as :func:`gemm_w4_ra`
    (BK 64 only), and ``DEEP``: load scales and words four K steps ahead. The W4A16 route where
    ``policy.register_operand_config`` takes the call."""
    return _register_operand_gemm("gemm_w4_rf", True, x, w, bias, activation, config)


class RaRunner:
    """``run(x, bias) -> out``: :func:`gemm_w4_ra` (``config["FRAGMENTS"]``: :func:`gemm_w4_rf`) for one weight at
    one M, x dtype, activation and config, decided once (:class:`RaPlan`) and launched through a kept compiled
    kernel: the call a prepared layer makes where the dispatch rules choose this kernel. ``x`` [M, K] contiguous
    and 16-byte aligned, ``bias`` None or a contiguous, 16-byte aligned [N] (the caller checks both once); the
    same bits as the function."""

    __slots__ = ("dtype", "launches", "plan")

    def __init__(self, w: QTensor, m: int, dtype: torch.dtype, activation: str | None, config: dict) -> None:
        self.plan = RaPlan(w, m, dtype, activation, {**RA_CONFIG, **config}, fragments=bool(config.get("FRAGMENTS")))
        self.dtype = dtype
        self.launches: dict = {}

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        p = self.plan
        out = torch.empty(p.m, p.n, dtype=self.dtype, device=x.device)
        p.launch(x, bias, out, self.launches, (torch._C._cuda_getDevice(),))
        return out


def ra_compile_variants(fragments: bool = False):
    """The register-operand kernel (``fragments``: the register-fragment one): each format, both activation
    dtypes, swizzled scales, both nvfp4 global scale modes, the epilogues, BM 64 / 128 / 256, one or two
    warpgroups, split K. Descriptor signatures from host descriptors over small CPU tensors, as the JIT writes them."""
    from triton.experimental.gluon import language as gl

    if fragments:
        from ._gemm_w4_rf import gemm_w4_rf_kernel as kernel
    else:
        from ._gemm_w4_ra import gemm_w4_ra_kernel as kernel

    bk = RA_CONFIG["BK"]
    cases = [("nvfp4", "bf16", 128, dict(GSCALE_MODE=1, HAS_BIAS=True, ACT=1)),
             ("nvfp4", "fp16", 64, dict(SCALE_SWIZZLED=True, GSCALE_MODE=2, ACT=2)),
             ("mxfp4", "bf16", 64, dict(SCALE_SWIZZLED=True, ACT=3)), ("mxfp4", "fp16", 128, dict(WG=2)),
             ("int4_awq", "bf16", 128, dict(HAS_BIAS=True, SPLIT=3)),
             ("int4_awq", "fp16", 64, dict(GROUP=64, WG=2, SPLIT=2)),
             # no bias, activation or global scale, one split: the epilogue's first operation converts the
             # accumulator (what ptxas once moved above the final wait)
             ("mxfp4", "bf16", 128, {}), ("int4_awq", "bf16", 256, dict(WG=2)),
             # the small-M route's tiles (the fragment kernel: loads four K steps ahead)
             ("nvfp4", "bf16", 64, dict(GSCALE_MODE=1, SPLIT=4, DEEP=True))]
    for fmt, dtype, bm, extra in cases:
        tdt, gdt = (torch.bfloat16, gl.bfloat16) if dtype == "bf16" else (torch.float16, gl.float16)
        sig = {"x_desc": _gluon_desc_signature(tdt, gdt, [bm, bk])}
        if fragments:
            sig["w_ptr"] = "*i32"
        else:
            sig["w_desc"] = _gluon_desc_signature(torch.int32, gl.int32, [64 * extra.get("WG", 1), bk // 8])
        s_type = "*i32" if fmt == "int4_awq" else "*u8"
        # without a global scale the launcher passes the scales there (never read), as the JIT then types it
        gscale_type = "*fp32" if extra.get("GSCALE_MODE") else s_type
        sig.update({"s_ptr": s_type, "gscale_ptr": gscale_type, "bias_ptr": f"*{dtype}",
                    "out_ptr": f"*{dtype}", "ws_ptr": "*fp32", "cnt_ptr": "*i32", "M": "i32", "N": "i32", "K": "i32",
                    "stride_sn": "i32", "stride_om": "i32"})
        consts = dict(FMT=_FMT_ID[fmt], GROUP={"nvfp4": 16, "mxfp4": 32, "int4_awq": 128}[fmt],
                      SCALE_SWIZZLED=False, GSCALE_MODE=0, HAS_BIAS=False, ACT=0, BM=bm, BK=bk,
                      STAGES=RA_CONFIG["STAGES"], GROUP_M=RA_CONFIG["GROUP_M"], WG=1, SPLIT=1)
        consts.update(extra)
        if fragments:
            del consts["BK"]
            consts["DEEP"] = bool(consts.pop("DEEP", False))
        else:
            consts.pop("DEEP", None)
        yield kernel, sig, consts
