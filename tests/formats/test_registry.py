"""The format registry: every per-format list derives from it, and a new format is one registration away."""

import importlib
import inspect
from dataclasses import replace

import pytest
import torch

import lowbit
from lowbit.formats import FORMATS, QTensor
from lowbit.formats.registry import REGISTRY, ROLES, Format, Kernel, formats_with, register_format, unregister_format
from lowbit.formats.spec import FormatSpec, IntSpec


def test_specs_are_the_registry_specs():
    assert list(FORMATS) == list(REGISTRY)
    assert all(FORMATS[name] is f.spec and f.spec.name == name == f.name for name, f in REGISTRY.items())
    assert list(lowbit.FORMATS) == list(REGISTRY)


def test_option_schema_matches_the_reference_signatures():
    for name, f in REGISTRY.items():
        params = list(inspect.signature(f.quantize).parameters)[1:]
        assert f.options == tuple(p for p in params if p != "fmt"), name
        assert f.takes_fmt == ("fmt" in params), name
        assert set(f.defaults) <= set(f.options), name


def test_op_lists_derive_from_the_registry():
    linear = importlib.import_module("lowbit.ops.linear")
    scaled_mm = importlib.import_module("lowbit.ops.scaled_mm")

    assert linear.SUPPORTED_FORMATS == formats_with("linear_weight")
    assert set(linear.SUPPORTED_FORMATS) == {"nvfp4", "mxfp4", "nf4", "int4_awq", "fp4_b32", "bnb_fp4"}
    operands = {f for pair in scaled_mm.PAIRS for f in pair}
    assert operands == set(formats_with("scaled_mm"))


def test_kernel_lists_derive_from_the_registry():
    pytest.importorskip("triton")
    from lowbit.kernels import gemm_w4, gemv_prepack
    from lowbit.kernels import scaled_mm as kernel_scaled_mm

    assert gemv_prepack.FORMATS == formats_with("gemv_w4") == ("nvfp4", "mxfp4", "fp4_b32", "nf4", "int4_awq")
    assert gemm_w4.FORMATS == formats_with("gemm_w4") == gemv_prepack.FORMATS
    assert kernel_scaled_mm.FORMATS == formats_with("scaled_mm")


def test_kernel_entries_name_existing_launchers():
    pytest.importorskip("triton")
    from lowbit.kernels import KERNEL_MODULES

    for name, f in REGISTRY.items():
        for kernel in (f.quantize_kernel, f.dequantize_kernel):
            if kernel is None:
                continue
            assert kernel.module in KERNEL_MODULES, name
            module = importlib.import_module(f"lowbit.kernels.{kernel.module}")
            assert callable(getattr(module, kernel.launcher)), (name, kernel)


def test_kernel_lookup_reads_the_registry():
    from lowbit import kernels

    assert kernels.quantize_kernel("nf4", {}) == "no triton quantize kernel for format 'nf4' yet"
    assert kernels.dequantize_kernel("fp8_rowwise", None) == "no triton dequantize kernel for format 'fp8_rowwise' yet"
    if kernels.triton_available() is None:
        reason = kernels.quantize_kernel("nvfp4", {"convention": "torchao"})
        assert reason == "the triton quantize kernel for 'nvfp4' does not cover these options"
        assert callable(kernels.quantize_kernel("nvfp4", {"convention": "lightx2v"}))


# ------------------------------------------------------------------------- a new format: per-channel int8


def quantize_int8_channel(x: torch.Tensor, axis: int = -1) -> QTensor:
    """Symmetric int8, one fp32 scale per row (reduced along ``axis``, the last dim)."""
    if axis != -1:
        raise ValueError("int8_channel: axis must be -1")
    xf = x.detach().float()
    scale = (xf.abs().amax(dim=-1, keepdim=True) / 127.0).clamp_min(torch.finfo(torch.float32).tiny)
    data = torch.round(xf / scale).clamp(-127, 127).to(torch.int8)
    return QTensor(data=data, scale=scale, fmt="int8_channel", shape=x.shape, dtype=x.dtype, params={})


def dequantize_int8_channel(q: QTensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return (q.data.float() * q.scale).to(dtype)


INT8_CHANNEL = Format(
    "int8_channel",
    FormatSpec("int8_channel", "int_channel", IntSpec("int8", 8, True), (1, -1), "fp32", {"axis": -1}),
    quantize_int8_channel,
    dequantize_int8_channel,
    options=("axis",),
)


@pytest.fixture
def int8_channel():
    register_format(INT8_CHANNEL)
    try:
        yield INT8_CHANNEL
    finally:
        unregister_format("int8_channel")


def test_a_registered_format_quantizes_and_dequantizes(int8_channel):
    x = torch.randn(8, 64)
    q = lowbit.quantize(x, "int8_channel")
    assert q.fmt == "int8_channel" and q.data.dtype == torch.int8 and q.scale.shape == (8, 1)
    out = lowbit.dequantize(q, torch.bfloat16)
    assert out.dtype == torch.bfloat16 and out.shape == x.shape
    torch.testing.assert_close(out.float(), x, atol=float(x.abs().max()) / 127, rtol=0)
    # the option schema: known options pass, others are refused as for every format; a spec passes its defaults
    lowbit.quantize(x, "int8_channel", axis=-1)
    with pytest.raises(ValueError, match=r"unknown option\(s\) \['group_size'\] for format 'int8_channel'"):
        lowbit.quantize(x, "int8_channel", group_size=4)
    assert lowbit.quantize(x, int8_channel.spec).fmt == "int8_channel"
    assert "int8_channel" in lowbit.FORMATS
    # no kernel declared: the kernel lookup says so
    from lowbit import kernels

    assert kernels.quantize_kernel("int8_channel", {}) == "no triton quantize kernel for format 'int8_channel' yet"


def test_unregistering_removes_the_format():
    register_format(INT8_CHANNEL)
    unregister_format("int8_channel")
    assert "int8_channel" not in REGISTRY and "int8_channel" not in FORMATS
    with pytest.raises(ValueError, match="unknown format 'int8_channel'"):
        lowbit.quantize(torch.randn(2, 4), "int8_channel")


@pytest.mark.parametrize(
    "bad, rule",
    [
        (replace(INT8_CHANNEL, name="nvfp4", spec=FORMATS["nvfp4"]), "format names are unique"),
        (replace(INT8_CHANNEL, quantize=None), "needs a reference quantize function"),
        (replace(INT8_CHANNEL, dequantize="dequantize_int8_channel"), "needs a reference dequantize function"),
        (replace(INT8_CHANNEL, spec=FORMATS["nf4"]), "spec must be a FormatSpec named 'int8_channel'"),
        (replace(INT8_CHANNEL, roles=frozenset({"gemv"})), "roles must be among"),
        (replace(INT8_CHANNEL, quantize_kernel=("blockscaled", "quantize_mx")), "kernels must be Kernel entries"),
        ("int8_channel", "expected a Format"),
    ],
    ids=["duplicate", "no-quantize", "no-dequantize", "spec-name", "role", "kernel", "not-a-format"],
)
def test_bad_registrations_name_the_rule(bad, rule):
    before = dict(REGISTRY)
    with pytest.raises(ValueError, match=rule):
        register_format(bad)
    assert REGISTRY == before and list(FORMATS) == list(REGISTRY)


def test_roles_are_known():
    assert all(f.roles <= set(ROLES) for f in REGISTRY.values())
    assert all(isinstance(k, Kernel) for f in REGISTRY.values() for k in (f.quantize_kernel, f.dequantize_kernel)
               if k is not None)
    with pytest.raises(ValueError, match="role must be one of"):
        formats_with("gemv")
