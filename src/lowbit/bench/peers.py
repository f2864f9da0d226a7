"""Other libraries' kernels a user would pick instead of lowbit, built on the same bf16 weights: the peer
baselines of the matmul ops.

- W4A16: bitsandbytes ``matmul_4bit`` (NF4, blocksize 64), gemlite's Triton GEMV/GEMM (INT4 asymmetric group
  128, and MXFP4), torchao's int4 weight-only layer (group 128, ``tile_packed_to_4d``), humming-kernels'
  ``HummingLayer`` (NVFP4, MXFP4, INT4 group 128 with zero points);
- FP8 block-scaled GEMM (DeepSeek-V3 W8A8): DeepGEMM's ``fp8_gemm_nt``.

Each builder takes one bf16 weight per rotated copy and returns one callable ``f(x) -> y`` per copy, after
one trial call; it raises ImportError when the package is missing and anything else when the peer cannot run
here. The ops wrap them in :func:`lowbit.bench.common.optional`, so a missing or failing peer becomes a
baseline skipped with its reason, never a failed run.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

Fn = Callable[[torch.Tensor], Any]


def _tried(fns: list[Fn], x: torch.Tensor | None) -> list[Fn]:
    if x is not None:
        fns[0](x)  # a peer that cannot run these shapes or this device says so at setup, not in the timing
    return fns


def bnb_nf4(weights: Sequence[torch.Tensor], double_quant: bool = False, x: torch.Tensor | None = None) -> list[Fn]:
    """bitsandbytes ``matmul_4bit`` on NF4 weights, blocksize 64 (``compress_statistics``: double quant)."""
    import bitsandbytes as bnb
    import bitsandbytes.functional as bnbf

    packed = [bnbf.quantize_4bit(w, blocksize=64, quant_type="nf4", compress_statistics=double_quant)
              for w in weights]
    return _tried([lambda x, p=p: bnb.matmul_4bit(x, p[0].t(), quant_state=p[1]) for p in packed], x)


def int4_minmax(w: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric min/max INT4 of ``w`` per ``group`` columns: (codes uint8 [N, K], scales, zeros [N, K/group])
    with ``w ~ (codes - zeros) * scales``, the layout gemlite's ``A16Wn.from_weights`` takes."""
    n, k = w.shape
    g = w.float().view(n, k // group, group)
    lo, hi = g.amin(-1), g.amax(-1)
    scale = ((hi - lo) / 15).clamp_min(1e-8)
    zero = (-lo / scale).round()
    codes = (g / scale[..., None] + zero[..., None]).round().clamp(0, 15).to(torch.uint8).view(n, k)
    return codes, scale, zero


def gemlite(weights: Sequence[torch.Tensor], kind: str, x: torch.Tensor | None = None) -> list[Fn]:
    """gemlite layers for ``kind`` in {"int4", "mxfp4"} (bf16 in and out)."""
    import importlib

    importlib.import_module("gemlite")  # loads the shipped per-GPU kernel configs
    from gemlite.helper import A16W4_MXFP, A16Wn

    layers = []
    for w in weights:
        if kind == "int4":
            codes, scale, zero = int4_minmax(w, 128)
            layer = A16Wn(device=str(w.device), dtype=torch.bfloat16).from_weights(
                codes, scale.to(torch.bfloat16), zero.to(torch.bfloat16), 4, 128
            )
        elif kind == "mxfp4":
            lin = torch.nn.Linear(w.shape[1], w.shape[0], bias=False, device=w.device, dtype=w.dtype)
            lin.weight.data.copy_(w)
            layer = A16W4_MXFP(device=str(w.device), dtype=torch.bfloat16).from_linear(lin)
        else:
            raise ValueError(f"kind must be 'int4' or 'mxfp4', got {kind!r}")
        layers.append(layer)
    return _tried([lambda x, layer=layer: layer(x) for layer in layers], x)


def torchao_int4(weights: Sequence[torch.Tensor], x: torch.Tensor | None = None) -> list[Fn]:
    """torchao ``Int4WeightOnlyConfig(group_size=128, int4_packing_format="tile_packed_to_4d")`` on an
    ``nn.Linear`` per weight (what ``lowbit e2e``'s ``torchao:int4`` config uses)."""
    from torchao.quantization import Int4WeightOnlyConfig, quantize_

    layers = []
    for w in weights:
        lin = torch.nn.Linear(w.shape[1], w.shape[0], bias=False, device=w.device, dtype=w.dtype)
        with torch.no_grad():
            lin.weight.copy_(w)
        quantize_(lin, Int4WeightOnlyConfig(group_size=128, int4_packing_format="tile_packed_to_4d"))
        layers.append(lin)
    return _tried([lambda x, layer=layer: layer(x) for layer in layers], x)


HUMMING_WEIGHTS = {
    # lowbit format -> humming weight schema of the same format (its own quantization of the bf16 weight)
    "nvfp4": {"b_dtype": "float4e2m1", "bs_dtype": "float8e4m3", "group_size": 16, "scale_2_type": "tensor"},
    "mxfp4": {"b_dtype": "float4e2m1", "bs_dtype": "float8e8m0", "group_size": 32},
    "int4_awq": {"b_dtype": "uint4", "group_size": 128, "has_zero_point": True},
}


def humming(weights: Sequence[torch.Tensor], fmt: str, x: torch.Tensor | None = None) -> list[Fn]:
    """humming-kernels' ``HummingLayer`` per weight in the format of :data:`HUMMING_WEIGHTS` (bf16 in and
    out): quantized by humming from the bf16 weight, transformed to its kernel layout, then called."""
    from humming.layer import HummingLayer

    layers = []
    for w in weights:
        n, k = w.shape
        layer = HummingLayer(shape_n=n, shape_k=k, weight_config=dict(HUMMING_WEIGHTS[fmt]),
                             torch_dtype=torch.bfloat16).to(w.device)
        layer.load_from_unquantized(w)
        layer.transform()
        layers.append(layer)
    return _tried([lambda x, layer=layer: layer(x) for layer in layers], x)


def deep_gemm_fp8(a: Any, weights: Sequence[Any]) -> list[Callable[[], Any]]:
    """DeepGEMM's FP8 GEMM on lowbit fp8_block operands (activation block (1, 128), weight (128, 128), fp32
    scales): ``fp8_gemm_nt`` (current releases, which lay the scales out themselves), else the older
    ``gemm_fp8_fp8_bf16_nt`` with the activation scales made column-major and TMA-aligned."""
    import deep_gemm

    m, n = a.shape[0], weights[0].shape[0]
    out = torch.empty((m, n), dtype=torch.bfloat16, device=a.data.device)
    fn = getattr(deep_gemm, "fp8_gemm_nt", None)
    a_scale = a.scale
    if fn is None:
        fn = deep_gemm.gemm_fp8_fp8_bf16_nt
        a_scale = deep_gemm.get_col_major_tma_aligned_tensor(a.scale)
    fns = [lambda w=w: fn((a.data, a_scale), (w.data, w.scale), out) for w in weights]
    fns[0]()
    return fns


def scaled_mm_fp8(x: torch.Tensor, weights: Sequence[torch.Tensor]) -> list[Callable[[], Any]]:
    """``torch._scaled_mm`` on E4M3 casts of ``x`` and each weight with per-tensor scales of 1 (cuBLASLt's FP8
    GEMM: the fastest FP8 product torch offers, with the simplest scaling)."""
    x8 = x.to(torch.float8_e4m3fn)
    one = torch.ones((), device=x.device)
    w8s = [w.to(torch.float8_e4m3fn) for w in weights]
    fns = [lambda w8=w8: torch._scaled_mm(x8, w8.T, scale_a=one, scale_b=one, out_dtype=torch.bfloat16)
           for w8 in w8s]
    fns[0]()
    return fns
