"""lowbit.scaled_mm / scaled_linear on CPU: the reference against an independent float64 computation for every
pair, linear vs swizzled scales, every validation error, dispatch rules (with stand-in kernel modules), the
custom ops' fake implementations and torch.compile."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import lowbit
from lowbit.formats.qtensor import QTensor
from lowbit.ops import PAIRS, policy, scaled_linear, scaled_mm_reference

# the modules behind lowbit.ops (the package re-exports functions that shadow the module attributes of the same
# name)
smm_dispatch = sys.modules["lowbit.ops.scaled_mm_dispatch"]
smm_op = sys.modules["lowbit.ops.scaled_mm_op"]

M, N, K = 33, 136, 320  # M, N not multiples of 128 (swizzle padding, partial 128x128 blocks); K = 2.5 x 128

# (a format, a options, b format, b options): every pair and the variants that change how it decodes
VARIANTS = [
    ("fp8_block", {}, "fp8_block", {"block": (128, 128)}),
    ("fp8_block", {"scale_fmt": "ue8m0"}, "fp8_block", {"block": (128, 128), "scale_fmt": "ue8m0"}),
    ("fp8_block", {"scale_layout": "column_major"}, "fp8_block", {"block": (128, 128)}),
    ("nvfp4", {}, "nvfp4", {}),
    ("nvfp4", {"scale_layout": "swizzled"}, "nvfp4", {"scale_layout": "swizzled"}),
    ("nvfp4", {"global_scale": "none"}, "nvfp4", {"convention": "torchao"}),
    ("nvfp4", {"convention": "compressed-tensors"}, "nvfp4", {"global_scale": 7.0}),
    ("mxfp4", {}, "mxfp4", {}),
    ("mxfp4", {"scale_rounding": "floor", "scale_layout": "swizzled"}, "mxfp4", {"scale_layout": "swizzled"}),
    ("mxfp8_e4m3", {}, "mxfp8_e4m3", {}),
    ("mxfp8_e5m2", {"scale_layout": "swizzled"}, "mxfp8_e4m3", {}),
    ("mxfp8_e4m3", {}, "mxfp8_e5m2", {"scale_layout": "swizzled"}),
    ("mxfp6_e2m3", {}, "mxfp8_e4m3", {}),
    ("mxfp6_e3m2", {"scale_layout": "swizzled"}, "mxfp8_e5m2", {"scale_layout": "swizzled"}),
    ("mxfp8_e4m3", {}, "mxfp6_e3m2", {}),
    ("mxfp8_e4m3", {"scale_layout": "swizzled"}, "mxfp6_e2m3", {"scale_layout": "swizzled"}),
    ("fp8_rowwise", {}, "nvfp4", {}),
    ("fp8_rowwise", {}, "mxfp4", {"scale_layout": "swizzled"}),
    ("fp8_block", {}, "nvfp4", {"scale_layout": "swizzled"}),
    ("fp8_block", {"scale_fmt": "ue8m0"}, "mxfp4", {}),
]
VIDS = [
    f"{af}{''.join(f'-{k}={v}' for k, v in ao.items())}__{bf}{''.join(f'-{k}={v}' for k, v in bo.items())}"
    for af, ao, bf, bo in VARIANTS
]
OUT_DTYPES = [torch.float32, torch.bfloat16, torch.float16]


# ---------------------------------------------------------------------------------- independent decoders
# Written from docs/formats.md (bit layouts, swizzle formula), not from lowbit's dequantize functions.

_MINIFLOATS = {  # (ebits, mbits, bias, kind)
    "e2m1": (2, 1, 1, "none"),
    "e2m3": (2, 3, 1, "none"),
    "e3m2": (3, 2, 3, "none"),
    "e4m3": (4, 3, 7, "fn"),
    "e5m2": (5, 2, 15, "ieee"),
}
_ELEMENT = {
    "nvfp4": "e2m1",
    "mxfp4": "e2m1",
    "mxfp6_e2m3": "e2m3",
    "mxfp6_e3m2": "e3m2",
    "mxfp8_e4m3": "e4m3",
    "mxfp8_e5m2": "e5m2",
    "fp8_block": "e4m3",
    "fp8_rowwise": "e4m3",
}


def _minifloat(codes: torch.Tensor, name: str) -> torch.Tensor:
    """float64 value of integer codes: sign | exponent | mantissa, subnormals at exponent 0."""
    e, m, bias, kind = _MINIFLOATS[name]
    c = codes.to(torch.int64)
    sign = torch.where((c >> (e + m)) & 1 == 1, -1.0, 1.0).to(torch.float64)
    exp = (c >> m) & ((1 << e) - 1)
    man = (c & ((1 << m) - 1)).to(torch.float64)
    normal = torch.ldexp(1.0 + man / (1 << m), (exp - bias).to(torch.float64))
    sub = torch.ldexp(man / (1 << m), torch.tensor(1.0 - bias, dtype=torch.float64))
    v = sign * torch.where(exp == 0, sub, normal)
    if kind == "fn":
        v = torch.where((c & 0x7F) == 0x7F, torch.tensor(float("nan"), dtype=torch.float64), v)
    if kind == "ieee":
        top = exp == (1 << e) - 1
        v = torch.where(top & ((c & 3) == 0), sign * float("inf"), v)
        v = torch.where(top & ((c & 3) != 0), torch.tensor(float("nan"), dtype=torch.float64), v)
    return v


def _codes(q: QTensor) -> torch.Tensor:
    rows, k = q.shape
    raw = q.data.contiguous().view(torch.uint8).to(torch.int64)
    bits = {"e2m1": 4, "e2m3": 6, "e3m2": 6}.get(_ELEMENT[q.fmt], 8)
    if bits == 4:  # element 2i in the low nibble
        return torch.stack([raw & 0xF, raw >> 4], dim=-1).reshape(rows, k)
    if bits == 6:  # little-endian 24-bit words of four 6-bit codes
        b = raw.reshape(rows, k // 4, 3)
        word = b[..., 0] | (b[..., 1] << 8) | (b[..., 2] << 16)
        return torch.stack([(word >> s) & 0x3F for s in (0, 6, 12, 18)], dim=-1).reshape(rows, k)
    return raw


def _unswizzle(scale: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    flat = scale.contiguous().view(torch.uint8).reshape(-1).to(torch.int64)
    r = torch.arange(rows).unsqueeze(1)
    c = torch.arange(cols).unsqueeze(0)
    n_col_tiles = -(-cols // 4)
    idx = ((r // 128) * n_col_tiles + c // 4) * 512 + (r % 32) * 16 + ((r // 32) % 4) * 4 + c % 4
    return flat[idx]


def _scale_bytes(q: QTensor, block: int) -> torch.Tensor:
    rows, k = q.shape
    if q.scale_layout == "swizzled":
        return _unswizzle(q.scale, rows, k // block)
    return q.scale.contiguous().view(torch.uint8).to(torch.int64).reshape(rows, k // block)


def decode(q: QTensor) -> torch.Tensor:
    """float64 ``[rows, K]`` of a QTensor, from its bits."""
    rows, k = q.shape
    vals = _minifloat(_codes(q), _ELEMENT[q.fmt])
    if q.fmt == "nvfp4":
        sf = _minifloat(_scale_bytes(q, 16), "e4m3")
        if "per_tensor_scale" in q.params:
            sf = sf * float(q.params["per_tensor_scale"])
        elif q.global_scale is not None:
            sf = sf / float(q.global_scale)
        return vals * sf.repeat_interleave(16, dim=1)
    if q.fmt.startswith("mx"):
        e = _scale_bytes(q, 32).to(torch.float64)
        s = torch.where(e == 255, float("nan"), torch.pow(2.0, e - 127))
        return vals * s.repeat_interleave(32, dim=1)
    s = q.scale.to(torch.float64)
    if q.fmt == "fp8_rowwise":
        return vals * s
    if q.params["block"] == (1, 128):
        return vals * s.repeat_interleave(128, dim=1)[:, :k]
    return vals * s.repeat_interleave(128, dim=0)[:rows].repeat_interleave(128, dim=1)[:, :k]


def independent(a, b, alpha=None, bias=None) -> torch.Tensor:
    y = decode(a) @ decode(b).T
    if alpha is not None:
        y = y * float(alpha)
    if bias is not None:
        y = y + bias.to(torch.float64)
    return y


_EPS = {torch.float32: 0.0, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}


def assert_matches(out, a, b, alpha=None, bias=None, out_dtype=torch.float32):
    """|out - exact| within the fp32 accumulation bound ``(K+2) u sum|a||b|`` plus one rounding to out_dtype."""
    assert out.dtype == out_dtype and out.shape == (a.shape[0], b.shape[0])
    want = independent(a, b, alpha, bias)
    da, db = decode(a), decode(b)
    mag = da.abs() @ db.abs().T * abs(float(1.0 if alpha is None else alpha))
    if bias is not None:
        mag = mag + bias.to(torch.float64).abs()
    bound = (a.shape[1] + 2) * 2.0**-24 * mag + _EPS[out_dtype] * want.abs() + 2.0**-24
    err = (out.to(torch.float64) - want).abs()
    bad = ~(err <= bound) & ~(want.isnan() & out.isnan())
    assert not bad.any(), f"{int(bad.sum())} elements off; first: got {out[bad][:4]}, want {want[bad][:4]}"


def _x(shape, dtype=torch.float32, seed=0, adversarial=False):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=g)
    if adversarial and shape[0] >= 4:
        x[0] = 0.0  # an all-zero row (zero blocks, fp8_rowwise's minimum scale)
        x[1] *= 1e4  # large dynamic range across rows
        x[2] *= 1e-4
        x[3, : shape[1] // 2] = 0.0  # zero blocks next to nonzero ones
    return x.to(dtype)


@pytest.fixture(scope="module")
def operands():
    out = {}
    for vid, (af, ao, bf, bo) in zip(VIDS, VARIANTS):
        a = lowbit.quantize(_x((M, K), torch.bfloat16, seed=1, adversarial=True), af, **ao)
        b = lowbit.quantize(_x((N, K), torch.bfloat16, seed=2) * 0.05, bf, **bo)
        out[vid] = (a, b)
    return out


# ---------------------------------------------------------------------------------- reference


def test_pairs_are_the_issues():
    kinds = {}
    for (af, bf), kind in PAIRS.items():
        kinds.setdefault(kind, set()).add((af, bf))
    assert kinds["fp8_block"] == {("fp8_block", "fp8_block")}
    assert kinds["nvfp4"] == {("nvfp4", "nvfp4")} and kinds["mxfp4"] == {("mxfp4", "mxfp4")}
    assert len(kinds["mxfp8"]) == 4 and len(kinds["mxfp6_mxfp8"]) == 8
    assert kinds["w4a8"] == {(a, w) for a in ("fp8_rowwise", "fp8_block") for w in ("nvfp4", "mxfp4")}
    assert {v[0] for v in VARIANTS} | {v[2] for v in VARIANTS} >= {f for p in PAIRS for f in p}


def test_decoder_agrees_with_dequantize(operands):
    for vid, (a, b) in operands.items():
        for q in (a, b):
            got, want = lowbit.dequantize(q).double(), decode(q)
            # equal up to the fp32 rounding of nvfp4's block multiplier sf / S
            ok = ((got - want).abs() <= 2**-23 * want.abs()) | (got.isnan() & want.isnan())
            assert ok.all(), vid


@pytest.mark.parametrize("vid", VIDS)
@pytest.mark.parametrize("out_dtype", OUT_DTYPES)
def test_reference_matches_independent_fp64(operands, vid, out_dtype):
    a, b = operands[vid]
    bias = _x((N,), torch.bfloat16, seed=3)
    alpha = torch.tensor(0.75)
    out = lowbit.scaled_mm(a, b, alpha, bias, out_dtype)
    assert_matches(out, a, b, 0.75, bias, out_dtype)
    # on CPU scaled_mm *is* the reference, bit for bit, whichever backend name selects it
    assert torch.equal(out, scaled_mm_reference(a, b, alpha, bias, out_dtype))
    assert torch.equal(out, lowbit.scaled_mm(a, b, alpha, bias, out_dtype, backend="torch"))
    ref = lowbit.dequantize(a) @ lowbit.dequantize(b).T * alpha + bias.float()
    assert torch.equal(out, ref.to(out_dtype))


@pytest.mark.parametrize("vid", [v for v in VIDS if "swizzled" in v])
def test_linear_and_swizzled_scales_agree(operands, vid):
    a, b = operands[vid]
    as_linear = []
    for q in (a, b):
        if q.scale_layout == "swizzled":
            block = 16 if q.fmt == "nvfp4" else 32
            lin = lowbit.unswizzle_scales(q.scale, q.shape[0], q.shape[1] // block)
            q = replace(q, scale=lin, scale_layout="linear")
        as_linear.append(q)
    for dt in OUT_DTYPES:
        assert torch.equal(lowbit.scaled_mm(a, b, out_dtype=dt), lowbit.scaled_mm(*as_linear, out_dtype=dt))


def test_column_major_activation_scales_agree(operands):
    a, b = operands[VIDS[2]]
    assert a.scale_layout == "column_major" and a.scale.stride(-2) == 1
    lin = replace(a, scale=a.scale.contiguous(), scale_layout="linear")
    assert torch.equal(lowbit.scaled_mm(a, b), lowbit.scaled_mm(lin, b))


@pytest.mark.parametrize(
    "alpha", [None, 1.0, 0.5, 2, torch.tensor(0.5), torch.tensor([0.5]), torch.tensor([[3.0]]), float("inf")]
)
def test_alpha_forms(operands, alpha):
    a, b = operands[VIDS[3]]
    out = lowbit.scaled_mm(a, b, alpha, out_dtype=torch.float32)
    value = 1.0 if alpha is None else float(alpha)
    base = lowbit.scaled_mm(a, b, out_dtype=torch.float32)
    want = base * torch.tensor(value, dtype=torch.float32)
    assert torch.equal(out, want) or torch.equal(out.isnan(), want.isnan())
    if value == 1.0:
        assert torch.equal(out, base)


def test_nvfp4_global_scales_are_in_dequant():
    """Two QTensors from lowbit.quantize need no alpha; raw-scale (single-level) operands take
    alpha = 1/(gs_a*gs_w), the LightX2V convention, and give the same product."""
    x, w = _x((8, 64), seed=4), _x((32, 64), seed=5)
    gs_a, gs_w = torch.tensor(2688.0) / x.abs().amax(), torch.tensor(2688.0) / w.abs().amax()
    a = lowbit.quantize(x, "nvfp4", global_scale=gs_a)
    b = lowbit.quantize(w, "nvfp4", global_scale=gs_w)
    y = lowbit.scaled_mm(a, b, out_dtype=torch.float32)
    raw_a, raw_b = replace(a, global_scale=None), replace(b, global_scale=None)
    y_raw = lowbit.scaled_mm(raw_a, raw_b, 1.0 / (gs_a * gs_w), out_dtype=torch.float32)
    torch.testing.assert_close(y_raw, y, rtol=1e-5, atol=1e-5 * y.abs().max().item())
    torch.testing.assert_close(y, x @ w.T, rtol=0.3, atol=0.3 * (x @ w.T).abs().max().item())


@pytest.mark.parametrize("bias_dtype", OUT_DTYPES)
@pytest.mark.parametrize("out_dtype", OUT_DTYPES)
def test_bias_dtypes(operands, bias_dtype, out_dtype):
    a, b = operands[VIDS[0]]
    bias = _x((N,), bias_dtype, seed=6)
    out = lowbit.scaled_mm(a, b, None, bias, out_dtype)
    assert_matches(out, a, b, None, bias, out_dtype)


def test_empty_dims():
    w = lowbit.quantize(_x((N, 64)), "nvfp4")
    a = lowbit.quantize(_x((0, 64)), "nvfp4")
    bias = _x((N,), seed=1)
    assert lowbit.scaled_mm(a, w, 2.0, bias).shape == (0, N)
    e = lowbit.quantize(_x((5, 0)), "fp8_block")
    ew = lowbit.quantize(_x((N, 0)), "fp8_block", block=(128, 128))
    out = lowbit.scaled_mm(e, ew, 2.0, bias, torch.float32)
    assert torch.equal(out, bias.expand(5, N))


def test_inputs_not_modified(operands):
    for a, b in operands.values():
        bias = _x((N,), torch.bfloat16, seed=7)
        alpha = torch.tensor([0.5])
        saved = [{k: t.clone() for k, t in q.tensors().items()} for q in (a, b)]
        before = (bias.clone(), alpha.clone(), dict(a.params), dict(b.params))
        lowbit.scaled_mm(a, b, alpha, bias)
        for q, s in zip((a, b), saved):
            for name, t in q.tensors().items():
                assert torch.equal(
                    t.view(torch.uint8) if t.element_size() == 1 else t,
                    s[name].view(torch.uint8) if t.element_size() == 1 else s[name],
                ), name
        assert torch.equal(bias, before[0]) and torch.equal(alpha, before[1])
        assert a.params == before[2] and b.params == before[3]


@settings(max_examples=30, deadline=None)
@given(
    vi=st.integers(0, len(VARIANTS) - 1),
    m=st.integers(1, 9),
    n8=st.integers(1, 20),
    k32=st.integers(1, 6),
    with_bias=st.booleans(),
    out_dtype=st.sampled_from(OUT_DTYPES),
    seed=st.integers(0, 2**16),
)
def test_random_shapes(vi, m, n8, k32, with_bias, out_dtype, seed):
    af, ao, bf, bo = VARIANTS[vi]
    n, k = 8 * n8, 32 * k32
    g = torch.Generator().manual_seed(seed)
    a = lowbit.quantize(torch.randn(m, k, generator=g), af, **ao)
    b = lowbit.quantize(torch.randn(n, k, generator=g), bf, **bo)
    bias = torch.randn(n, generator=g).to(out_dtype) if with_bias else None
    assert_matches(lowbit.scaled_mm(a, b, 1.5, bias, out_dtype), a, b, 1.5, bias, out_dtype)


# ---------------------------------------------------------------------------------- validation


def _q(fmt, shape=(4, 64), **opts):
    return lowbit.quantize(_x(shape, seed=sum(shape)), fmt, **opts)


def test_errors():
    a, w = _q("nvfp4"), _q("nvfp4", (32, 64))
    wb = _q("fp8_block", (32, 256), block=(128, 128))
    ab = _q("fp8_block", (4, 256))
    mx = _q("mxfp4", (32, 64), scale_layout="swizzled")
    b16 = torch.zeros(32, dtype=torch.bfloat16)
    cases = [
        (TypeError, "a must be a lowbit QTensor", lambda: lowbit.scaled_mm(torch.zeros(4, 64), w)),
        (TypeError, "b must be a lowbit QTensor", lambda: lowbit.scaled_mm(a, torch.zeros(32, 64))),
        (
            ValueError,
            r"unsupported pair \(a.fmt, b.fmt\) = \('nvfp4', 'mxfp4'\).*a.fmt may be",
            lambda: lowbit.scaled_mm(a, mx),
        ),
        (ValueError, "unsupported pair", lambda: lowbit.scaled_mm(_q("nf4"), w)),
        (ValueError, "unsupported pair", lambda: lowbit.scaled_mm(w, _q("fp8_rowwise", (32, 64)))),
        (
            ValueError,
            "unsupported pair",
            lambda: lowbit.scaled_mm(_q("mxfp6_e2m3"), _q("mxfp6_e2m3", (32, 64))),
        ),
        (ValueError, "2-D QTensor", lambda: lowbit.scaled_mm(_q("nvfp4", (2, 4, 64)), w)),
        (ValueError, "K mismatch", lambda: lowbit.scaled_mm(_q("nvfp4", (4, 128)), w)),
        (ValueError, r"the activation a needs block \(1, 128\)", lambda: lowbit.scaled_mm(wb, wb)),
        (ValueError, r"the activation a needs block \(1, 128\)", lambda: lowbit.scaled_mm(ab, ab)),
        (
            ValueError,
            r"block must be \(1, 128\) or \(128, 128\)",  # QTensor checks its layout when built
            lambda: lowbit.scaled_mm(replace(ab, params={"block": (1, 64)}), wb),
        ),
        (
            ValueError,
            r"scale_layout must be one of \('linear', 'column_major'\)",
            lambda: lowbit.scaled_mm(replace(ab, scale_layout="swizzled"), wb),
        ),
        (
            ValueError,
            r"scale_layout 'column_major' needs block \(1, 128\)",
            lambda: lowbit.scaled_mm(ab, replace(wb, scale_layout="column_major")),
        ),
        (
            ValueError,
            r"q.scale must have shape \(4, 2\) for shape \(4, 256\) and block \(1, 128\)",
            lambda: lowbit.scaled_mm(replace(ab, scale=ab.scale[:, :1]), wb),
        ),
        (
            TypeError,
            "scale must be float32",
            lambda: lowbit.scaled_mm(ab, replace(wb, scale=wb.scale.double())),
        ),
        (
            TypeError,
            "data must be float8_e4m3fn",
            lambda: lowbit.scaled_mm(replace(ab, data=ab.data.view(torch.uint8)), wb),
        ),
        # K not a multiple of the format's block (a QTensor built by hand)
        (
            ValueError,
            r"\(K = 40\) must be a multiple of 16",
            lambda: lowbit.scaled_mm(
                QTensor(a.data[:, :20], a.scale[:, :2], "nvfp4", (4, 40)),
                QTensor(w.data[:, :20], w.scale[:, :2], "nvfp4", (32, 40)),
            ),
        ),
        (
            ValueError,
            r"\(K = 48\) must be a multiple of 32",
            lambda: lowbit.scaled_mm(
                QTensor(mx.data[:4, :24], mx.scale, "mxfp4", (4, 48), scale_layout="swizzled"),
                QTensor(mx.data[:, :24], mx.scale, "mxfp4", (32, 48), scale_layout="swizzled"),
            ),
        ),
        (
            ValueError,
            (
                r"scale must be float8_e8m0fnu \(128, 4\) \(swizzled: \[round_up\(rows, 128\), "
                r"round_up\(K/32, 4\)\]\)"
            ),
            lambda: lowbit.scaled_mm(_q("mxfp4"), replace(mx, scale=mx.scale[:64])),
        ),
        (
            ValueError,
            r"scale must be float8_e4m3fn \(4, 4\) \(linear: \[..., K/16\]\)",
            lambda: lowbit.scaled_mm(replace(a, scale=a.scale.reshape(2, 8)), w),
        ),
        (
            ValueError,
            r"scale_layout must be one of \('linear', 'swizzled'\)",
            lambda: lowbit.scaled_mm(replace(a, scale_layout="x"), w),
        ),
        (
            TypeError,
            r"scale must be float8_e4m3fn",
            lambda: lowbit.scaled_mm(replace(a, scale=a.scale.view(torch.uint8)), w),
        ),
        (
            TypeError,
            r"data must be uint8",
            lambda: lowbit.scaled_mm(a, replace(w, data=w.data.view(torch.int8))),
        ),
        (
            ValueError,
            r"data must be uint8 \(32, 32\) .* got uint8 \(32, 16\)",
            lambda: lowbit.scaled_mm(a, replace(w, data=w.data[:, :16])),
        ),
        (
            TypeError,
            "global_scale must be None or one float32 value",
            lambda: lowbit.scaled_mm(replace(a, global_scale=a.global_scale.double()), w),
        ),
        (
            ValueError,
            r"global_scale must be None or one float32 value, got float32 \(2,\)",
            lambda: lowbit.scaled_mm(replace(a, global_scale=torch.ones(2)), w),
        ),
        (
            ValueError,
            "global_scale must be None for mxfp4",
            lambda: lowbit.scaled_mm(_q("mxfp4"), replace(mx, global_scale=torch.ones(1))),
        ),
        (
            ValueError,
            r"scale must have shape \(4, 1\) \(one scale per row\)",
            lambda: lowbit.scaled_mm(replace(r := _q("fp8_rowwise"), scale=r.scale.reshape(4)), w),
        ),
        # alpha
        (
            TypeError,
            "alpha must be a float32 scalar tensor",
            lambda: lowbit.scaled_mm(a, w, torch.tensor(1.0).double()),
        ),
        (
            TypeError,
            "alpha must be a float32 scalar tensor",
            lambda: lowbit.scaled_mm(a, w, torch.tensor(1, dtype=torch.int32)),
        ),
        (TypeError, "1-element", lambda: lowbit.scaled_mm(a, w, torch.ones(2))),
        (TypeError, "1-element", lambda: lowbit.scaled_mm(a, w, torch.ones(0))),
        (TypeError, "alpha must be None, a Python float", lambda: lowbit.scaled_mm(a, w, True)),
        (TypeError, "alpha must be None, a Python float", lambda: lowbit.scaled_mm(a, w, "2")),
        (TypeError, "alpha must be None, a Python float", lambda: lowbit.scaled_mm(a, w, [1.0])),
        (ValueError, "devices differ.*alpha", lambda: lowbit.scaled_mm(a, w, torch.ones(1, device="meta"))),
        # bias
        (ValueError, r"bias must have shape \[N\] = \(32,\)", lambda: lowbit.scaled_mm(a, w, None, b16[:31])),
        (ValueError, r"bias must have shape \[N\]", lambda: lowbit.scaled_mm(a, w, None, b16.reshape(1, 32))),
        (
            TypeError,
            "bias must be bfloat16, float16 or float32",
            lambda: lowbit.scaled_mm(a, w, None, b16.double()),
        ),
        (
            TypeError,
            "bias must be None or a torch.Tensor",
            lambda: lowbit.scaled_mm(a, w, None, b16.tolist()),
        ),
        (ValueError, "devices differ.*bias", lambda: lowbit.scaled_mm(a, w, None, b16.to("meta"))),
        # out dtype, devices, backend
        (TypeError, "out_dtype must be", lambda: lowbit.scaled_mm(a, w, out_dtype=torch.float64)),
        (TypeError, "out_dtype must be", lambda: lowbit.scaled_mm(a, w, out_dtype="bfloat16")),
        (
            ValueError,
            "devices differ: a.data is on cpu, b.data on meta",
            lambda: lowbit.scaled_mm(a, w.to("meta")),
        ),
        (ValueError, "backend must be one of", lambda: lowbit.scaled_mm(a, w, backend="cuda")),
        (ValueError, "backend='triton' needs CUDA", lambda: lowbit.scaled_mm(a, w, backend="triton")),
    ]
    for exc, match, fn in cases:
        with pytest.raises(exc, match=match):
            fn()
    # the reference validates the same way
    with pytest.raises(ValueError, match="K mismatch"):
        scaled_mm_reference(_q("nvfp4", (4, 128)), w)


def test_scaled_linear_errors():
    w = _q("nvfp4", (32, 64))
    x = _x((4, 64), torch.bfloat16)
    cases = [
        (TypeError, "w must be a lowbit QTensor", lambda: scaled_linear(x, torch.zeros(32, 64), "nvfp4")),
        (ValueError, "w must be a 2-D weight", lambda: scaled_linear(x, _q("nvfp4", (2, 32, 64)), "nvfp4")),
        (TypeError, "x must be a torch.Tensor", lambda: scaled_linear(x.tolist(), w, "nvfp4")),
        (TypeError, "x must be bfloat16, float16 or float32", lambda: scaled_linear(x.double(), w, "nvfp4")),
        (ValueError, "K mismatch", lambda: scaled_linear(_x((4, 32)), w, "nvfp4")),
        (
            ValueError,
            (
                "act_format 'mxfp4' does not pair with weight format 'nvfp4'; allowed: fp8_block, "
                "fp8_rowwise, nvfp4"
            ),
            lambda: scaled_linear(x, w, "mxfp4"),
        ),
        (
            ValueError,
            "no scaled_mm pair has weight format 'nf4'",
            lambda: scaled_linear(x, _q("nf4", (32, 64)), "nvfp4"),
        ),
        (ValueError, "does not pair", lambda: scaled_linear(x, w, None)),
        (
            TypeError,
            "act_options must be None or a dict",
            lambda: scaled_linear(x, w, "nvfp4", act_options=[1]),
        ),
        (
            ValueError,
            "act_global_scale is for nvfp4 activations only",
            lambda: scaled_linear(x, w, "fp8_rowwise", act_global_scale=torch.tensor(1.0)),
        ),
        (
            ValueError,
            "either as act_global_scale or in act_options",
            lambda: scaled_linear(x, w, "nvfp4", act_options={"global_scale": 2.0}, act_global_scale=2.0),
        ),
        (ValueError, "unknown option", lambda: scaled_linear(x, w, "nvfp4", act_options={"block": (1, 128)})),
        (
            ValueError,
            r"the activation a needs block \(1, 128\)",
            lambda: scaled_linear(
                _x((4, 256)),
                _q("fp8_block", (32, 256), block=(128, 128)),
                "fp8_block",
                act_options={"block": (128, 128)},
            ),
        ),
        (TypeError, "out_dtype must be", lambda: scaled_linear(x, w, "nvfp4", out_dtype=torch.int8)),
        (
            ValueError,
            r"bias must have shape \[N\]",
            lambda: scaled_linear(x, w, "nvfp4", bias=torch.zeros(3)),
        ),
        (TypeError, "alpha must be", lambda: scaled_linear(x, w, "nvfp4", alpha="x")),
        (
            ValueError,
            "global_scale must be finite and > 0",
            lambda: scaled_linear(x, w, "nvfp4", act_global_scale=torch.tensor(-1.0)),
        ),
    ]
    for exc, match, fn in cases:
        with pytest.raises(exc, match=match):
            fn()


# ---------------------------------------------------------------------------------- scaled_linear


LINEAR_CASES = [
    ("nvfp4", {}, "nvfp4", {}),
    ("fp8_block", {}, "fp8_block", {"block": (128, 128)}),
    ("fp8_block", {"scale_fmt": "ue8m0", "scale_layout": "column_major"}, "fp8_block", {"block": (128, 128)}),
    ("mxfp4", {"scale_layout": "swizzled"}, "mxfp4", {}),
    ("mxfp8_e4m3", {}, "mxfp8_e4m3", {}),
    ("mxfp6_e3m2", {}, "mxfp8_e4m3", {}),
    ("fp8_rowwise", {}, "mxfp4", {}),
    ("fp8_block", {}, "nvfp4", {}),
]


@pytest.mark.parametrize("case", LINEAR_CASES, ids=[f"{c[0]}x{c[2]}" for c in LINEAR_CASES])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_scaled_linear_is_quantize_then_scaled_mm(case, dtype):
    af, ao, wf, wo = case
    w = lowbit.quantize(_x((48, 256), seed=8) * 0.1, wf, **wo)
    x = _x((2, 3, 256), dtype, seed=9)
    bias = _x((48,), torch.bfloat16, seed=10)
    out = scaled_linear(x, w, af, act_options=ao, bias=bias, alpha=0.5)
    assert out.shape == (2, 3, 48) and out.dtype == dtype
    a = lowbit.quantize(x.reshape(6, 256), af, **ao)
    assert torch.equal(out.reshape(6, 48), lowbit.scaled_mm(a, w, 0.5, bias, dtype))
    assert_matches(out.reshape(6, 48), a, w, 0.5, bias, dtype)
    # the float32 result is close to the unquantized product (quantization error of both operands)
    y = scaled_linear(x, w, af, act_options=ao, out_dtype=torch.float32)
    exact = x.float().reshape(6, 256) @ lowbit.dequantize(w).T
    assert ((y.reshape(6, 48) - exact).norm() / exact.norm()).item() < 0.2


def test_scaled_linear_static_and_dynamic_nvfp4_global_scale():
    w = _q("nvfp4", (32, 64))
    x = _x((5, 64), torch.bfloat16, seed=11)
    gs = torch.tensor(2688.0) / 8.0
    static = scaled_linear(x, w, "nvfp4", act_global_scale=gs)
    a = lowbit.quantize(x, "nvfp4", global_scale=gs)
    assert torch.equal(static, lowbit.scaled_mm(a, w, out_dtype=torch.bfloat16))
    assert torch.equal(scaled_linear(x, w, "nvfp4", act_global_scale=336.0), static)
    dynamic = scaled_linear(x, w, "nvfp4")
    assert torch.equal(dynamic, lowbit.scaled_mm(lowbit.quantize(x, "nvfp4"), w, out_dtype=torch.bfloat16))


@pytest.mark.parametrize("shape", [(64,), (1, 64), (7, 64), (2, 3, 64), (2, 1, 5, 64), (0, 64), (3, 0, 64)])
def test_scaled_linear_leading_dims(shape):
    w = _q("mxfp8_e4m3", (32, 64))
    x = _x(shape, torch.bfloat16, seed=12)
    out = scaled_linear(x, w, "mxfp8_e4m3")
    assert out.shape == (*shape[:-1], 32) and out.dtype == torch.bfloat16
    if x.numel():
        flat = scaled_linear(x.reshape(-1, 64), w, "mxfp8_e4m3")
        assert torch.equal(out.reshape(-1, 32), flat)


def test_scaled_linear_non_contiguous_x():
    w = _q("fp8_block", (32, 256), block=(128, 128))
    x = _x((256, 6), torch.bfloat16).T
    assert not x.is_contiguous()
    assert torch.equal(scaled_linear(x, w, "fp8_block"), scaled_linear(x.contiguous(), w, "fp8_block"))


# ---------------------------------------------------------------------------------- dispatch


def test_explain_cpu(operands):
    a, b = operands[VIDS[0]]
    text = smm_dispatch.explain_scaled_mm(a, b)
    assert text.startswith(f"lowbit.scaled_mm fp8_block x fp8_block [M={M}, K={K}] x [N={N}, K={K}] on cpu")
    assert "reference" in text
    plan = smm_dispatch.plan_scaled_mm(a, b, backend="torch")
    assert (plan.path, plan.backend, plan.m, plan.n, plan.k, plan.kind) == (
        "reference",
        "torch",
        M,
        N,
        K,
        "fp8_block",
    )
    plan = smm_dispatch.plan_scaled_mm(a, b, backend="triton")
    assert plan.path == "unavailable" and plan.error is ValueError
    assert "raises ValueError" in smm_dispatch.explain_scaled_mm(a, b, backend="triton")
    with pytest.raises(ValueError, match=r"the activation a needs block \(1, 128\)"):
        smm_dispatch.explain_scaled_mm(b, a)


def _stand_in(reason=None, calls=None, routes=()):
    """A kernel module that can run the routes in ``routes`` (besides "kernel") and records its calls."""

    def kernel(a, b, alpha, bias, out_dtype, route):
        if calls is not None:
            calls.append((a.fmt, b.fmt, alpha, bias, out_dtype, route))
        return scaled_mm_reference(a, b, alpha, bias, out_dtype)

    def capability(name):
        return lambda *args: None if name in routes else f"stand-in: no {name}"

    return SimpleNamespace(supports=lambda a, b: reason, scaled_mm=kernel, gemv_unsupported=capability("gemv"),
                           fold_unsupported=capability("fold"), cublas_unsupported=capability("cublas"))


@pytest.fixture
def kernels(monkeypatch):
    """Replace the kernel-module lookup: ``kernels["scaled_mm"] = module or None``."""
    table = {"scaled_mm": None}
    monkeypatch.setattr(policy, "kernel_module", lambda name: table[name])
    monkeypatch.setattr("lowbit.kernels.triton_available", lambda: None)
    return table


CUDA = torch.device("cuda", 0)


def _path(a, b, backend="auto", device=CUDA, m=None):
    m = a.shape[0] if m is None else m
    path, target, facts = policy.scaled_decide(m, b.shape[0], a.shape[1], device, a, b, backend)
    return SimpleNamespace(path=path, target=target, reason=policy.scaled_reason(path, facts, device, a, b))


def test_dispatch_rules(operands, kernels):
    a, b = operands[VIDS[3]]
    kernels["scaled_mm"] = _stand_in()
    assert _path(a, b).path == "scaled_mm"
    assert _path(a, b, "triton").path == "scaled_mm"
    assert _path(a, b, m=0).path == "empty"
    assert _path(a, b, "torch").path == "reference"
    assert _path(a, b, "auto", torch.device("cpu")).path == "reference"
    plan = _path(a, b, "triton", torch.device("cpu"))
    assert plan.path == "unavailable" and plan.target is ValueError
    # a kernel module that declines, or none at all: an error naming the reason, never a silent reference
    kernels["scaled_mm"] = _stand_in(reason="swizzled nvfp4 scales not yet")
    plan = _path(a, b)
    assert plan.path == "unavailable" and plan.target is RuntimeError
    assert "swizzled nvfp4 scales not yet" in plan.reason and "backend='torch'" in plan.reason
    kernels["scaled_mm"] = None
    plan = _path(a, b)
    assert plan.path == "unavailable" and "no module lowbit.kernels.scaled_mm" in plan.reason
    assert _path(a, b, "torch").path == "reference"


def test_dispatch_no_triton(operands, kernels, monkeypatch):
    monkeypatch.setattr("lowbit.kernels.triton_available", lambda: "triton cannot be imported (boom)")
    kernels["scaled_mm"] = _stand_in()
    plan = _path(*operands[VIDS[0]])
    assert plan.path == "unavailable" and "triton cannot be imported" in plan.reason


def test_run_calls_the_kernel(operands, kernels, monkeypatch):
    """The CPU stand-in for CUDA: the kernel gets alpha as float32 [1] (or None), a contiguous bias, out_dtype."""
    calls = []
    kernels["scaled_mm"] = _stand_in(calls=calls)
    real_decide = policy.scaled_decide
    monkeypatch.setattr(
        policy, "scaled_decide", lambda m, n, k, device, a, b, backend: real_decide(m, n, k, CUDA, a, b, backend)
    )
    a, b = operands[VIDS[16]]
    bias = _x((2 * N,), torch.float16)[::2]
    assert not bias.is_contiguous()
    out = lowbit.scaled_mm(a, b, 0.25, bias, torch.float16)
    ((af, bf, alpha, kb, odt, route),) = calls
    assert (af, bf, odt, route) == ("fp8_rowwise", "nvfp4", torch.float16, "kernel")
    assert alpha.dtype == torch.float32 and alpha.shape == (1,) and alpha.item() == 0.25
    assert kb.is_contiguous() and torch.equal(kb, bias)
    assert torch.equal(out, scaled_mm_reference(a, b, 0.25, bias, torch.float16))
    lowbit.scaled_mm(a, b, torch.tensor(1.0))
    assert calls[-1][2].shape == (1,) and calls[-1][3] is None
    lowbit.scaled_mm(a, b, 1.0)
    assert calls[-1][2] is None  # alpha 1.0 becomes None: no multiply
    # M == 0 launches nothing and returns alpha * 0 + bias
    e = lowbit.quantize(_x((0, K)), "fp8_rowwise")
    assert lowbit.scaled_mm(e, b, 2.0, bias).shape == (0, N) and len(calls) == 3
    # scaled_linear quantizes and goes through the same dispatch
    scaled_linear(_x((2, 4, K), torch.bfloat16), b, "fp8_rowwise")
    assert calls[-1][:2] == ("fp8_rowwise", "nvfp4") and len(calls) == 4
    kernels["scaled_mm"] = None
    with pytest.raises(RuntimeError, match="no triton kernel runs lowbit.scaled_mm for fp8_rowwise x nvfp4"):
        lowbit.scaled_mm(a, b)


def test_kernel_module_lookup():
    policy.kernel_module.cache_clear()
    assert policy.kernel_module("no_such_kernel_module") is None
    policy.kernel_module.cache_clear()


# ---------------------------------------------------------------------------------- custom ops


def _op_args(a, b, alpha=None, bias=None, out_dtype=torch.bfloat16, backend="auto"):
    a_t, a_meta = smm_op.flatten(a)
    b_t, b_meta = smm_op.flatten(b)
    return (
        *a_t,
        a.fmt,
        list(a.shape),
        a_meta,
        *b_t,
        b.fmt,
        list(b.shape),
        b_meta,
        alpha,
        bias,
        out_dtype,
        backend,
    )


@pytest.mark.parametrize("vid", VIDS)
def test_flatten_round_trip(operands, vid):
    for q in operands[vid]:
        tensors, meta = smm_op.flatten(q)
        r = smm_op._unflatten(*tensors, q.fmt, list(q.shape), meta)
        assert (r.fmt, r.shape, r.dtype, r.scale_layout) == (q.fmt, q.shape, q.dtype, q.scale_layout)
        assert r.params.keys() == q.params.keys()
        for k, v in q.params.items():
            assert torch.equal(r.params[k], v) if isinstance(v, torch.Tensor) else r.params[k] == v, k
        assert all(r.tensors()[k] is t for k, t in q.tensors().items())


def test_flatten_rejects_unencodable_params(operands):
    q = replace(operands[VIDS[7]][0], params={"scale_rounding": "a;b"})
    with pytest.raises(TypeError, match="cannot pass the QTensor param"):
        smm_op.flatten(q)


@pytest.mark.parametrize("vid", [VIDS[0], VIDS[4], VIDS[5], VIDS[11], VIDS[16]])
def test_custom_op_opcheck(operands, vid):
    a, b = operands[vid]
    utils = ["test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic"]
    op = torch.ops.lowbit.scaled_mm.default
    torch.library.opcheck(op, _op_args(a, b, torch.tensor([0.5]), _x((N,), torch.bfloat16)), test_utils=utils)
    torch.library.opcheck(op, _op_args(a, b, None, None, torch.float32, "torch"), test_utils=utils)


def test_custom_op_eager_equals_scaled_mm(operands):
    a, b = operands[VIDS[2]]
    bias = _x((N,), torch.float32)
    out = torch.ops.lowbit.scaled_mm(*_op_args(a, b, torch.tensor([0.5]), bias, torch.float16))
    assert torch.equal(out, lowbit.scaled_mm(a, b, 0.5, bias, torch.float16))


def test_fake_impl_shapes(operands):
    from torch._subclasses.fake_tensor import FakeTensorMode

    _, b = operands[VIDS[3]]
    cases = [
        (lowbit.quantize(_x((m, K)), "nvfp4"), m, dt)
        for m, dt in [(1, torch.bfloat16), (17, torch.float32), (0, torch.float16)]
    ]
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        for a, m, dt in cases:
            fa = replace(a, **{k: mode.from_tensor(t) for k, t in a.tensors().items()})
            out = torch.ops.lowbit.scaled_mm(*_op_args(fa, b, None, None, dt))
            assert out.shape == (m, N) and out.dtype == dt
    am, bm = lowbit.quantize(_x((9, K)), "nvfp4").to("meta"), b.to("meta")
    out = torch.ops.lowbit.scaled_mm(*_op_args(am, bm))
    assert out.shape == (9, N) and out.device.type == "meta"


@pytest.fixture
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


class _GraphRecorder:
    def __init__(self):
        self.graphs = []

    def __call__(self, gm, example_inputs):
        self.graphs.append(gm)
        return gm.forward


def _targets(rec):
    return [str(n.target) for g in rec.graphs for n in g.graph.nodes if n.op == "call_function"]


@pytest.mark.parametrize("backend", ["auto", "torch"])
def test_compile_fullgraph_emits_the_ops(operands, backend, fresh_dynamo):
    a, b = operands[VIDS[1]]
    bias = _x((N,), torch.bfloat16)
    rec = _GraphRecorder()

    @torch.compile(fullgraph=True, backend=rec)
    def f(a, x):
        y = lowbit.scaled_mm(a, b, 0.5, bias, backend=backend) * 2
        return y, scaled_linear(
            x, b, "fp8_block", act_options={"scale_fmt": "ue8m0"}, bias=bias, backend=backend
        )

    x = _x((5, K), torch.bfloat16)
    y, z = f(a, x)
    assert torch.equal(y, lowbit.scaled_mm(a, b, 0.5, bias) * 2)
    assert torch.equal(z, scaled_linear(x, b, "fp8_block", act_options={"scale_fmt": "ue8m0"}, bias=bias))
    assert len(rec.graphs) == 1
    targets = _targets(rec)
    assert any(t.startswith("lowbit.scaled_mm") for t in targets), targets
    assert any(t.startswith("lowbit.scaled_linear") for t in targets), targets


@pytest.mark.parametrize("compile_backend", ["aot_eager", "inductor"])
@pytest.mark.parametrize("case", LINEAR_CASES, ids=[f"{c[0]}x{c[2]}" for c in LINEAR_CASES])
def test_compile_matches_eager(case, compile_backend, fresh_dynamo):
    af, ao, wf, wo = case
    w = lowbit.quantize(_x((48, 256), seed=13), wf, **wo)
    bias = _x((48,), torch.float16)
    gs = torch.tensor(300.0) if af == "nvfp4" else None

    def f(x, w, bias):
        return scaled_linear(x, w, af, act_options=ao, act_global_scale=gs, bias=bias, alpha=0.5) + 1

    cf = torch.compile(f, fullgraph=True, backend=compile_backend)
    for shape in [(1, 256), (4, 5, 256)]:
        x = _x(shape, torch.float16, seed=shape[0])
        assert torch.equal(cf(x, w, bias), f(x, w, bias))


def test_compile_scaled_mm_on_prequantized(operands, fresh_dynamo):
    a, b = operands[VIDS[9]]
    for compile_backend in ("aot_eager", "inductor"):
        cf = torch.compile(
            lambda a, b: lowbit.scaled_mm(a, b, 2.0, None, torch.float32) + 1,
            fullgraph=True,
            backend=compile_backend,
        )
        assert torch.equal(cf(a, b), lowbit.scaled_mm(a, b, 2.0, None, torch.float32) + 1)


def test_compile_dynamic_m_does_not_recompile(fresh_dynamo):
    w = _q("mxfp4", (32, 64))
    counter = torch._dynamo.testing.CompileCounter()
    cf = torch.compile(
        lambda x: scaled_linear(x, w, "fp8_rowwise"), fullgraph=True, dynamic=True, backend=counter
    )
    for m in (3, 16, 17, 40, 1000):
        x = _x((m, 64), torch.bfloat16)
        assert torch.equal(cf(x), scaled_linear(x, w, "fp8_rowwise"))
    assert counter.frame_count == 1


def test_compile_reports_validation_errors(fresh_dynamo):
    w = _q("nvfp4", (32, 64))
    cf = torch.compile(lambda x: scaled_linear(x, w, "nvfp4"), fullgraph=True, backend="eager")
    with pytest.raises(Exception, match="K mismatch"):
        cf(_x((2, 100), torch.bfloat16))


def test_scaled_linear_op_opcheck():
    w = _q("fp8_block", (32, 256), block=(128, 128))
    x = _x((5, 256), torch.bfloat16)
    w_t, w_meta = smm_op.flatten(w)
    act_tensors: list = []
    act_meta = ";".join(
        smm_op.encode(k, v, act_tensors) for k, v in sorted({"scale_fmt": "ue8m0", "block": (1, 128)}.items())
    )
    args = (
        x,
        *w_t,
        w.fmt,
        list(w.shape),
        w_meta,
        "fp8_block",
        act_meta,
        act_tensors,
        None,
        _x((32,), torch.bfloat16),
        torch.bfloat16,
        "auto",
    )
    torch.library.opcheck(
        torch.ops.lowbit.scaled_linear.default,
        args,
        test_utils=["test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic"],
    )
    out = torch.ops.lowbit.scaled_linear(*args)
    assert torch.equal(
        out, scaled_linear(x, w, "fp8_block", act_options={"scale_fmt": "ue8m0"}, bias=args[-3])
    )


def test_cpu_scaled_mm_needs_no_triton():
    code = textwrap.dedent(
        """
        import sys, torch
        sys.modules["triton"] = None
        import lowbit
        from lowbit.ops import scaled_linear, explain_scaled_mm
        w = lowbit.quantize(torch.randn(16, 64), "nvfp4")
        a = lowbit.quantize(torch.randn(2, 64), "fp8_rowwise")
        assert lowbit.scaled_mm(a, w).shape == (2, 16)
        assert scaled_linear(torch.randn(3, 64, dtype=torch.bfloat16), w, "nvfp4").shape == (3, 16)
        print(explain_scaled_mm(a, w))
        assert "triton" not in [m for m in sys.modules if sys.modules[m] is not None]
        print("ok")
        """
    )
    out = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().endswith("ok")
