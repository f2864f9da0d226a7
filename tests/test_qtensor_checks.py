"""QTensor construction checks its layout; quantize never keeps autograd history; meta tensors quantize shape-only."""

from dataclasses import replace

import pytest
import torch

import lowbit
from lowbit import QTensor

# one option set per format, every format of lowbit.FORMATS covered (checked below)
CASES = [
    ("nvfp4", {}),
    ("nvfp4", {"convention": "torchao"}),
    ("nvfp4", {"convention": "compressed-tensors", "scale_layout": "swizzled"}),
    ("nvfp4", {"global_scale": torch.tensor(3.0, requires_grad=True)}),
    ("nvfp4", {"global_scale": "none"}),
    ("mxfp4", {"scale_layout": "swizzled"}),
    ("mxfp6_e2m3", {}),
    ("mxfp6_e3m2", {"scale_rounding": "floor"}),
    ("mxfp8_e4m3", {}),
    ("mxfp8_e5m2", {}),
    ("fp4_b32", {}),
    ("fp8_block", {}),
    ("fp8_block", {"block": (128, 128), "scale_fmt": "ue8m0"}),
    ("fp8_rowwise", {}),
    ("nf4", {}),
    ("nf4", {"double_quant": True}),
    ("int4_awq", {"group_size": 64}),
]
IDS = [f"{f}-{'-'.join(map(str, o))}" if o else f for f, o in CASES]
SHAPE = (16, 256)


def test_cases_cover_every_format():
    assert {f for f, _ in CASES} >= set(lowbit.FORMATS) - {"bnb_fp4"}


def _x(shape=SHAPE, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g).to(dtype)


# ------------------------------------------------------------------------------------------ autograd


@pytest.mark.parametrize("fmt", sorted(lowbit.FORMATS))
def test_every_format_returns_detached_tensors(fmt):
    x = _x().requires_grad_(True)
    q = lowbit.quantize(x, fmt, backend="torch")
    tensors = {**q.tensors(), **{f"params[{k}]": v for k, v in q.params.items() if isinstance(v, torch.Tensor)}}
    for name, t in tensors.items():
        assert not t.requires_grad and t.grad_fn is None, f"{fmt}: {name} keeps the autograd graph"
    assert x.grad is None


@pytest.mark.parametrize(("fmt", "opts"), CASES, ids=IDS)
def test_options_return_detached_tensors(fmt, opts):
    x = _x().requires_grad_(True)
    q = lowbit.quantize(x, fmt, backend="torch", **opts)
    for name, t in q.tensors().items():
        assert t.grad_fn is None and not t.requires_grad, f"{fmt} {opts}: {name} keeps the autograd graph"


# ------------------------------------------------------------------------------------------ meta


@pytest.mark.parametrize(("fmt", "opts"), CASES, ids=IDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_meta_quantize_is_shape_only(fmt, opts, dtype):
    x = _x(dtype=dtype)
    opts_meta = {k: (v.detach().to("meta") if isinstance(v, torch.Tensor) else v) for k, v in opts.items()}
    real = lowbit.quantize(x, fmt, backend="torch", **opts)
    meta = lowbit.quantize(x.to("meta"), fmt, **opts_meta)
    assert meta.device.type == "meta"
    assert (meta.fmt, meta.shape, meta.dtype, meta.scale_layout) == (real.fmt, real.shape, real.dtype, real.scale_layout)
    assert set(meta.tensors()) == set(real.tensors())
    for name, t in real.tensors().items():
        m = meta.tensors()[name]
        assert m.is_meta and (m.dtype, m.shape) == (t.dtype, t.shape), name
    assert set(meta.params) == set(real.params)
    assert fmt in repr(meta)  # no value is read from a meta global scale


# ------------------------------------------------------------------------------------------ construction


def test_hand_built_blockscaled_qtensors_are_checked_when_built():
    nv = lowbit.quantize(_x((4, 64)), "nvfp4")
    mx = lowbit.quantize(_x((4, 64)), "mxfp4")
    bad = [
        # inconsistent sizes: before, dequantize/linear failed later with a bare reshape error
        (lambda: replace(nv, shape=(4, 128)), ValueError, r"QTensor\(nvfp4\): data must be uint8 \(4, 64\)"),
        (lambda: replace(nv, scale=nv.scale[:, :2]), ValueError, r"scale must be float8_e4m3fn \(4, 4\)"),
        (lambda: replace(mx, data=mx.data[:3]), ValueError, r"QTensor\(mxfp4\): data must be uint8 \(4, 32\)"),
        (lambda: replace(mx, shape=(4, 48)), ValueError, r"shape\[-1\] \(K = 48\) must be a multiple of 32"),
        (lambda: replace(mx, scale_layout="swizzled"), ValueError, r"scale must be .* \(128, 4\) \(swizzled"),
        # an unknown layout was taken as linear
        (lambda: replace(nv, scale_layout="foo"), ValueError, r"scale_layout must be one of \('linear', 'swizzled'\)"),
        (lambda: replace(lowbit.quantize(_x((4, 64)), "fp4_b32"), scale_layout="swizzled"), ValueError,
         r"QTensor\(fp4_b32\): scale_layout must be one of \('linear',\)"),
        (lambda: replace(nv, scale=nv.scale.view(torch.uint8)), TypeError, "scale must be float8_e4m3fn"),
        (lambda: replace(nv, global_scale=torch.ones(2)), ValueError, "global_scale must be None or one float32"),
        (lambda: replace(nv, global_scale=2.0), TypeError, "global_scale must be None or a torch.Tensor"),
        (lambda: replace(mx, global_scale=torch.ones(1)), ValueError, "global_scale must be None for mxfp4"),
        (lambda: replace(nv, params={"per_tensor_scale": torch.ones(2)}), ValueError, r"params\['per_tensor_scale'\]"),
        (lambda: replace(nv, zeros=torch.zeros(1)), ValueError, "zeros must be None for nvfp4"),
        (lambda: replace(nv, data=nv.data.tolist()), TypeError, "data must be a torch.Tensor"),
        (lambda: replace(nv, fmt="nvfp5"), ValueError, "unknown fmt 'nvfp5'"),
        (lambda: replace(nv, fmt=None), TypeError, "fmt must be a format name"),
        (lambda: replace(nv, shape=(4, -64)), ValueError, "shape must not have negative sizes"),
        (lambda: replace(nv, shape="4x64"), TypeError, "shape must be a sequence of ints"),
        (lambda: replace(nv, shape=()), ValueError, "shape must have at least 1 dimension"),
        (lambda: replace(nv, dtype=torch.int8), TypeError, "dtype must be the floating dtype"),
        (lambda: replace(nv, params=[("convention", "vllm")]), TypeError, "params must be a dict"),
    ]
    for make, exc, match in bad:
        with pytest.raises(exc, match=match):
            make()
    # the structure of a valid QTensor is remembered: a bad one after a good one of the same shape still fails
    assert replace(nv, params={}).shape == nv.shape
    with pytest.raises(ValueError, match="scale_layout"):
        replace(nv, scale_layout="foo")


def test_dequantize_and_linear_never_see_inconsistent_sizes():
    w = lowbit.quantize(_x((32, 64)), "nvfp4")
    with pytest.raises(ValueError, match=r"QTensor\(nvfp4\): scale must be"):
        lowbit.dequantize(QTensor(w.data, w.scale[:16], "nvfp4", (32, 64), global_scale=w.global_scale))
    with pytest.raises(ValueError, match=r"QTensor\(nvfp4\): data must be"):
        lowbit.linear(_x((2, 64)), QTensor(w.data[:, :16], w.scale, "nvfp4", (32, 64)))


def test_valid_qtensors_are_accepted():
    for fmt, opts in CASES:
        q = lowbit.quantize(_x(), fmt, **opts)
        again = replace(q)
        assert again.shape == q.shape
        # meta and moved copies keep the layout
        assert q.to("meta").device.type == "meta"
    # shape-only QTensors can be built by hand from meta tensors
    m = QTensor(torch.empty(8, 32, dtype=torch.uint8, device="meta"),
                torch.empty(8, 4, dtype=torch.float8_e4m3fn, device="meta"), "nvfp4", (8, 64))
    assert m.device.type == "meta" and "nvfp4" in repr(m)
