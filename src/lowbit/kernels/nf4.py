"""Triton launcher for NF4 dequantization, with the signature of ``lowbit.formats.nf4.dequantize_nf4``; bnb_fp4
(bitsandbytes' other 4-bit type, the same layout) runs the same kernel with its own table
(:func:`dequantize_bnb_fp4`).

Bytes moved per element: n/2 packed + 4n/blocksize absmax (or n/blocksize codes + 4n/(256 blocksize)
nested absmax with double quantization) read, 4 (fp32) or 2 (bf16/fp16) written. One pass, no host sync.

NaN bits follow the reference as it runs on an x86 host with vectorized ATen kernels (see ``_nf4``): the
default NaN of ``0 * inf`` is 0xFFC00000 there (an aarch64 host would give 0x7FC00000) and fp16 NaN keeps
its payload as F16C does.
"""

from __future__ import annotations

import functools

import torch

from ..formats import nf4 as ref
from ..formats.codecs import codebook_table
from ..formats.qtensor import QTensor
from . import _nf4 as k
from . import cdiv
from . import interpreting as _interpreting
from ._launch import KernelCall, Launch, same_memory


# elements per program (power of two) and warps: best of benchmarks/experiments/sweep_dequant_tile.py on an
# H200 (bf16 out, 8192^2 / 28672x8192: 3.10 / 3.39 TB/s against 2.91 / 3.17 for 4096 elements)
TILE = {"elems": 8192, "warps": 4}

_OUT = {torch.float32: (0, torch.int32, 4), torch.bfloat16: (1, torch.int16, 8), torch.float16: (2, torch.int16, 8)}


@functools.lru_cache(maxsize=16)
def _tables(device: torch.device, fmt: str = "nf4") -> tuple[torch.Tensor, torch.Tensor]:
    """(the format's 16 levels fp32 [16] (NF4 or bnb FP4), bitsandbytes dynamic map fp32 [256]) on ``device``,
    the reference's values."""
    return codebook_table(ref.BNB_4BIT_FORMATS[fmt]).to(device), ref.dynamic_map(device)


def _aligned_bytes(data: torch.Tensor) -> torch.Tensor:
    flat = data.reshape(-1)
    # the kernel loads the packed bytes as 2- or 4-byte words
    if not flat.is_contiguous() or flat.data_ptr() % 16:
        flat = flat.clone(memory_format=torch.contiguous_format)
    return flat


def dequantize_nf4(q: QTensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Decode an nf4 QTensor on its device (CUDA; CPU under ``TRITON_INTERPRET=1``), bit-identical to
    ``lowbit.formats.nf4.dequantize_nf4``: ``NF4[code] * absmax[block]`` in fp32, the absmax decoded
    in-kernel from double quantization as ``fp32(dmap[code] * nested[block // 256]) + offset``, then
    converted to ``dtype`` (float32, bfloat16 by bitsandbytes' bit trick, float16).

    Returns:
        ``dtype`` tensor of shape ``q.shape``.
    """
    return dequantize_call(q, dtype)()


def dequantize_bnb_fp4(q: QTensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Decode a bnb_fp4 QTensor on its device, bit-identical to ``lowbit.formats.bnb_fp4.dequantize_bnb_fp4``:
    the kernel of :func:`dequantize_nf4` reading bitsandbytes' FP4 table instead of NF4's."""
    if not isinstance(q, QTensor) or q.fmt != "bnb_fp4":
        raise ValueError(f"q must be a bnb_fp4 QTensor, got {getattr(q, 'fmt', type(q).__name__)!r}")
    return dequantize_call(q, dtype)()


def dequantize_call(q: QTensor, dtype: torch.dtype) -> KernelCall:
    """The kernel call behind :func:`dequantize_nf4` / :func:`dequantize_bnb_fp4` (the table by ``q.fmt``), to
    launch again without argument binding."""
    n, blocksize, double_quant = ref.check_bnb4_qtensor(q)
    if dtype not in _OUT:
        raise TypeError(f"dtype must be float32, bfloat16 or float16, got {dtype}")
    device = q.data.device
    out_kind, int_view, vec = _OUT[dtype]
    call, args, copies = None, (None,), False
    if n:
        lut, dmap = _tables(device, q.fmt)
        data = _aligned_bytes(q.data)
        scale = q.scale.reshape(-1).contiguous()
        if double_quant:
            nested = q.nested_scale.reshape(-1).contiguous()
            offset = q.nested_offset.reshape(1).to(device=device, dtype=torch.float32)
        else:
            nested = offset = scale
        block = TILE["elems"]
        call = Launch(k.dequantize_nf4_kernel, (cdiv(n, block),),
                        dict(BLOCKSIZE=blocksize, BLOCK=block, V=vec, DOUBLE_QUANT=double_quant, OUT_KIND=out_kind,
                             ON_GPU=not _interpreting()), TILE["warps"], enable_fp_fusion=False)
        args = (data, scale, nested, offset, lut, dmap, None, n)
        pairs = [(data, q.data), (scale, q.scale)]
        if double_quant:
            pairs += [(nested, q.nested_scale), (offset, q.nested_offset)]
        copies = not same_memory(*pairs)
    return KernelCall(call, args, 6, (n,), dtype, int_view, device, q.shape, copies)


def compile_variants():
    """(kernel, signature, constexprs) of every code path the launcher can start."""
    for double_quant in (False, True):
        for out_kind in (0, 1, 2):
            blocksizes = ref.BLOCKSIZES if (double_quant and out_kind == 1) else (64,)
            for blocksize in blocksizes:
                for n_type in (("i32", "i64") if blocksize == 64 else ("i32",)):
                    sig = {"data_ptr": "*u8", "absmax_ptr": "*u8" if double_quant else "*fp32",
                           "nested_ptr": "*fp32", "offset_ptr": "*fp32", "lut_ptr": "*fp32", "dmap_ptr": "*fp32",
                           "out_ptr": "*i32" if out_kind == 0 else "*i16", "n": n_type}
                    yield k.dequantize_nf4_kernel, sig, {
                        "BLOCKSIZE": blocksize, "BLOCK": TILE["elems"], "V": 4 if out_kind == 0 else 8,
                        "DOUBLE_QUANT": double_quant, "OUT_KIND": out_kind, "ON_GPU": True}
