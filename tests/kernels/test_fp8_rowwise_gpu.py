"""The fp8_rowwise quantize kernel is bit-identical to the CPU reference (codes and scale bits)."""

import pytest
import torch

import lowbit
from lowbit.formats import fp8_rowwise as ref
from lowbit.testing import assert_bitexact

pytestmark = pytest.mark.gpu


def _adversarial(rows: int, k: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=g) * torch.logspace(-8, 8, rows)[:, None]
    if rows >= 8:
        x[0] = 0.0                                       # all-zero row: MIN_SCALE
        x[1] = -0.0
        x[2, ::2] = 448.0                                # amax 448: s = 1, +-max codes
        x[2, 1::2] = -448.0
        x[3] = torch.tensor([1.0, 0.5, 0.25, 1.5 + 2**-4, 3.25, 0.0078125, 1e-9, 2.0**-9] * (k // 8 + 1))[:k]
        x[4, k // 2] = float("nan")
        x[5, 0] = float("inf")
        x[6, -1] = -float("inf")
        x[7] = 1e-30                                     # tiny row: s = MIN_SCALE, codes from x / MIN_SCALE
    return x.to(dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("rows, k", [(1, 7), (9, 1000), (33, 4096), (300, 7168), (5, 20000)])
def test_quantize_fp8_rowwise_bit_exact(rows, k, dtype):
    x = _adversarial(rows, k, dtype, seed=rows * 7 + k)
    got = lowbit.quantize(x.cuda(), "fp8_rowwise", backend="triton")
    want = ref.quantize_fp8_rowwise(x)
    assert got.scale.shape == want.scale.shape and got.data.shape == want.data.shape
    assert_bitexact(got.data.view(torch.uint8).cpu(), want.data.view(torch.uint8), "E4M3 codes")
    assert_bitexact(got.scale.view(torch.int32).cpu(), want.scale.view(torch.int32), "scale bits")


def test_quantize_fp8_rowwise_leading_dims_and_strides():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(3, 5, 2 * 640, generator=g).to(torch.bfloat16)
    view = x.cuda()[:, :, ::2]                          # last dim not contiguous
    got = lowbit.quantize(view, "fp8_rowwise", backend="triton")
    want = ref.quantize_fp8_rowwise(x[:, :, ::2])
    assert got.shape == (3, 5, 640) and got.scale.shape == (3, 5, 1)
    assert_bitexact(got.data.view(torch.uint8).cpu(), want.data.view(torch.uint8), "E4M3 codes")
    assert_bitexact(got.scale.view(torch.int32).cpu(), want.scale.view(torch.int32), "scale bits")
    empty = lowbit.quantize(torch.empty(0, 64, device="cuda"), "fp8_rowwise", backend="triton")
    assert empty.data.shape == (0, 64) and empty.scale.shape == (0, 1)
