"""lowbit.linear on CPU: the reference against an independent float64 computation, validation, dispatch
rules (with stand-in kernel modules), the custom op's fake implementation and torch.compile."""

from __future__ import annotations

import math
import subprocess
import sys
import textwrap
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import lowbit
from lowbit.formats import NF4
from lowbit.formats.int4_awq import AWQ_ORDER
from lowbit.formats.nf4 import NESTED_BLOCKSIZE, dynamic_map

# the package re-exports the function ``linear``, which shadows the module attribute of the same name
lin = sys.modules["lowbit.ops.linear"]
policy = sys.modules["lowbit.ops.policy"]

ACTS = [None, "gelu", "gelu_tanh", "silu"]
XDTYPES = [torch.bfloat16, torch.float16]

# (format, options): every weight format and the variants that change how it decodes
VARIANTS = [
    ("nvfp4", {}),
    ("nvfp4", {"convention": "torchao"}),
    ("nvfp4", {"convention": "compressed-tensors"}),
    ("nvfp4", {"global_scale": "none"}),
    ("nvfp4", {"scale_layout": "swizzled"}),
    ("mxfp4", {}),
    ("mxfp4", {"scale_rounding": "floor", "scale_layout": "swizzled"}),
    ("nf4", {}),
    ("nf4", {"double_quant": True}),
    ("nf4", {"blocksize": 128, "double_quant": True}),
    ("int4_awq", {}),
    ("int4_awq", {"group_size": 32}),
    ("int4_awq", {"group_size": 192}),
    ("fp4_b32", {}),
]
VARIANT_IDS = [f + "".join(f"-{k}={v}" for k, v in o.items()) for f, o in VARIANTS]


# ---------------------------------------------------------------------------------- independent decoders
# Written from docs/formats.md, not from lowbit's dequantize functions.

_E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def _fp4_values(data: torch.Tensor, n: int, k: int) -> torch.Tensor:
    table = torch.tensor(_E2M1 + [-v for v in _E2M1], dtype=torch.float64)
    b = data.reshape(n, k // 2).to(torch.int64)
    codes = torch.stack([b & 0xF, b >> 4], dim=-1).reshape(n, k)  # element 2i in the low nibble
    return table[codes]


def _unswizzle(scale: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    flat = scale.reshape(-1)
    out = torch.empty(rows, cols, dtype=scale.dtype)
    n_col_tiles = -(-cols // 4)
    for r in range(rows):
        for c in range(cols):
            i = ((r // 128) * n_col_tiles + c // 4) * 512 + (r % 32) * 16 + ((r // 32) % 4) * 4 + c % 4
            out[r, c] = flat[i]
    return out


def _scales(q, block: int) -> torch.Tensor:
    n, k = q.shape
    s = q.scale if q.scale_layout == "linear" else _unswizzle(q.scale, n, k // block)
    return s.reshape(n, k // block)


def _decode(q) -> torch.Tensor:
    """float64 ``[N, K]`` weight of a QTensor, from the bits."""
    n, k = q.shape
    if q.fmt == "nvfp4":
        sf = _scales(q, 16).to(torch.float64)
        if "per_tensor_scale" in q.params:
            sf = sf * float(q.params["per_tensor_scale"])
        elif q.global_scale is not None:
            sf = sf / float(q.global_scale)
        return _fp4_values(q.data, n, k) * sf.repeat_interleave(16, dim=1)
    if q.fmt == "mxfp4":
        e = _scales(q, 32).view(torch.uint8).to(torch.float64)
        return _fp4_values(q.data, n, k) * torch.pow(2.0, e - 127).repeat_interleave(32, dim=1)
    if q.fmt == "fp4_b32":
        return _fp4_values(q.data, n, k) * q.scale.to(torch.float64).reshape(n, k // 32).repeat_interleave(32, 1)
    if q.fmt == "nf4":
        bs = q.params["blocksize"]
        b = q.data.to(torch.int64)
        codes = torch.stack([b >> 4, b & 0xF], dim=-1).reshape(-1)[: n * k]  # element 2i in the high nibble
        if q.params["double_quant"]:
            table = dynamic_map().to(torch.float64)
            nested = q.nested_scale.to(torch.float64).repeat_interleave(NESTED_BLOCKSIZE)[: q.scale.numel()]
            absmax = table[q.scale.to(torch.int64)] * nested + float(q.nested_offset)
        else:
            absmax = q.scale.to(torch.float64)
        vals = torch.tensor(NF4.levels, dtype=torch.float64)[codes]
        return (vals * absmax.repeat_interleave(bs)[: n * k]).reshape(n, k)
    if q.fmt == "int4_awq":
        g = q.params["group_size"]

        def unpack(words):  # [rows, cols/8] int32 -> [rows, cols]; nibble i holds column 8c + AWQ_ORDER[i]
            rows, c8 = words.shape
            out = torch.empty(rows, c8 * 8, dtype=torch.int64)
            w64 = words.to(torch.int64) & 0xFFFFFFFF
            for i, col in enumerate(AWQ_ORDER):
                out[:, col::8] = (w64 >> (4 * i)) & 0xF
            return out

        iw = unpack(q.data)  # [K, N]
        z = unpack(q.zeros).repeat_interleave(g, dim=0)
        s = q.scale.repeat_interleave(g, dim=0)
        # AutoAWQ: (q - z) * s is one float16 multiply
        return ((iw - z).to(torch.float16) * s).to(torch.float64).T
    raise AssertionError(q.fmt)


def _act64(y: torch.Tensor, activation: str | None) -> torch.Tensor:
    if activation == "gelu":
        return 0.5 * y * (1 + torch.erf(y / math.sqrt(2)))
    if activation == "gelu_tanh":
        return 0.5 * y * (1 + torch.tanh(math.sqrt(2 / math.pi) * (y + 0.044715 * y**3)))
    if activation == "silu":
        return y / (1 + torch.exp(-y))
    return y


def _independent(x, q, bias, activation) -> torch.Tensor:
    y = x.to(torch.float64) @ _decode(q).T
    if bias is not None:
        y = y + bias.to(torch.float64)
    return _act64(y, activation)


def _check_against_independent(out, x, q, bias, activation):
    want = _independent(x, q, bias, activation)
    assert out.shape == want.shape and out.dtype == x.dtype
    # one rounding to x's dtype (plus fp32 accumulation noise, far below it)
    eps = torch.finfo(x.dtype).eps
    torch.testing.assert_close(out.to(torch.float64), want, rtol=eps, atol=1e-5 * want.abs().max().item() + 1e-6)


@pytest.fixture(scope="module")
def weights():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(48, 384, generator=g) * 0.1
    return {vid: lowbit.quantize(w, f, **o) for vid, (f, o) in zip(VARIANT_IDS, VARIANTS)}


def _x(shape, dtype, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(dtype)


# ---------------------------------------------------------------------------------- reference


def test_decoders_agree_with_dequantize(weights):
    # equal up to the fp32 rounding of the block multiplier (nvfp4 computes sf / S in fp32 first)
    for vid, q in weights.items():
        torch.testing.assert_close(_decode(q), lowbit.dequantize(q).double(), rtol=2**-23, atol=0, msg=vid)


@pytest.mark.parametrize("vid", VARIANT_IDS)
@pytest.mark.parametrize("activation", ACTS)
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("dtype", XDTYPES)
def test_linear_matches_independent_fp64(weights, vid, activation, with_bias, dtype):
    q = weights[vid]
    x = _x((2, 3, 384), dtype)
    bias = _x((48,), dtype, seed=2) if with_bias else None
    out = lowbit.linear(x, q, bias, activation)
    _check_against_independent(out, x, q, bias, activation)
    ref32 = lin.linear_reference(x, q, bias, activation, out_dtype=torch.float32)
    torch.testing.assert_close(ref32.double(), _independent(x, q, bias, activation), rtol=1e-5, atol=1e-5)
    # linear on CPU *is* the reference, bit for bit, whichever backend name selects it
    assert torch.equal(out, lin.linear_reference(x, q, bias, activation))
    assert torch.equal(out, lowbit.linear(x, q, bias, activation, backend="torch"))


@pytest.mark.parametrize("shape", [(384,), (1, 384), (7, 384), (2, 3, 384), (2, 1, 5, 384), (0, 384), (3, 0, 384)])
def test_leading_dims(weights, shape):
    q = weights["nvfp4"]
    x = _x(shape, torch.bfloat16)
    out = lowbit.linear(x, q, None, "silu")
    assert out.shape == (*shape[:-1], 48)
    if x.numel():
        _check_against_independent(out, x, q, None, "silu")
        flat = lowbit.linear(x.reshape(-1, 384), q, None, "silu")
        assert torch.equal(out.reshape(-1, 48), flat)


def test_non_contiguous_x(weights):
    q = weights["int4_awq"]
    base = _x((384, 6), torch.float16)
    x = base.T  # [6, 384], stride (1, 6)
    assert not x.is_contiguous()
    out = lowbit.linear(x, q)
    assert torch.equal(out, lowbit.linear(x.contiguous(), q))


@settings(max_examples=30, deadline=None)
@given(
    fmt=st.sampled_from(["nvfp4", "mxfp4", "nf4", "int4_awq", "fp4_b32"]),
    n8=st.integers(1, 6),
    k64=st.integers(1, 4),
    lead=st.lists(st.integers(1, 3), min_size=0, max_size=2),
    activation=st.sampled_from(ACTS),
    with_bias=st.booleans(),
    dtype=st.sampled_from(XDTYPES),
    seed=st.integers(0, 2**16),
)
def test_random_shapes(fmt, n8, k64, lead, activation, with_bias, dtype, seed):
    n, k = 8 * n8, 64 * k64
    g = torch.Generator().manual_seed(seed)
    opts = {"group_size": 64} if fmt == "int4_awq" else {}
    q = lowbit.quantize(torch.randn(n, k, generator=g), fmt, **opts)
    x = torch.randn(*lead, k, generator=g).to(dtype)
    bias = torch.randn(n, generator=g).to(dtype) if with_bias else None
    _check_against_independent(lowbit.linear(x, q, bias, activation), x, q, bias, activation)


def test_inputs_not_modified(weights):
    for q in weights.values():
        x = _x((4, 384), torch.bfloat16)
        bias = _x((48,), torch.bfloat16, seed=3)
        before = (x.clone(), bias.clone(), {k: t.clone() for k, t in q.tensors().items()}, dict(q.params))
        lowbit.linear(x, q, bias, "gelu")
        lin.linear_reference(x, q, bias, "gelu")
        assert torch.equal(x, before[0]) and torch.equal(bias, before[1])
        for name, t in q.tensors().items():
            assert torch.equal(t, before[2][name]), name
        assert q.params.keys() == before[3].keys()


# ---------------------------------------------------------------------------------- validation


def test_errors(weights):
    q = weights["nvfp4"]
    x = _x((2, 384), torch.bfloat16)
    b = _x((48,), torch.bfloat16)
    cases = [
        (ValueError, "K mismatch", lambda: lowbit.linear(_x((2, 383), torch.bfloat16), q)),
        (ValueError, "K mismatch", lambda: lowbit.linear(torch.tensor(1.0, dtype=torch.bfloat16), q)),
        (TypeError, "bfloat16 or float16", lambda: lowbit.linear(x.float(), q)),
        (TypeError, "bfloat16 or float16", lambda: lowbit.linear(x.to(torch.float8_e4m3fn), q)),
        (TypeError, "x must be a torch.Tensor", lambda: lowbit.linear(x.tolist(), q)),
        (TypeError, "QTensor", lambda: lowbit.linear(x, torch.randn(48, 384))),
        (ValueError, "unsupported weight format 'mxfp8_e4m3'",
         lambda: lowbit.linear(x, lowbit.quantize(torch.randn(48, 384), "mxfp8_e4m3"))),
        (ValueError, "unsupported weight format 'fp8_block'",
         lambda: lowbit.linear(x, lowbit.quantize(torch.randn(48, 384), "fp8_block", block=(128, 128)))),
        (ValueError, "2-D", lambda: lowbit.linear(x, lowbit.quantize(torch.randn(2, 48, 384), "nvfp4"))),
        (ValueError, "2-D", lambda: lowbit.linear(x, lowbit.quantize(torch.randn(384), "nf4"))),
        (ValueError, "activation must be one of", lambda: lowbit.linear(x, q, activation="relu")),
        (ValueError, "activation must be one of", lambda: lowbit.linear(x, q, activation="GELU")),
        (ValueError, r"bias must have shape \[N\]", lambda: lowbit.linear(x, q, b[:47])),
        (ValueError, r"bias must have shape \[N\]", lambda: lowbit.linear(x, q, b.reshape(1, 48))),
        (TypeError, "bias dtype", lambda: lowbit.linear(x, q, b.half())),
        (TypeError, "bias must be None or a torch.Tensor", lambda: lowbit.linear(x, q, b.tolist())),
        (ValueError, "devices differ", lambda: lowbit.linear(x.to("meta"), q)),
        (ValueError, "devices differ", lambda: lowbit.linear(x, q, b.to("meta"))),
        (ValueError, "backend must be one of", lambda: lowbit.linear(x, q, backend="cuda")),
        (ValueError, "backend='triton' needs CUDA", lambda: lowbit.linear(x, q, backend="triton")),
    ]
    for exc, match, fn in cases:
        with pytest.raises(exc, match=match):
            fn()
    # the reference validates the same way
    with pytest.raises(ValueError, match="K mismatch"):
        lin.linear_reference(_x((2, 383), torch.bfloat16), q)


def test_env_backend(weights, monkeypatch):
    q, x = weights["mxfp4"], _x((2, 384), torch.bfloat16)
    monkeypatch.setenv("LOWBIT_BACKEND", "triton")
    with pytest.raises(ValueError, match="needs CUDA"):
        lowbit.linear(x, q)
    assert lowbit.linear(x, q, backend="auto").shape == (2, 48)
    monkeypatch.setenv("LOWBIT_BACKEND", "nonsense")
    with pytest.raises(ValueError, match="LOWBIT_BACKEND"):
        lowbit.linear(x, q)


# ---------------------------------------------------------------------------------- dispatch


def test_explain_cpu(weights):
    q = weights["nf4-double_quant=True"]
    text = lowbit.explain((3, 5, 384), q)
    assert "M=15" in text and "N=48" in text and "reference" in text and "nf4" in text
    x = _x((3, 384), torch.bfloat16)
    assert lowbit.explain(x, q) == str(lin.plan_linear(x, q))
    plan = lin.plan_linear(x, q, backend="torch")
    assert (plan.path, plan.backend, plan.m, plan.n, plan.k) == ("reference", "torch", 3, 48, 384)
    plan = lin.plan_linear(x, q, backend="triton")
    assert plan.path == "unavailable" and plan.error is ValueError
    assert "raises ValueError" in lowbit.explain(x, q, backend="triton")
    with pytest.raises(ValueError, match="K mismatch"):
        lowbit.explain((3, 100), q)
    with pytest.raises(ValueError, match="unsupported weight format"):
        lowbit.explain((3, 384), lowbit.quantize(torch.randn(8, 384), "mxfp6_e2m3"))


def _stand_in(name, reason=None, calls=None):
    def kernel(x, w, bias, activation):
        if calls is not None:
            calls.append((name, tuple(x.shape), x.is_contiguous(), bias is not None, activation))
        return lin.linear_reference(x, w, bias, activation)

    return SimpleNamespace(supports=lambda w: reason, describe=lambda w, m: f"{name} stand-in", **{name: kernel})


@pytest.fixture
def kernels(monkeypatch):
    """Replace the kernel-module lookup: ``kernels["gemv_w4"] = module or None``."""
    table = {"gemv_w4": None, "gemm_w4": None}
    monkeypatch.setattr(policy, "kernel_module", lambda name: table[name])
    monkeypatch.setattr("lowbit.kernels.triton_available", lambda: None)
    return table


CUDA = torch.device("cuda", 0)


def _path(w, m, backend="auto", device=CUDA):
    return lin._plan(m, w.shape[0], w.shape[1], device, w, backend)


def test_dispatch_rules(weights, kernels):
    w = weights["nvfp4"]
    kernels["gemv_w4"] = _stand_in("gemv_w4")
    kernels["gemm_w4"] = _stand_in("gemm_w4")
    for m in (1, 2, 7, policy.GEMV_MAX_M):
        assert _path(w, m).path == "gemv_w4"
        assert _path(w, m, "triton").path == "gemv_w4"
    min_m = policy.dequant_gemm_min_m(w.fmt)
    for m in (policy.GEMV_MAX_M + 1, 33, min_m - 1):
        assert _path(w, m).path == "gemm_w4"
    for m in (min_m, 4096):
        plan = _path(w, m)
        assert plan.path == "dequant_gemm" and "then cuBLAS" in plan.reason
    assert _path(w, 0).path == "empty"
    assert _path(w, 1, "torch").path == "reference"
    assert _path(w, 1, "auto", torch.device("cpu")).path == "reference"
    plan = _path(w, 1)
    assert "GEMV_MAX_M=16" in plan.reason and "cuda:0" in str(plan)

    # a GEMV that does not cover the weight, or no GEMV module: the GEMM takes small M, and says why
    kernels["gemv_w4"] = _stand_in("gemv_w4", reason="swizzled scales not supported")
    plan = _path(w, 4)
    assert plan.path == "gemm_w4" and "swizzled scales not supported" in plan.reason
    kernels["gemv_w4"] = None
    plan = _path(w, 4)
    assert plan.path == "gemm_w4" and "no module lowbit.kernels.gemv_w4" in plan.reason

    # no kernel at all on CUDA: an error naming every reason, never a silent reference
    kernels["gemm_w4"] = _stand_in("gemm_w4", reason="nf4 not yet")
    for m in (1, 100):
        plan = _path(w, m)
        assert plan.path == "unavailable" and plan.error is RuntimeError
        assert "nf4 not yet" in plan.reason and "backend='torch'" in plan.reason
    assert "no module lowbit.kernels.gemv_w4" in _path(w, 1).reason
    kernels["gemm_w4"] = None
    assert _path(w, 200).path == "unavailable"
    assert _path(w, 200, "torch").path == "reference"


def test_dispatch_no_triton(weights, kernels, monkeypatch):
    monkeypatch.setattr("lowbit.kernels.triton_available", lambda: "triton cannot be imported (boom)")
    kernels["gemm_w4"] = _stand_in("gemm_w4")
    plan = _path(weights["mxfp4"], 64)
    assert plan.path == "unavailable" and "triton cannot be imported" in plan.reason


def _stand_ins_on_cuda(kernels, monkeypatch, calls):
    """Stand-in GEMV and GEMM modules recording their calls, and the rules deciding as if x were on CUDA."""
    kernels["gemv_w4"] = _stand_in("gemv_w4", calls=calls)
    kernels["gemm_w4"] = _stand_in("gemm_w4", calls=calls)
    real_decide = policy.linear_decide
    monkeypatch.setattr(policy, "linear_decide",
                        lambda m, device, w, backend, x_dtype=None: real_decide(m, CUDA, w, backend, x_dtype))


def test_run_calls_the_kernel(weights, kernels, monkeypatch):
    """The CPU stand-in for CUDA: _run hands the kernel a contiguous [M, K] x and reshapes its result."""
    calls = []
    _stand_ins_on_cuda(kernels, monkeypatch, calls)
    q = weights["fp4_b32"]
    x = _x((384, 2, 3), torch.bfloat16).permute(1, 2, 0)  # [2, 3, 384], not contiguous
    b = _x((48,), torch.bfloat16)
    out = lowbit.linear(x, q, b, "gelu_tanh")
    assert calls == [("gemv_w4", (6, 384), True, True, "gelu_tanh")]
    assert out.shape == (2, 3, 48)
    assert torch.equal(out, lin.linear_reference(x, q, b, "gelu_tanh"))
    lowbit.linear(_x((40, 384), torch.bfloat16), q)
    assert calls[-1][:2] == ("gemm_w4", (40, 384))
    assert lowbit.linear(_x((0, 384), torch.bfloat16), q).shape == (0, 48)
    assert len(calls) == 2
    kernels["gemv_w4"] = kernels["gemm_w4"] = None
    with pytest.raises(RuntimeError, match="no triton kernel runs lowbit.linear"):
        lowbit.linear(x, q)


def test_gemv_row_blocks_rule(weights, kernels, monkeypatch):
    """Past GEMV_MAX_M the rules ask the GEMV module's row_blocks_apply with x's dtype (plan_linear: the given
    tensor's, a shape's: the weight's); a module without it, another dtype or M past its limit take the GEMM."""
    calls, asked = [], []

    def rows(w, m, x_dtype):
        asked.append((m, x_dtype))
        return policy.GEMV_MAX_M < m <= 32 and x_dtype == torch.bfloat16

    _stand_ins_on_cuda(kernels, monkeypatch, calls)
    q = weights["nvfp4"]
    k = q.shape[1]
    assert _path(q, 24).path == "gemm_w4"                        # a module without row_blocks_apply
    kernels["gemv_w4"].row_blocks_apply = rows
    plan = lin._plan(24, q.shape[0], k, CUDA, q, "auto", torch.bfloat16)
    assert plan.path == "gemv_w4" and "blocks of x rows" in plan.reason
    assert lin._plan(24, q.shape[0], k, CUDA, q, "auto", torch.float16).path == "gemm_w4"
    assert lin._plan(33, q.shape[0], k, CUDA, q, "auto", torch.bfloat16).path == "gemm_w4"
    assert _path(q, 8).path == "gemv_w4" and all(m > policy.GEMV_MAX_M for m, _ in asked)  # past it only
    lowbit.linear(_x((24, k), torch.bfloat16), q)
    lowbit.linear(_x((24, k), torch.float16), q)
    assert [c[0] for c in calls] == ["gemv_w4", "gemm_w4"]
    assert (24, torch.bfloat16) in asked and (24, torch.float16) in asked


def test_kernel_module_lookup():
    # the real lookup: absent modules are None (the kernels may land later), present ones are imported
    policy.kernel_module.cache_clear()
    assert policy.kernel_module("no_such_kernel_module") is None
    policy.kernel_module.cache_clear()


# ---------------------------------------------------------------------------------- custom op


def _op_args(x2, q, bias=None, activation=None, backend="auto"):
    tensors, meta = lin._flatten(q)
    return (x2, *tensors, bias, q.fmt, list(q.shape), meta, activation, backend)


@pytest.mark.parametrize("vid", VARIANT_IDS)
def test_flatten_round_trip(weights, vid):
    q = weights[vid]
    tensors, meta = lin._flatten(q)
    r = lin._unflatten(tensors[0], tensors[1], tensors[2:6], tensors[6], q.fmt, list(q.shape), meta)
    assert (r.fmt, r.shape, r.dtype, r.scale_layout) == (q.fmt, q.shape, q.dtype, q.scale_layout)
    assert r.params.keys() == q.params.keys()
    for k, v in q.params.items():
        assert (torch.equal(r.params[k], v) if isinstance(v, torch.Tensor) else r.params[k] == v), k
    assert r.tensors().keys() == q.tensors().keys()
    assert all(r.tensors()[k] is t for k, t in q.tensors().items())
    assert torch.equal(lowbit.dequantize(r), lowbit.dequantize(q))


def test_flatten_rejects_unencodable_params(weights):
    from dataclasses import replace

    q = replace(weights["mxfp4"], params={"scale_rounding": "a;b"})
    with pytest.raises(TypeError, match="cannot pass QTensor param"):
        lin._flatten(q)


@pytest.mark.parametrize("vid", ["nvfp4-convention=torchao", "nf4-double_quant=True", "int4_awq", "mxfp4"])
def test_custom_op_opcheck(weights, vid):
    q = weights[vid]
    x2 = _x((5, 384), torch.bfloat16)
    b = _x((48,), torch.bfloat16)
    utils = ["test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic"]
    if any(t.dtype.is_floating_point and t.element_size() == 1 for t in q.tensors().values()):
        utils.remove("test_schema")  # SchemaCheckMode compares inputs with ops float8 has no CPU kernel for
    op = torch.ops.lowbit.linear_w4a16.default
    torch.library.opcheck(op, _op_args(x2, q, b, "gelu"), test_utils=utils)
    torch.library.opcheck(op, _op_args(x2, q, None, None, "torch"), test_utils=utils)


def test_custom_op_eager_equals_linear(weights):
    q = weights["nf4-double_quant=True"]
    x2 = _x((5, 384), torch.float16)
    b = _x((48,), torch.float16)
    out = torch.ops.lowbit.linear_w4a16(*_op_args(x2, q, b, "silu"))
    assert torch.equal(out, lowbit.linear(x2, q, b, "silu"))


def test_fake_impl_shapes(weights):
    from torch._subclasses.fake_tensor import FakeTensorMode

    q = weights["int4_awq-group_size=32"]
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        for m, dtype in [(1, torch.bfloat16), (17, torch.float16), (0, torch.bfloat16)]:
            x2 = mode.from_tensor(_x((m, 384), dtype))
            out = torch.ops.lowbit.linear_w4a16(*_op_args(x2, q, None, "gelu"))
            assert out.shape == (m, 48) and out.dtype == dtype
    # meta tensors run the fake implementation too
    qm = q.to("meta")
    out = torch.ops.lowbit.linear_w4a16(*_op_args(torch.empty(9, 384, dtype=torch.bfloat16, device="meta"), qm))
    assert out.shape == (9, 48) and out.device.type == "meta"


@pytest.fixture
def fresh_dynamo():
    """Dynamo caches per code object; parametrized tests reuse one, so start each from an empty cache."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


class _GraphRecorder:
    def __init__(self):
        self.graphs = []

    def __call__(self, gm, example_inputs):
        self.graphs.append(gm)
        return gm.forward


@pytest.mark.parametrize("backend", ["auto", "torch"])
def test_compile_fullgraph_emits_the_op(weights, backend, fresh_dynamo):
    q = weights["nvfp4-convention=torchao"]
    b = _x((48,), torch.bfloat16)
    rec = _GraphRecorder()

    @torch.compile(fullgraph=True, backend=rec)
    def f(x):
        return lowbit.linear(x, q, b, "gelu", backend=backend) * 2

    x = _x((2, 3, 384), torch.bfloat16)
    assert torch.equal(f(x), lowbit.linear(x, q, b, "gelu") * 2)
    assert len(rec.graphs) == 1
    targets = [n.target for n in rec.graphs[0].graph.nodes if n.op == "call_function"]
    assert any(str(t).startswith("lowbit.linear_w4a16") for t in targets), targets


@pytest.mark.parametrize("compile_backend", ["aot_eager", "inductor"])
@pytest.mark.parametrize("vid", ["nvfp4", "nf4-double_quant=True", "int4_awq-group_size=32", "mxfp4", "fp4_b32"])
def test_compile_matches_eager(weights, compile_backend, vid, fresh_dynamo):
    q = weights[vid]
    b = _x((48,), torch.float16)

    def f(x, w, bias):
        return lowbit.linear(x, w, bias, "silu") + 1

    cf = torch.compile(f, fullgraph=True, backend=compile_backend)
    for shape in [(1, 384), (4, 5, 384)]:
        x = _x(shape, torch.float16)
        torch.testing.assert_close(cf(x, q, b), f(x, q, b), rtol=0, atol=0)


def test_compile_dynamic_m_does_not_recompile(weights, fresh_dynamo):
    q = weights["mxfp4"]
    counter = torch._dynamo.testing.CompileCounter()
    cf = torch.compile(lambda x: lowbit.linear(x, q, None, "gelu"), fullgraph=True, dynamic=True, backend=counter)
    # the GEMV/GEMM choice is made inside the op at run time, so M crossing GEMV_MAX_M does not recompile
    # (M = 0 and 1 would: dynamo specializes sizes 0 and 1 itself)
    for m in (3, 16, 17, 40, 1000):
        x = _x((m, 384), torch.bfloat16)
        assert torch.equal(cf(x), lowbit.linear(x, q, None, "gelu"))
    assert counter.frame_count == 1


def test_compile_reports_validation_errors(weights, fresh_dynamo):
    q = weights["mxfp4"]
    cf = torch.compile(lambda x: lowbit.linear(x, q), fullgraph=True, backend="eager")
    with pytest.raises(Exception, match="K mismatch"):
        cf(_x((2, 100), torch.bfloat16))


def test_cpu_linear_needs_no_triton():
    code = textwrap.dedent(
        """
        import sys, torch
        sys.modules["triton"] = None
        import lowbit
        q = lowbit.quantize(torch.randn(16, 64), "nvfp4")
        y = lowbit.linear(torch.randn(2, 64, dtype=torch.bfloat16), q, None, "gelu")
        assert y.shape == (2, 16)
        print(lowbit.explain((2, 64), q))
        assert "triton" not in [m for m in sys.modules if sys.modules[m] is not None]
        print("ok")
        """
    )
    out = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().endswith("ok")


@pytest.mark.parametrize("compile_backend", ["aot_eager", "inductor"])
def test_compiled_op_sees_the_weights_own_tensors(weights, compile_backend, fresh_dynamo, monkeypatch):
    """Kernel modules may cache per weight keyed on ``w.data``: the op must receive the same tensor objects
    (it rebuilds the QTensor around them on every call), in eager and compiled calls alike."""
    q = weights["nf4-double_quant=True"]
    b = _x((48,), torch.bfloat16)
    seen = []
    real_run = lin._run

    def spy(x2, w, bias, activation, backend):
        seen.append(all(getattr(w, n) is t for n, t in q.tensors().items()) and bias is b)
        return real_run(x2, w, bias, activation, backend)

    monkeypatch.setattr(lin, "_run", spy)
    closure = torch.compile(lambda x: lowbit.linear(x, q, b), backend=compile_backend, fullgraph=True)
    argument = torch.compile(lambda x, w: lowbit.linear(x, w, b), backend=compile_backend, fullgraph=True)
    x = _x((3, 384), torch.bfloat16)
    for _ in range(2):
        closure(x)
        argument(x, q)
        lowbit.linear(x, q, b)
    assert seen == [True] * 6


# ------------------------------------------------------------------------------ chunked dequantize + GEMM

_CHUNK_CASES = [("nvfp4", {}), ("nvfp4", {"scale_layout": "swizzled"}), ("mxfp4", {}), ("fp4_b32", {}),
                ("nf4", {"double_quant": True}), ("int4_awq", {"group_size": 64})]


@pytest.mark.parametrize("fmt, opts", _CHUNK_CASES, ids=[f"{f}-{o}" for f, o in _CHUNK_CASES])
@pytest.mark.parametrize("act", [None, "silu"])
def test_linear_dequant_gemm_matches_reference_over_several_chunks(fmt, opts, act):
    gen = torch.Generator().manual_seed(3)
    n, k, m = 392, 256, 9
    w = torch.randn(n, k, generator=gen) * 0.1
    q = lowbit.quantize(w.half() if fmt == "int4_awq" else w, fmt, **opts)
    x = torch.randn(m, k, generator=gen).to(torch.bfloat16)
    bias = torch.randn(n, generator=gen).to(torch.bfloat16)
    ref = lin.linear_reference(x, q, bias, act).float()
    # 128-row chunks: 4 chunks, the last one partial
    got = lin.linear_dequant_gemm(x, q, bias, act, chunk_bytes=128 * k * 2)
    one = lin.linear_dequant_gemm(x, q, bias, act)
    assert got.dtype == torch.bfloat16 and got.shape == (m, n)
    for y in (got, one):
        err = (y.float() - ref).norm() / ref.norm()
        assert err <= 1e-2, err
    assert torch.equal(got, one)
    assert lin._chunk_rows(q, 2, 128 * k * 2) == 128
    # a weight whose decoded matrix fits the budget is one chunk; else the most 128-row multiples that fit
    assert lin._chunk_rows(q, 2, n * k * 2) == n and lin._chunk_rows(q, 2, None) == n
    assert lin._chunk_rows(q, 2, (n - 1) * k * 2) == 384 and lin._chunk_rows(q, 2, 100 * k * 2) == 128
    assert [c[:2] for c in lin.weight_chunks(q, 2, 300 * k * 2)] == [(0, 256), (256, 392)]


def test_dequant_gemm_is_chosen_only_when_enabled(monkeypatch):
    q = lowbit.quantize(torch.randn(256, 128), "nvfp4")
    assert "DEQUANT_GEMM_MIN_M_BY_FORMAT['nvfp4']=256" in lin._reason("dequant_gemm", (), 4096, torch.device("cuda"), q)
    monkeypatch.setattr(policy, "DEQUANT_GEMM_MIN_M_BY_FORMAT", {})
    monkeypatch.setattr(policy, "DEQUANT_GEMM_MIN_M", None)
    assert policy.linear_decide(4096, torch.device("cuda"), q, "auto")[0] != "dequant_gemm"
    monkeypatch.setattr(policy, "DEQUANT_GEMM_MIN_M", 1024)
    path, target, facts = policy.linear_decide(4096, torch.device("cuda"), q, "auto")
    assert path == "dequant_gemm" and target is None
    assert "DEQUANT_GEMM_MIN_M=1024" in lin._reason(path, facts, 4096, torch.device("cuda"), q)
    assert policy.linear_decide(1000, torch.device("cuda"), q, "auto")[0] != "dequant_gemm"
    assert policy.linear_decide(4096, torch.device("cpu"), q, "auto")[0] == "reference"


def test_dequant_gemm_threshold_per_format(weights, kernels, monkeypatch):
    kernels["gemv_w4"] = _stand_in("gemv_w4")
    kernels["gemm_w4"] = _stand_in("gemm_w4")
    for fmt in ("mxfp4", "int4_awq"):               # no override: these switch at DEQUANT_GEMM_MIN_M
        assert fmt not in policy.DEQUANT_GEMM_MIN_M_BY_FORMAT
        assert _path(weights[fmt], policy.DEQUANT_GEMM_MIN_M - 1).path == "gemm_w4"
        assert _path(weights[fmt], policy.DEQUANT_GEMM_MIN_M).path == "dequant_gemm"
    for fmt in ("nf4", "nvfp4"):                    # the shipped overrides, below the default
        low = policy.DEQUANT_GEMM_MIN_M_BY_FORMAT[fmt]
        assert low < policy.DEQUANT_GEMM_MIN_M
        assert _path(weights[fmt], low - 1).path == "gemm_w4"
        assert _path(weights[fmt], low).path == "dequant_gemm"
    monkeypatch.setitem(policy.DEQUANT_GEMM_MIN_M_BY_FORMAT, "nf4", 2 * policy.DEQUANT_GEMM_MIN_M)
    assert _path(weights["nf4"], policy.DEQUANT_GEMM_MIN_M).path == "gemm_w4"
    assert _path(weights["nf4"], 2 * policy.DEQUANT_GEMM_MIN_M).path == "dequant_gemm"
    assert _path(weights["mxfp4"], policy.DEQUANT_GEMM_MIN_M).path == "dequant_gemm"


@pytest.mark.parametrize("dq", [False, True])
def test_bnb_fp4_always_dequantizes_then_gemm_on_cuda(monkeypatch, dq):
    # no W4A16 GEMV / GEMM kernel reads bnb_fp4's table: every M on CUDA dequantizes (Triton) then cuBLAS,
    # even with DEQUANT_GEMM_MIN_M off; the CPU path is the reference
    q = lowbit.quantize(torch.randn(256, 128), "bnb_fp4", double_quant=dq)
    for min_m in (None, 2048):
        monkeypatch.setattr(policy, "DEQUANT_GEMM_MIN_M", min_m)
        for m in (1, 16, 100, 4096):
            assert policy.linear_decide(m, torch.device("cuda"), q, "auto")[:2] == ("dequant_gemm", None)
    assert policy.linear_decide(1, torch.device("cpu"), q, "auto")[0] == "reference"
    # the reference and the chunked dequantize + GEMM path agree with dequantize(q) @ x
    x = torch.randn(3, 128, dtype=torch.bfloat16)
    want = x.float() @ lowbit.dequantize(q).T
    got = lowbit.ops.linear(x, q, backend="torch").float()
    assert ((got - want).norm() / want.norm()) < 1e-2
    chunked = lin.linear_dequant_gemm(x, q, None, None, dequant_backend="torch", chunk_bytes=64 * 128 * 2)
    assert torch.allclose(chunked.float(), (x @ lowbit.dequantize(q, torch.bfloat16).T).float(), rtol=0, atol=0)


def test_kept_dequant_chunks_are_made_once_per_weight_and_dtype(monkeypatch):
    # linear_dequant_gemm on CUDA keeps its chunks' decode launches (kept_chunks): made once per weight and x
    # dtype, made again after an in-place update or a replaced tensor, dropped with the weight, never kept
    # during a CUDA-graph capture or custom-op call
    pytest.importorskip("triton")
    gc = pytest.importorskip("gc")
    made = []

    def builder(q, dtype):
        made.append((q.shape[0], dtype))
        return lambda: None

    monkeypatch.setattr(lin._kernels, "dequantize_call", lambda w: builder)
    monkeypatch.setattr(lin, "DEQUANT_CHUNK_BYTES", 256 * 128 * 2)  # two chunks of this weight in bf16 / fp16
    w = lowbit.quantize(torch.randn(512, 128), "nvfp4")
    first = lin.kept_chunks(w, torch.bfloat16)
    assert [c[:2] for c in first] == [(0, 256), (256, 512)] and len(made) == 2
    assert lin.kept_chunks(w, torch.bfloat16) is first and len(made) == 2
    lin.kept_chunks(w, torch.float16)
    assert len(made) == 4 and made[-1][1] == torch.float16
    w.scale.view(torch.uint8).add_(0)                # bumps the version: made again
    assert lin.kept_chunks(w, torch.bfloat16) is not first and len(made) == 6
    w2 = lowbit.QTensor(**{**w.__dict__, "scale": w.scale.clone()})  # same data, another scale tensor
    lin.kept_chunks(w2, torch.bfloat16)
    assert len(made) == 8
    key = id(w.data)
    assert key in lin._KEPT_CHUNKS
    del w, w2, first
    gc.collect()
    assert key not in lin._KEPT_CHUNKS
    with lowbit.kernels.per_call_scratch():          # inside the custom op: nothing kept
        assert lin.kept_chunks(lowbit.quantize(torch.randn(256, 128), "nvfp4"), torch.bfloat16) is None
    monkeypatch.setattr(lin._kernels, "dequantize_call", lambda w: None)
    assert lin.kept_chunks(lowbit.quantize(torch.randn(256, 128), "nvfp4"), torch.bfloat16) is None


@pytest.mark.parametrize(("fmt", "opts"), [("nvfp4", {}), ("int4_awq", {"group_size": 64}), ("nf4", {})])
def test_kept_dequant_chunks_do_not_keep_the_weight_alive(fmt, opts, monkeypatch):
    # the real kernel calls (made, not launched): they hold storage aliases, so the weight's death drops them
    pytest.importorskip("triton")
    import gc
    import weakref

    monkeypatch.setattr(lin, "DEQUANT_CHUNK_BYTES", 256 * 128 * 2)  # two chunks

    w = lowbit.quantize(torch.randn(512, 128).half() if fmt == "int4_awq" else torch.randn(512, 128), fmt, **opts)
    chunks = lin.kept_chunks(w, torch.bfloat16)
    assert chunks and len(chunks) == 2
    key, ref = id(w.data), weakref.ref(w.data)
    del w, chunks
    gc.collect()
    assert ref() is None and key not in lin._KEPT_CHUNKS


def test_register_fragment_rule(monkeypatch):
    # policy.register_operand_config as shipped (the fragment kernel, loads four K steps ahead) on the shapes of
    # its sweeps, for a 132-SM GPU: 256-row x tiles where the programs fill at least 0.8 of their last wave, up
    # to the format's largest M; 128-row tiles at M = 97..128; 64-row tiles split in 4 for nvfp4 at M = 32..64,
    # mxfp4 / int4_awq at 33..64; work bounds
    from types import SimpleNamespace

    assert policy.REGISTER_OPERAND_FRAGMENTS and policy.FRAGMENT_DEEP
    monkeypatch.setattr(policy, "sm_count", lambda device: 132)
    cuda = torch.device("cuda")

    def cfg(fmt, n, m, k=8192):
        return policy.register_operand_config(m, SimpleNamespace(fmt=fmt, shape=(n, k)), cuda)

    big = {"BM": 256, "WG": 2, "SPLIT": 1, "DEEP": 1}
    # 28672 columns: 224 tiles of 128 per 256 rows, 0.85 of two waves
    assert cfg("nvfp4", 28672, 256) == cfg("int4_awq", 28672, 192) == cfg("mxfp4", 28672, 512) == big
    assert cfg("nvfp4", 28672, 1024) == cfg("nvfp4", 28672, 768) == cfg("mxfp4", 28672, 1024) == big
    assert cfg("int4_awq", 28672, 768) is None and cfg("int4_awq", 28672, 1024) is None  # past the format's M
    assert cfg("nvfp4", 28672, 1025) is None and cfg("mxfp4", 28672, 2048) is None
    assert cfg("nvfp4", 28672, 384) == big and cfg("nvfp4", 28672, 383) is None        # last tile half full
    assert cfg("int4_awq", 4096, 512, 14336) == {**big, "SPLIT": 2}   # 64 tiles, split in 2: 128 of 132
    assert cfg("nvfp4", 4096, 1024, 14336) == big                      # 128 tiles
    assert cfg("nvfp4", 6144, 256, 4096) is None      # 48 tiles, split 2: 96 of 132 (0.73)
    assert cfg("nvfp4", 6144, 1024, 4096) is None     # 192 tiles: 0.73 of two waves
    assert policy.wave_fill(192, 132) == pytest.approx(192 / 264) and policy.wave_fill(132, 132) == 1.0
    assert cfg("nf4", 28672, 256) is None and cfg("nvfp4", 28672, 96) is None and cfg("nf4", 28672, 64) is None
    mid = {"BM": 128, "WG": 2, "SPLIT": 1, "DEEP": 1}
    assert cfg("nvfp4", 28672, 128) == cfg("mxfp4", 28672, 128) == cfg("int4_awq", 28672, 100) == mid
    assert cfg("nvfp4", 4096, 128, 14336) is None      # 32 tiles
    small = {"BM": 64, "WG": 1, "SPLIT": 4, "DEEP": 1}
    assert cfg("nvfp4", 28672, 64) == cfg("nvfp4", 28672, 32) == cfg("nvfp4", 6144, 32, 4096) == small
    assert cfg("mxfp4", 28672, 64) == cfg("int4_awq", 4096, 64, 14336) == cfg("int4_awq", 28672, 33) == small
    assert cfg("mxfp4", 28672, 32) is None and cfg("nvfp4", 28672, 31) is None
    # below the work bounds
    assert cfg("nvfp4", 1024, 64, 4096) is None      # 2.7e8
    assert cfg("mxfp4", 6144, 64, 4096) is None      # 1.6e9
    assert cfg("nvfp4", 28672, 256, 1024) is None and cfg("nvfp4", 28672, 256, 2048) == big
    monkeypatch.setattr(policy, "FRAGMENT_DEEP", False)
    assert cfg("nvfp4", 28672, 256) == {"BM": 256, "WG": 2, "SPLIT": 1}


def test_register_operand_rule(monkeypatch):
    # without the fragment kernel (REGISTER_OPERAND_FRAGMENTS False), the register-operand kernel's own rule:
    # two warpgroups and 256-row x tiles where the output tiles (times the split) fill 0.9 to 2 waves, 64-row
    # tiles for nvfp4 at M = 33..64; never below the rules' work bounds (M x N x K)
    from types import SimpleNamespace

    monkeypatch.setattr(policy, "REGISTER_OPERAND_FRAGMENTS", False)
    monkeypatch.setattr(policy, "sm_count", lambda device: 132)
    cuda = torch.device("cuda")

    def cfg(fmt, n, m, k=8192):
        return policy.register_operand_config(m, SimpleNamespace(fmt=fmt, shape=(n, k)), cuda)

    big = {"BM": 256, "WG": 2, "SPLIT": 1}
    assert cfg("nvfp4", 28672, 256) == cfg("int4_awq", 28672, 192) == cfg("mxfp4", 28672, 256) == big
    assert cfg("nvfp4", 28672, 512) is None          # 448 tiles: more than two waves
    assert cfg("int4_awq", 4096, 512, 14336) == {**big, "SPLIT": 2}   # 64 tiles, split in 2: 128 programs
    assert cfg("nvfp4", 6144, 256) is None           # 48 tiles: split 2 fills 96 of 132
    assert cfg("nvfp4", 28672, 300) is None and cfg("nvfp4", 28672, 128) is None  # M outside the ranges
    assert cfg("nf4", 28672, 256) is None
    assert cfg("nvfp4", 28672, 64) == {"BM": 64, "WG": 1, "SPLIT": 2}
    assert cfg("nvfp4", 8192, 64, 28672) == {"BM": 64, "WG": 1, "SPLIT": 4}
    assert cfg("mxfp4", 28672, 64) is None and cfg("nvfp4", 28672, 32) is None
    # below the work bounds
    assert cfg("nvfp4", 6144, 64, 4096) == {"BM": 64, "WG": 1, "SPLIT": 4}       # 1.6e9
    assert cfg("nvfp4", 1024, 64, 4096) is None and cfg("nvfp4", 6144, 33, 4096) is None
    assert cfg("nvfp4", 28672, 256, 1024) is None and cfg("nvfp4", 28672, 256, 2048) == big


def test_register_operand_route_is_decided_and_explained(monkeypatch):
    pytest.importorskip("triton")
    from lowbit.kernels import gemm_w4

    monkeypatch.setattr(policy, "REGISTER_OPERAND_FRAGMENTS", False)
    monkeypatch.setattr(policy, "sm_count", lambda device: 132)
    monkeypatch.setattr(policy, "REGISTER_OPERAND_MIN_WORK", 0)
    monkeypatch.setattr(policy, "REGISTER_OPERAND_SMALL_M_MIN_WORK", 0)
    q = lowbit.quantize(torch.randn(28672, 64), "nvfp4")
    cuda = torch.device("cuda")
    path, target, facts = policy.linear_decide(256, cuda, q, "auto")
    assert (path, target, facts) == ("gemm_w4_ra", gemm_w4.gemm_w4_ra, ({"BM": 256, "WG": 2, "SPLIT": 1},))
    assert "register-operand" in lin._reason(path, facts, 256, cuda, q)
    # not where the kernel cannot read the weight: K not a multiple of 32
    odd = lowbit.quantize(torch.randn(28672, 48), "nvfp4")
    assert "multiple of 32" in gemm_w4.ra_weight_supports(odd)
    assert policy.linear_decide(256, cuda, odd, "auto")[0] == "dequant_gemm"
    assert policy.linear_decide(512, cuda, q, "auto")[0] == "dequant_gemm"
    assert policy.linear_decide(256, torch.device("cpu"), q, "auto")[0] == "reference"


def test_register_fragment_kernel_behind_its_switch(monkeypatch):
    # policy.REGISTER_OPERAND_FRAGMENTS (on as shipped): the rule runs gemm_w4_rf, and a prepared layer's runner
    # the same; off, gemm_w4_ra under its own rule
    pytest.importorskip("triton")
    from lowbit.kernels import gemm_w4

    monkeypatch.setattr(policy, "sm_count", lambda device: 132)
    q = lowbit.quantize(torch.randn(28672, 2048), "nvfp4")
    cuda = torch.device("cuda")
    path, target, facts = policy.linear_decide(256, cuda, q, "auto")
    assert (path, target) == ("gemm_w4_ra", gemm_w4.gemm_w4_rf) and facts[0]["FRAGMENTS"] == 1
    assert "register-fragment" in lin._reason(path, facts, 256, cuda, q)
    run = gemm_w4.RaRunner(q, 256, torch.bfloat16, None, facts[0])
    assert run.plan.fragments and run.plan.w_args[0].shape == (448, 32, 512)
    assert policy.linear_decide(768, cuda, q, "auto")[1] is gemm_w4.gemm_w4_rf
    monkeypatch.setattr(policy, "REGISTER_OPERAND_FRAGMENTS", False)
    path, target, facts = policy.linear_decide(256, cuda, q, "auto")
    assert (path, target) == ("gemm_w4_ra", gemm_w4.gemm_w4_ra) and "FRAGMENTS" not in facts[0]
    assert policy.linear_decide(768, cuda, q, "auto")[0] == "dequant_gemm"
