"""int4_awq <-> AutoAWQ GEMM, GPTQ v1 and compressed-tensors pack-quantized, checked bit for bit.

Producers run here: AutoAWQ 0.2.9 ``packing_utils`` (loaded by path: ``import awq`` needs accelerate),
compressed-tensors 0.20.0 (``pack_to_int32``/``unpack_from_int32``, ``AutoAWQConverter``,
``PackedQuantizationCompressor``). AutoGPTQ is not installed (it needs CUDA to build); its v1 reader is
re-typed in :func:`_autogptq_v1_dequant` from ``qlinear_cuda_old.QuantLinear.forward``'s torch path.
"""

from __future__ import annotations

import importlib.util
import pathlib

import pytest
import torch

from lowbit.formats.int4_awq import (
    dequantize_int4_awq,
    pack_awq,
    quantize_int4_awq,
    unpack_awq,
)
from lowbit.formats.qtensor import QTensor
from lowbit.io._ct_int4 import from_ct_pack_quantized, to_ct_pack_quantized
from lowbit.io.awq import from_autoawq, to_autoawq
from lowbit.io.gptq import from_gptq, to_gptq


def _bits16(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int16)


def _same(a: QTensor, b: QTensor) -> bool:
    return (
        a.shape == b.shape
        and a.params == b.params
        and torch.equal(a.data, b.data)
        and torch.equal(a.zeros, b.zeros)
        and torch.equal(_bits16(a.scale), _bits16(b.scale))
    )


def _from_ints(codes: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor) -> QTensor:
    """int4_awq QTensor from logical codes [out, in], zeros [out, n_groups], scales [out, n_groups]."""
    out_features, in_features = codes.shape
    return QTensor(
        data=pack_awq(codes.t().to(torch.int32)),
        scale=scales.t().contiguous().to(torch.float16),
        fmt="int4_awq",
        shape=torch.Size((out_features, in_features)),
        dtype=torch.float16,
        zeros=pack_awq(zeros.t().to(torch.int32)),
        params={"group_size": in_features // zeros.shape[1]},
    )


def _weight(seed: int, out: int = 32, inp: int = 256, dtype: torch.dtype = torch.float16) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(out, inp, generator=gen) * 0.05
    w[:4] = w[:4].abs()  # only positives: raw zero point 0 in every group of these rows
    w[8:12] = -w[8:12].abs()  # only negatives: zero point 15
    return w.to(dtype)


def _awq_packing_utils():
    spec = importlib.util.find_spec("awq")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("autoawq is not installed")
    path = pathlib.Path(list(spec.submodule_search_locations)[0]) / "utils" / "packing_utils.py"
    mod_spec = importlib.util.spec_from_file_location("_lowbit_test_awq_packing_utils", path)
    module = importlib.util.module_from_spec(mod_spec)
    mod_spec.loader.exec_module(module)
    return module


def _autogptq_v1_dequant(qweight, qzeros, scales, group_size):
    """AutoGPTQ ``qlinear_cuda_old`` torch path: nibble & 0xF, zero + 1 (no wrap), ``scales * (w - z)``.

    Returns fp16 ``[in, out]``."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32)
    zeros = (qzeros.unsqueeze(2) >> shifts).to(torch.int8) & 0xF
    zeros = (zeros + 1).reshape(qzeros.shape[0], 1, -1)
    weight = (qweight.unsqueeze(1) >> shifts.unsqueeze(-1)).to(torch.int8) & 0xF
    weight = weight.reshape(-1, group_size, weight.shape[2])
    out = scales.reshape(-1, 1, scales.shape[-1]) * (weight - zeros)
    return out.reshape(-1, out.shape[-1])


# ---------------------------------------------------------------- AutoAWQ GEMM


def test_autoawq_round_trip_and_copies():
    q = quantize_int4_awq(_weight(1), 64)
    t = to_autoawq(q)
    assert set(t) == {"qweight", "qzeros", "scales"}
    assert (t["qweight"].dtype, tuple(t["qweight"].shape)) == (torch.int32, (256, 4))
    assert (t["qzeros"].dtype, tuple(t["qzeros"].shape)) == (torch.int32, (4, 4))
    assert (t["scales"].dtype, tuple(t["scales"].shape)) == (torch.float16, (4, 32))
    back = from_autoawq(**t)
    assert _same(back, q) and back.params == {"group_size": 64} and back.dtype == torch.float16
    assert _same(from_autoawq(**t, group_size=64), q)
    t["qweight"].zero_()
    assert not torch.equal(q.data, t["qweight"]), "to_autoawq must not alias the QTensor"
    assert not torch.equal(back.data, t["qweight"]), "from_autoawq must not alias its inputs"


def test_autoawq_group_size_minus_one():
    q = quantize_int4_awq(_weight(2, inp=64), 64)
    t = to_autoawq(q)
    assert from_autoawq(**t, group_size=-1).params == {"group_size": 64}


@pytest.mark.parametrize(
    "mutate, kwargs, err, match",
    [
        (lambda t: t.update(qweight=t["qweight"].long()), {}, TypeError, "qweight must be torch.int32"),
        (lambda t: t.update(scales=t["scales"].float()), {}, TypeError, "scales must be torch.float16"),
        (lambda t: t.update(qzeros=t["qzeros"][:, :2]), {}, ValueError, "qzeros must be"),
        (lambda t: t.update(qweight=t["qweight"][:, :2]), {}, ValueError, "does not match scales"),
        (lambda t: t.update(qweight=t["qweight"][:250]), {}, ValueError, "not a multiple"),
        (lambda t: t.update(scales=t["scales"].reshape(-1)), {}, ValueError, "2-D"),
        (lambda t: None, {"group_size": 128}, ValueError, "does not match scales"),
        (lambda t: None, {"group_size": 0}, ValueError, "positive"),
        (lambda t: None, {"group_size": "64"}, TypeError, "group_size"),
    ],
)
def test_from_autoawq_rejects(mutate, kwargs, err, match):
    t = to_autoawq(quantize_int4_awq(_weight(3), 64))
    mutate(t)
    with pytest.raises(err, match=match):
        from_autoawq(**t, **kwargs)


def test_to_functions_reject_non_awq():
    for fn in (to_autoawq, to_gptq, to_ct_pack_quantized):
        with pytest.raises(TypeError, match="QTensor"):
            fn({"qweight": torch.zeros(1)})


# ---------------------------------------------------------------- GPTQ v1


def test_gptq_layout_by_hand():
    gen = torch.Generator().manual_seed(4)
    codes = torch.randint(0, 16, (16, 32), generator=gen)
    zeros = torch.randint(1, 16, (16, 2), generator=gen)
    scales = torch.rand(16, 2, generator=gen).half()
    g = to_gptq(_from_ints(codes, zeros, scales))
    assert (g["qweight"].dtype, tuple(g["qweight"].shape)) == (torch.int32, (4, 16))
    assert (g["qzeros"].dtype, tuple(g["qzeros"].shape)) == (torch.int32, (2, 2))
    for r in range(4):
        for j in range(16):
            word = g["qweight"][r, j].item() & 0xFFFFFFFF
            assert [(word >> (4 * k)) & 0xF for k in range(8)] == codes[j, 8 * r: 8 * r + 8].tolist()
    for grp in range(2):
        for c in range(2):
            word = g["qzeros"][grp, c].item() & 0xFFFFFFFF
            assert [(word >> (4 * k)) & 0xF for k in range(8)] == (zeros[8 * c: 8 * c + 8, grp] - 1).tolist()
    assert torch.equal(_bits16(g["scales"]), _bits16(scales.t()))
    assert g["g_idx"].dtype == torch.int32 and g["g_idx"].tolist() == [i // 16 for i in range(32)]


def test_gptq_symmetric_zero_words():
    codes = torch.arange(16 * 16).reshape(16, 16) % 16
    q = _from_ints(codes, torch.full((16, 1), 8), torch.ones(16, 1))
    assert to_gptq(q)["qzeros"].tolist() == [[0x77777777, 0x77777777]]
    zeros = torch.tensor(list(range(1, 16)) + [1]).reshape(16, 1)
    q = _from_ints(codes, zeros, torch.ones(16, 1))
    # zeros 1..8 store 0..7; zeros 9..15, 1 store 8..14, 0
    assert [w & 0xFFFFFFFF for w in to_gptq(q)["qzeros"][0].tolist()] == [0x76543210, 0x0EDCBA98]


def test_gptq_zero_point_zero_borrows():
    # raw zeros [0, 5, 1, 1, 1, 1, 1, 1]: packed 0x11111150 - 0x11111111 = 0x0000003F:
    # the 0 stores 0xF and its upper neighbour 5 stores 5 - 2 = 3
    zeros = torch.tensor([0, 5, 1, 1, 1, 1, 1, 1]).reshape(8, 1)
    q = _from_ints(torch.full((8, 8), 7), zeros, torch.ones(8, 1))
    g = to_gptq(q)
    assert g["qzeros"].tolist() == [[0x3F]]
    assert _same(from_gptq(g["qweight"], g["qzeros"], g["scales"], g["g_idx"]), q)
    # a 0 in the top nibble borrows past bit 31 (mod 2^32)
    top = _from_ints(torch.full((8, 8), 7), torch.tensor([1] * 7 + [0]).reshape(8, 1), torch.ones(8, 1))
    assert [w & 0xFFFFFFFF for w in to_gptq(top)["qzeros"][0].tolist()] == [0xF0000000]
    assert _same(from_gptq(**{k: v for k, v in to_gptq(top).items()}), top)
    with pytest.raises(ValueError, match="zero point is 0"):
        to_gptq(q, strict=True)
    shifted = to_gptq(_from_ints(torch.full((8, 8), 7), zeros + 1, torch.ones(8, 1)), strict=True)
    assert shifted["qzeros"].tolist() == [[0x22222261 - 0x11111111]]


@pytest.mark.parametrize("group_size", [32, 64, 256])
def test_gptq_round_trip(group_size):
    q = quantize_int4_awq(_weight(5, dtype=torch.bfloat16), group_size)
    assert bool((unpack_awq(q.zeros) == 0).any())
    g = to_gptq(q)
    back = from_gptq(g["qweight"], g["qzeros"], g["scales"], g["g_idx"])
    assert _same(back, q)
    assert _same(from_gptq(g["qweight"], g["qzeros"], g["scales"]), q)
    assert torch.equal(dequantize_int4_awq(back, torch.float16), dequantize_int4_awq(q, torch.float16))


def test_gptq_v1_nibble_reader():
    """What AutoGPTQ/exllama/vLLM (v1) compute from our tensors: exact without a zero of 0, and the
    documented misread (zero 16, neighbour one low) with one."""
    w = torch.randn(32, 256, generator=torch.Generator().manual_seed(6)).half()
    q = quantize_int4_awq(w, 32)
    assert not bool((unpack_awq(q.zeros) == 0).any())
    g = to_gptq(q, strict=True)
    ours = dequantize_int4_awq(q, torch.float16)
    theirs = _autogptq_v1_dequant(g["qweight"], g["qzeros"], g["scales"], 32).t()
    assert torch.equal(_bits16(theirs), _bits16(ours))

    zeros = torch.tensor([0, 5, 1, 1, 1, 1, 1, 1]).reshape(8, 1)
    codes = torch.full((8, 8), 7)
    g = to_gptq(_from_ints(codes, zeros, torch.ones(8, 1)))
    deq = _autogptq_v1_dequant(g["qweight"], g["qzeros"], g["scales"], 8).t()
    assert deq[:, 0].tolist() == [7 - 16, 7 - 4] + [6.0] * 6


@pytest.mark.parametrize(
    "g_idx, match",
    [
        (torch.arange(64, dtype=torch.int32).flip(0) // 32, "act-order"),
        (torch.tensor([0, 1] * 32, dtype=torch.int32), "act-order"),
        (torch.zeros(32, dtype=torch.int32), r"shape \[in\]"),
        (torch.arange(64, dtype=torch.int32) // 16, "group_size=16"),
    ],
)
def test_from_gptq_rejects_g_idx(g_idx, match):
    g = to_gptq(quantize_int4_awq(_weight(7, inp=64), 32))
    with pytest.raises(ValueError, match=match):
        from_gptq(g["qweight"], g["qzeros"], g["scales"], g_idx)


def test_from_gptq_rejects_partial_last_group():
    # in = 96 with g = 64: AutoGPTQ allows ceil(96/64) = 2 groups, the AWQ layout cannot hold them
    qweight = torch.zeros(12, 8, dtype=torch.int32)
    qzeros = torch.zeros(2, 1, dtype=torch.int32)
    scales = torch.ones(2, 8, dtype=torch.float16)
    with pytest.raises(ValueError, match="divide in_features=96"):
        from_gptq(qweight, qzeros, scales, torch.arange(96, dtype=torch.int32) // 64)
    with pytest.raises(ValueError, match="not a multiple"):
        from_gptq(qweight[:, :8], torch.zeros(5, 1, dtype=torch.int32), torch.ones(5, 8, dtype=torch.float16))


def _i32(*shape):
    return torch.zeros(*shape, dtype=torch.int32)


@pytest.mark.parametrize(
    "args, err, match",
    [
        ((_i32(4, 8).long(), _i32(1, 1), torch.ones(1, 8).half()), TypeError, "qweight"),
        ((_i32(4, 8), _i32(1, 1), torch.ones(1, 8)), TypeError, "scales"),
        ((_i32(4, 8), _i32(1, 2), torch.ones(1, 8).half()), ValueError, "qzeros"),
        ((_i32(4, 12), _i32(1, 1), torch.ones(1, 12).half()), ValueError, "multiple of 8"),
        ((_i32(4, 8), _i32(1, 1), torch.ones(1, 16).half()), ValueError, "does not match"),
    ],
)
def test_from_gptq_rejects(args, err, match):
    with pytest.raises(err, match=match):
        from_gptq(*args)


def test_to_gptq_rejects_in_not_multiple_of_8():
    q = quantize_int4_awq(torch.randn(8, 12), 4)
    with pytest.raises(ValueError, match="multiple of 8"):
        to_gptq(q)
    with pytest.raises(TypeError, match="strict"):
        to_gptq(quantize_int4_awq(torch.randn(8, 16), 8), strict=1)


def test_gptq_inputs_not_modified():
    g = to_gptq(quantize_int4_awq(_weight(8), 32))
    before = {k: v.clone() for k, v in g.items()}
    from_gptq(**g)
    assert all(torch.equal(g[k], before[k]) for k in g)


@pytest.mark.interop
def test_gptq_matches_autoawq_unpack_reorder_pack():
    """AutoAWQ's own AWQ -> exllama/GPTQ converter writes the same words, borrows included."""
    pu = _awq_packing_utils()
    q = quantize_int4_awq(_weight(9), 32)
    assert bool((unpack_awq(q.zeros) == 0).any())
    qweight, qzeros = pu.unpack_reorder_pack(q.data, q.zeros, 4)
    g = to_gptq(q)
    assert torch.equal(g["qweight"], qweight)
    assert torch.equal(g["qzeros"], qzeros)


# ---------------------------------------------------------------- compressed-tensors pack-quantized


def test_ct_golden_word():
    # signed [-8, -7, 0, 1, 2, 3, 4, 7] are AWQ codes [0, 1, 8, 9, 10, 11, 12, 15]
    codes = torch.tensor([0, 1, 8, 9, 10, 11, 12, 15]).repeat(8, 1)
    ct = to_ct_pack_quantized(_from_ints(codes, torch.full((8, 1), 8), torch.ones(8, 1)))
    assert [w & 0xFFFFFFFF for w in ct["weight_packed"][:, 0].tolist()] == [0xFCBA9810] * 8
    assert [w & 0xFFFFFFFF for w in ct["weight_zero_point"].reshape(-1).tolist()] == [0x88888888]


def test_ct_layout_by_hand():
    gen = torch.Generator().manual_seed(10)
    codes = torch.randint(0, 16, (16, 32), generator=gen)
    zeros = torch.randint(0, 16, (16, 4), generator=gen)
    scales = torch.rand(16, 4, generator=gen).half()
    ct = to_ct_pack_quantized(_from_ints(codes, zeros, scales))
    assert set(ct) == {"weight_packed", "weight_scale", "weight_zero_point", "weight_shape"}
    assert (ct["weight_packed"].dtype, tuple(ct["weight_packed"].shape)) == (torch.int32, (16, 4))
    assert (ct["weight_zero_point"].dtype, tuple(ct["weight_zero_point"].shape)) == (torch.int32, (2, 4))
    assert ct["weight_shape"].dtype == torch.int64 and ct["weight_shape"].tolist() == [16, 32]
    assert torch.equal(_bits16(ct["weight_scale"]), _bits16(scales))
    for j in range(16):
        for c in range(4):
            word = ct["weight_packed"][j, c].item() & 0xFFFFFFFF
            assert [(word >> (4 * k)) & 0xF for k in range(8)] == codes[j, 8 * c: 8 * c + 8].tolist()
    for r in range(2):
        for grp in range(4):
            word = ct["weight_zero_point"][r, grp].item() & 0xFFFFFFFF
            assert [(word >> (4 * k)) & 0xF for k in range(8)] == zeros[8 * r: 8 * r + 8, grp].tolist()


@pytest.mark.parametrize("group_size", [32, 128])
def test_ct_round_trip(group_size):
    q = quantize_int4_awq(_weight(11), group_size)
    ct = to_ct_pack_quantized(q)
    before = {k: v.clone() for k, v in ct.items()}
    back = from_ct_pack_quantized(ct)
    assert _same(back, q) and back.dtype == torch.float16
    assert all(torch.equal(ct[k], before[k]) for k in ct)
    ct["weight_g_idx"] = torch.arange(256, dtype=torch.int32) // group_size
    assert _same(from_ct_pack_quantized(ct), q)


def test_ct_symmetric_and_scale_dtypes():
    q = quantize_int4_awq(_weight(12), 64)
    ct = to_ct_pack_quantized(q)
    sym = {k: v for k, v in ct.items() if k != "weight_zero_point"}
    back = from_ct_pack_quantized(sym)
    assert unpack_awq(back.zeros).unique().tolist() == [8]
    assert torch.equal(back.data, q.data)
    # compressed-tensors keeps the model's dtype for the scales: they are read as written, float16 ones as a
    # plain AutoAWQ tensor (same decode), others under the compressed-tensors convention
    assert "convention" not in back.params and back.scale.dtype == torch.float16
    for dtype, value in ((torch.bfloat16, 0.0078125), (torch.bfloat16, 1e-30), (torch.float32, 1 / 3)):
        scale = torch.full((32, 4), value, dtype=dtype)
        converted = from_ct_pack_quantized(dict(ct, weight_scale=scale))
        assert converted.dtype == dtype and converted.scale.dtype == dtype
        assert converted.params["convention"] == "compressed-tensors"
        assert torch.equal(converted.scale, scale.t())
        assert torch.equal(to_ct_pack_quantized(converted)["weight_scale"], scale)
    with pytest.raises(TypeError, match="weight_scale must be float16, bfloat16 or float32"):
        from_ct_pack_quantized(dict(ct, weight_scale=torch.full((32, 4), 0.5, dtype=torch.float64)))


def test_ct_odd_in_features_pad():
    q = quantize_int4_awq(_weight(13, inp=12), 4)
    ct = to_ct_pack_quantized(q)
    assert ct["weight_packed"].shape == (32, 2)
    assert (ct["weight_packed"][:, 1] >> 16).eq(0).all(), "the tail of the last word is zero padding"
    assert _same(from_ct_pack_quantized(ct), q)


@pytest.mark.parametrize(
    "mutate, err, match",
    [
        (lambda t: t.pop("weight_packed"), ValueError, "missing 'weight_packed'"),
        (lambda t: t.update(weight_packed=t["weight_packed"].to(torch.int64)), TypeError, "weight_packed"),
        (lambda t: t.update(weight_packed=t["weight_packed"][:, :4]), ValueError, "weight_packed must be"),
        (lambda t: t.update(weight_shape=torch.tensor([32.0, 256.0])), ValueError, "weight_shape"),
        (lambda t: t.update(weight_scale=t["weight_scale"][:8]), ValueError, "weight_scale must be"),
        (lambda t: t.update(weight_scale=t["weight_scale"].to(torch.int32)), TypeError, "weight_scale"),
        (lambda t: t.update(weight_zero_point=t["weight_zero_point"][:2]), ValueError, "zero_point must be"),
        (lambda t: t.update(weight_zero_point=t["weight_zero_point"].to(torch.int8)), TypeError, "int32"),
        (lambda t: t.update(weight_g_idx=torch.arange(256).flip(0) // 64), ValueError, "activation ordering"),
        (lambda t: t.update(weight_scale=t["weight_scale"][:, :3]), ValueError, "not a multiple"),
        (lambda t: t.update(weight_g_idx=[0] * 256), TypeError, "weight_g_idx"),
    ],
)
def test_from_ct_rejects(mutate, err, match):
    t = to_ct_pack_quantized(quantize_int4_awq(_weight(14), 64))
    mutate(t)
    with pytest.raises(err, match=match):
        from_ct_pack_quantized(t)
    with pytest.raises(TypeError, match="mapping"):
        from_ct_pack_quantized([("weight_packed", t.get("weight_packed"))])


def test_empty_conversions():
    q = quantize_int4_awq(torch.zeros(0, 64, dtype=torch.float16), 64)
    assert _same(from_autoawq(**to_autoawq(q)), q)
    assert _same(from_gptq(**to_gptq(q)), q)
    assert _same(from_ct_pack_quantized(to_ct_pack_quantized(q)), q)
    q = quantize_int4_awq(torch.zeros(8, 0, dtype=torch.float16), 64)
    assert _same(from_autoawq(**to_autoawq(q), group_size=64), q)
    with pytest.raises(ValueError, match="pass group_size"):
        from_autoawq(**to_autoawq(q))


def test_dequant_equal_across_layouts():
    q = quantize_int4_awq(_weight(15, dtype=torch.bfloat16), 32)
    ref = dequantize_int4_awq(q, torch.float16)
    via_gptq = from_gptq(**to_gptq(q))
    via_ct = from_ct_pack_quantized(to_ct_pack_quantized(q))
    via_awq = from_autoawq(**to_autoawq(q))
    for other in (via_gptq, via_ct, via_awq):
        assert torch.equal(_bits16(dequantize_int4_awq(other, torch.float16)), _bits16(ref))


@pytest.mark.interop
def test_ct_pack_helpers_agree():
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32, unpack_from_int32

    assert pack_to_int32(torch.tensor([[-8, -7, 0, 1, 2, 3, 4, 7]], dtype=torch.int8), 4).tolist() == [
        [0xFCBA9810 - (1 << 32)]
    ]
    q = quantize_int4_awq(_weight(16), 64)
    ct = to_ct_pack_quantized(q)
    codes, zeros = unpack_awq(q.data).t(), unpack_awq(q.zeros).t()
    signed = (codes - 8).to(torch.int8)
    signed_zp = (zeros - 8).to(torch.int8)
    assert torch.equal(pack_to_int32(signed, 4), ct["weight_packed"])
    assert torch.equal(pack_to_int32(signed_zp, 4, packed_dim=0), ct["weight_zero_point"])
    assert torch.equal(unpack_from_int32(ct["weight_packed"], 4, torch.Size((32, 256))), signed)
    zp = unpack_from_int32(ct["weight_zero_point"], 4, torch.Size((32, 4)), packed_dim=0)
    assert torch.equal(zp, signed_zp)


@pytest.mark.interop
def test_ct_autoawq_converter_agrees():
    from compressed_tensors.entrypoints.convert.converters.autoawq import AutoAWQConverter

    q = quantize_int4_awq(_weight(17), 32)
    converted = AutoAWQConverter(group_size=32).process({f"layer.{k}": v for k, v in to_autoawq(q).items()})
    ours = to_ct_pack_quantized(q)
    assert set(converted) == {f"layer.{k}" for k in ours}
    for k, v in ours.items():
        assert converted[f"layer.{k}"].dtype == v.dtype
        assert torch.equal(converted[f"layer.{k}"], v), k


@pytest.mark.interop
@pytest.mark.parametrize("group_size", [32, 128])
def test_ct_compressor_agrees(group_size):
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    scheme = QuantizationScheme(
        targets=["Linear"],
        weights=QuantizationArgs(
            num_bits=4, type="int", symmetric=False, strategy="group", group_size=group_size
        ),
    )
    q = quantize_int4_awq(_weight(18), group_size)
    ct = to_ct_pack_quantized(q)
    ours = dequantize_int4_awq(q, torch.float16)
    decompressed = PackedQuantizationCompressor.decompress(dict(ct), scheme)["weight"]
    assert decompressed.dtype == torch.float16
    assert torch.equal(_bits16(decompressed), _bits16(ours))
    # compressing our dequantized weight with our scales/zero points reproduces our packed tensors
    zp = unpack_from_int32(ct["weight_zero_point"], 4, torch.Size((32, 256 // group_size)), packed_dim=0)
    state = {"weight": ours, "weight_scale": ct["weight_scale"], "weight_zero_point": zp}
    compressed = PackedQuantizationCompressor.compress(state, scheme)
    for k, v in ct.items():
        assert torch.equal(compressed[k], v), k
    # and AutoAWQ's dequantize_gemm on the same weight gives the same fp16 bits
    pu = _awq_packing_utils()
    theirs = pu.dequantize_gemm(q.data, q.zeros, q.scale, 4, group_size)
    assert torch.equal(_bits16(theirs.t()), _bits16(ours))


def _ct_checkpoint(dtype: torch.dtype, symmetric: bool, group_size: int, seed: int):
    """One module's pack-quantized tensors as llm-compressor writes them for a ``dtype`` model: scales and zero
    points from compressed-tensors' ``calculate_qparams`` (scale in the weight's dtype), packed by its
    ``PackedQuantizationCompressor``; with the scheme, to decompress them with compressed-tensors."""
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    from compressed_tensors.quantization.utils import calculate_qparams

    args = QuantizationArgs(num_bits=4, type="int", symmetric=symmetric, strategy="group", group_size=group_size)
    scheme = QuantizationScheme(targets=["Linear"], weights=args)
    g = torch.Generator().manual_seed(seed)
    # rows from 1e-6 to 1: the small ones decode to fp16 subnormals, where an fp16 decode loses bits
    w = (torch.randn(64, 256, generator=g) * torch.logspace(-6, 0, 64)[:, None]).to(dtype)
    groups = w.reshape(64, 256 // group_size, group_size)
    scale, zp = calculate_qparams(groups.amin(-1), groups.amax(-1), args)
    state = {"weight": w, "weight_scale": scale, **({} if symmetric else {"weight_zero_point": zp})}
    return dict(PackedQuantizationCompressor.compress(state, scheme)), scheme


@pytest.mark.interop
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("symmetric", [False, True])
def test_ct_checkpoint_of_any_model_dtype_decodes_as_compressed_tensors(dtype, symmetric):
    """llm-compressor W4A16 / W4A16_ASYM checkpoints of fp32, bf16 and fp16 models load with the scale dtype
    they were written in and decode bit for bit as compressed-tensors' own decompression: one multiply in the
    scale's dtype (a bf16 scale is not decoded in fp16 and cast, which rounds twice)."""
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor

    ct, scheme = _ct_checkpoint(dtype, symmetric, 32, seed=21)
    assert ct["weight_scale"].dtype == dtype and ("weight_zero_point" in ct) != symmetric
    q = from_ct_pack_quantized(ct)
    assert q.dtype == dtype and q.scale.dtype == dtype
    theirs = PackedQuantizationCompressor.decompress(dict(ct), scheme)["weight"]
    assert theirs.dtype == dtype
    ours = dequantize_int4_awq(q, dtype)
    assert torch.equal(ours.view(torch.uint8), theirs.view(torch.uint8))
    # a wider request is the producer's values exactly; the packed tensors round-trip unchanged
    assert torch.equal(dequantize_int4_awq(q, torch.float32), theirs.float())
    back = to_ct_pack_quantized(q)
    for k in ("weight_packed", "weight_scale", "weight_shape"):
        assert torch.equal(back[k], ct[k]), k
    if dtype != torch.float16:
        # the AutoAWQ rule (fp16 scales, fp16 multiply, then a cast) gives other bits on this data
        s16 = QTensor(q.data, q.scale.to(torch.float16), q.fmt, q.shape, q.dtype, zeros=q.zeros,
                      params={"group_size": 32})
        assert not torch.equal(dequantize_int4_awq(s16, dtype), theirs)


def test_ct_convention_weights_stay_out_of_fp16_only_consumers():
    """AutoAWQ and GPTQ store float16 scales and decode in float16: a compressed-tensors weight with bf16 or
    fp32 scales is refused there (ValueError naming the rule), and an unknown convention is refused."""
    q = quantize_int4_awq(_weight(19), 32)
    ct = to_ct_pack_quantized(q)
    bf = from_ct_pack_quantized(dict(ct, weight_scale=ct["weight_scale"].to(torch.bfloat16)))
    for fn in (to_autoawq, to_gptq):
        with pytest.raises(ValueError, match="decodes .* in float16"):
            fn(bf)
    with pytest.raises(TypeError, match="scale must be torch.float16 .convention 'autoawq'"):
        dequantize_int4_awq(QTensor(q.data, q.scale.float(), q.fmt, q.shape, zeros=q.zeros,
                                    params={"group_size": 32}))
    with pytest.raises(ValueError, match="convention"):
        dequantize_int4_awq(QTensor(q.data, q.scale, q.fmt, q.shape, zeros=q.zeros,
                                    params={"group_size": 32, "convention": "gptq"}))
