"""lowbit.compat.lightx2v on CPU: LightX2V's quantize kernels emulated in torch from their source (exact
reciprocals), shape/dtype/layout contracts, the GEMMs against an fp64 product of independently decoded
operands, the seed document's MMWeightFp4 flow, and every upstream TORCH_CHECK as a ValueError/TypeError."""

from __future__ import annotations

import pytest
import torch

import lowbit
from lowbit.compat import lightx2v as L

E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def _round_up(x, y):
    return (x + y - 1) // y * y


def _table(ebits, mbits, bias):
    vals = []
    for c in range(1 << (ebits + mbits)):
        e, m = c >> mbits, c & ((1 << mbits) - 1)
        vals.append(
            m / (1 << mbits) * 2.0 ** (1 - bias) if e == 0 else (1 + m / (1 << mbits)) * 2.0 ** (e - bias)
        )
    return vals


E3M2 = _table(3, 2, 3)


def _encode_rne(y: torch.Tensor, levels: list[float]) -> torch.Tensor:
    """Nearest level, ties to the even code, saturating; sign bit above the magnitude bits (PTX cvt.rn.satfinite)."""
    lv = torch.tensor(levels, dtype=torch.float64)
    mag = y.double().abs().clamp(max=levels[-1])
    d = (mag.unsqueeze(-1) - lv).abs()
    best = d.min(dim=-1, keepdim=True).values
    cand = (d == best) & (torch.arange(len(levels)) % 2 == 0)
    idx = torch.where(cand.any(-1), cand.int().argmax(-1), d.argmin(-1))
    sign = torch.signbit(y).to(torch.int64) << (len(levels).bit_length() - 1)
    return idx | sign


def _rceil_e8m0(v: torch.Tensor) -> torch.Tensor:
    """``__nv_cvt_float_to_e8m0(v, SATFINITE, cudaRoundPosInf)`` for finite v >= 0, via frexp (not exponent bits)."""
    v = v.double()
    mant, exp = torch.frexp(v)
    e = torch.where(mant == 0.5, exp - 1, exp)  # v = 2^e exactly, else the next power of two up
    code = (e + 127).clamp(0, 254)
    return torch.where(v == 0, torch.zeros_like(code), code).to(torch.int64)


def _swizzle(sf: torch.Tensor) -> torch.Tensor:
    """Place linear ``[m, cols]`` scale bytes at the seed's ``cvt_quant_to_fp4_get_sf_out_offset``."""
    m, cols = sf.shape
    rm, rc = _round_up(m, 128), _round_up(cols, 4)
    out = torch.zeros(rm * rc, dtype=torch.uint8)
    r = torch.arange(m).unsqueeze(1)
    k = torch.arange(cols).unsqueeze(0)
    n_k_tiles = rc // 4
    off = (r // 128) * (n_k_tiles * 512) + (k // 4) * 512 + (r % 32) * 16 + ((r % 128) // 32) * 4 + (k % 4)
    out[off.reshape(-1)] = sf.reshape(-1).to(torch.uint8)
    return out.reshape(rm, rc)


def _unswizzle(s: torch.Tensor, m: int, cols: int) -> torch.Tensor:
    flat = s.contiguous().view(torch.uint8).reshape(-1).to(torch.int64)
    r = torch.arange(m).unsqueeze(1)
    k = torch.arange(cols).unsqueeze(0)
    n_k_tiles = _round_up(cols, 4) // 4
    off = (r // 128) * (n_k_tiles * 512) + (k // 4) * 512 + (r % 32) * 16 + ((r % 128) // 32) * 4 + (k % 4)
    return flat[off]


def emulate_quant(x: torch.Tensor, kind: str, gs: torch.Tensor | None = None):
    """LightX2V ``scaled_{nvfp4,mxfp4,mxfp6,mxfp8}_quant`` in torch (exact reciprocals instead of rcp.approx)."""
    m, n = x.shape
    block = 16 if kind == "nvfp4" else 32
    xb = x.float().reshape(m, n // block, block)
    vec_max = xb.abs().amax(-1)
    if kind == "nvfp4":
        s = gs.reshape(())
        sf = (s * (vec_max * torch.tensor(0.16666666666666666, dtype=torch.float32))).clamp(max=448.0)
        sf8 = sf.to(torch.float8_e4m3fn)
        sf32 = sf8.float()
        out_scale = torch.where(sf32 != 0, s * (1.0 / sf32), torch.zeros_like(sf32))
        sf_bytes = sf8.view(torch.uint8)
    else:
        if kind == "mxfp4":
            v = vec_max * torch.tensor(0.16666666666666666, dtype=torch.float32)
        else:
            v = vec_max / torch.tensor(28.0 if kind == "mxfp6" else 448.0)
        code = _rceil_e8m0(v)
        sf32 = torch.pow(2.0, (code - 127).double()).float()
        out_scale = torch.where(sf32 != 0, 1.0 / sf32, torch.zeros_like(sf32))
        sf_bytes = code.to(torch.uint8)
    y = (xb * out_scale.unsqueeze(-1)).reshape(m, n)
    if kind in ("nvfp4", "mxfp4"):
        c = _encode_rne(y, E2M1)
        data = (c[:, 0::2] | (c[:, 1::2] << 4)).to(torch.uint8)
    elif kind == "mxfp6":
        c = _encode_rne(y, E3M2).reshape(m, n // 4, 4)
        a, b, cc, d = c.unbind(-1)
        data = torch.stack([a | ((b & 3) << 6), (b >> 2) | ((cc & 0xF) << 4), (cc >> 4) | (d << 2)], -1)
        data = data.reshape(m, 3 * n // 4).to(torch.uint8)
    else:
        data = y.clamp(-448.0, 448.0).to(torch.float8_e4m3fn).view(torch.uint8)
    return data, _swizzle(sf_bytes)


def decode(data: torch.Tensor, scale: torch.Tensor, kind: str, m: int, k: int) -> torch.Tensor:
    """float64 [m, k] of raw LightX2V tensors (no global scale)."""
    raw = data.to(torch.int64)
    block = 16 if kind == "nvfp4" else 32
    if kind in ("nvfp4", "mxfp4"):
        codes = torch.stack([raw & 0xF, raw >> 4], -1).reshape(m, k)
        table = torch.tensor(E2M1 + [-v for v in E2M1], dtype=torch.float64)
    elif kind == "mxfp6":
        b = raw.reshape(m, k // 4, 3)
        word = b[..., 0] | (b[..., 1] << 8) | (b[..., 2] << 16)
        codes = torch.stack([(word >> s) & 0x3F for s in (0, 6, 12, 18)], -1).reshape(m, k)
        table = torch.tensor(E3M2 + [-v for v in E3M2], dtype=torch.float64)
    else:
        codes = raw
        table = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).double()
    sb = _unswizzle(scale, m, k // block)
    if kind == "nvfp4":
        sf = sb.to(torch.uint8).view(torch.float8_e4m3fn).double()
    else:
        sf = torch.pow(2.0, (sb - 127).double())
    return table[codes] * sf.repeat_interleave(block, dim=1)


def assert_gemm(out, da, db, alpha, bias):
    assert out.dtype == torch.bfloat16 and out.shape == (da.shape[0], db.shape[0])
    want = da @ db.T * alpha
    mag = (da.abs() @ db.abs().T) * abs(alpha)
    if bias is not None:
        want = want + bias.double().reshape(-1)
        mag = mag + bias.double().abs().reshape(-1)
    bound = (da.shape[1] + 2) * 2.0**-24 * mag + 2.0**-8 * want.abs() + 1e-30
    err = (out.double() - want).abs()
    assert (err <= bound).all(), f"max err {err.max()}, bound there {bound[err.argmax() // err.shape[1]]}"


def _x(shape, dtype=torch.bfloat16, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=g) * scale
    if shape[0] > 2:
        x[1] = 0.0  # a zero row: zero blocks
        x[2] *= 1e3
    return x.to(dtype)


# ---------------------------------------------------------------------------------- quantize


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m, n", [(1, 64), (100, 80), (128, 256), (1000, 2048), (130, 32)])
def test_nvfp4_quant_contract_and_bits(m, n, dtype):
    x = _x((m, n), dtype, seed=m + n)
    gs = (torch.tensor(2688.0) / x.float().abs().max()).to(torch.float32)
    data, scale = L.scaled_nvfp4_quant(x, gs)
    assert data.dtype == torch.uint8 and data.shape == (m, n // 2)
    # the seed: [round_up(m, 128), round_up(n/16, 4)] float8_e4m3fn (upstream's int32 buffer viewed as fp8)
    assert scale.dtype == torch.float8_e4m3fn and scale.shape == (_round_up(m, 128), _round_up(n // 16, 4))
    want_data, want_scale = emulate_quant(x, "nvfp4", gs)
    assert torch.equal(data, want_data)
    assert torch.equal(scale.view(torch.uint8), want_scale)
    # padding rows and columns are zero bytes (upstream zero-fills its buffer)
    real = _swizzle(torch.ones(m, n // 16, dtype=torch.uint8)) == 1
    assert torch.all(scale.view(torch.uint8)[~real] == 0)


@pytest.mark.parametrize(
    "kind, fn, cols",
    [
        ("mxfp4", L.scaled_mxfp4_quant, lambda n: n // 2),
        ("mxfp6", L.scaled_mxfp6_quant, lambda n: 3 * n // 4),
        ("mxfp8", L.scaled_mxfp8_quant, lambda n: n),
    ],
)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m, n", [(1, 32), (100, 96), (128, 256), (257, 2048)])
def test_mx_quant_contract_and_bits(kind, fn, cols, m, n, dtype):
    x = _x((m, n), dtype, seed=m * n)
    data, scale = fn(x)
    assert data.dtype == torch.uint8 and data.shape == (m, cols(n))
    assert scale.dtype == torch.float8_e8m0fnu and scale.shape == (_round_up(m, 128), _round_up(n // 32, 4))
    want_data, want_scale = emulate_quant(x, kind)
    assert torch.equal(data, want_data)
    assert torch.equal(scale.view(torch.uint8), want_scale)
    real = _swizzle(torch.ones(m, n // 32, dtype=torch.uint8)) == 1
    assert torch.all(scale.view(torch.uint8)[~real] == 0)  # zero padding (upstream: mxfp8 leaves it unset)


def test_quant_matches_lowbit_formats():
    x = _x((40, 128), seed=3)
    gs = torch.tensor(100.0)
    data, scale = L.scaled_nvfp4_quant(x, gs)
    q = lowbit.quantize(x, "nvfp4", global_scale=gs, convention="lightx2v")
    assert torch.equal(data, q.data)
    assert torch.equal(lowbit.unswizzle_scales(scale, 40, 8).view(torch.uint8), q.scale.view(torch.uint8))
    for fn, fmt in (
        (L.scaled_mxfp4_quant, "mxfp4"),
        (L.scaled_mxfp6_quant, "mxfp6_e3m2"),
        (L.scaled_mxfp8_quant, "mxfp8_e4m3"),
    ):
        data, scale = fn(x)
        q = lowbit.quantize(x, fmt)
        assert torch.equal(data, q.data.view(torch.uint8))
        assert torch.equal(lowbit.unswizzle_scales(scale, 40, 4).view(torch.uint8), q.scale.view(torch.uint8))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_nvfp4_quant_takes_lightx2v_multiplier_order_at_ties(dtype):
    """Upstream scales elements by ``SFScaleVal * reciprocal(SFValue)``; vLLM's ``1/(sf * (1/S))`` gives other
    codes for elements on E2M1 ties, and this data has such elements (random, with the global scale its
    amax gives), so a quantizer with vLLM's order fails here."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(256, 1024, generator=g).to(dtype)
    gs = (torch.tensor(2688.0) / x.float().abs().max()).to(torch.float32)
    data, scale = L.scaled_nvfp4_quant(x, gs)
    want_data, want_scale = emulate_quant(x, "nvfp4", gs)
    assert torch.equal(scale.view(torch.uint8), want_scale)
    assert torch.equal(data, want_data)
    vllm = lowbit.quantize(x, "nvfp4", global_scale=gs, convention="vllm")
    assert not torch.equal(vllm.data, data)


def test_quant_global_scale_forms_and_input_untouched():
    x = _x((8, 64), seed=4)
    before = x.clone()
    d0, s0 = L.scaled_nvfp4_quant(x, torch.tensor(50.0))
    d1, s1 = L.scaled_nvfp4_quant(x, torch.tensor([50.0]))
    assert torch.equal(d0, d1) and torch.equal(s0.view(torch.uint8), s1.view(torch.uint8))
    assert torch.equal(x, before)


# ---------------------------------------------------------------------------------- GEMMs


def test_seed_mmweightfp4_flow():
    """The seed document's MMWeightFp4: weight global scale from its amax, activation global scale from a
    calibrated absmax (5.0), alpha = 1/(gs_in * gs_w)."""
    m, k, n = 64, 512, 96
    x = _x((m, k), seed=5).clamp(-5, 5)
    w = _x((n, k), seed=6, scale=0.05)
    bias = _x((1, n), seed=7)
    gs_w = (2688.0 / torch.max(torch.abs(w))).to(torch.float32)
    weight, weight_scale = L.scaled_nvfp4_quant(w, gs_w)
    gs_in = (2688.0 / torch.tensor(5.0, dtype=torch.float32)).to(torch.float32)
    alpha = 1.0 / (gs_in * gs_w)
    xq, xs = L.scaled_nvfp4_quant(x, gs_in)
    out = L.cutlass_scaled_nvfp4_mm(xq, weight, xs, weight_scale, alpha=alpha, bias=bias)
    assert out.shape == (m, n) and out.dtype == torch.bfloat16
    da, db = decode(xq, xs, "nvfp4", m, k), decode(weight, weight_scale, "nvfp4", n, k)
    assert_gemm(out, da, db, alpha.item(), bias)
    exact = x.float() @ w.float().T + bias.float()
    assert ((out.float() - exact).norm() / exact.norm()).item() < 0.2
    # the same product through lowbit QTensors that carry their global scales, with alpha = 1
    qa = lowbit.quantize(x, "nvfp4", global_scale=gs_in, scale_layout="swizzled")
    qw = lowbit.quantize(w, "nvfp4", global_scale=gs_w)
    y = lowbit.scaled_mm(qa, qw, None, bias.reshape(n), torch.float32)
    torch.testing.assert_close(out.float(), y, rtol=2**-7, atol=2**-7 * y.abs().max().item())


@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize(
    "kind, m, n, k",
    [
        ("nvfp4", 33, 96, 256),
        ("nvfp4", 1, 32, 32),
        ("mxfp4", 33, 256, 256),
        ("mxfp4", 130, 128, 128),
        ("mxfp8", 33, 128, 96),
        ("mxfp8", 2, 256, 512),
        ("mxfp6", 33, 128, 96),
        ("mxfp6", 129, 256, 256),
    ],
)
def test_gemms_against_fp64(kind, m, n, k, with_bias):
    x = _x((m, k), seed=m + k)
    w = _x((n, k), seed=n * k, scale=0.1)
    bias = _x((1, n), seed=9) if with_bias else None
    alpha = torch.tensor([0.75])
    if kind == "nvfp4":
        gx, gw = torch.tensor(300.0), torch.tensor(5000.0)
        (a, sa), (b, sb) = L.scaled_nvfp4_quant(x, gx), L.scaled_nvfp4_quant(w, gw)
        out = L.cutlass_scaled_nvfp4_mm(a, b, sa, sb, alpha, bias)
        da, db = decode(a, sa, "nvfp4", m, k), decode(b, sb, "nvfp4", n, k)
    elif kind == "mxfp4":
        (a, sa), (b, sb) = L.scaled_mxfp4_quant(x), L.scaled_mxfp4_quant(w)
        out = L.cutlass_scaled_mxfp4_mm(a, b, sa, sb, alpha, bias)
        da, db = decode(a, sa, "mxfp4", m, k), decode(b, sb, "mxfp4", n, k)
    elif kind == "mxfp8":
        (a, sa), (b, sb) = L.scaled_mxfp8_quant(x), L.scaled_mxfp8_quant(w)
        out = L.cutlass_scaled_mxfp8_mm(a, b, sa, sb, alpha, bias)
        da, db = decode(a, sa, "mxfp8", m, k), decode(b, sb, "mxfp8", n, k)
    else:
        (a, sa), (b, sb) = L.scaled_mxfp8_quant(x), L.scaled_mxfp6_quant(w)
        out = L.cutlass_scaled_mxfp6_mxfp8_mm(a, b, sa, sb, alpha, bias)
        da, db = decode(a, sa, "mxfp8", m, k), decode(b, sb, "mxfp6", n, k)
    assert_gemm(out, da, db, 0.75, bias)


def test_bias_shapes_and_alpha_shapes_agree():
    x, w = _x((5, 64), seed=10), _x((32, 64), seed=11)
    (a, sa), (b, sb) = (
        L.scaled_nvfp4_quant(x, torch.tensor(100.0)),
        L.scaled_nvfp4_quant(w, torch.tensor(100.0)),
    )
    bias = _x((1, 32), seed=12)
    y0 = L.cutlass_scaled_nvfp4_mm(a, b, sa, sb, torch.tensor(0.5), bias)
    y1 = L.cutlass_scaled_nvfp4_mm(a, b, sa, sb, torch.tensor([0.5]), bias.reshape(32))
    assert torch.equal(y0, y1)


# ---------------------------------------------------------------------------------- errors


def test_quant_errors():
    x = _x((4, 64))
    gs = torch.tensor(1.0)
    cases = [
        (TypeError, "input must be a torch.Tensor", lambda: L.scaled_nvfp4_quant(x.tolist(), gs)),
        (
            ValueError,
            r"input must be a matrix \(m, n\)",
            lambda: L.scaled_nvfp4_quant(x.reshape(2, 2, 64), gs),
        ),
        (TypeError, "input.dtype needs to be fp16 or bf16", lambda: L.scaled_nvfp4_quant(x.float(), gs)),
        (ValueError, "The N dimension must be multiple of 16", lambda: L.scaled_nvfp4_quant(x[:, :40], gs)),
        (TypeError, "input_global_scale must be a float32 tensor", lambda: L.scaled_nvfp4_quant(x, 1.0)),
        (TypeError, "input_global_scale must be float32", lambda: L.scaled_nvfp4_quant(x, gs.double())),
        (
            ValueError,
            "input_global_scale must be a scalar tensor",
            lambda: L.scaled_nvfp4_quant(x, torch.ones(2)),
        ),
        (
            ValueError,
            "global_scale must be finite and > 0",
            lambda: L.scaled_nvfp4_quant(x, torch.tensor(0.0)),
        ),
        (ValueError, "The N dimension must be multiple of 32", lambda: L.scaled_mxfp4_quant(x[:, :48])),
        (ValueError, "The N dimension must be multiple of 32", lambda: L.scaled_mxfp6_quant(x[:, :16])),
        (TypeError, "fp16 or bf16", lambda: L.scaled_mxfp8_quant(x.float())),
        (ValueError, "must be a matrix", lambda: L.scaled_mxfp8_quant(x[0])),
    ]
    for exc, match, fn in cases:
        with pytest.raises(exc, match=match):
            fn()


def _nv(m, n, k):
    (a, sa) = L.scaled_nvfp4_quant(_x((m, k), seed=1), torch.tensor(100.0))
    (b, sb) = L.scaled_nvfp4_quant(_x((n, k), seed=2), torch.tensor(100.0))
    return a, b, sa, sb


def test_nvfp4_mm_errors():
    a, b, sa, sb = _nv(8, 64, 64)
    one = torch.tensor(1.0)
    f = L.cutlass_scaled_nvfp4_mm
    a48, b48, sa48, sb48 = _nv(8, 64, 48)
    _, b40, _, sb40 = _nv(8, 40, 64)
    cases = [
        (
            TypeError,
            "Inconsistency of Tensor type: a must be torch.uint8",
            lambda: f(a.view(torch.int8), b, sa, sb, one),
        ),
        (TypeError, "b must be a torch.Tensor", lambda: f(a, None, sa, sb, one)),
        (ValueError, "a must be contiguous", lambda: f(a.T.contiguous().T, b, sa, sb, one)),
        (ValueError, "b must be a matrix", lambda: f(a, b.reshape(1, 64, 32), sa, sb, one)),
        (
            ValueError,
            r"a and b shapes cannot be multiplied \(8x32 and 64x16\)",
            lambda: f(a, b[:, :16].contiguous(), sa, sb, one),
        ),
        (
            ValueError,
            r"Expected k to be divisible by 32, but got a shape: \(8x24\), k: 48\.",
            lambda: f(a48, b48, sa48, sb48, one),
        ),
        (
            ValueError,
            r"Expected n to be divisible by 32, but got b shape: \(40x32\)\.",
            lambda: f(a, b40, sa, sb40, one),
        ),
        (TypeError, "scale_a must be torch.float8_e4m3fn", lambda: f(a, b, sa.view(torch.uint8), sb, one)),
        (
            ValueError,
            r"scale_a must be padded and swizzled to a shape \(128x4\), but got a shape \(64x4\)",
            lambda: f(a, b, sa[:64].contiguous(), sb, one),
        ),
        (
            ValueError,
            r"scale_a and scale_b shapes cannot be multiplied \(128x4 and 128x8\)",
            lambda: f(a, b, sa, torch.zeros(128, 8, dtype=torch.float8_e4m3fn), one),
        ),
        (ValueError, "scale_b must be contiguous", lambda: f(a, b, sa, sb.T.contiguous().T, one)),
        (TypeError, "alpha must be torch.float32", lambda: f(a, b, sa, sb, one.double())),
        (TypeError, "alpha must be a float32 tensor of one element", lambda: f(a, b, sa, sb, 1.0)),
        (TypeError, "alpha must be a float32 tensor of one element", lambda: f(a, b, sa, sb, torch.ones(2))),
        (TypeError, "bias must be torch.bfloat16", lambda: f(a, b, sa, sb, one, torch.zeros(64))),
        (
            ValueError,
            r"bias must have shape \(1, n\) or \(n,\) with n = 64",
            lambda: f(a, b, sa, sb, one, torch.zeros(2, 32, dtype=torch.bfloat16)),
        ),
        (
            ValueError,
            r"bias must have shape",
            lambda: f(a, b, sa, sb, one, torch.zeros(63, dtype=torch.bfloat16)),
        ),
        (TypeError, "bias must be None or a torch.Tensor", lambda: f(a, b, sa, sb, one, [0.0] * 64)),
        (ValueError, "all tensors must be on one device", lambda: f(a, b, sa, sb, one.to("meta"))),
    ]
    for exc, match, fn in cases:
        with pytest.raises(exc, match=match):
            fn()


def test_mx_mm_errors():
    one = torch.tensor(1.0)
    x = _x((8, 256), seed=1)
    a4, sa4 = L.scaled_mxfp4_quant(x)
    b4, sb4 = L.scaled_mxfp4_quant(_x((128, 256), seed=2))
    b4n, sb4n = L.scaled_mxfp4_quant(_x((96, 256), seed=2))
    a4k, sa4k = L.scaled_mxfp4_quant(x[:, :192])
    b4k, sb4k = L.scaled_mxfp4_quant(_x((128, 192), seed=2))
    a8, sa8 = L.scaled_mxfp8_quant(x)
    b8, sb8 = L.scaled_mxfp8_quant(_x((128, 256), seed=3))
    b8n, sb8n = L.scaled_mxfp8_quant(_x((96, 256), seed=3))
    b6, sb6 = L.scaled_mxfp6_quant(_x((128, 256), seed=4))
    b6n, sb6n = L.scaled_mxfp6_quant(_x((64, 256), seed=4))
    cases = [
        (
            ValueError,
            r"Expected n to be divisible by 128, but got b shape: \(96x128\)",
            lambda: L.cutlass_scaled_mxfp4_mm(a4, b4n, sa4, sb4n, one),
        ),
        (
            ValueError,
            r"Expected k to be divisible by 128, but got a shape: \(8x96\), k: 192\.",
            lambda: L.cutlass_scaled_mxfp4_mm(a4k, b4k, sa4k, sb4k, one),
        ),
        (
            TypeError,
            "scale_b must be torch.float8_e8m0fnu",
            lambda: L.cutlass_scaled_mxfp4_mm(a4, b4, sa4, sb4.view(torch.uint8), one),
        ),
        (
            ValueError,
            r"scale_b must be padded and swizzled to a shape \(128x8\), but got a shape \(64x8\)",
            lambda: L.cutlass_scaled_mxfp4_mm(a4, b4, sa4, sb4[:64].contiguous(), one),
        ),
        (
            ValueError,
            r"Expected n to be divisible by 128",
            lambda: L.cutlass_scaled_mxfp8_mm(a8, b8n, sa8, sb8n, one),
        ),
        (
            ValueError,
            "a and b shapes cannot be multiplied",
            lambda: L.cutlass_scaled_mxfp8_mm(a8, b8[:, :128].contiguous(), sa8, sb8, one),
        ),
        (
            TypeError,
            "a must be torch.uint8",
            lambda: L.cutlass_scaled_mxfp8_mm(a8.view(torch.float8_e4m3fn), b8, sa8, sb8, one),
        ),
        (
            ValueError,
            r"Expected k to be divisible by 16",
            lambda: L.cutlass_scaled_mxfp8_mm(
                a8[:, :40].contiguous(), b8[:, :40].contiguous(), sa8, sb8, one
            ),
        ),
        (
            ValueError,
            r"Expected k to be divisible by 32 \(one E8M0 scale per 32 elements\)",
            lambda: L.cutlass_scaled_mxfp8_mm(
                a8[:, :48].contiguous(), b8[:, :48].contiguous(), sa8, sb8, one
            ),
        ),
        (
            ValueError,
            r"b must have 3k/4 = 192 columns",
            lambda: L.cutlass_scaled_mxfp6_mxfp8_mm(a8, b8, sa8, sb8, one),
        ),
        (
            ValueError,
            r"Expected n to be divisible by 128",
            lambda: L.cutlass_scaled_mxfp6_mxfp8_mm(a8, b6n, sa8, sb6n, one),
        ),
        (
            TypeError,
            "alpha must be torch.float32",
            lambda: L.cutlass_scaled_mxfp6_mxfp8_mm(a8, b6, sa8, sb6, torch.tensor(1)),
        ),
    ]
    for exc, match, fn in cases:
        with pytest.raises(exc, match=match):
            fn()
