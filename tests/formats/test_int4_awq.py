"""int4_awq: AutoAWQ's INT4 group quantization (GEMM layout), checked bit for bit.

The interop tests run AutoAWQ 0.2.9's own code on CPU: ``AwqQuantizer.pseudo_quantize_tensor`` (compiled
from the installed quantizer.py, whose module imports need accelerate/datasets) and
``WQLinear_GEMM.from_linear`` (gemm.py loaded by path with its two unavailable helpers stubbed). The glue
between them is ``AwqQuantizer._apply_quant``'s four lines (cast the layer to fp16, quantize, transpose
scales/zeros, ``from_linear``), re-typed in :func:`_autoawq_pipeline` from the source.
"""

from __future__ import annotations

import ast
import contextlib
import importlib.util
import pathlib
import sys
import types

import pytest
import torch

import lowbit
from lowbit.formats.int4_awq import (
    AWQ_ORDER,
    check_int4_awq,
    dequantize_int4_awq,
    pack_awq,
    pack_int4_sequential,
    quantize_int4_awq,
    unpack_awq,
    unpack_int4_sequential,
)
from lowbit.formats.qtensor import QTensor

FP16_EPS_1E5 = torch.tensor(1e-5, dtype=torch.float16)


def _bits16(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int16)


def _int_codes(q: QTensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes [out, in], zeros [out, in/g]) in the logical orientation."""
    return unpack_awq(q.data).t(), unpack_awq(q.zeros).t()


# ---------------------------------------------------------------- AutoAWQ loaded from site-packages


def _awq_dir() -> pathlib.Path:
    spec = importlib.util.find_spec("awq")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("autoawq is not installed")
    return pathlib.Path(list(spec.submodule_search_locations)[0])


def _load(name: str, path: pathlib.Path) -> types.ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


@contextlib.contextmanager
def _scratch_awq_modules():
    """Let gemm.py's ``from awq.utils...`` imports resolve to stubs, then restore sys.modules."""
    saved = {k: v for k, v in sys.modules.items() if k == "awq" or k.startswith("awq.")}
    for k in saved:
        del sys.modules[k]
    try:
        for pkg in ("awq", "awq.utils", "awq.modules", "awq.modules.linear"):
            stub = types.ModuleType(pkg)
            stub.__path__ = []
            sys.modules[pkg] = stub
        utils = types.ModuleType("awq.utils.utils")
        utils.get_best_device = lambda: "cpu"  # the real module imports accelerate
        sys.modules["awq.utils.utils"] = utils
        sys.modules["awq.modules.triton"] = None  # gemm.py then takes its no-triton branch
        yield
    finally:
        for k in [k for k in sys.modules if k == "awq" or k.startswith("awq.")]:
            del sys.modules[k]
        sys.modules.update(saved)


@pytest.fixture(scope="module")
def autoawq() -> types.SimpleNamespace:
    root = _awq_dir()
    with _scratch_awq_modules():
        _load("awq.utils.module", root / "utils" / "module.py")
        packing_utils = _load("awq.utils.packing_utils", root / "utils" / "packing_utils.py")
        gemm = _load("awq.modules.linear.gemm", root / "modules" / "linear" / "gemm.py")
    source = root / "quantize" / "quantizer.py"
    tree = ast.parse(source.read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "AwqQuantizer")
    fn = next(n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "pseudo_quantize_tensor")
    namespace = {"torch": torch}
    exec(compile(ast.Module(body=[fn], type_ignores=[]), str(source), "exec"), namespace)
    return types.SimpleNamespace(
        pseudo_quantize_tensor=namespace["pseudo_quantize_tensor"],
        WQLinear_GEMM=gemm.WQLinear_GEMM,
        packing_utils=packing_utils,
    )


def _autoawq_pipeline(ref: types.SimpleNamespace, w: torch.Tensor, group_size: int):
    """``AwqQuantizer._apply_quant`` for one Linear with version="gemm" (w_bit=4, zero_point=True)."""
    quantizer = types.SimpleNamespace(group_size=group_size, zero_point=True, w_bit=4)
    linear = torch.nn.Linear(w.shape[1], w.shape[0], bias=False, dtype=w.dtype)
    linear.weight.data = w.clone()
    linear = linear.half()
    linear.weight.data, scales, zeros = ref.pseudo_quantize_tensor(quantizer, linear.weight.data)
    scales = scales.t().contiguous()
    zeros = zeros.t().contiguous()
    return ref.WQLinear_GEMM.from_linear(linear, 4, group_size, init_only=False, scales=scales, zeros=zeros)


# ---------------------------------------------------------------- weights with every edge case

TIE_UNIT = 2.0**-6


def _tie_group(group_size: int) -> torch.Tensor:
    """min -2.5u, max 12.5u -> s = u exactly; every other value is an odd multiple of u/2 (a .5 tie)."""
    halves = torch.arange(-1.5, 12.0, 1.0)
    vals = torch.cat([torch.tensor([-2.5, 12.5]), halves.repeat(group_size)])[:group_size]
    return vals * TIE_UNIT


def _edge_weight(dtype: torch.dtype, group_size: int, seed: int) -> torch.Tensor:
    """[32, 256]: random rows plus one adversarial group per row 0..11."""
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(32, 256, generator=gen) * 0.05
    w[16:24] *= 200.0
    g = slice(0, group_size)
    w[0, g] = 0.25  # max == min: the 1e-5 clamp on the range
    w[1, g] = 0.0  # zero group inside a nonzero tensor
    w[2, g] = -0.3  # constant negative group
    w[3, g] = w[3, g].abs()  # only positives -> zero point 0
    w[4, g] = -w[4, g].abs() - 0.01  # only negatives -> zero point 15
    w[5, g] = _tie_group(group_size)
    w[6, g] = torch.randn(group_size, generator=gen) * 1e-7  # below the clamp, fp16 subnormals
    w[7, g] = torch.linspace(-30000.0, 30000.0, group_size)  # range 60000: largest fp16 scales
    # +-max of fp16 (bf16 rounds 65504 up to 65536, past fp16's range, so use its largest value below)
    top, step = (65280.0, 256.0) if dtype == torch.bfloat16 else (65504.0, 32.0)
    w[8, g] = top - torch.arange(group_size) * step
    w[9, g] = -w[8, g]
    w[10, g] = torch.tensor([0.0, 1e-5]).repeat(group_size // 2)  # range right at the clamp
    w[11, ::2] = w[11, 1::2]  # repeated values everywhere in the row
    return w.to(dtype)


# ---------------------------------------------------------------- packing


def test_pack_awq_golden_word():
    cols = torch.arange(8, dtype=torch.int32).reshape(1, 8)
    assert pack_awq(cols).tolist() == [[0x75316420]]
    assert unpack_awq(torch.tensor([[0x75316420]], dtype=torch.int32)).tolist() == [list(range(8))]


def test_pack_awq_nibble_positions():
    for col in range(8):
        row = torch.zeros(1, 16, dtype=torch.int32)
        row[0, 8 + col] = 0xA
        nibble = AWQ_ORDER.index(col)
        word = 0xA << (4 * nibble)
        # a set top nibble makes the int32 negative: the same bits AutoAWQ's int32 shifts produce
        expected = word - (1 << 32) if word >= 1 << 31 else word
        assert pack_awq(row).tolist() == [[0, expected]]


def test_pack_awq_round_trip_and_sign_bit():
    gen = torch.Generator().manual_seed(3)
    vals = torch.randint(0, 16, (5, 64), generator=gen, dtype=torch.int32)
    vals[0] = 15
    packed = pack_awq(vals)
    assert packed.dtype == torch.int32 and packed.shape == (5, 8)
    assert packed[0].tolist() == [-1] * 8
    assert torch.equal(unpack_awq(packed), vals)
    assert torch.equal(pack_awq(vals.to(torch.uint8)), packed)


def test_pack_sequential_golden_and_padding():
    assert pack_int4_sequential(torch.arange(8).reshape(1, 8)).tolist() == [[0x76543210]]
    # dim 0: element 8w + k of a column goes to nibble k of word w
    col = torch.arange(16).reshape(16, 1) % 16
    assert pack_int4_sequential(col, dim=0).tolist() == [[0x76543210], [0xFEDCBA98 - (1 << 32)]]
    # 10 values -> 2 words, the tail padded with nibble 0
    ten = torch.tensor([[1] * 10])
    assert pack_int4_sequential(ten).tolist() == [[0x11111111, 0x11]]
    assert unpack_int4_sequential(pack_int4_sequential(ten), 10).tolist() == ten.tolist()
    gen = torch.Generator().manual_seed(4)
    vals = torch.randint(0, 16, (24, 7), generator=gen)
    packed = pack_int4_sequential(vals, dim=0)
    assert torch.equal(unpack_int4_sequential(packed, 24, dim=0), vals.to(torch.int32))


@pytest.mark.parametrize(
    "values, err, match",
    [
        (torch.tensor([[16] + [0] * 7]), ValueError, r"\[0, 15\]"),
        (torch.tensor([[-1] + [0] * 7]), ValueError, r"\[0, 15\]"),
        (torch.zeros(1, 8), TypeError, "integer"),
        (torch.zeros(1, 6, dtype=torch.int32), ValueError, "cols % 8"),
        (torch.zeros(8, dtype=torch.int32), ValueError, "2-D"),
    ],
)
def test_pack_awq_rejects(values, err, match):
    with pytest.raises(err, match=match):
        pack_awq(values)


def test_unpack_rejects():
    with pytest.raises(TypeError, match="int32"):
        unpack_awq(torch.zeros(2, 2, dtype=torch.int64))
    with pytest.raises(ValueError, match="ceil"):
        unpack_int4_sequential(torch.zeros(2, 2, dtype=torch.int32), 20)


# ---------------------------------------------------------------- quantization, hand-computed


def test_ties_round_half_to_even():
    gs = 32
    w = torch.zeros(8, gs, dtype=torch.float16)
    w[:] = _tie_group(gs).to(torch.float16)
    q = quantize_int4_awq(w, gs)
    codes, zeros = _int_codes(q)
    # s = 15u/15 = u exactly; z = -round(-2.5) = 2 (half-to-even; half-away-from-zero would give 3)
    assert q.scale[0, 0].item() == TIE_UNIT
    assert zeros.unique().tolist() == [2]
    v = (w[0].float() / TIE_UNIT).tolist()
    expected = [min(max(int(torch.round(torch.tensor(x)).item()) + 2, 0), 15) for x in v]
    assert codes[0].tolist() == expected
    # spot checks: -1.5 -> -2 + 2 = 0; -0.5 -> 0 + 2; 0.5 -> 0 + 2; 1.5 -> 2 + 2; 2.5 -> 2 + 2; 12.5 -> 12 + 2
    assert [codes[0, i].item() for i in (2, 3, 4, 5, 6, 1)] == [0, 2, 2, 4, 4, 14]


def test_constant_groups_and_one_sided_groups():
    gs = 32
    w = torch.zeros(8, 2 * gs, dtype=torch.float16)
    w[0, :gs] = 0.25
    w[1, :gs] = -0.3
    w[2, :gs] = torch.linspace(0.1, 1.6, gs)  # only positives
    w[3, :gs] = torch.linspace(-1.6, -0.1, gs)  # only negatives
    w[:, gs:] = torch.linspace(-1.0, 1.0, gs)
    q = quantize_int4_awq(w, gs)
    codes, zeros = _int_codes(q)
    clamp_scale = (FP16_EPS_1E5 / 15).item()
    # max == min: the range clamps to fp16(1e-5), so a positive constant saturates at code 15 with zero 0,
    # a negative one at code 0 with zero 15 (AutoAWQ loses the constant; we reproduce that)
    assert q.scale[0, 0].item() == clamp_scale and q.scale[0, 1].item() == clamp_scale
    assert zeros[0, 0].item() == 0 and codes[0, :gs].unique().tolist() == [15]
    assert zeros[1, 0].item() == 15 and codes[1, :gs].unique().tolist() == [0]
    assert zeros[2, 0].item() == 0
    assert zeros[3, 0].item() == 15
    assert codes[2, :gs].max().item() == 15 and codes[3, :gs].min().item() == 0
    # the zero group of rows 4..7 has scale fp16(1e-5)/15, zero 0 and codes 0
    assert zeros[4:, 0].unique().tolist() == [0] and codes[4:, :gs].unique().tolist() == [0]
    deq = dequantize_int4_awq(q, torch.float16)
    assert torch.equal(_bits16(deq[4:, :gs]), _bits16(torch.zeros(4, gs, dtype=torch.float16)))


def test_quantize_matches_formula_in_fp16():
    """The integers agree with pseudo_quantize_tensor's first pass; the scales are its fp16 scales."""
    w = _edge_weight(torch.float16, 64, seed=5)
    q = quantize_int4_awq(w, 64)
    wg = w.reshape(32, 4, 64)
    mx, mn = wg.amax(-1, keepdim=True), wg.amin(-1, keepdim=True)
    s = (mx - mn).clamp(min=1e-5) / 15
    z = (-torch.round(mn / s)).clamp(0, 15)
    first_pass = torch.clamp(torch.round(wg / s) + z, 0, 15).to(torch.int32).reshape(32, 256)
    codes, zeros = _int_codes(q)
    assert torch.equal(codes, first_pass)
    assert torch.equal(zeros, z.to(torch.int32).reshape(32, 4))
    assert torch.equal(_bits16(q.scale), _bits16(s.reshape(32, 4).t()))


def test_bf16_and_fp32_quantize_their_fp16_image():
    w = _edge_weight(torch.float32, 32, seed=6)
    wbf = _edge_weight(torch.bfloat16, 32, seed=6)
    q32 = quantize_int4_awq(w, 32)
    q16 = quantize_int4_awq(w.half(), 32)
    qbf = quantize_int4_awq(wbf, 32)
    qbf16 = quantize_int4_awq(wbf.half(), 32)
    for a, b in ((q32, q16), (qbf, qbf16)):
        assert torch.equal(a.data, b.data) and torch.equal(a.zeros, b.zeros)
        assert torch.equal(_bits16(a.scale), _bits16(b.scale))
    assert q32.dtype == torch.float32 and qbf.dtype == torch.bfloat16


def test_layout_and_metadata():
    w = _edge_weight(torch.bfloat16, 128, seed=7)
    q = quantize_int4_awq(w, 128)
    assert q.fmt == "int4_awq" and q.shape == (32, 256) and q.params == {"group_size": 128}
    assert q.data.dtype == torch.int32 and q.data.shape == (256, 4)
    assert q.zeros.dtype == torch.int32 and q.zeros.shape == (2, 4)
    assert q.scale.dtype == torch.float16 and q.scale.shape == (2, 32)
    assert check_int4_awq(q) == (32, 256, 128)


def test_dequantize_is_fp16_product_transposed():
    w = _edge_weight(torch.float16, 32, seed=8)
    q = quantize_int4_awq(w, 32)
    codes, zeros = _int_codes(q)
    s = q.scale.t().repeat_interleave(32, dim=1)
    expected = (codes - zeros.repeat_interleave(32, dim=1)).to(torch.float16) * s
    d16 = dequantize_int4_awq(q, torch.float16)
    assert d16.shape == (32, 256) and d16.is_contiguous()
    assert torch.equal(_bits16(d16), _bits16(expected))
    assert torch.equal(dequantize_int4_awq(q, torch.float32), expected.float())
    assert torch.equal(dequantize_int4_awq(q, torch.bfloat16), expected.bfloat16())
    # a real approximation on the generic rows: within one step (the rounded zero point can clip the
    # group's max or min by up to a step), and mostly within half a step
    err = (d16[12:].float() - w[12:].float()).abs()
    step = s[12:].float()
    assert (err <= step * 1.01).all()
    assert (err <= step * 0.51).float().mean() > 0.99


def test_non_contiguous_input_and_no_mutation():
    base = _edge_weight(torch.float16, 64, seed=9)
    strided = base.t().contiguous().t()
    assert not strided.is_contiguous()
    before = strided.clone()
    q = quantize_int4_awq(strided, 64)
    ref = quantize_int4_awq(base.contiguous(), 64)
    assert torch.equal(strided, before)
    assert torch.equal(q.data, ref.data) and torch.equal(q.zeros, ref.zeros)
    assert torch.equal(_bits16(q.scale), _bits16(ref.scale))
    data_before = q.data.clone()
    dequantize_int4_awq(q)
    assert torch.equal(q.data, data_before)


@pytest.mark.parametrize("shape", [(0, 128), (8, 0), (0, 0)])
def test_empty(shape):
    q = quantize_int4_awq(torch.zeros(shape, dtype=torch.float16), 128 if shape[1] else 64)
    g = q.params["group_size"]
    assert q.data.shape == (shape[1], shape[0] // 8)
    assert q.zeros.shape == (shape[1] // g, shape[0] // 8) and q.scale.shape == (shape[1] // g, shape[0])
    assert dequantize_int4_awq(q).shape == shape


def test_api_dispatch():
    w = _edge_weight(torch.float16, 64, seed=10)
    q = lowbit.quantize(w, "int4_awq", group_size=64)
    ref = quantize_int4_awq(w, 64)
    assert torch.equal(q.data, ref.data) and torch.equal(q.zeros, ref.zeros)
    assert lowbit.quantize(w[16:], "int4_awq").params == {"group_size": 128}
    assert torch.equal(lowbit.dequantize(q, torch.float16), dequantize_int4_awq(q, torch.float16))
    with pytest.raises(ValueError, match="unknown option"):
        lowbit.quantize(w, "int4_awq", blocksize=64)


@pytest.mark.parametrize(
    "x, kwargs, err, match",
    [
        ([[1.0] * 8] * 8, {}, TypeError, "torch.Tensor"),
        (torch.zeros(8, 128, dtype=torch.int32), {}, TypeError, "float32, bfloat16 or float16"),
        (torch.zeros(128), {}, ValueError, "2-D"),
        (torch.zeros(2, 8, 128), {}, ValueError, "2-D"),
        (torch.zeros(8, 96), {"group_size": 64}, ValueError, "multiple of group_size"),
        (torch.zeros(12, 128), {}, ValueError, "multiple of 8"),
        (torch.zeros(8, 128), {"group_size": 0}, ValueError, "positive"),
        (torch.zeros(8, 128), {"group_size": -1}, ValueError, "positive"),
        (torch.zeros(8, 128), {"group_size": 64.0}, TypeError, "group_size"),
        (torch.zeros(8, 128), {"group_size": True}, TypeError, "group_size"),
    ],
)
def test_bad_arguments(x, kwargs, err, match):
    with pytest.raises(err, match=match):
        quantize_int4_awq(x, **kwargs)


@pytest.mark.parametrize(
    "value, dtype",
    [(float("nan"), torch.float16), (float("inf"), torch.float16), (-float("inf"), torch.bfloat16),
     (1e5, torch.float32), (-7e4, torch.bfloat16)],
)
def test_non_finite_or_fp16_overflow_rejected(value, dtype):
    w = torch.randn(8, 64).to(dtype)
    w[3, 5] = value
    with pytest.raises(ValueError, match="finite after the cast to float16"):
        quantize_int4_awq(w, 32)


def test_range_overflow_rejected():
    # max - min = 80000 overflows fp16; AutoAWQ would then assert on NaN
    w = torch.zeros(8, 32, dtype=torch.float16)
    w[0, 0], w[0, 1] = -40000.0, 40000.0
    with pytest.raises(ValueError, match="too wide"):
        quantize_int4_awq(w, 32)


@pytest.mark.interop
def test_range_overflow_is_inf_in_autoawq(autoawq):
    """Why the ValueError above and in test_range_overflow_rejected: AutoAWQ's own fake-quantized weight
    is already Inf/NaN there, and from_linear would then cast Inf to int32 (platform-dependent)."""
    w = torch.zeros(8, 32, dtype=torch.float16)
    w[0, 0], w[0, 1] = -32.0, 65472.0  # range 65504: s = 4368 and 15 * s overflows fp16
    quantizer = types.SimpleNamespace(group_size=32, zero_point=True, w_bit=4)
    w_fq, _, _ = autoawq.pseudo_quantize_tensor(quantizer, w.clone())
    assert not torch.isfinite(w_fq).all()
    with pytest.raises(ValueError, match="too wide"):
        quantize_int4_awq(w, 32)


def test_dequantize_rejects_malformed_qtensor():
    q = quantize_int4_awq(torch.randn(8, 64), 32)

    def make(data=q.data, scale=q.scale, fmt="int4_awq", zeros=q.zeros, params=q.params):
        return QTensor(data, scale, fmt, q.shape, zeros=zeros, params=params)

    # rejected where the QTensor is built, so dequantize never meets one
    bad = [
        ({"scale": q.scale.float()}, TypeError, "float16"),
        ({"zeros": None}, TypeError, "zeros"),
        ({"data": q.data[:32]}, ValueError, "data"),
        ({"params": {}}, TypeError, "group_size"),
        ({"fmt": "nf4"}, ValueError, "zeros must be None for nf4"),
    ]
    for change, err, match in bad:
        with pytest.raises(err, match=match):
            make(**change)
    with pytest.raises(TypeError, match="dtype"):
        dequantize_int4_awq(q, torch.int32)


# ---------------------------------------------------------------- AutoAWQ itself


@pytest.mark.interop
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("group_size", [32, 64, 128])
def test_matches_autoawq_pipeline(autoawq, dtype, group_size):
    w = _edge_weight(dtype, group_size, seed=group_size)
    ref = _autoawq_pipeline(autoawq, w, group_size)
    q = quantize_int4_awq(w, group_size)
    assert torch.equal(q.data, ref.qweight)
    assert torch.equal(q.zeros, ref.qzeros)
    assert ref.scales.dtype == torch.float16
    assert torch.equal(_bits16(q.scale), _bits16(ref.scales))


@pytest.mark.interop
@pytest.mark.parametrize("seed", range(4))
def test_matches_autoawq_random_scales(autoawq, seed):
    """Rows at very different magnitudes, from fp16 subnormal scales up to thousands."""
    gen = torch.Generator().manual_seed(100 + seed)
    mags = torch.logspace(-6, 3.5, 16).repeat_interleave(2).reshape(32, 1)
    w = (torch.randn(32, 128, generator=gen) * mags + torch.randn(32, 1, generator=gen) * mags).half()
    ref = _autoawq_pipeline(autoawq, w, 32)
    q = quantize_int4_awq(w, 32)
    assert torch.equal(q.data, ref.qweight) and torch.equal(q.zeros, ref.qzeros)
    assert torch.equal(_bits16(q.scale), _bits16(ref.scales))


@pytest.mark.interop
def test_autoawq_packing_utils_read_our_tensors(autoawq):
    pu = autoawq.packing_utils
    w = _edge_weight(torch.bfloat16, 64, seed=11)
    q = quantize_int4_awq(w, 64)
    iweight, izeros = pu.reverse_awq_order(*pu.unpack_awq(q.data, q.zeros, 4), 4)
    codes, zeros = _int_codes(q)
    assert torch.equal((iweight & 0xF).to(torch.int32), codes.t())
    assert torch.equal((izeros & 0xF).to(torch.int32), zeros.t())
    ref = pu.dequantize_gemm(q.data, q.zeros, q.scale, 4, 64)
    assert ref.dtype == torch.float16 and ref.shape == (256, 32)
    assert torch.equal(_bits16(dequantize_int4_awq(q, torch.float16)), _bits16(ref.t()))


@pytest.mark.interop
def test_autoawq_golden_word(autoawq):
    pu = autoawq.packing_utils
    word = pack_awq(torch.arange(8, dtype=torch.int32).reshape(1, 8))
    iweight, _ = pu.reverse_awq_order(*pu.unpack_awq(word, word, 4), 4)
    assert (iweight & 0xF).tolist() == [list(range(8))]
