"""lowbit against compressed-tensors 0.20.0 (CPU paths): the NVFP4 reference and the checkpoint converters.

The CT side is run the way llm-compressor produces a checkpoint: ``generate_gparam`` on the weight's
min/max (weight dtype), ``calculate_qparams`` on the 16-element group min/max (weight dtype), then the
format's compressor (``NVFP4PackedCompressor.compress`` -> ``quantize`` -> ``cast_to_fp4`` -> pack).
"""

import pytest
import torch

import lowbit
from lowbit.formats import codecs
from lowbit.formats.packing import pack_fp4, pack_fp6, unpack_fp6
from lowbit.formats.spec import E2M1, E2M3
from lowbit.io.compressed_tensors import ct_compression_format, from_compressed_tensors, to_compressed_tensors

pytest.importorskip("compressed_tensors")
from compressed_tensors.compressors.mxfp4.base import MXFP4PackedCompressor
from compressed_tensors.compressors.mxfp6.base import MXFP6PackedCompressor
from compressed_tensors.compressors.mxfp6.helpers import pack_fp6_to_uint8, unpack_fp6_from_uint8
from compressed_tensors.compressors.mxfp8.base import MXFP8QuantizationCompressor
from compressed_tensors.compressors.nvfp4.base import NVFP4PackedCompressor
from compressed_tensors.compressors.nvfp4.helpers import pack_fp4_to_uint8
from compressed_tensors.quantization import QuantizationScheme
from compressed_tensors.quantization.quant_scheme import MXFP4A16, MXFP6A16, MXFP8A16, NVFP4
from compressed_tensors.quantization.utils.helpers import calculate_qparams, generate_gparam

pytestmark = pytest.mark.interop

NVFP4_SCHEME = QuantizationScheme(targets=["Linear"], **NVFP4)
MX = {
    "mxfp4": (QuantizationScheme(targets=["Linear"], **MXFP4A16), MXFP4PackedCompressor),
    "mxfp6_e2m3": (QuantizationScheme(targets=["Linear"], **MXFP6A16), MXFP6PackedCompressor),
    "mxfp8_e4m3": (QuantizationScheme(targets=["Linear"], **MXFP8A16), MXFP8QuantizationCompressor),
}
VEC16 = [0, 0.25, 0.5, 0.75, 1, 1.25, 1.5, 1.75, 2, 2.5, 3, 3.5, 4, 5, 6, -6]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _u8(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int16 if t.element_size() == 2 else torch.int32)


def _ct_nvfp4(w: torch.Tensor, global_scale: torch.Tensor | None = None) -> dict:
    if global_scale is None:
        global_scale = generate_gparam(w.amin(), w.amax())
    groups = w.reshape(w.shape[0], -1, 16)
    scale, _ = calculate_qparams(
        groups.amin(-1), groups.amax(-1), NVFP4_SCHEME.weights, global_scale=global_scale
    )
    # llm-compressor keeps weight_scale in the weight's dtype (its values are E4M3, exact in bf16/fp16)
    state = {"weight": w, "weight_scale": scale.to(w.dtype), "weight_global_scale": global_scale}
    return NVFP4PackedCompressor.compress(state, NVFP4_SCHEME)


def _ct_mx(w: torch.Tensor, fmt: str) -> dict:
    scheme, comp = MX[fmt]
    groups = w.reshape(w.shape[0], -1, 32)
    scale, _ = calculate_qparams(groups.amin(-1), groups.amax(-1), scheme.weights)
    return comp.compress({"weight": w, "weight_scale": scale}, scheme)


def _ct_decompress(tensors: dict, fmt: str) -> torch.Tensor:
    if fmt == "nvfp4":
        return NVFP4PackedCompressor.decompress(dict(tensors), NVFP4_SCHEME)["weight"]
    scheme, comp = MX[fmt]
    return comp.decompress(dict(tensors), scheme)["weight"]


def _assert_same_nvfp4(q, ct: dict, what: str = "") -> None:
    assert torch.equal(q.data, ct["weight_packed"]), (
        f"{what} data: {(q.data != ct['weight_packed']).sum()} bytes differ"
    )
    assert torch.equal(_u8(q.scale), _u8(ct["weight_scale"])), f"{what} scale"
    assert torch.equal(q.global_scale, ct["weight_global_scale"]), f"{what} global scale"


def _random(rows: int, k: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    span = 6 if dtype == torch.float16 else 20
    x = torch.randn(rows, k, generator=g) * torch.exp2(
        torch.randint(-span, span, (rows, 1), generator=g).float()
    )
    x[:, ::5] *= torch.rand(rows, 1, generator=g) * 8
    return x.to(dtype)


def _adversarial(dtype: torch.dtype, k: int = 64) -> torch.Tensor:
    g = torch.Generator().manual_seed(99)
    v = torch.tensor(VEC16 * (k // 16))
    rows = [torch.zeros(k), -torch.zeros(k)]
    for s in (1.0, 0.5, 1 / 3, 2.0**-10, 2.0**10, 448 / 6):
        rows += [v * s, -v.flip(0) * s]  # ties, plus exact -0.0 elements at the end of the flipped row
    tiny = torch.finfo(dtype).tiny
    rows += [
        torch.full((k,), tiny),
        torch.full((k,), -tiny / 4),
        torch.full((k,), torch.finfo(dtype).max / 8),
    ]
    rows.append(torch.linspace(1, 2, k) * 6)
    t = -torch.rand(k, generator=g) * 1e-3
    t[0] = 10.0
    t[40] = -0.0
    rows.append(t)
    mixed = torch.randn(k, generator=g)
    mixed[16:32] = 1e-6  # a block whose E4M3 scale underflows to 0 -> CT's eps 0.125
    rows.append(mixed)
    for _ in range(4):
        rows.append(
            torch.randn(k, generator=g) * torch.exp2(torch.randint(-12, 12, (k,), generator=g).float())
        )
    x = torch.stack(rows).to(dtype)
    assert x.isfinite().all()
    return x


# ---------------------------------------------------------------------------- NVFP4 quantization vs CT


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("seed", range(3))
def test_nvfp4_ct_convention_matches_llm_compressor_pipeline(dtype, seed):
    w = _random(32, 256, dtype, seed)
    ct = _ct_nvfp4(w)
    q = lowbit.quantize(w, "nvfp4", convention="compressed-tensors")
    _assert_same_nvfp4(q, ct)
    t = to_compressed_tensors(q)
    assert set(t) == {"weight_packed", "weight_scale", "weight_global_scale"}
    for k in t:
        assert torch.equal(_u8(t[k]), _u8(ct[k])), k


@pytest.mark.parametrize("dtype", DTYPES)
def test_nvfp4_ct_convention_adversarial(dtype):
    x = _adversarial(dtype)
    for i in range(x.shape[0]):
        row = x[i : i + 1]
        _assert_same_nvfp4(
            lowbit.quantize(row, "nvfp4", convention="compressed-tensors"), _ct_nvfp4(row), f"row {i}"
        )
    _assert_same_nvfp4(lowbit.quantize(x, "nvfp4", convention="compressed-tensors"), _ct_nvfp4(x), "matrix")
    for s in (1.0, 394.5, 1e4):
        gs = torch.tensor([s])
        q = lowbit.quantize(x, "nvfp4", convention="compressed-tensors", global_scale=gs)
        _assert_same_nvfp4(q, _ct_nvfp4(x, gs), f"S={s}")


def test_nvfp4_ct_default_global_scale_is_computed_in_the_weight_dtype():
    w = torch.zeros(1, 16)
    w[0, 3] = 0.205078125  # exact in bf16; 2688 / amax = 13107.2 in fp32, rounds to 13120 in bf16
    for dtype, want in (
        (torch.float32, torch.tensor(2688 / 0.205078125, dtype=torch.float32)),
        (torch.bfloat16, 13120.0),
    ):
        wd = w.to(dtype)
        q = lowbit.quantize(wd, "nvfp4", convention="compressed-tensors")
        assert q.global_scale.item() == want
        assert torch.equal(q.global_scale, generate_gparam(wd.amin(), wd.amax()))
    assert lowbit.quantize(w, "nvfp4").global_scale.item() == pytest.approx(13107.2)
    # fp16: 2688 / 0.01 overflows fp16 -> Inf -> CT's nan_to_num makes it 1.0
    w16 = (torch.rand(4, 32) * 0.01).to(torch.float16)
    q = lowbit.quantize(w16, "nvfp4", convention="compressed-tensors")
    assert q.global_scale.item() == 1.0
    _assert_same_nvfp4(q, _ct_nvfp4(w16))


def test_nvfp4_ct_block_scale_uses_the_bf16_amax_over_6():
    # amax 2.796875: bf16(amax/6) = 0.466796875, times S = 394.5 gives 184.15 -> E4M3 192 (0x74); in fp32
    # amax/6 = 0.4661458 gives 183.89 -> 176 (0x73), which the vllm convention (fp32 throughout) writes
    w = torch.zeros(1, 16, dtype=torch.bfloat16)
    w[0, 0] = 2.796875
    gs = torch.tensor([394.5])
    ct = _ct_nvfp4(w, gs)
    assert _u8(ct["weight_scale"]).tolist() == [0x74]
    assert _u8(
        lowbit.quantize(w, "nvfp4", convention="compressed-tensors", global_scale=gs).scale
    ).tolist() == [0x74]
    assert _u8(lowbit.quantize(w, "nvfp4", global_scale=gs).scale).tolist() == [0x73]


def test_nvfp4_ct_zero_tiny_and_signed_zero_blocks():
    w = torch.zeros(1, 64)
    w[0, 16:32] = 1e-6  # nonzero block whose scale rounds to E4M3 0 -> eps 0.125 (0x20)
    w[0, 32] = 1.0
    w[0, 33] = -0.0  # exactly -0.0: CT's torch.sign gives 0 -> code 0x0
    w[0, 34] = -0.01  # negative that rounds to zero keeps the sign: code 0x8
    w[0, 48:] = -0.0
    ct = _ct_nvfp4(w)
    q = lowbit.quantize(w, "nvfp4", convention="compressed-tensors")
    _assert_same_nvfp4(q, ct)
    assert (
        _u8(q.scale).tolist()[0] == 0x20
        and _u8(q.scale).tolist()[1] == 0x20
        and _u8(q.scale).tolist()[3] == 0x20
    )
    # byte 16 = (1.0 -> 0x7, -0.0 -> 0x0), byte 17 = (-0.01 -> 0x8, 0.0 -> 0x0)
    assert q.data[0, 16].item() == 0x07 and q.data[0, 17].item() == 0x08
    assert (q.data[0, 24:] == 0).all()
    # the torchao/vllm codec keeps -0.0's sign (0x8): the CT convention is the only one that drops it
    assert lowbit.quantize(w, "nvfp4").data[0, 16].item() == 0x87


def test_nvfp4_ct_deviation_nonfinite_weight_global_scale():
    # CT: a NaN anywhere makes generate_gparam return 1.0 and an Inf makes it 0.0; lowbit ignores the
    # non-finite elements (an Inf-derived S = 0 would zero the whole tensor)
    w = _random(2, 32, torch.bfloat16, 0)
    finite_g = lowbit.quantize(w, "nvfp4", convention="compressed-tensors").global_scale
    for bad, ct_g in ((float("nan"), 1.0), (float("inf"), 0.0)):
        wb = w.clone()
        wb[1, 5] = bad
        assert generate_gparam(wb.amin(), wb.amax()).item() == ct_g
        assert torch.equal(
            lowbit.quantize(wb, "nvfp4", convention="compressed-tensors").global_scale, finite_g
        )


# ---------------------------------------------------------------------------- NVFP4 converter


@pytest.mark.parametrize("convention", ["vllm", "compressed-tensors", "torchao"])
@pytest.mark.parametrize("layout", ["linear", "swizzled"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_to_ct_nvfp4_decompresses_like_lowbit(convention, layout, dtype):
    w = torch.cat([_random(40, 128, dtype, 3), _adversarial(dtype)[:, :64].repeat(1, 2)])
    q = lowbit.quantize(w, "nvfp4", convention=convention, scale_layout=layout)
    t = to_compressed_tensors(q, input_global_scale=torch.tensor([1234.5]))
    n, k = w.shape
    assert t["weight_packed"].dtype == torch.uint8 and t["weight_packed"].shape == (n, k // 2)
    assert t["weight_scale"].dtype == torch.float8_e4m3fn and t["weight_scale"].shape == (n, k // 16)
    assert t["weight_global_scale"].dtype == torch.float32 and t["weight_global_scale"].shape == (1,)
    assert torch.equal(t["input_global_scale"], torch.tensor([1234.5]))
    assert all(v.is_contiguous() for v in t.values())
    ct = _ct_decompress(t, "nvfp4")
    back = from_compressed_tensors(t)
    assert torch.equal(_bits(ct), _bits(lowbit.dequantize(back, torch.bfloat16)))
    if convention != "torchao":
        # torchao's QTensor decodes p * sf where CT decodes sf / (1/p): equal only up to the last bit
        assert torch.equal(_bits(ct), _bits(lowbit.dequantize(q, torch.bfloat16)))
    assert torch.equal(back.data, q.data) and back.scale_layout == "linear"
    assert torch.equal(back.global_scale, q.global_scale)


def test_to_ct_single_level_nvfp4_writes_global_scale_one():
    w = _random(8, 64, torch.float32, 1)
    q = lowbit.quantize(w, "nvfp4", convention="torchao", global_scale="none")
    t = to_compressed_tensors(q)
    assert torch.equal(t["weight_global_scale"], torch.ones(1))
    assert torch.equal(_bits(_ct_decompress(t, "nvfp4")), _bits(lowbit.dequantize(q, torch.bfloat16)))


@pytest.mark.parametrize("dtype", DTYPES)
def test_from_ct_nvfp4_checkpoint(dtype):
    w = _random(24, 128, dtype, 5)
    ct = _ct_nvfp4(w)
    q = from_compressed_tensors(ct, dtype=dtype)
    assert q.fmt == "nvfp4" and q.shape == w.shape and q.dtype == dtype
    assert torch.equal(_bits(lowbit.dequantize(q, torch.bfloat16)), _bits(_ct_decompress(ct, "nvfp4")))
    again = to_compressed_tensors(q)
    assert all(torch.equal(_u8(again[k]), _u8(ct[k])) for k in ct)
    # module-prefixed names work too
    prefixed = {f"model.layers.0.mlp.down_proj.{k}": v for k, v in ct.items()}
    assert torch.equal(from_compressed_tensors(prefixed).data, q.data)


# ---------------------------------------------------------------------------- MX converters


@pytest.mark.parametrize("fmt", MX)
@pytest.mark.parametrize("rounding", ["rceil", "floor"])
@pytest.mark.parametrize("layout", ["linear", "swizzled"])
def test_to_ct_mx_decompresses_like_lowbit(fmt, rounding, layout):
    w = torch.cat([_random(33, 128, torch.bfloat16, 2), _adversarial(torch.bfloat16).repeat(1, 2)])
    q = lowbit.quantize(w, fmt, scale_rounding=rounding, scale_layout=layout)
    t = to_compressed_tensors(q)
    n, k = w.shape
    if fmt == "mxfp8_e4m3":
        assert set(t) == {"weight", "weight_scale"} and t["weight"].dtype == torch.float8_e4m3fn
        assert t["weight"].shape == (n, k)
    else:
        assert set(t) == {"weight_packed", "weight_scale"} and t["weight_packed"].dtype == torch.uint8
        assert t["weight_packed"].shape == (n, k // 2 if fmt == "mxfp4" else 3 * k // 4)
    assert t["weight_scale"].dtype == torch.uint8 and t["weight_scale"].shape == (n, k // 32)
    assert ct_compression_format(fmt) in ("mxfp4-pack-quantized", "mxfp6-pack-quantized", "mxfp8-quantized")
    ct = _ct_decompress(t, fmt)
    assert torch.equal(_bits(ct), _bits(lowbit.dequantize(q, torch.bfloat16)))
    back = from_compressed_tensors(t)
    assert back.fmt == fmt and torch.equal(_u8(back.data), _u8(q.data))


@pytest.mark.parametrize("fmt", MX)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_from_ct_mx_checkpoint(fmt, dtype):
    w = torch.cat([_random(16, 128, dtype, 4), _adversarial(dtype).repeat(1, 2)])
    ct = _ct_mx(w, fmt)
    q = from_compressed_tensors(ct)
    assert q.fmt == fmt and q.shape == w.shape and q.scale.dtype == torch.float8_e8m0fnu
    assert torch.equal(_bits(lowbit.dequantize(q, torch.bfloat16)), _bits(_ct_decompress(ct, fmt)))
    again = to_compressed_tensors(q)
    assert set(again) == set(ct) and all(torch.equal(_u8(again[k]), _u8(ct[k])) for k in ct)


def test_ct_mx_scale_rule_differs_from_lowbit_by_design():
    # CT rounds the block absmax at the element's mantissa width and floors (EVEN-like, formats.md 2.2):
    # absmax 6.5 -> 0x7F (6.5 then saturates to 6); lowbit RCEIL -> 0x80. absmax 7 -> CT 0x80, FLOOR 0x7F.
    for amax, ct_byte, rceil_byte, floor_byte in ((6.5, 0x7F, 0x80, 0x7F), (7.0, 0x80, 0x80, 0x7F)):
        w = torch.zeros(1, 32, dtype=torch.bfloat16)
        w[0, 0] = amax
        ct = _ct_mx(w, "mxfp4")
        assert _u8(ct["weight_scale"]).item() == ct_byte
        assert _u8(lowbit.quantize(w, "mxfp4", scale_rounding="rceil").scale).item() == rceil_byte
        assert _u8(lowbit.quantize(w, "mxfp4", scale_rounding="floor").scale).item() == floor_byte
        assert torch.equal(
            lowbit.dequantize(from_compressed_tensors(ct), torch.bfloat16), _ct_decompress(ct, "mxfp4")
        )


@pytest.mark.parametrize("fmt", MX)
def test_ct_mx_deviation_nan_scale(fmt):
    # lowbit writes 0xFF for a NaN block and decodes it as NaN; CT decodes 0xFF as 2^128 = Inf in bf16
    w = _random(2, 32, torch.float32, 6)
    w[0, 3] = float("nan")
    q = lowbit.quantize(w, fmt)
    t = to_compressed_tensors(q)
    assert _u8(t["weight_scale"]).tolist()[0] == 0xFF
    ct, ours = _ct_decompress(t, fmt), lowbit.dequantize(q, torch.bfloat16)
    assert ours[0].isnan().all() and not ct[0].isfinite().any()
    if fmt != "mxfp8_e4m3":  # FP4/FP6 NaN-block codes are finite, so CT decodes them to +-Inf, not NaN
        assert ct[0].isinf().all()
    assert torch.equal(_bits(ct[1]), _bits(ours[1]))


# ---------------------------------------------------------------------------- packing


def test_fp6_packing_matches_ct():
    codes = torch.tensor([[0x01, 0x02, 0x03, 0x3F]], dtype=torch.uint8)
    assert _u8(pack_fp6(codes)).tolist() == [0x81, 0x30, 0xFC]
    values = codecs.decode_minifloat(codes, E2M3)
    assert _u8(pack_fp6_to_uint8(values)).tolist() == [0x81, 0x30, 0xFC]
    g = torch.Generator().manual_seed(0)
    every = torch.arange(64, dtype=torch.uint8)
    codes = torch.cat([every, torch.randint(0, 64, (4 * 64 - 64,), generator=g, dtype=torch.uint8)]).reshape(
        4, 64
    )
    values = codecs.decode_minifloat(codes, E2M3)  # code 0x20 is -0.0, which CT's signbit keeps
    assert torch.equal(pack_fp6(codes), pack_fp6_to_uint8(values))
    assert torch.equal(unpack_fp6(pack_fp6(codes)), codes)
    ct_values = unpack_fp6_from_uint8(pack_fp6(codes), 4, 64, dtype=torch.float32)
    assert torch.equal(ct_values.view(torch.int32), values.view(torch.int32))


def test_fp4_packing_matches_ct():
    codes = torch.arange(16, dtype=torch.uint8).repeat(3).reshape(3, 16)
    values = codecs.decode_minifloat(codes, E2M1)
    assert torch.equal(pack_fp4(codes), pack_fp4_to_uint8(values))


# ---------------------------------------------------------------------------- errors


def test_converter_errors_name_the_rule():
    w = _random(4, 64, torch.float32, 0)
    q = lowbit.quantize(w, "nvfp4")
    t = to_compressed_tensors(q)
    with pytest.raises(ValueError, match="weight_global_scale"):
        from_compressed_tensors({k: v for k, v in t.items() if k != "weight_global_scale"}, fmt="nvfp4")
    with pytest.raises(ValueError, match="weight_scale"):
        from_compressed_tensors({"weight_packed": t["weight_packed"]}, fmt="nvfp4")
    with pytest.raises(ValueError, match="no compressed weight"):
        from_compressed_tensors({"bias": torch.zeros(4)})
    with pytest.raises(TypeError, match="weight_scale must be a 2-D"):
        from_compressed_tensors({**t, "weight_scale": t["weight_scale"].float()}, fmt="nvfp4")
    with pytest.raises(TypeError, match="weight_packed must be a 2-D"):
        from_compressed_tensors({**t, "weight_packed": t["weight_packed"].to(torch.int16)}, fmt="nvfp4")
    with pytest.raises(ValueError, match=r"weight_packed must be \(4, 32\)"):
        from_compressed_tensors({**t, "weight_packed": t["weight_packed"][:, :16]}, fmt="nvfp4")
    with pytest.raises(TypeError, match="weight_global_scale must be float32"):
        from_compressed_tensors({**t, "weight_global_scale": t["weight_global_scale"].double()})
    with pytest.raises(ValueError, match="finite and > 0"):
        from_compressed_tensors({**t, "weight_global_scale": torch.zeros(1)})
    with pytest.raises(ValueError, match="one module"):
        from_compressed_tensors({"a.weight_packed": t["weight_packed"], "b.weight_scale": t["weight_scale"]})
    with pytest.raises(ValueError, match="fmt"):
        from_compressed_tensors(t, fmt="mxfp6_e3m2")
    with pytest.raises(ValueError, match="fmt"):
        to_compressed_tensors(lowbit.quantize(w, "mxfp8_e5m2"))
    with pytest.raises(ValueError, match="2-D weight"):
        to_compressed_tensors(lowbit.quantize(w.reshape(2, 2, 64), "nvfp4"))
    with pytest.raises(ValueError, match="input_global_scale is only stored for nvfp4"):
        to_compressed_tensors(lowbit.quantize(w, "mxfp4"), input_global_scale=torch.tensor([1.0]))
    with pytest.raises(TypeError, match="input_global_scale must be float32"):
        to_compressed_tensors(q, input_global_scale=torch.tensor([1.0], dtype=torch.float64))
    with pytest.raises(TypeError, match="q must be a QTensor"):
        to_compressed_tensors(t)
    mx = to_compressed_tensors(lowbit.quantize(w, "mxfp4"))
    with pytest.raises(ValueError, match="cannot tell the format"):
        from_compressed_tensors({**mx, "weight_packed": mx["weight_packed"][:, :5]})
    assert from_compressed_tensors(mx).fmt == "mxfp4"
