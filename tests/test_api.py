"""The public quantize/dequantize surface: option validation, FormatSpec objects, QTensor."""

import pytest
import torch

import lowbit
from lowbit.formats.spec import MXFP4_FORMAT, FormatSpec


def test_every_format_is_listed():
    assert set(lowbit.FORMATS) == {
        "nvfp4", "mxfp4", "mxfp6_e2m3", "mxfp6_e3m2", "mxfp8_e4m3", "mxfp8_e5m2",
        "fp4_b32", "fp8_block", "fp8_rowwise", "nf4", "bnb_fp4", "int4_awq",
    }


def test_unknown_format_and_option():
    x = torch.randn(4, 64)
    with pytest.raises(ValueError, match="unknown format 'fp3'"):
        lowbit.quantize(x, "fp3")
    with pytest.raises(ValueError, match=r"unknown option\(s\) \['group_size'\] for format 'mxfp4'.*scale_rounding"):
        lowbit.quantize(x, "mxfp4", group_size=32)
    with pytest.raises(TypeError, match="fmt must be"):
        lowbit.quantize(x, 4)
    with pytest.raises(TypeError, match="q must be a QTensor"):
        lowbit.dequantize(x)
    q = lowbit.quantize(x, "mxfp4")
    with pytest.raises(TypeError, match="dtype must be"):
        lowbit.dequantize(q, torch.int8)


def test_format_spec_objects_and_their_option_defaults():
    x = torch.randn(4, 64)
    by_obj = lowbit.quantize(x, MXFP4_FORMAT)
    by_name = lowbit.quantize(x, "mxfp4")
    assert torch.equal(by_obj.scale.view(torch.uint8), by_name.scale.view(torch.uint8))
    floor_spec = FormatSpec("mxfp4", "blockscaled", MXFP4_FORMAT.element, 32, "e8m0", {"scale_rounding": "floor"})
    assert lowbit.quantize(x, floor_spec).params["scale_rounding"] == "floor"
    with pytest.raises(ValueError, match="unknown format spec"):
        lowbit.quantize(x, FormatSpec("mine", "blockscaled", MXFP4_FORMAT.element, 32, "e8m0"))


def test_qtensor_surface():
    x = torch.randn(2, 3, 64, dtype=torch.bfloat16)
    q = lowbit.quantize(x, "nvfp4")
    assert q.fmt == "nvfp4" and q.shape == x.shape and q.dtype == torch.bfloat16
    assert q.data.dtype == torch.uint8 and q.data.shape == (2, 3, 32)
    assert q.scale.dtype == torch.float8_e4m3fn and q.scale.shape == (2, 3, 4)
    assert q.global_scale.dtype == torch.float32 and q.global_scale.shape == (1,)
    assert q.zeros is None and q.spec.block == 16
    assert q.nbytes == 2 * 3 * 32 + 2 * 3 * 4 + 4
    assert "nvfp4" in repr(q)
    m = lowbit.quantize(x, "mxfp8_e4m3")
    assert m.data.dtype == torch.float8_e4m3fn and m.scale.dtype == torch.float8_e8m0fnu and m.global_scale is None


# ------------------------------------------------------------------- decisions kept across repeated calls


def _counting_quantizer(monkeypatch):
    from lowbit import api

    calls = []
    real = api.quantizer

    def counted(*a, **k):
        calls.append(a[0])
        return real(*a, **k)

    monkeypatch.setattr(api, "quantizer", counted)
    monkeypatch.setattr(api, "_RESOLVED", {})
    return calls


def test_a_repeated_quantize_decides_once(monkeypatch):
    calls = _counting_quantizer(monkeypatch)
    x = torch.randn(4, 64)
    for _ in range(3):
        lowbit.quantize(x, "mxfp4")
    assert len(calls) == 1
    lowbit.quantize(x, "mxfp4", scale_rounding="floor")  # other option values: decided again
    lowbit.quantize(x, "mxfp4", scale_rounding="floor")
    assert len(calls) == 2
    monkeypatch.setenv("LOWBIT_BACKEND", "torch")  # the backend chosen by the environment: decided again
    lowbit.quantize(x, "mxfp4")
    assert len(calls) == 3
    for _ in range(2):  # a FormatSpec (its options are not in its hash): decided on every call
        lowbit.quantize(x, MXFP4_FORMAT)
    assert len(calls) == 5
    with pytest.raises(ValueError, match="unknown option"):  # a kept decision does not let bad options through
        lowbit.quantize(x, "mxfp4", group_size=32)


def test_a_kept_decision_passes_each_calls_tensor_options(monkeypatch):
    """A tensor-valued option enters the kept decision by name: each call still quantizes with its own value."""
    calls = _counting_quantizer(monkeypatch)
    x = torch.randn(4, 64)
    outs = [lowbit.quantize(x, "nvfp4", global_scale=torch.tensor([g])) for g in (1.0, 64.0, 1.0)]
    assert len(calls) == 1
    assert [float(q.global_scale) for q in outs] == [1.0, 64.0, 1.0]
    assert not torch.equal(outs[0].scale.view(torch.uint8), outs[1].scale.view(torch.uint8))
    assert torch.equal(outs[0].scale.view(torch.uint8), outs[2].scale.view(torch.uint8))
    lowbit.quantize(x, "nvfp4", global_scale=64.0)  # a float is another kind of option: decided again
    assert len(calls) == 2


def test_a_registry_change_drops_kept_decisions(monkeypatch):
    from lowbit.formats.qtensor import QTensor
    from lowbit.formats.registry import Format, register_format, unregister_format
    from lowbit.formats.spec import IntSpec

    def make(tag):
        def q(x):
            return QTensor(data=x.detach().to(torch.int8), scale=torch.ones(1), fmt="tagged", shape=x.shape,
                           params={"tag": tag})
        spec = FormatSpec("tagged", "int_channel", IntSpec("int8", 8, True), (1, -1), "fp32", {})
        return Format("tagged", spec, q, lambda q, dtype=torch.float32: q.data.to(dtype))

    calls = _counting_quantizer(monkeypatch)
    x = torch.zeros(2, 4)
    register_format(make("first"))
    try:
        assert lowbit.quantize(x, "tagged").params["tag"] == "first"
        assert lowbit.quantize(x, "tagged").params["tag"] == "first"
        unregister_format("tagged")
        register_format(make("second"))
        assert lowbit.quantize(x, "tagged").params["tag"] == "second"
        assert len(calls) == 2
    finally:
        unregister_format("tagged")
    with pytest.raises(ValueError, match="unknown format 'tagged'"):
        lowbit.quantize(x, "tagged")


def test_no_kept_decode_call_where_the_kernel_module_offers_none():
    from lowbit import kernels

    if kernels.triton_available() is not None:
        pytest.skip(kernels.triton_available())
    q = lowbit.quantize(torch.randn(4, 128), "fp8_block", backend="torch")
    assert callable(kernels.dequantize_kernel("fp8_block", q)) and kernels.dequantize_call(q) is None
    assert kernels.dequantize_call(lowbit.quantize(torch.randn(4, 64), "mxfp4")) is not None
