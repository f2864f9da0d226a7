"""Triton launcher for AutoAWQ INT4 dequantization, with the signature of
``lowbit.formats.int4_awq.dequantize_int4_awq``.

Bytes moved per element: 1/2 (qweight) + 2/g (scales) + 1/(2g) (qzeros) read, 4 (fp32) or 2 (bf16/fp16)
written. The [in, out/8] -> [out, in] transpose goes through shared memory as packed words (1/2 byte per
element each way); loads and stores are 16-byte vectors.
"""

from __future__ import annotations

import torch

from ..formats import int4_awq as ref
from ..formats.qtensor import QTensor
from . import _int4_awq as k
from . import cdiv
from . import interpreting as _interpreting
from ._launch import KernelCall, Launch, same_memory


# elements per program, widest column tile (powers of two) and warps: best of
# benchmarks/experiments/sweep_dequant_tile.py on an H200 (bf16 out, 8192^2 / 28672x8192: 3.20 / 3.52 TB/s
# against 3.14 / 3.34 for 8192 elements)
TILE = {"elems": 16384, "cols": 128, "warps": 4}

_OUT = {torch.float32: (0, torch.int32), torch.bfloat16: (1, torch.int16), torch.float16: (2, torch.int16)}


def _tiles(group_size: int, out_kind: int) -> tuple[int, int]:
    """(TI, TC): TI input channels per program, a power of two dividing the group size (one group per
    program), and TC packed word columns (8 TC outputs); TI * 8 TC elements per program. fp32 output
    takes half the elements and columns (the same bytes)."""
    half = 2 if out_kind == 0 else 1
    ti = min(TILE["cols"] // half, group_size & -group_size)
    tc = max(1, TILE["elems"] // half // (8 * ti))
    return ti, tc


def _rows_unit_stride(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself when its rows are contiguous (a column slice of a wider weight), else a contiguous copy."""
    return t if t.dim() == 2 and t.stride(1) == 1 and t.stride(0) >= t.shape[1] else t.contiguous()


def dequantize_int4_awq(q: QTensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``(q - z) * s`` rounded to fp16 as AutoAWQ computes it, returned as the logical ``[out, in]`` weight in
    ``dtype`` (float32, bfloat16, float16), bit-identical to the reference. CUDA tensors (CPU under
    ``TRITON_INTERPRET=1``)."""
    return dequantize_call(q, dtype)()


def dequantize_call(q: QTensor, dtype: torch.dtype) -> KernelCall:
    """The kernel call behind :func:`dequantize_int4_awq`, to launch again without argument binding."""
    out_features, in_features, group_size = ref.check_int4_awq(q)
    # the kernel's arithmetic is AutoAWQ's fp16 multiply; other scale dtypes decode in the torch reference
    ref.require_fp16_decode(q, "the triton int4_awq dequantize kernel")
    if dtype not in _OUT:
        raise TypeError(f"dtype must be float32, bfloat16 or float16, got {dtype}")
    out_kind, int_view = _OUT[dtype]
    call, args, copies = None, (None,), False
    if out_features * in_features:
        ti, tc = _tiles(group_size, out_kind)
        outw = out_features // 8
        nc = cdiv(outw, tc)
        qweight, qzeros, scales = (_rows_unit_stride(t) for t in (q.data, q.zeros, q.scale))
        call = Launch(k.dequantize_int4_awq_kernel, (nc * (in_features // ti),),
                        dict(GROUP=group_size, TI=ti, TC=tc, OUT_KIND=out_kind, ON_GPU=not _interpreting()),
                        TILE["warps"], enable_fp_fusion=False)
        args = (qweight, qzeros, scales, None, in_features, out_features, outw, nc, qweight.stride(0),
                qzeros.stride(0), scales.stride(0))
        copies = not same_memory((qweight, q.data), (qzeros, q.zeros), (scales, q.scale))
    return KernelCall(call, args, 3, (out_features, in_features), dtype, int_view, q.data.device, copies=copies)


def compile_variants():
    """(kernel, signature, constexprs) of every code path the launcher can start: each output dtype at
    group 128, and the tile shapes of the other group sizes (32, 64, in = 14336, an odd group)."""
    sig = {"qweight_ptr": "*i32", "qzeros_ptr": "*i32", "scales_ptr": "*fp16", "out_ptr": "*i16",
           "IN": "i32", "OUT": "i32", "OUTW": "i32", "NC": "i32", "QW_STRIDE": "i32", "QZ_STRIDE": "i32",
           "S_STRIDE": "i32"}
    cases = [(128, 0), (128, 1), (128, 2), (32, 2), (64, 1), (14336, 1), (96, 0), (3, 1)]
    for group_size, out_kind in cases:
        ti, tc = _tiles(group_size, out_kind)
        yield k.dequantize_int4_awq_kernel, dict(sig, out_ptr="*i32" if out_kind == 0 else "*i16"), {
            "GROUP": group_size, "TI": ti, "TC": tc, "OUT_KIND": out_kind, "ON_GPU": True}
