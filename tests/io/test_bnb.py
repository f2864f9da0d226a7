"""bitsandbytes NF4 checkpoint layout: key set and order, bytes, JSON, round trips, bnb's 1-row shape quirk,
and errors for malformed state dicts."""

import json

import pytest
import torch

import lowbit
from lowbit.formats import nf4
from lowbit.formats.codecs import codebook_table
from lowbit.formats import bnb_fp4
from lowbit.formats.spec import BNB_FP4, NF4
from lowbit.io.bnb import from_bnb_state_dict, to_bnb_state_dict

QS = "quant_state.bitsandbytes__nf4"
INT_VIEW = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}


def _bits(t):
    return t.contiguous().view(INT_VIEW[t.dtype]).reshape(-1) if t.is_floating_point() else t


def _same_qtensor(a, b):
    assert a.fmt == b.fmt and a.shape == b.shape and a.dtype == b.dtype and a.params == b.params
    for name in ("data", "scale", "nested_scale", "nested_offset"):
        x, y = getattr(a, name), getattr(b, name)
        assert (x is None) == (y is None), name
        if x is not None:
            assert x.dtype == y.dtype and x.shape == y.shape, name
            if name == "nested_offset" and x.isnan() and y.isnan():
                continue  # empty input: mean() is -NaN, JSON "NaN" cannot carry the sign (bnb reads +NaN too)
            assert torch.equal(_bits(x), _bits(y)), name


def _json(sd, prefix="weight"):
    return bytes(sd[f"{prefix}.{QS}"].tolist()).decode("utf-8")


def _x(shape, dtype=torch.bfloat16, seed=0):
    return (torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * 3).to(dtype)


def test_layout_keys_and_json():
    x = _x((4, 128))
    q = lowbit.quantize(x, "nf4", double_quant=True)
    sd = to_bnb_state_dict(q)
    assert list(sd) == [
        "weight",
        "weight.absmax",
        "weight.quant_map",
        "weight.nested_absmax",
        "weight.nested_quant_map",
        f"weight.{QS}",
    ]
    assert sd["weight"].dtype == torch.uint8 and sd["weight"].shape == (256, 1)
    assert sd["weight.absmax"].dtype == torch.uint8 and sd["weight.absmax"].shape == (8,)
    assert torch.equal(sd["weight.quant_map"], codebook_table(NF4))
    assert sd["weight.nested_absmax"].dtype == torch.float32 and sd["weight.nested_absmax"].shape == (1,)
    assert torch.equal(sd["weight.nested_quant_map"], nf4.create_dynamic_map())
    offset = q.nested_offset.item()
    assert _json(sd) == (
        '{"quant_type": "nf4", "blocksize": 64, "dtype": "bfloat16", "shape": [4, 128], '
        '"nested_blocksize": 256, '
        f'"nested_dtype": "float32", "nested_offset": {offset!r}}}'
    )
    plain = to_bnb_state_dict(
        lowbit.quantize(x.float(), "nf4", blocksize=128), prefix="model.layers.0.mlp.up_proj.weight"
    )
    p = "model.layers.0.mlp.up_proj.weight"
    assert list(plain) == [p, f"{p}.absmax", f"{p}.quant_map", f"{p}.{QS}"]
    assert plain[f"{p}.absmax"].dtype == torch.float32 and plain[f"{p}.absmax"].shape == (4,)
    assert _json(plain, p) == '{"quant_type": "nf4", "blocksize": 128, "dtype": "float32", "shape": [4, 128]}'


@pytest.mark.parametrize("dq", [False, True])
@pytest.mark.parametrize(
    "shape, dtype",
    [
        ((4, 128), torch.bfloat16),
        ((3, 33), torch.float16),
        ((7,), torch.float32),
        ((2, 3, 400), torch.float32),
        ((), torch.bfloat16),
        ((0, 64), torch.float16),
    ],
)
def test_round_trip_is_identical(shape, dtype, dq):
    x = _x(shape, dtype)
    q = nf4.quantize_nf4(x, 64, dq)
    sd = to_bnb_state_dict(q)
    back = from_bnb_state_dict(sd)
    _same_qtensor(q, back)
    assert torch.equal(_bits(nf4.dequantize_nf4(back, dtype)), _bits(nf4.dequantize_nf4(q, dtype)))
    if dq and x.numel() == 0:
        assert '"nested_offset": NaN' in _json(sd)  # mean of no blocks, as bitsandbytes writes it


def test_outputs_are_copies_and_inputs_untouched():
    q = nf4.quantize_nf4(_x((2, 64)), double_quant=True)
    snapshot = {k: v.clone() for k, v in q.tensors().items()}
    sd = to_bnb_state_dict(q)
    for v in sd.values():
        v.zero_()
    for k, v in q.tensors().items():
        assert torch.equal(_bits(v), _bits(snapshot[k]))
    sd = to_bnb_state_dict(q)
    frozen = {k: v.clone() for k, v in sd.items()}
    back = from_bnb_state_dict(sd)
    back.data.zero_()
    back.scale.zero_()
    for k in sd:
        assert torch.equal(sd[k], frozen[k])


def test_other_keys_are_ignored():
    q = nf4.quantize_nf4(_x((2, 64)))
    sd = {
        **to_bnb_state_dict(q, "a.weight"),
        **to_bnb_state_dict(nf4.quantize_nf4(_x((64,), seed=1)), "a.weight2"),
        "a.bias": torch.ones(2),
        "a.weight_scale": torch.ones(1),
    }
    _same_qtensor(from_bnb_state_dict(sd, "a.weight"), q)


def _sd(dq=True, shape=(2, 130)):
    return to_bnb_state_dict(nf4.quantize_nf4(_x(shape), double_quant=dq))


def _with_json(sd, **changes):
    meta = json.loads(_json(sd))
    meta.update(changes)
    for k in [k for k, v in changes.items() if v is ...]:
        del meta[k]
    return {**sd, f"weight.{QS}": torch.tensor(list(json.dumps(meta).encode()), dtype=torch.uint8)}


def _without(sd, key):
    return {k: v for k, v in sd.items() if k != key}


@pytest.mark.parametrize(
    "make, exc, match",
    [
        (lambda: [("weight", torch.zeros(1))], TypeError, "tensors must be a Mapping"),
        (lambda: _without(_sd(), "weight"), ValueError, "missing the packed weight 'weight'"),
        (lambda: _without(_sd(), "weight.absmax"), ValueError, r"missing \['weight.absmax'\]"),
        (
            lambda: _without(_sd(), "weight.nested_quant_map"),
            ValueError,
            r"missing \['weight.nested_quant_map'\]",
        ),
        (
            lambda: _without(_sd(), f"weight.{QS}"),
            ValueError,
            "exactly one 'weight.quant_state.bitsandbytes__",
        ),
        (
            lambda: {**_sd(), "weight.quant_state.bitsandbytes__fp4": torch.zeros(1, dtype=torch.uint8)},
            ValueError,
            "exactly one",
        ),
        (
            lambda: {
                ("weight.quant_state.bitsandbytes__fp4" if k.endswith(QS) else k): v for k, v in _sd().items()
            },
            ValueError,
            # the fp4 key with nf4's JSON: key and JSON must name the same type
            "quant_type must be 'fp4' \\(the key's\\), got 'nf4'",
        ),
        (
            lambda: {
                ("weight.quant_state.bitsandbytes__int4" if k.endswith(QS) else k): v for k, v in _sd().items()
            },
            ValueError,
            r"quant_type must be one of \['fp4', 'nf4'\].*got 'int4'",
        ),
        (lambda: {**_sd(), "weight.code": torch.zeros(1)}, ValueError, r"unexpected \['weight.code'\]"),
        (
            lambda: {**_sd(), f"weight.{QS}": torch.tensor([0xFF, 0xFE], dtype=torch.uint8)},
            ValueError,
            "UTF-8 JSON",
        ),
        (
            lambda: {**_sd(), f"weight.{QS}": torch.tensor(list(b"[1, 2]"), dtype=torch.uint8)},
            ValueError,
            "JSON object",
        ),
        (lambda: {**_sd(), f"weight.{QS}": torch.zeros(2, 2, dtype=torch.uint8)}, ValueError, "1-D uint8"),
        (lambda: _with_json(_sd(), quant_type="fp4"), ValueError, "quant_type must be 'nf4'"),
        (lambda: {**_sd(), "weight.quant_map": codebook_table(BNB_FP4)}, ValueError, "not the standard NF4 table"),
        (lambda: _with_json(_sd(), blocksize=48), ValueError, "blocksize must be one of"),
        (lambda: _with_json(_sd(), dtype="float64"), ValueError, "dtype must be one of"),
        (lambda: _with_json(_sd(), shape=[2, -130]), ValueError, "shape must be a list of non-negative ints"),
        (lambda: _with_json(_sd(), shape=None), ValueError, "shape must be a list"),
        (lambda: _with_json(_sd(), shape=[2, 131]), ValueError, r"must hold ceil\(262/2\) = 131 bytes"),
        (lambda: _with_json(_sd(), nested_offset=...), ValueError, r"missing \['nested_offset'\]"),
        (lambda: _with_json(_sd(), extra=1), ValueError, r"unexpected \['extra'\]"),
        (lambda: _with_json(_sd(), nested_blocksize=128), ValueError, "nested_blocksize must be 256"),
        (lambda: _with_json(_sd(), nested_dtype="float16"), ValueError, "nested_dtype must be 'float32'"),
        (lambda: _with_json(_sd(), nested_offset="1.0"), ValueError, "nested_offset must be a number"),
        (lambda: _with_json(_sd(dq=False), nested_offset=1.0), ValueError, "there is no nested_absmax"),
        (lambda: {**_sd(), "weight": _sd()["weight"].reshape(-1)}, ValueError, r"shape \[k, 1\]"),
        (lambda: {**_sd(), "weight": _sd()["weight"][:-1]}, ValueError, "must hold ceil"),
        (
            lambda: {**_sd(), "weight.absmax": _sd()["weight.absmax"].float()},
            ValueError,
            r"weight.absmax must be torch.uint8 \[5\]",
        ),
        (lambda: {**_sd(dq=False), "weight.absmax": torch.ones(4)}, ValueError, r"torch.float32 \[5\]"),
        (
            lambda: {**_sd(), "weight.nested_absmax": torch.ones(2)},
            ValueError,
            r"nested_absmax must be torch.float32 \[1\]",
        ),
        (
            lambda: {**_sd(), "weight.quant_map": -codebook_table(NF4)},
            ValueError,
            "not the standard NF4 table",
        ),
        (
            lambda: {**_sd(), "weight.nested_quant_map": nf4.create_dynamic_map(max_exponent_bits=5)},
            ValueError,
            "not bitsandbytes' default signed dynamic map",
        ),
    ],
)
def test_from_bnb_errors(make, exc, match):
    with pytest.raises(exc, match=match):
        from_bnb_state_dict(make())


def test_prefix_and_qtensor_errors():
    q = nf4.quantize_nf4(_x((2, 64)))
    with pytest.raises(ValueError, match="prefix must be a non-empty key"):
        to_bnb_state_dict(q, prefix="")
    with pytest.raises(ValueError, match="prefix must be a non-empty key"):
        from_bnb_state_dict(to_bnb_state_dict(q), prefix="weight.")
    with pytest.raises(TypeError, match="prefix must be a str"):
        to_bnb_state_dict(q, prefix=3)
    with pytest.raises(TypeError, match="q must be a QTensor"):
        to_bnb_state_dict(to_bnb_state_dict(q))
    with pytest.raises(ValueError, match=r"one of \('nf4', 'bnb_fp4'\)"):
        to_bnb_state_dict(lowbit.quantize(torch.ones(1, 32), "mxfp4"))


# ---------------------------------------------------------------- bitsandbytes cross-checks


@pytest.fixture
def bnbf():
    return pytest.importorskip("bitsandbytes.functional")


def _bnb_sd(F, x, blocksize=64, dq=True, prefix="weight", quant_type="nf4", **kw):
    packed, state = F.quantize_4bit(x, blocksize=blocksize, compress_statistics=dq, quant_type=quant_type, **kw)
    return (
        {prefix: packed, **{f"{prefix}.{k}": v for k, v in state.as_dict(packed=True).items()}},
        packed,
        state,
    )


def _assert_same_state_dict(ours, ref):
    assert list(ours) == list(ref)
    for k in ref:
        assert ours[k].dtype == ref[k].dtype and ours[k].shape == ref[k].shape, k
        assert torch.equal(_bits(ours[k]), _bits(ref[k])), k


@pytest.mark.interop
@pytest.mark.parametrize("dq", [False, True])
@pytest.mark.parametrize(
    "shape, dtype, blocksize",
    [
        ((4, 128), torch.bfloat16, 64),
        ((3, 33), torch.float16, 128),
        ((1000,), torch.float32, 256),
        ((2, 5, 300), torch.bfloat16, 64),
        ((), torch.float32, 64),
        ((0, 64), torch.bfloat16, 64),
    ],
)
def test_state_dict_equals_bitsandbytes(bnbf, shape, dtype, blocksize, dq):
    x = _x(shape, dtype, seed=blocksize)
    ref, _, _ = _bnb_sd(bnbf, x, blocksize, dq)
    q = nf4.quantize_nf4(x, blocksize, dq)
    _assert_same_state_dict(to_bnb_state_dict(q), ref)
    _same_qtensor(from_bnb_state_dict(ref), q)


@pytest.mark.interop
def test_linear4bit_state_dict(bnbf):
    bnb = pytest.importorskip("bitsandbytes")
    w = _x((8, 192), torch.bfloat16, seed=3)
    lin = bnb.nn.Linear4bit(192, 8, bias=True, quant_type="nf4", compress_statistics=True)
    lin.weight = bnb.nn.Params4bit(w.clone(), requires_grad=False, quant_type="nf4", compress_statistics=True)
    lin = lin.to("cpu")
    sd = lin.state_dict(prefix="model.proj.")
    ours = to_bnb_state_dict(lowbit.quantize(w, "nf4", double_quant=True), prefix="model.proj.weight")
    _assert_same_state_dict(ours, {k: v for k, v in sd.items() if k != "model.proj.bias"})
    back = from_bnb_state_dict(sd, prefix="model.proj.weight")
    assert back.shape == (8, 192) and back.dtype == torch.bfloat16


@pytest.mark.interop
def test_bitsandbytes_loads_our_state_dict(bnbf, bnb_dequantize_4bit):
    x = _x((6, 256), torch.float16, seed=9)
    q = nf4.quantize_nf4(x, 64, True)
    sd = to_bnb_state_dict(q)
    qs_dict = {k[len("weight.") :]: v for k, v in sd.items() if k != "weight"}
    state = bnbf.QuantState.from_dict(qs_dict, device=torch.device("cpu"))
    ref = bnb_dequantize_4bit(sd["weight"], state)
    assert torch.equal(_bits(ref), _bits(nf4.dequantize_nf4(q, torch.float16)))


@pytest.mark.interop
@pytest.mark.parametrize(
    "shape, bnb_shape",
    # bnb returns [1, n] for every even 1-D input and transposes when the packed weight is a single byte
    [
        ((1, 2), (2, 1)),
        ((2,), (2, 1)),
        ((2, 1), (1, 2)),
        ((128,), (1, 128)),
        ((1, 1), (1, 1)),
        ((4, 32), (4, 32)),
    ],
)
def test_bnb_dequantize_shape_quirk(bnbf, bnb_dequantize_4bit, shape, bnb_shape):
    x = _x(shape, torch.float32, seed=5)
    ref_sd, packed, state = _bnb_sd(bnbf, x, dq=False)
    with torch.compiler.set_stance("force_eager"):  # odd last dims use bnb's torch.compile'd fallback
        bnb_out = bnbf.dequantize_4bit(packed, state, quant_type="nf4")
    assert tuple(bnb_out.shape) == bnb_shape
    # values from bnb's host-independent decode: its CPU op misreads absmax for (4, 32) on AVX-512 hosts
    ref = bnb_dequantize_4bit(packed, state)
    q = from_bnb_state_dict(ref_sd)
    assert q.shape == shape
    ours = lowbit.dequantize(q)
    assert ours.shape == shape and torch.equal(ours.reshape(-1), ref.reshape(-1))


@pytest.mark.interop
def test_non_uint8_quant_storage_is_read_as_bytes(bnbf):
    x = _x((4, 64), torch.bfloat16, seed=2)
    ref, packed, _ = _bnb_sd(bnbf, x, dq=True, quant_storage=torch.bfloat16)
    assert packed.dtype == torch.bfloat16 and packed.shape == (64, 1)
    _same_qtensor(from_bnb_state_dict(ref), nf4.quantize_nf4(x, 64, True))


# ---------------------------------------------------------------- bnb_fp4 (quant_type "fp4")


def test_fp4_layout_keys_and_json():
    x = _x((4, 128))
    q = bnb_fp4.quantize_bnb_fp4(x, 64, True)
    sd = to_bnb_state_dict(q, prefix="m.weight")
    assert list(sd) == ["m.weight", "m.weight.absmax", "m.weight.quant_map", "m.weight.nested_absmax",
                        "m.weight.nested_quant_map", "m.weight.quant_state.bitsandbytes__fp4"]
    assert torch.equal(sd["m.weight.quant_map"].view(torch.int32), codebook_table(BNB_FP4).view(torch.int32))
    meta = json.loads(bytes(sd["m.weight.quant_state.bitsandbytes__fp4"].tolist()))
    assert meta["quant_type"] == "fp4" and meta["blocksize"] == 64 and meta["shape"] == [4, 128]
    back = from_bnb_state_dict(sd, prefix="m.weight")
    assert back.fmt == "bnb_fp4"
    _same_qtensor(back, q)
    plain = bnb_fp4.quantize_bnb_fp4(x.float(), 128)
    _same_qtensor(from_bnb_state_dict(to_bnb_state_dict(plain)), plain)


def test_fp4_errors():
    sd = to_bnb_state_dict(bnb_fp4.quantize_bnb_fp4(_x((2, 64)), 64))
    bad = dict(sd, **{"weight.quant_map": codebook_table(NF4)})
    with pytest.raises(ValueError, match="not the standard FP4 table"):
        from_bnb_state_dict(bad)
    # code 8 as -0.0 is another map (bitsandbytes' table holds +0.0 there)
    neg = codebook_table(BNB_FP4).clone()
    neg[8] = -0.0
    with pytest.raises(ValueError, match="not the standard FP4 table"):
        from_bnb_state_dict(dict(sd, **{"weight.quant_map": neg}))
    # an nf4 checkpoint's JSON under the fp4 key, and the reverse
    nf4_sd = to_bnb_state_dict(nf4.quantize_nf4(_x((2, 64)), 64))
    swapped = dict(nf4_sd)
    swapped["weight.quant_state.bitsandbytes__nf4"] = sd["weight.quant_state.bitsandbytes__fp4"]
    with pytest.raises(ValueError, match="quant_type must be 'nf4' \\(the key's\\), got 'fp4'"):
        from_bnb_state_dict(swapped)


@pytest.mark.interop
@pytest.mark.parametrize("dq", [False, True])
@pytest.mark.parametrize(
    "shape, dtype, blocksize",
    [((4, 128), torch.bfloat16, 64), ((3, 33), torch.float16, 128), ((1000,), torch.float32, 256),
     ((2, 5, 300), torch.bfloat16, 32), ((), torch.float32, 64), ((0, 64), torch.bfloat16, 64)],
)
def test_fp4_state_dict_equals_bitsandbytes(bnbf, shape, dtype, blocksize, dq):
    x = _x(shape, dtype, seed=blocksize + 1)
    ref, _, _ = _bnb_sd(bnbf, x, blocksize, dq, quant_type="fp4")
    q = bnb_fp4.quantize_bnb_fp4(x, blocksize, dq)
    _assert_same_state_dict(to_bnb_state_dict(q), ref)
    _same_qtensor(from_bnb_state_dict(ref), q)


@pytest.mark.interop
@pytest.mark.parametrize("dq", [False, True])
def test_fp4_linear4bit_state_dict_round_trip(bnbf, bnb_dequantize_4bit, dq):
    bnb = pytest.importorskip("bitsandbytes")
    w = _x((8, 192), torch.bfloat16, seed=3)
    lin = bnb.nn.Linear4bit(192, 8, bias=True, quant_type="fp4", compress_statistics=dq)
    lin.weight = bnb.nn.Params4bit(w.clone(), requires_grad=False, quant_type="fp4", compress_statistics=dq)
    lin = lin.to("cpu")
    sd = lin.state_dict(prefix="model.proj.")
    assert "model.proj.weight.quant_state.bitsandbytes__fp4" in sd
    ours = to_bnb_state_dict(bnb_fp4.quantize_bnb_fp4(w, 64, dq), prefix="model.proj.weight")
    _assert_same_state_dict(ours, {k: v for k, v in sd.items() if k != "model.proj.bias"})
    back = from_bnb_state_dict(sd, prefix="model.proj.weight")
    assert back.fmt == "bnb_fp4" and back.shape == (8, 192) and back.dtype == torch.bfloat16
    # bitsandbytes reads ours (QuantState.from_dict, what its Params4bit.from_prequantized calls) and decodes it
    # as our reference does
    qs = {k[len("model.proj.weight."):]: v for k, v in ours.items() if k != "model.proj.weight"}
    state = bnbf.QuantState.from_dict(qs, device=torch.device("cpu"))
    assert state.quant_type == "fp4" and state.nested == dq
    ref = bnb_dequantize_4bit(ours["model.proj.weight"], state)
    assert torch.equal(_bits(ref), _bits(bnb_fp4.dequantize_bnb_fp4(back, torch.bfloat16)))
