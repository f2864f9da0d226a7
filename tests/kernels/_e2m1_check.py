"""Test kernels shared by the interpreter and GPU tests: the quantize kernel's E2M1 rounding to a value
(``_e2m1_rounded``) beside the code path it replaces (encode, then decode), and the dequantize kernel's E2M1
decoding (``_e2m1_decoded``) beside ``decode_minifloat``, element by element."""

import torch
import triton
import triton.language as tl

from lowbit.kernels._blockscaled import _e2m1_decoded, _e2m1_rounded, _encode_minifloat
from lowbit.kernels.device import decode_minifloat


@triton.jit
def e2m1_paths_kernel(x_ptr, got_ptr, want_ptr, n, NAN_FIXUP: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < n
    x = tl.load(x_ptr + offs, mask=ok, other=0).to(tl.float32, bitcast=True)
    tl.store(got_ptr + offs, _e2m1_rounded(x, NAN_FIXUP).to(tl.int32, bitcast=True), mask=ok)
    want = decode_minifloat(_encode_minifloat(x, 2, 1, 1, 6.0, NAN_FIXUP), 2, 1, 1)
    tl.store(want_ptr + offs, want.to(tl.int32, bitcast=True), mask=ok)


def adversarial_fp32_bits(n_random: int, seed: int = 0) -> torch.Tensor:
    """int32 fp32 patterns: every bf16 value (all exponents, +-0, subnormals, +-Inf, NaNs), the E2M1 codes and
    the midpoints between them with 8 neighbours each way, and ``n_random`` random patterns."""
    every_bf16 = (torch.arange(65536, dtype=torch.int32) << 16)
    points = torch.tensor([0.0, 0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 3.5, 4.0, 5.0, 6.0, 7.0, 8.0])
    near = points.view(torch.int32)[:, None] + torch.arange(-8, 9, dtype=torch.int32)[None, :]
    near = near[near >= 0]
    near = torch.cat([near, near | torch.tensor(-0x80000000, dtype=torch.int32)])
    g = torch.Generator().manual_seed(seed)
    rand = torch.randint(-2**31, 2**31 - 1, (n_random,), generator=g, dtype=torch.int64).to(torch.int32)
    nans = torch.tensor([0x7FC00000, 0x7F800001, 0x7FFFFFFF, -0x00400000, -0x00000001], dtype=torch.int32)
    return torch.cat([every_bf16, near, rand, nans])


def run_e2m1_paths(bits: torch.Tensor, nan_fixup: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(lean, encode-then-decode) fp32 results as int32 bits for the fp32 patterns ``bits``."""
    got, want = torch.empty_like(bits), torch.empty_like(bits)
    block = 1024
    e2m1_paths_kernel[(triton.cdiv(bits.numel(), block),)](bits, got, want, bits.numel(), NAN_FIXUP=nan_fixup,
                                                          BLOCK=block)
    return got, want


@triton.jit
def e2m1_decode_paths_kernel(code_ptr, got_ptr, want_ptr, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    code = tl.load(code_ptr + offs)
    tl.store(got_ptr + offs, _e2m1_decoded(code).to(tl.int32, bitcast=True))
    tl.store(want_ptr + offs, decode_minifloat(code, 2, 1, 1).to(tl.int32, bitcast=True))


def run_e2m1_decode_paths(device: str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """(lean, ``decode_minifloat``) fp32 bits of the 16 E2M1 codes."""
    codes = torch.arange(16, dtype=torch.int32, device=device)
    got, want = torch.empty_like(codes), torch.empty_like(codes)
    e2m1_decode_paths_kernel[(1,)](codes, got, want, BLOCK=16)
    return got, want
