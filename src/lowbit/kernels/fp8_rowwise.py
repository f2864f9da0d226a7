"""Triton launcher for fp8_rowwise quantization (per-token FP8, vLLM's dynamic per-token scaling), bit for bit
equal to ``lowbit.formats.fp8_rowwise.quantize_fp8_rowwise``: the scaled_mm W4A8 entry quantizes its bf16
activation with it on every call. The kernel (``_fp8_block.quantize_rowwise_kernel``) shares the fp8_block
kernels' exact division and E4M3 encoding.
"""

from __future__ import annotations

import torch

from ..formats import fp8_rowwise as ref
from ..formats.qtensor import QTensor
from . import _fp8_block as k
from . import cdiv
from ._launch import launch


MIN_SCALE_BITS = int(torch.tensor(ref.MIN_SCALE, dtype=torch.float32).view(torch.int32).item())
BLOCK_M = 4
BLOCK_K = 1024
NUM_WARPS = 4
_IN_SIG = {torch.float32: "*fp32", torch.bfloat16: "*bf16", torch.float16: "*fp16"}


def quantize_fp8_rowwise(x: torch.Tensor) -> QTensor:
    """``lowbit.formats.fp8_rowwise.quantize_fp8_rowwise`` on a CUDA tensor (any leading dims and strides;
    a last dim that is not contiguous is copied once)."""
    ref.check_input(x)
    kdim = x.shape[-1]
    rows = x.shape[:-1].numel()
    x2 = x.detach()
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    x2 = x2.reshape(rows, kdim)  # a view when the leading dims merge, else a copy
    data = torch.empty(x.shape, dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty(*x.shape[:-1], 1, dtype=torch.float32, device=x.device)
    if rows:
        launch(k.quantize_rowwise_kernel, (cdiv(rows, BLOCK_M),), (
                x2, data, scale, rows, kdim, x2.stride(0) if rows > 1 else kdim,
            ),
            MIN_SCALE_BITS=MIN_SCALE_BITS, BLOCK_M=BLOCK_M, BLOCK_K=BLOCK_K, num_warps=NUM_WARPS,
        )
    return QTensor(data=data, scale=scale, fmt="fp8_rowwise", shape=x.shape, dtype=x.dtype,
                   scale_layout="linear", params={})


def compile_variants():
    sig = {"q_ptr": "*fp8e4nv", "s_ptr": "*fp32", "M": "i32", "K": "i32", "stride_xm": "i64"}
    for xs in _IN_SIG.values():
        yield (k.quantize_rowwise_kernel, {**sig, "x_ptr": xs},
               {"MIN_SCALE_BITS": MIN_SCALE_BITS, "BLOCK_M": BLOCK_M, "BLOCK_K": BLOCK_K})
