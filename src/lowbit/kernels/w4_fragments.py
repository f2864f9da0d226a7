"""The packed 4-bit weight laid out as wgmma register fragments: each thread of a warpgroup loads, with one
16-byte load per K step, exactly the codes of its part of the A operand (``DotOperandLayout(0, k_width=2)`` of a
``m64nNk16`` wgmma) for a 64-row x 64-column tile, nibbles ordered so that two codes 16 bits apart decode into
one bf16x2 / f16x2 register (``_gemm_w4_rf``). Pure PyTorch: the layout is made once per weight on its device.

Within a 64 x 64 tile, row ``r = 16 w + 8 h + l`` and column ``k = 16 c + 8 g + 2 q + j`` (w: warp, l = lane / 4,
q = lane % 4, c: the 16-wide K chunk, h, g, j in {0, 1}). Thread (w, l, q) holds one int32 word per chunk c; the
word's nibble ``h + 2 g + 4 j`` is the code at (r, k): the A fragment register ``h + 2 g`` (rows r and r + 8,
columns k and k + 8) takes its low half from nibble ``h + 2 g`` and its high half from the nibble 16 bits up.
Words are stored ``[N / 64 tiles][K / 64 steps][w 4][l 8][q 4][c 4]``: a warpgroup's 512 words of a step are
contiguous, each thread's four are one 16-byte vector. N and K are padded to 64 with zero codes.
"""

from __future__ import annotations

import torch

TILE = 64
"""Rows and columns of one fragment tile (one warpgroup's wgmma M, one K step)."""


def fragment_words(codes: torch.Tensor, k_dim: int) -> torch.Tensor:
    """``codes``: uint8 [N, K / 2] with element 2i in the low nibble of byte i (the nvfp4 / mxfp4 ``data``, or
    int4's re-laid codes); ``k_dim``: K. Returns int32 [ceil(N / 64), ceil(K / 64), 512], the layout above."""
    if codes.dtype != torch.uint8 or codes.dim() != 2 or codes.shape[1] * 2 != k_dim:
        raise ValueError(f"fragment_words: codes must be uint8 [N, K / 2] with K = {k_dim}, got "
                         f"{codes.dtype} {tuple(codes.shape)}")
    n = codes.shape[0]
    nt, ks = -(-n // TILE), -(-k_dim // TILE)
    nib = torch.zeros(nt * TILE, ks * TILE, dtype=torch.uint8, device=codes.device)
    nib[:n, 0:k_dim:2] = codes & 15
    nib[:n, 1:k_dim:2] = codes >> 4
    # rows (w, h, l), columns (c, g, q, j)
    t = nib.view(nt, 4, 2, 8, ks, 4, 2, 4, 2)
    # -> [nt, ks, w, l, q, c, j, g, h]: byte (j, g) holds nibbles h = 0 (low) and h = 1 (high)
    t = t.permute(0, 4, 1, 3, 7, 5, 8, 6, 2)
    byte = t[..., 0] | (t[..., 1] << 4)
    return byte.reshape(nt, ks, TILE * TILE // 8, 4).contiguous().view(torch.int32).view(nt, ks, TILE * TILE // 8)


def fragment_codes(words: torch.Tensor, n: int, k_dim: int) -> torch.Tensor:
    """The inverse of :func:`fragment_words` (tests): uint8 [N, K / 2] codes from the fragment words."""
    nt, ks = words.shape[0], words.shape[1]
    byte = words.contiguous().view(torch.uint8).view(nt, ks, 4, 8, 4, 4, 2, 2)  # ..., j, g
    t = torch.stack((byte & 15, byte >> 4), dim=-1)                                # ..., j, g, h
    t = t.permute(0, 2, 8, 3, 1, 5, 7, 4, 6)                                        # nt, w, h, l, ks, c, g, q, j
    nib = t.reshape(nt * TILE, ks * TILE)[:n, :k_dim]
    return (nib[:, 0::2] | (nib[:, 1::2] << 4)).contiguous()


__all__ = ["TILE", "fragment_codes", "fragment_words"]
