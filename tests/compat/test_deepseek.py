"""lowbit.compat.deepseek on CPU: DeepSeek-V3 ``inference/kernel.py`` semantics, re-written here from its source
(act_quant with eps and scale_fmt, weight_dequant, the per-K-block fp8_gemm accumulation), shapes, default
dtype, the ue8m0 difference lowbit keeps on purpose, and errors."""

from __future__ import annotations

import contextlib
import functools

import pytest
import torch

import lowbit
from lowbit.compat import deepseek as D


@contextlib.contextmanager
def default_dtype(dtype):
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def ds_act_quant(x: torch.Tensor, scale_fmt=None, block_size=128):
    """DeepSeek ``act_quant_kernel``: per ``block_size`` contiguous elements, ``amax = max(max|x|, 1e-4)``,
    ``s = amax/448``, ``ue8m0``: ``s = exp2(ceil(log2(s)))`` in fp32, ``y = fp8(x / s)`` (Triton's cast
    saturates on Hopper)."""
    k = x.shape[-1]
    xb = x.float().reshape(-1, k // block_size, block_size)
    amax = torch.maximum(xb.abs().amax(-1), torch.tensor(1e-4, dtype=torch.float32))
    s = amax / torch.tensor(448.0)
    if scale_fmt == "ue8m0":
        s = torch.exp2(torch.ceil(torch.log2(s)))
    y = (xb / s.unsqueeze(-1)).clamp(-448, 448).to(torch.float8_e4m3fn)
    return y.reshape(x.shape), s.reshape(*x.shape[:-1], k // block_size)


def ds_fp8_gemm64(a, a_s, b, b_s) -> torch.Tensor:
    """``acc += dot(a_blk, b_blk) * a_s[:, None] * b_s[None, :]`` over 128-wide K blocks, in float64."""
    k = a.shape[-1]
    a2 = a.reshape(-1, k).double()
    as2 = a_s.reshape(-1, a_s.shape[-1]).double()
    bd = b.double()
    bs = b_s.double().repeat_interleave(128, dim=0)[: b.shape[0]]
    acc = torch.zeros(a2.shape[0], b.shape[0], dtype=torch.float64)
    for i in range(-(-k // 128)):
        blk = slice(i * 128, (i + 1) * 128)
        acc += (a2[:, blk] @ bd[:, blk].T) * as2[:, i : i + 1] * bs[:, i].unsqueeze(0)
    return acc.reshape(*a.shape[:-1], b.shape[0])


def _bits(t):
    return t.view(torch.uint8) if t.element_size() == 1 else t.view(torch.int32)


def _x(shape, dtype=torch.bfloat16, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=g)
    flat = x.reshape(-1, shape[-1])
    if flat.shape[0] > 2:
        flat[0, :128] = 0.0  # a zero block: the 1e-4 clamp
        flat[1] *= 1e3
    return x.to(dtype)


# ---------------------------------------------------------------------------------- act_quant


@pytest.mark.parametrize("scale_fmt", [None, "ue8m0"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("shape", [(1, 128), (5, 7168), (2, 3, 512), (0, 256)])
def test_act_quant_is_deepseeks(shape, dtype, scale_fmt):
    x = _x(shape, dtype, seed=sum(shape))
    y, s = D.act_quant(x, 128, scale_fmt)
    assert y.dtype == torch.float8_e4m3fn and y.shape == x.shape
    assert s.dtype == torch.float32 and s.shape == (*shape[:-1], shape[-1] // 128)
    wy, ws = ds_act_quant(x, scale_fmt)
    assert torch.equal(_bits(y), _bits(wy)) and torch.equal(_bits(s), _bits(ws))
    q = lowbit.quantize(x, "fp8_block", scale_fmt=scale_fmt)
    assert torch.equal(_bits(y), _bits(q.data)) and torch.equal(s, q.scale)


@pytest.mark.parametrize("block_size", [1, 16, 32, 64, 256, 512, 1024])
@pytest.mark.parametrize("scale_fmt", [None, "ue8m0"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_act_quant_other_block_sizes_are_deepseeks(block_size, scale_fmt, dtype):
    """DeepSeek's kernel takes any power-of-two block_size dividing K (it asserts ``K % block_size == 0`` and
    uses block_size as a tl.arange extent)."""
    x = _x((6, 2048), dtype, seed=block_size)
    x[2, : 4 * block_size] *= 1e-7  # blocks under the 1e-4 clamp next to ordinary ones
    y, s = D.act_quant(x, block_size, scale_fmt)
    assert y.dtype == torch.float8_e4m3fn and y.shape == x.shape
    assert s.dtype == torch.float32 and s.shape == (6, 2048 // block_size)
    wy, ws = ds_act_quant(x, scale_fmt, block_size)
    if scale_fmt is None:
        assert torch.equal(_bits(y), _bits(wy)) and torch.equal(_bits(s), _bits(ws))
    else:
        # the exponent-bit rounding (see the test below) can only pick a larger power of two
        assert ((s == ws) | (s == 2 * ws)).all()
        assert torch.equal(_bits(y)[s.repeat_interleave(block_size, -1) == ws.repeat_interleave(block_size, -1)],
                           _bits(wy)[s.repeat_interleave(block_size, -1) == ws.repeat_interleave(block_size, -1)])
    # a block of 128 is lowbit's fp8_block: the same bits through either path
    if block_size == 128:
        q = lowbit.quantize(x, "fp8_block", scale_fmt=scale_fmt)
        assert torch.equal(_bits(y), _bits(q.data))


def test_act_quant_ue8m0_uses_the_exact_exponent():
    """DeepSeek's float ``exp2(ceil(log2(s)))`` picks 2^-7 for ``s = nextafter(2^-7)`` (log2 rounds to -7.0);
    lowbit picks 2^-6, the smallest power of two >= s (DeepGEMM ``ceil_to_ue8m0``)."""
    x = torch.zeros(1, 128)
    x[0, 0] = torch.nextafter(torch.tensor(3.5), torch.tensor(4.0))  # amax / 448 = nextafter(2^-7) exactly
    x[0, 1] = 1.0
    _, s = D.act_quant(x, scale_fmt="ue8m0")
    _, ws = ds_act_quant(x, "ue8m0")
    assert s.item() == 2.0**-6 and ws.item() == 2.0**-7


def test_act_quant_non_contiguous_input():
    x = _x((256, 6), seed=1).T
    y, s = D.act_quant(x)
    y2, s2 = D.act_quant(x.contiguous())
    assert torch.equal(_bits(y), _bits(y2)) and torch.equal(s, s2)


def test_act_quant_errors():
    x = _x((4, 256))
    cases = [
        (ValueError, r"block_size must be a power of two from 1 to 2\*\*20", lambda: D.act_quant(x, 96)),
        (ValueError, r"block_size must be a power of two", lambda: D.act_quant(x, 0)),
        (ValueError, r"block_size must be a power of two", lambda: D.act_quant(x, -128)),
        (ValueError, r"block_size must be a power of two", lambda: D.act_quant(x, 1 << 21)),
        (
            ValueError,
            r"Last dimension size must be divisible by block_size \(block_size=512\)",
            lambda: D.act_quant(x, 512),
        ),
        (TypeError, "block_size must be an int", lambda: D.act_quant(x, 128.0)),
        (TypeError, "block_size must be an int", lambda: D.act_quant(x, True)),
        (
            ValueError,
            r"Last dimension size must be divisible by block_size \(block_size=128\)",
            lambda: D.act_quant(x[:, :200]),
        ),
        (ValueError, "Last dimension size", lambda: D.act_quant(torch.tensor(1.0))),
        (ValueError, "scale_fmt must be None or 'ue8m0'", lambda: D.act_quant(x, scale_fmt="e8m0")),
        (TypeError, "x must be a torch.Tensor", lambda: D.act_quant(x.tolist())),
        (TypeError, "float32, bfloat16 or float16", lambda: D.act_quant(x.double())),
    ]
    for exc, match, fn in cases:
        with pytest.raises(exc, match=match):
            fn()


# ---------------------------------------------------------------------------------- weight_dequant


@functools.cache
def _weight(n, k, seed=2):
    q = lowbit.quantize(_x((n, k), torch.float32, seed=seed) * 0.02, "fp8_block", block=(128, 128))
    return q.data, q.scale


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16, torch.float64])
@pytest.mark.parametrize("shape", [(128, 128), (300, 520), (2112, 7168)])
def test_weight_dequant_is_deepseeks(shape, dtype):
    w, s = _weight(*shape)
    with default_dtype(dtype):
        y = D.weight_dequant(w, s)
    n, k = shape
    want = (w.float() * s.repeat_interleave(128, 0)[:n].repeat_interleave(128, 1)[:, :k]).to(dtype)
    assert y.dtype == dtype and y.shape == shape
    assert torch.equal(y, want)


def test_weight_dequant_errors():
    w, s = _weight(300, 520)
    cases = [
        (TypeError, "x must be torch.float8_e4m3fn", lambda: D.weight_dequant(w.float(), s)),
        (TypeError, "s must be torch.float32", lambda: D.weight_dequant(w, s.double())),
        (ValueError, "must have 2 dimensions", lambda: D.weight_dequant(w.reshape(1, 300, 520), s)),
        (ValueError, r"s must have shape \(3, 5\)", lambda: D.weight_dequant(w, s[:, :4])),
        (ValueError, "block_size must be 128", lambda: D.weight_dequant(w, s, 64)),
        (ValueError, "one device", lambda: D.weight_dequant(w, s.to("meta"))),
    ]
    for exc, match, fn in cases:
        with pytest.raises(exc, match=match):
            fn()


# ---------------------------------------------------------------------------------- fp8_gemm


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(
    "lead, n, k", [((1,), 256, 512), ((7,), 300, 640), ((2, 3), 128, 7168), ((0,), 128, 256)]
)
def test_fp8_gemm_is_deepseeks(lead, n, k, dtype):
    x = _x((*lead, k), seed=n + k)
    a, a_s = D.act_quant(x)
    b, b_s = _weight(n, k, seed=k)
    with default_dtype(dtype):
        c = D.fp8_gemm(a, a_s, b, b_s)
    assert c.dtype == dtype and c.shape == (*lead, n)
    want = ds_fp8_gemm64(a, a_s, b, b_s)
    mag = ds_fp8_gemm64(
        a.float().abs().to(torch.float8_e4m3fn), a_s, b.float().abs().to(torch.float8_e4m3fn), b_s
    )
    eps = {torch.bfloat16: 2.0**-8, torch.float32: 0.0}[dtype]
    bound = (k + 2) * 2.0**-24 * mag + eps * want.abs() + 1e-30
    assert ((c.double() - want).abs() <= bound).all()


def test_deepseek_linear_flow():
    """model.py ``linear`` with gemm_impl 'fp8' (act_quant + fp8_gemm) against 'bf16' (weight_dequant + F.linear)."""
    with default_dtype(torch.bfloat16):
        x = _x((4, 1024), seed=5)
        w, s = _weight(512, 1024, seed=6)
        y, ys = D.act_quant(x, 128, "ue8m0")
        fp8 = D.fp8_gemm(y, ys, w, s)
        bf16 = torch.nn.functional.linear(x, D.weight_dequant(w, s))
    assert fp8.dtype == bf16.dtype == torch.bfloat16
    # activation quantization with power-of-two scales: a few percent
    assert ((fp8.float() - bf16.float()).norm() / bf16.float().norm()).item() < 0.1


def test_fp8_gemm_errors():
    a, a_s = D.act_quant(_x((4, 256)))
    b, b_s = _weight(128, 256)
    cases = [
        (TypeError, "a must be torch.float8_e4m3fn", lambda: D.fp8_gemm(a.float(), a_s, b, b_s)),
        (TypeError, "b_s must be torch.float32", lambda: D.fp8_gemm(a, a_s, b, b_s.double())),
        (ValueError, r"b must be a 2-D weight", lambda: D.fp8_gemm(a, a_s, b.reshape(1, 128, 256), b_s)),
        (ValueError, "K mismatch", lambda: D.fp8_gemm(a[:, :128], a_s[:, :1], b, b_s)),
        (ValueError, r"a_s must have shape \(4, 2\)", lambda: D.fp8_gemm(a, a_s[:, :1], b, b_s)),
        (ValueError, r"b_s must have shape \(1, 2\)", lambda: D.fp8_gemm(a, a_s, b, b_s.reshape(2, 1))),
        (ValueError, "at least 1 dimension", lambda: D.fp8_gemm(a[0, 0], a_s, b, b_s)),
        (ValueError, "devices differ", lambda: D.fp8_gemm(a, a_s, b.to("meta"), b_s.to("meta"))),
    ]
    for exc, match, fn in cases:
        with pytest.raises(exc, match=match):
            fn()
