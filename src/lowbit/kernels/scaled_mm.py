"""Launcher of the two-quantized-operand GEMM (``_scaled_mm``) behind ``lowbit.scaled_mm`` on CUDA.

Contract (``lowbit.ops.scaled_mm``): ``supports(a, b)`` returns None or the reason this module cannot run the
pair; ``scaled_mm(a, b, alpha, bias, out_dtype)`` gets QTensors ``a`` [M, K] and ``b`` [N, K] the op layer has
validated, ``alpha`` None or a fp32 [1] tensor, ``bias`` None or contiguous [N], and returns [M, N].

The routes and what each needs: :mod:`lowbit.kernels.scaled_mm_routes` (gemv, dequant, fold,
fold_deepgemm, cublas, deepgemm) and :mod:`lowbit.kernels.scaled_mm_launch` (lowbit's kernels, their tile
configurations ``CONFIGS``, ``FP8_CONFIGS``, ``FOLD_CONFIGS``, by M regime; nothing is autotuned).
:class:`KernelRoute` is the ``"kernel"`` route decided once for a layer's weight. No host synchronization:
calls can be captured in CUDA graphs.
"""

from __future__ import annotations

import torch

from ..formats.qtensor import QTensor
from ..formats.registry import formats_with
from ..formats.shards import plan_rows
from . import _scaled_mm as k
from . import cdiv
from . import cublas_fp8_block as cb
from . import interpreting as _interpreting
from ._launch import Launch
from .scaled_mm_launch import (
    CONFIGS,
    FOLD_CONFIGS,
    FP8_CONFIGS,
    MINIFLOAT,
    ONE_PARTITION_CONFIG,
    WS_CONFIG,
    config_for,
    kernel_consts,
    launch_fp8_block_tma,
    launch_decoding,
    operand_args,
    split_k,
    tma_ready,
)
from .scaled_mm_routes import (
    DEQUANT_EPILOGUE_TILE,
    cublas_unsupported,
    deepgemm_mm,
    deepgemm_unsupported,
    dequant_mm,
    dequant_unsupported,
    fold_deepgemm_unsupported,
    fold_mm,
    fold_unsupported,
    gemv_unsupported,
    scaled_gemv,
)
from .scratch import KeptScratch, split_k_scratch


_FP8 = ("fp8_block", "fp8_rowwise", "mxfp8_e4m3", "mxfp8_e5m2")
FORMATS = formats_with("scaled_mm")  # the operand formats: _FP8, nvfp4, mxfp4, mxfp6_e2m3, mxfp6_e3m2


def supports(a, b) -> str | None:
    if not isinstance(a, QTensor) or not isinstance(b, QTensor):
        return "a and b must be QTensors"
    for name, q in (("a", a), ("b", b)):
        if q.fmt not in FORMATS:
            return f"no scaled_mm kernel operand for format {q.fmt!r} ({name})"
        if len(q.shape) != 2:
            return f"{name} must be 2-D, got shape {tuple(q.shape)}"
    if b.fmt == "fp8_rowwise":
        return "fp8_rowwise is an activation (a) format"
    if a.fmt == "fp8_block" and tuple(a.params.get("block", ())) != (1, 128):
        return "fp8_block activation (a) must have block (1, 128)"
    if b.fmt == "fp8_block" and tuple(b.params.get("block", ())) not in ((128, 128), (1, 128)):
        return "fp8_block weight (b) must have block (128, 128) or (1, 128)"
    return None


ROUTES = ("gemv", "fold", "fold_deepgemm", "cublas", "deepgemm", "dequant", "kernel")


def scaled_mm(a: QTensor, b: QTensor, alpha, bias, out_dtype, route: str = "kernel", config: dict | None = None,
              cublas: bool | None = None) -> torch.Tensor:
    """The product on ``route`` (:data:`ROUTES`; ``lowbit.ops.policy.scaled_route`` decides it for
    ``lowbit.scaled_mm``; the capability checks above say where each can run):

    - ``"gemv"``: the activation decoded to bf16, then the W4A16 GEMV;
    - ``"fold"``: the exact E4M3 re-encoding, then cuBLASLt's FP8 GEMM where it can run (``cublas=False``:
      never; True: ValueError where it cannot), else the TMA kernel (with ``config``, that config and no cuBLAS);
    - ``"fold_deepgemm"``: the exact E4M3 re-encoding, then DeepGEMM's FP8 GEMM (ValueError where it cannot run);
    - ``"cublas"``: cuBLASLt's block-scaled FP8 GEMM (ValueError where it cannot run);
    - ``"deepgemm"``: DeepGEMM's FP8 GEMM, where it is installed (ValueError where it cannot run);
    - ``"dequant"``: nvfp4 x nvfp4 or 6/8-bit MX pairs decoded exactly to bf16, then cuBLAS's bf16 GEMM
      (:func:`dequant_unsupported`);
    - ``"kernel"``: lowbit's block-scaled GEMM kernels (``config``: a tile config instead of the table's)."""
    if route not in ROUTES:
        raise ValueError(f"route must be one of {ROUTES}, got {route!r}")
    m, k_dim = a.shape
    n = b.shape[0]
    if route == "gemv":
        why = gemv_unsupported(a, b)
        if why is not None:
            raise ValueError(f"route 'gemv': {why}")
        return scaled_gemv(a, b, alpha, bias, out_dtype)
    if route == "fold":
        why = fold_unsupported(a, b)
        if why is not None:
            raise ValueError(f"route 'fold': {why}")
        cfg = dict(config) if config is not None else config_for(m, True, fold=True)
        return fold_mm(a, b, alpha, bias, out_dtype, cfg, cublas if config is None else False)
    if route == "fold_deepgemm":
        why = fold_deepgemm_unsupported(a, b, bias, out_dtype)
        if why is not None:
            raise ValueError(f"route 'fold_deepgemm': {why}")
        return fold_mm(a, b, alpha, bias, out_dtype, config_for(m, True, fold=True), deepgemm=True)
    if route == "cublas":
        why = cublas_unsupported(a, b, bias, out_dtype)
        if why is not None:
            raise ValueError(f"route 'cublas': {why}")
        return cb.mm(a.data, a.scale, b.data, b.scale, alpha, bias, out_dtype)
    if route == "deepgemm":
        why = deepgemm_unsupported(a, b, bias, out_dtype)
        if why is not None:
            raise ValueError(f"route 'deepgemm': {why}")
        return deepgemm_mm(a, b, alpha, bias, out_dtype)
    if route == "dequant":
        why = dequant_unsupported(a, b)
        if why is not None:
            raise ValueError(f"route 'dequant': {why}")
        return dequant_mm(a, b, alpha, bias, out_dtype)
    a_args, ac = operand_args(a)
    b_args, bc = operand_args(b)
    raw_fp8 = ac["KIND"] == 0 and bc["KIND"] == 0 and ac["SMODE"] == 1 and bc["SMODE"] == 1
    cfg = dict(config) if config is not None else config_for(m, raw_fp8)
    out = torch.empty((m, n), dtype=out_dtype, device=a.data.device)
    if (
        raw_fp8
        and cfg.get("tma")
        and cfg["BK"] == 128
        and not _interpreting()
        and tma_ready(a_args[0])
        and tma_ready(b_args[0])
    ):
        launch_fp8_block_tma(a_args, b_args, bc, m, n, k_dim, alpha, bias, out, cfg)
        return out
    launch_decoding(a_args, ac, b_args, bc, m, n, k_dim, alpha, bias, out, cfg, plan_n=plan_rows(b))
    return out


class KernelRoute:
    """The ``"kernel"`` route (lowbit's decoding GEMM) of one weight ``b`` for one activation layout (format,
    options, M), alpha and bias presence and output dtype, decided once: the tile config, split-K, constexprs
    and the weight's arguments. A call takes a fresh activation of that layout and launches the cached compiled
    kernel (``lowbit.kernels._launch.Launch``). :meth:`covers` says whether a pair takes this launch (the TMA
    kernel of raw FP8 pairs does not)."""

    def __init__(self, a: QTensor, b: QTensor, has_alpha: bool, has_bias: bool, out_dtype: torch.dtype) -> None:
        a_args, ac = operand_args(a)
        b_args, bc = operand_args(b)
        m, k_dim = a.shape
        n = b.shape[0]
        raw_fp8 = ac["KIND"] == 0 and bc["KIND"] == 0 and ac["SMODE"] == 1 and bc["SMODE"] == 1
        cfg = config_for(m, raw_fp8)
        self.ok = not (raw_fp8 and cfg.get("tma") and cfg["BK"] == 128) and not _interpreting()
        bm, bn, bk = cfg["BM"], cfg["BN"], cfg["BK"]
        self.tiles = cdiv(m, bm) * cdiv(n, bn)
        device = a.data.device
        # K is split as for the whole weight when b is a column shard (lowbit.formats.shards.plan_rows)
        self.split, self.k_per = split_k(cdiv(m, bm) * cdiv(plan_rows(b), bn), cdiv(k_dim, bk), bk, cfg, device)
        consts = kernel_consts(ac, bc, cfg, has_alpha, has_bias, k_dim, self.split, guard=False)
        self.launch = Launch(k.scaled_mm_kernel, (self.tiles, self.split), consts, cfg["num_warps"],
                             cfg["num_stages"])
        self.b3, self.b_strides = tuple(b_args[:3]), tuple(b_args[3:7])
        self.m, self.n, self.k_dim, self.dtype, self.device = m, n, k_dim, out_dtype, device
        self.dev_index = device.index if device.index is not None else torch.cuda.current_device()

    def __call__(self, a: QTensor, alpha: torch.Tensor | None, bias: torch.Tensor | None) -> torch.Tensor:
        """``a``: an activation of the layout this route was made for; ``bias`` contiguous and 16-byte aligned."""
        a_args, _ = operand_args(a)
        return self.run(a_args[0], a_args[1], a_args[2], tuple(a_args[3:7]), alpha, bias)

    def run(self, data: torch.Tensor, scale: torch.Tensor, gscale: torch.Tensor, a_strides: tuple,
            alpha: torch.Tensor | None, bias: torch.Tensor | None) -> torch.Tensor:
        """The launch on an activation's operand arguments (``operand_args``: data, scale, global scale and
        (data row stride, scale strides, padded scale columns)), for callers that keep them."""
        m, n = self.m, self.n
        out = torch.empty((m, n), dtype=self.dtype, device=self.device)
        if self.split > 1:
            ws, cnt = split_k_scratch(self.device, self.dev_index, self.split * m * n, self.tiles)
        else:
            ws = cnt = out
        self.launch.run(self.dev_index, data, scale, gscale, *self.b3, out if alpha is None else alpha,
                        out if bias is None else bias, out, ws, cnt, cnt, m, n, self.k_dim, self.k_per,
                        *a_strides, *self.b_strides, n)
        return out


    def quant_in_gemm(self, pow2: bool) -> QuantInGemm | None:
        """This launch with the activation quantized inside the kernel (``A_QUANT``), for an fp8_block (1x128)
        activation with 128-wide K tiles: x goes straight in, one launch instead of the quantize kernel and this
        one, the same codes and scales in registers, so the same bits. On an fp8_block weight whose tensors
        are contiguous it is ``fp8_block_decode_kernel`` (the same code with strides derived from the shapes:
        fewer launch arguments). ``pow2``: the activation's ue8m0 scales. None where the route is another
        kind."""
        c = self.launch.consts
        if not (self.ok and c["A_KIND"] == 0 and c["A_SMODE"] == 1 and c["BK"] == 128 and not c["GUARD"]
                and not c["HAS_ALPHA"]):
            return None
        data, scale = self.b3[0], self.b3[1]
        if (c["B_KIND"] == 0 and c["B_SMODE"] == 1 and data.is_contiguous() and scale.is_contiguous()
                and c["GROUP_M"] == 1):
            consts = dict(HAS_BIAS=c["HAS_BIAS"], BM=c["BM"], BN=c["BN"], SPLIT=c["SPLIT"], EVEN_K=c["EVEN_K"],
                          POW2=bool(pow2), ROWS_PER_SCALE=c["B_ROWS_PER_SCALE"], ON_GPU=c["ON_GPU"])
            return QuantInGemm(Launch(k.fp8_block_decode_kernel, self.launch.grid, consts, **self.launch.options),
                               self, minimal=True)
        launch = Launch(k.scaled_mm_kernel, self.launch.grid, {**c, "A_QUANT": True, "A_POW2": bool(pow2)},
                        **self.launch.options)
        return QuantInGemm(launch, self, minimal=False)


class QuantInGemm:
    """``run(x, bias) -> out`` for x ``[M, K]`` (bf16, fp16 or fp32; contiguous, 16-byte aligned) and ``bias``
    None or ``[N]`` of the output dtype, contiguous and aligned (the caller checks; nothing is checked here):
    :meth:`KernelRoute.quant_in_gemm`'s single launch, with the route's split-K scratch kept per stream as the
    GEMV runners keep theirs."""

    __slots__ = ("launch", "minimal", "m", "n", "k_dim", "k_per", "split", "tiles", "b3", "b_strides", "dtype",
                 "device", "dev_index", "scratch")

    def __init__(self, launch: Launch, route: KernelRoute, minimal: bool) -> None:
        self.launch, self.minimal = launch, minimal
        self.m, self.n, self.k_dim, self.k_per = route.m, route.n, route.k_dim, route.k_per
        self.split, self.tiles = route.split, route.tiles
        self.b3, self.b_strides = route.b3, route.b_strides
        self.dtype, self.device, self.dev_index = route.dtype, route.device, route.dev_index
        self.scratch = KeptScratch(self.device, self.dev_index, self.split * self.m * self.n, self.tiles)

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        m, n = self.m, self.n
        out = torch.empty((m, n), dtype=self.dtype, device=self.device)
        stream = torch._C._cuda_getCurrentRawStream(self.dev_index)
        if self.split > 1:
            ws, cnt = self.scratch.get(stream)
        else:
            ws = cnt = out
        b = out if bias is None else bias
        if self.minimal:
            self.launch.run_on(stream, x, self.b3[0], self.b3[1], b, out, ws, cnt, m, n, self.k_dim, self.k_per)
        else:
            self.launch.run_on(stream, x, x, x, *self.b3, out, b, out, ws, cnt, cnt, m, n, self.k_dim, self.k_per,
                               x.stride(0), 0, 0, 0, *self.b_strides, n)
        return out


def traced_quant_in_gemm(x: torch.Tensor, w_data: torch.Tensor, w_scale: torch.Tensor, ws: torch.Tensor,
                         cnt: torch.Tensor, bias: torch.Tensor | None, pow2: bool, rows_per_scale: int,
                         plan_n: int = 0) -> torch.Tensor:
    """fp8_block decode (x ``[M, K]`` contiguous, M <= the first FP8 config's limit; the weight's data and
    scales contiguous) as ``torch.compile`` traces it inside a ``triton_op`` body: the launch of
    :meth:`KernelRoute.quant_in_gemm`, planned from the shapes alone (the grid does not depend on M within
    the config). ``ws`` / ``cnt``: a split-K workspace and zeroed counters that cover the plan
    (``lowbit.kernels.scratch.traced_scratch``; a larger plan gets its own)."""
    m, k_dim = x.shape
    n = w_data.shape[0]
    dev = x.device
    cfg = dict(FP8_CONFIGS[0][1])
    tiles = cdiv(n, cfg["BN"])  # one row of tiles: M <= BM
    split, k_per = split_k(cdiv(plan_n or n, cfg["BN"]), cdiv(k_dim, cfg["BK"]), cfg["BK"], cfg, dev)
    out = torch.empty((m, n), dtype=x.dtype, device=dev)
    if split > 1 and (ws.numel() < split * cfg["BM"] * n or cnt.numel() < tiles):
        ws = torch.empty(split * cfg["BM"] * n, dtype=torch.float32, device=dev)
        cnt = torch.zeros(tiles, dtype=torch.int32, device=dev)
    consts = dict(HAS_BIAS=bias is not None, BM=cfg["BM"], BN=cfg["BN"], SPLIT=split,
                  EVEN_K=k_dim % cfg["BK"] == 0, POW2=bool(pow2), ROWS_PER_SCALE=rows_per_scale,
                  ON_GPU=not _interpreting())
    launch = Launch(k.fp8_block_decode_kernel, (tiles, split), consts, cfg["num_warps"], cfg["num_stages"])
    if split == 1:
        ws = cnt = out
    launch.traced(x, w_data, w_scale, out if bias is None else bias, out, ws, cnt, m, n, k_dim, k_per)
    return out


def quant_in_gemm_scratch_size(n: int, k_dim: int) -> tuple[int, int]:
    """(workspace floats, counters) that cover :func:`traced_quant_in_gemm`'s plan for an ``[N, K]`` weight."""
    cfg = FP8_CONFIGS[0][1]
    return cfg.get("split_k", 1) * cfg["BM"] * n, cdiv(n, cfg["BN"])


_DTYPES = {
    "fp8_block": "*fp8e4nv",
    "fp8_rowwise": "*fp8e4nv",
    "mxfp8_e4m3": "*fp8e4nv",
    "mxfp8_e5m2": "*fp8e5",
}


def compile_variants():
    """(kernel, signature, constexprs) for every pair kind, both M regimes, swizzled scales, masked K, epilogues."""
    pairs = [
        ("fp8_block", "fp8_block", {}),
        ("nvfp4", "nvfp4", {}),
        ("mxfp4", "mxfp4", {}),
        ("mxfp8_e4m3", "mxfp8_e4m3", {}),
        ("mxfp8_e5m2", "mxfp8_e4m3", {}),
        ("mxfp8_e4m3", "mxfp6_e3m2", {}),
        ("mxfp6_e2m3", "mxfp8_e4m3", {}),
        ("fp8_rowwise", "nvfp4", {}),
        ("fp8_block", "mxfp4", {}),
        ("nvfp4", "nvfp4", {"swizzled": True, "even_k": False, "bias": True, "alpha": True, "small": True}),
        ("fp8_block", "fp8_block", {"even_k": False, "small": True, "bias": True}),
        # decode with the activation quantized in the GEMM (one launch): bf16 / fp16 x, ue8m0 scales, masked K
        ("fp8_block", "fp8_block", {"small": True, "bias": True, "a_quant": "*bf16"}),
        ("fp8_block", "fp8_block", {"small": True, "even_k": False, "a_quant": "*fp16", "pow2": True}),
        ("fp8_block", "mxfp4", {"small": True, "a_quant": "*bf16", "bias": True}),
        ("mxfp4", "mxfp4", {"swizzled": True, "small": True}),
        # the guarded exact fallback of the FP8 re-encoded pairs
        ("mxfp4", "mxfp4", {"guard": True}),
        ("fp8_rowwise", "mxfp4", {"guard": True, "even_k": False}),
        ("fp8_block", "mxfp4", {"guard": True, "swizzled": True}),
    ]
    for fa, fb, opt in pairs:
        raw = fa == fb == "fp8_block"
        cfg = dict((FP8_CONFIGS if raw else CONFIGS)[0 if opt.get("small") else 1][1])
        consts = {}
        for side, fmt in (("A", fa), ("B", fb)):
            kind = 0 if fmt in _FP8 else (2 if fmt.startswith("mxfp6") else 1)
            smode = {"fp8_block": 1, "fp8_rowwise": 3, "nvfp4": 4}.get(fmt, 2)
            e, mb, bias = MINIFLOAT.get(fmt, (0, 0, 0))
            consts.update(
                {
                    f"{side}_KIND": kind,
                    f"{side}_SMODE": smode,
                    f"{side}_SWIZZLED": bool(opt.get("swizzled")) and smode in (2, 4),
                    f"{side}_GMODE": 1 if fmt == "nvfp4" else 0,
                    f"{side}_EBITS": e,
                    f"{side}_MBITS": mb,
                    f"{side}_BIAS": bias,
                }
            )
        consts["B_ROWS_PER_SCALE"] = 128 if fb == "fp8_block" else 1
        consts.update(
            HAS_ALPHA=bool(opt.get("alpha")),
            HAS_BIAS=bool(opt.get("bias")),
            BM=cfg["BM"],
            BN=cfg["BN"],
            BK=cfg["BK"],
            GROUP_M=cfg["GROUP_M"],
            EVEN_K=opt.get("even_k", True),
            SPLIT=4 if opt.get("small") else 1,
            ON_GPU=True,
            GUARD=bool(opt.get("guard")),
            A_QUANT=bool(opt.get("a_quant")),
            A_POW2=bool(opt.get("pow2")),
        )
        sig = {
            "a_ptr": opt.get("a_quant") or _DTYPES.get(fa, "*u8"),
            "as_ptr": "*fp32" if fa in ("fp8_block", "fp8_rowwise") else "*u8",
            "ag_ptr": "*fp32",
            "b_ptr": _DTYPES.get(fb, "*u8"),
            "bs_ptr": "*fp32" if fb == "fp8_block" else "*u8",
            "bg_ptr": "*fp32",
            "alpha_ptr": "*fp32",
            "bias_ptr": "*bf16",
            "out_ptr": "*bf16",
            "ws_ptr": "*fp32",
            "cnt_ptr": "*i32",
            "guard_ptr": "*i32",
        }
        sig.update(
            {
                n: "i32"
                for n in (
                    "M",
                    "N",
                    "K",
                    "K_PER",
                    "stride_a",
                    "stride_as0",
                    "stride_as1",
                    "a_cols4",
                    "stride_b",
                    "stride_bs0",
                    "stride_bs1",
                    "b_cols4",
                    "stride_om",
                )
            }
        )
        yield k.scaled_mm_kernel, sig, consts
    # the fp8_block decode kernel (activation quantized in the GEMM): each x dtype, ue8m0, masked K, bias, split-K
    for x_ty, pow2, even_k, bias in (("*bf16", False, True, True), ("*fp16", True, False, False),
                                     ("*fp32", False, True, False)):
        cfg = FP8_CONFIGS[0][1]
        sig = {"x_ptr": x_ty, "w_ptr": "*fp8e4nv", "ws_ptr": "*fp32", "bias_ptr": x_ty,
               "out_ptr": x_ty, "part_ptr": "*fp32", "cnt_ptr": "*i32", "M": "i32", "N": "i32", "K": "i32",
               "K_PER": "i32"}
        yield k.fp8_block_decode_kernel, sig, dict(HAS_BIAS=bias, BM=cfg["BM"], BN=cfg["BN"], SPLIT=4,
                                                    EVEN_K=even_k, POW2=pow2, ROWS_PER_SCALE=128, ON_GPU=True)
    # the TMA fp8_block kernel: every shipped config, plus per-row weight scales (block (1, 128)) with bias/alpha,
    # and every config of the FP8 re-encoded pairs (128x128 weight blocks, with bias/alpha)
    tma_cases = []
    for i, (_limit, cfg) in enumerate(FP8_CONFIGS):
        if cfg.get("ws"):
            cfg = ONE_PARTITION_CONFIG  # what a ws config runs for weights without 128x128 scale blocks
        if cfg.get("tma"):
            tma_cases.append((cfg, 128, False))
            if i == len(FP8_CONFIGS) - 1:
                tma_cases.append((cfg, 1, True))
    tma_cases += [(cfg, 128, True) for _limit, cfg in FOLD_CONFIGS if not cfg.get("ws")]
    for cfg, rows_per_scale, extras in tma_cases:
        bm, bn, bk = cfg["BM"], cfg["BN"], cfg["BK"]
        sig = {
            "a_desc": f"tensordesc<fp8e4nv[{bm}, {bk}]>",
            "b_desc": f"tensordesc<fp8e4nv[{bn}, {bk}]>",
            "as_ptr": "*fp32",
            "bs_ptr": "*fp32",
            "alpha_ptr": "*fp32",
            "bias_ptr": "*bf16",
            "out_ptr": "*bf16",
        }
        sig.update({n: "i32" for n in ("M", "N", "K", "stride_as0", "stride_as1", "stride_bs0", "stride_bs1",
                                       "stride_om", "num_programs")})
        consts = dict(B_ROWS_PER_SCALE=rows_per_scale, HAS_ALPHA=extras, HAS_BIAS=extras, BM=bm, BN=bn, BK=bk,
                      GROUP_M=cfg["GROUP_M"])
        yield k.fp8_block_mm_tma_kernel, sig, consts
    epilogues = (("*bf16", "*bf16", (True, True, False, False)), ("*fp16", "*fp32", (True, True, True, True)),
                 ("*fp32", "*bf16", (False, True, False, True)))
    for out, bias, flags in epilogues:
        sig = {"acc_ptr": "*fp32", "out_ptr": out, "inv_a_ptr": "*fp32", "inv_b_ptr": "*fp32", "alpha_ptr": "*fp32",
               "bias_ptr": bias, "M": "i32", "C": "i32", "stride_out": "i32"}
        yield k.dequant_epilogue_kernel, sig, dict(zip(("HAS_A", "HAS_B", "HAS_ALPHA", "HAS_BIAS"), flags),
                                                   **DEQUANT_EPILOGUE_TILE)
    # the DeepGEMM routes' bias pass: a bf16 product in place, plus a bf16 bias
    sig = {"acc_ptr": "*bf16", "out_ptr": "*bf16", "inv_a_ptr": "*bf16", "inv_b_ptr": "*bf16", "alpha_ptr": "*bf16",
           "bias_ptr": "*bf16", "M": "i32", "C": "i32", "stride_out": "i32"}
    yield k.dequant_epilogue_kernel, sig, dict(HAS_A=False, HAS_B=False, HAS_ALPHA=False, HAS_BIAS=True,
                                               **DEQUANT_EPILOGUE_TILE)
    yield from _ws_compile_variants()


def _ws_compile_variants():
    """The Gluon kernel: the shipped config (TMA and plain output stores, bf16 and fp32 out, bias/alpha).
    Descriptor signatures come from host descriptors over small CPU tensors, as the JIT would write them."""
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import BaseBackend
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    from . import _fp8_block_ws as kws

    def desc_sig(dtype, gl_dtype, block):
        t = torch.empty(256, 256, dtype=dtype)
        d = TensorDescriptor.from_tensor(t, block, gl.NVMMASharedLayout.get_default_for(block, gl_dtype))
        return native_specialize_impl(BaseBackend, d, False, True, True)[0]

    cases = [(WS_CONFIG, torch.bfloat16, True, True), (WS_CONFIG, torch.float32, True, False),
             (WS_CONFIG, torch.bfloat16, False, True)]
    for cfg, out_dtype, tma_store, extras in cases:
        bn, consumers = cfg["BN"], cfg["BM"] // 64
        gl_out, ptr_out = (gl.bfloat16, "*bf16") if out_dtype == torch.bfloat16 else (gl.float32, "*fp32")
        sig = {
            "a_desc": desc_sig(torch.float8_e4m3fn, gl.float8e4nv, [64, 128]),
            "b_desc": desc_sig(torch.float8_e4m3fn, gl.float8e4nv, [bn, 128]),
            "c_desc": desc_sig(out_dtype, gl_out, [64, bn]),
            "as_ptr": "*fp32",
            "bs_ptr": "*fp32",
            "alpha_ptr": "*fp32",
            "bias_ptr": "*bf16",
            "out_ptr": ptr_out,
        }
        sig.update({n: "i32" for n in ("M", "N", "K", "stride_as0", "stride_as1", "stride_bs0", "stride_bs1",
                                       "stride_om")})
        consts = dict(B_ROWS_PER_SCALE=128, HAS_ALPHA=extras, HAS_BIAS=extras, BN=bn, STAGES=cfg["num_stages"],
                      GROUP_M=cfg["GROUP_M"], CONSUMERS=consumers, CONSUMER_REGS=240,
                      PRODUCER_REGS=24, TMA_STORE=tma_store)
        yield kws.fp8_block_mm_ws_kernel, sig, consts
