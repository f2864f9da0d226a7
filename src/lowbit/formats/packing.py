"""Bit packing of sub-byte codes and the 128x4 swizzled scale layout.

- FP4 / E2M1 (NVFP4, MXFP4, fp4_b32): two codes per byte along the last dim, element ``2i`` in the LOW
  nibble (torchao ``pack_uint4``, vLLM/FlashInfer/LightX2V PTX order, compressed-tensors, torch
  ``float4_e2m1fn_x2``).
- NF4 / bnb FP4: element ``2i`` in the HIGH nibble (bitsandbytes), over the flattened tensor.
- FP6: four codes in three bytes, a little-endian 6-bit stream (LightX2V, compressed-tensors):
  codes ``01 02 03 3F`` -> bytes ``81 30 FC``.
- Scales: 128x4 tiles ``[ceil(rows/128), ceil(cols/4), 32, 4, 4]`` (CUTLASS / cuBLAS block-scaled layout).
"""

from __future__ import annotations

import torch


def _check_last_dim(codes: torch.Tensor, multiple: int, what: str) -> None:
    if codes.dtype != torch.uint8:
        raise TypeError(f"{what}: codes must be uint8, got {codes.dtype}")
    if codes.dim() == 0 or codes.shape[-1] % multiple:
        raise ValueError(f"{what}: last dim must be a multiple of {multiple}, got shape {tuple(codes.shape)}")


def pack_fp4(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes ``[..., K]`` (low 4 bits used) -> bytes ``[..., K/2]``, element 2i in the low nibble."""
    _check_last_dim(codes, 2, "pack_fp4")
    c = codes & 0xF
    return c[..., 0::2] | (c[..., 1::2] << 4)


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack_fp4`: bytes ``[..., K/2]`` -> codes ``[..., K]``."""
    _check_last_dim(packed, 1, "unpack_fp4")
    lo = packed & 0xF
    hi = packed >> 4
    return torch.stack([lo, hi], dim=-1).flatten(-2)


def pack_nibbles_high_first(codes: torch.Tensor) -> torch.Tensor:
    """bitsandbytes order: flat codes ``[n]`` -> bytes ``[ceil(n/2)]``, element 2i in the HIGH nibble.

    An odd tail is padded with code 0 in the low nibble, as bitsandbytes does.
    """
    if codes.dtype != torch.uint8:
        raise TypeError(f"pack_nibbles_high_first: codes must be uint8, got {codes.dtype}")
    c = codes.reshape(-1) & 0xF
    if c.numel() % 2:
        c = torch.cat([c, c.new_zeros(1)])
    return (c[0::2] << 4) | c[1::2]


def unpack_nibbles_high_first(packed: torch.Tensor, n: int) -> torch.Tensor:
    """Inverse of :func:`pack_nibbles_high_first`, returning the first ``n`` codes."""
    p = packed.reshape(-1)
    return torch.stack([p >> 4, p & 0xF], dim=-1).reshape(-1)[:n]


def pack_fp6(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes ``[..., K]`` (low 6 bits used, K % 4 == 0) -> bytes ``[..., 3K/4]``.

    Codes a, b, c, d form the 24-bit little-endian word ``a | b<<6 | c<<12 | d<<18``.
    """
    _check_last_dim(codes, 4, "pack_fp6")
    c = (codes & 0x3F).reshape(*codes.shape[:-1], codes.shape[-1] // 4, 4).to(torch.int32)
    word = c[..., 0] | (c[..., 1] << 6) | (c[..., 2] << 12) | (c[..., 3] << 18)
    out = torch.stack([word & 0xFF, (word >> 8) & 0xFF, (word >> 16) & 0xFF], dim=-1)
    return out.to(torch.uint8).flatten(-2)


def unpack_fp6(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack_fp6`: bytes ``[..., 3K/4]`` -> codes ``[..., K]``."""
    _check_last_dim(packed, 3, "unpack_fp6")
    b = packed.reshape(*packed.shape[:-1], packed.shape[-1] // 3, 3).to(torch.int32)
    word = b[..., 0] | (b[..., 1] << 8) | (b[..., 2] << 16)
    out = torch.stack([(word >> s) & 0x3F for s in (0, 6, 12, 18)], dim=-1)
    return out.to(torch.uint8).flatten(-2)


def swizzled_scale_shape(rows: int, cols: int) -> tuple[int, int]:
    """2-D shape ``[round_up(rows, 128), round_up(cols, 4)]`` of a 128x4-swizzled scale tensor."""
    return (-(-rows // 128) * 128, -(-cols // 4) * 4)


def swizzle_scales(scale: torch.Tensor) -> torch.Tensor:
    """Linear scales ``[rows, cols]`` -> 128x4-swizzled ``[round_up(rows,128), round_up(cols,4)]``.

    Byte ``(r, k)`` lands at flat offset
    ``((r//128)*ceil(cols/4) + k//4)*512 + (r%32)*16 + ((r//32)%4)*4 + k%4``; padding is zero bytes.
    Works for any 1-byte scale dtype (float8_e4m3fn, float8_e8m0fnu, uint8).
    """
    if scale.dim() != 2:
        raise ValueError(f"swizzle_scales: scale must be 2-D [rows, cols], got shape {tuple(scale.shape)}")
    if scale.element_size() != 1:
        raise TypeError(f"swizzle_scales: scale must have a 1-byte dtype, got {scale.dtype}")
    rows, cols = scale.shape
    prow, pcol = swizzled_scale_shape(rows, cols)
    raw = scale.contiguous().view(torch.uint8)
    padded = raw.new_zeros(prow, pcol)
    padded[:rows, :cols] = raw
    tiles = padded.view(prow // 128, 4, 32, pcol // 4, 4).permute(0, 3, 2, 1, 4)
    return tiles.contiguous().view(prow, pcol).view(scale.dtype)


def unswizzle_scales(swizzled: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """Inverse of :func:`swizzle_scales`: returns the linear ``[rows, cols]`` scales."""
    prow, pcol = swizzled_scale_shape(rows, cols)
    if swizzled.numel() != prow * pcol:
        raise ValueError(
            f"unswizzle_scales: swizzled has {swizzled.numel()} elements, expected {prow}*{pcol} "
            f"for rows={rows}, cols={cols}"
        )
    if swizzled.element_size() != 1:
        raise TypeError(f"unswizzle_scales: swizzled must have a 1-byte dtype, got {swizzled.dtype}")
    raw = swizzled.contiguous().view(torch.uint8).reshape(prow // 128, pcol // 4, 32, 4, 4)
    linear = raw.permute(0, 3, 2, 1, 4).reshape(prow, pcol)
    return linear[:rows, :cols].contiguous().view(swizzled.dtype)
