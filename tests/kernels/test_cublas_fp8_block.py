"""The host side of lowbit.kernels.cublas_fp8_block on CPU: which GEMMs it can take, the M from which the policy
routes fp8_block pairs to it, and the scale layouts it hands to cuBLASLt (the GEMM itself runs in
tests/ops/test_scaled_mm_gpu.py on the H100)."""

import pytest
import torch

from lowbit.kernels import cublas_fp8_block as cb
from lowbit.ops import policy

CPU = torch.device("cpu")


def _route(m=4096, n=7168, k=2048, aligned=True, bias=None, out_dtype=torch.bfloat16, device=CPU):
    return cb.unsupported(m, n, k, device, aligned, bias, out_dtype)


@pytest.mark.parametrize(
    "kwargs, reason",
    [
        ({"n": 2120 + 4}, "multiples of 16"),
        ({"k": 2000 + 8}, "multiples of 16"),
        ({"aligned": False}, "16-byte aligned"),
        ({"bias": torch.zeros(7168, dtype=torch.float32)}, "bias only of the output's dtype"),
        ({"bias": torch.zeros(7168, dtype=torch.float16)}, "bias only of the output's dtype"),
        ({"bias": torch.zeros(7168, dtype=torch.float32), "out_dtype": torch.float32}, "bf16/fp16 output"),
        ({}, "not on CUDA"),
        ({"bias": torch.zeros(7168, dtype=torch.bfloat16)}, "not on CUDA"),
    ],
)
def test_route_reasons(kwargs, reason):
    assert reason in _route(**kwargs)


def test_policy_routes_decode_to_lowbits_kernel():
    import lowbit

    a = lowbit.quantize(torch.randn(64, 256), "fp8_block")
    b = lowbit.quantize(torch.randn(128, 256), "fp8_block", block=(128, 128))
    capable = type("M", (), {"gemv_unsupported": lambda *x: "no", "fold_unsupported": lambda *x: "no",
                             "cublas_unsupported": lambda *x: None})
    assert policy.CUBLAS_FP8_BLOCK_MIN_M == 65
    assert policy.scaled_route(a, b, None, torch.bfloat16, capable) == "kernel"  # M = 64
    a68 = lowbit.quantize(torch.randn(68, 256), "fp8_block")
    assert policy.scaled_route(a68, b, None, torch.bfloat16, capable) == "cublas"


def test_route_can_be_switched_off(monkeypatch):
    monkeypatch.setenv(cb.ENV, "0")
    assert _route() == f"${cb.ENV}=0"


def test_aligned():
    x = torch.zeros(64, 256, dtype=torch.uint8)
    assert cb.aligned(x) and not cb.aligned(x[:, 8:]) and not cb.aligned(x[:, :200].t())
    assert not cb.aligned(torch.zeros(64, 264, dtype=torch.uint8)[:, :256][1:])


def test_any_m_is_taken():
    """M not a multiple of 4 is padded by mm (cuBLAS's rule), so the route takes it."""
    assert _route(m=4094) == "not on CUDA" and _route(m=8190) == "not on CUDA"


def test_activation_scales_padded_rows_are_zero():
    s = torch.rand(6, 3) + 0.5
    sa = cb.activation_scales(s, 6, 3, torch.tensor([2.0]), rows=8)
    assert sa.shape == (8, 3) and sa.stride() == (1, 8)
    assert torch.equal(sa[:6], s * 2) and torch.equal(sa[6:], torch.zeros(2, 3))


@pytest.mark.parametrize("m, kb", [(128, 16), (4100, 3), (68, 1)])
def test_activation_scales_are_m_major_and_carry_alpha(m, kb):
    g = torch.Generator().manual_seed(m)
    s = torch.rand(m, kb, generator=g) + 0.5
    sa = cb.activation_scales(s, m, kb, None)
    assert sa.stride() == (1, m) and torch.equal(sa, s)
    alpha = torch.tensor([0.375])
    sa = cb.activation_scales(s, m, kb, alpha)
    assert sa.stride() == (1, m) and torch.equal(sa, s * alpha)
    assert s.stride() == (kb, 1)  # the caller's scales are untouched
    col = s.t().contiguous().t()  # the column_major layout: used as it is (K/128 = 1 has strides (1, 1))
    assert (cb.activation_scales(col, m, kb, None) is col) == (kb > 1)
    rowwise = torch.rand(m, 1, generator=g)
    sa = cb.activation_scales(rowwise, m, kb, alpha)
    assert sa.stride() == (1, m) and torch.equal(sa, (rowwise * alpha).expand(m, kb))


@pytest.mark.parametrize("nb, kb", [(56, 16), (17, 11), (3, 1)])
def test_weight_scales_padded_to_four_k_tiles(nb, kb):
    s = torch.rand(nb, kb) + 0.5
    k4 = -(-kb // 4) * 4
    sb = cb.weight_scales(s)
    assert sb.shape == (k4, nb) and sb.stride() == (1, k4)
    assert torch.equal(sb[:kb].t(), s) and not sb[kb:].any()
    if k4 == kb:
        assert sb.data_ptr() == s.data_ptr()
    padded = torch.zeros(nb, k4)
    padded[:, :kb] = s
    view = padded[:, :kb]
    sb = cb.weight_scales(view, zero_padded=True)
    assert sb.data_ptr() == padded.data_ptr() and torch.equal(sb.t(), padded)
