"""Property-based fuzzing of the public entry points with bad input (CPU only, bounded run time).

Every call must either succeed or raise ValueError / TypeError / FileNotFoundError with a message; never
another exception, a hang or an unbounded allocation, and never modify its inputs.
"""

import json
import struct
import warnings
from dataclasses import replace

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from torch import nn

import lowbit
from lowbit import QTensor

ALLOWED = (ValueError, TypeError, FileNotFoundError)
FUZZ = settings(
    max_examples=100, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck), database=None
)
FORMATS = sorted(lowbit.FORMATS)
DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int32, torch.uint8, torch.bool,
          torch.float8_e4m3fn]


def _call(fn, *args, **kwargs):
    """Run ``fn``; an allowed exception must carry a message; anything else fails the test."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return fn(*args, **kwargs)
    except ALLOWED as e:
        assert str(e).strip(), f"{type(e).__name__} without a message"
        return e


def _snapshot(*objs):
    out = []
    for o in objs:
        if isinstance(o, torch.Tensor):
            out.append(o.clone() if not o.is_meta else o)
        elif isinstance(o, QTensor):
            out.append({k: v.clone() for k, v in o.tensors().items()})
        else:
            out.append(None)
    return out


def _same(before, objs):
    for b, o in zip(before, objs):
        if isinstance(o, torch.Tensor) and not o.is_meta:
            assert torch.equal(b.view(torch.uint8) if b.dtype.itemsize == 1 else b, o.view(torch.uint8)
                               if o.dtype.itemsize == 1 else o) or (b.isnan() == o.isnan()).all(), "input modified"
        elif isinstance(o, QTensor):
            for k, t in o.tensors().items():
                assert torch.equal(b[k].view(torch.uint8), t.view(torch.uint8)) if t.dtype.itemsize == 1 else (
                    torch.equal(b[k], t) or torch.equal(b[k].isnan(), t.isnan())), f"QTensor.{k} modified"


shapes = st.lists(st.integers(0, 40), min_size=0, max_size=3).map(tuple) | st.sampled_from(
    [(4, 64), (8, 128), (16, 256), (2, 3, 32), (128, 128), (0, 64)])
values = st.sampled_from(["randn", "zeros", "nan", "inf", "huge", "tiny"])


def _tensor(shape, dtype, kind, seed=0):
    g = torch.Generator().manual_seed(seed)
    t = torch.randn(shape, generator=g) * 3
    if kind == "zeros":
        t = torch.zeros(shape)
    elif kind == "nan" and t.numel():
        t.view(-1)[0] = float("nan")
    elif kind == "inf" and t.numel():
        t.view(-1)[-1] = float("inf")
    elif kind == "huge":
        t = t * 1e30
    elif kind == "tiny":
        t = t * 1e-30
    if dtype in (torch.int32, torch.uint8):
        return t.nan_to_num().clamp(0, 100).to(dtype)
    return t.to(dtype)


option_values = st.one_of(
    st.none(), st.booleans(), st.integers(-3, 300), st.floats(allow_nan=True), st.text(max_size=4),
    st.sampled_from(["linear", "swizzled", "column_major", "rceil", "floor", "vllm", "torchao", "ue8m0", "none",
                     (1, 128), (128, 128), (1, 64), [1, 128], 64, 128, 32, torch.tensor(2.0), torch.ones(3)]),
)
option_names = st.sampled_from(["global_scale", "convention", "scale_layout", "scale_rounding", "block",
                                "scale_fmt", "blocksize", "double_quant", "group_size", "bogus"])


@FUZZ
@given(fmt=st.sampled_from(FORMATS + ["nvfp5", ""]), shape=shapes, dtype=st.sampled_from(DTYPES), kind=values,
       opts=st.dictionaries(option_names, option_values, max_size=2), backend=st.sampled_from([None, "torch", "x"]))
def test_quantize_and_dequantize(fmt, shape, dtype, kind, opts, backend):
    x = _tensor(shape, dtype, kind)
    before = _snapshot(x)
    q = _call(lowbit.quantize, x, fmt, backend=backend, **opts)
    _same(before, [x])
    if isinstance(q, QTensor):
        assert q.shape == x.shape
        qb = _snapshot(q)
        for out in (torch.float32, torch.bfloat16, torch.int8):
            y = _call(lowbit.dequantize, q, out)
            if isinstance(y, torch.Tensor):
                assert y.shape == x.shape and y.dtype == out
        _same(qb, [q])


@FUZZ
@given(fmt=st.sampled_from(FORMATS), n=st.sampled_from([8, 16, 32]), k=st.sampled_from([64, 128, 256]),
       xshape=st.sampled_from(["ok", "bad_k", "3d", "1d", "empty"]), xdtype=st.sampled_from(DTYPES[:5]),
       bias=st.sampled_from([None, "ok", "bad_shape", "bad_dtype", "list"]),
       activation=st.sampled_from([None, "gelu", "silu", "relu", 3]))
def test_linear(fmt, n, k, xshape, xdtype, bias, activation):
    w = _call(lowbit.quantize, torch.randn(n, k), fmt)
    assume(isinstance(w, QTensor))
    shape = {"ok": (3, k), "bad_k": (3, k + 1), "3d": (2, 2, k), "1d": (k,), "empty": (0, k)}[xshape]
    x = _tensor(shape, xdtype, "randn")
    b = {None: None, "ok": torch.randn(n), "bad_shape": torch.randn(n + 1), "bad_dtype": torch.ones(n, dtype=torch.int32),
         "list": [0.0] * n}[bias]
    before = _snapshot(x, w, b)
    y = _call(lowbit.linear, x, w, b, activation)
    _same(before, [x, w, b])
    if isinstance(y, torch.Tensor):
        assert y.shape == (*shape[:-1], n)


pair_fmts = st.sampled_from(["nvfp4", "mxfp4", "mxfp8_e4m3", "mxfp6_e2m3", "fp8_block", "fp8_rowwise", "nf4"])


@FUZZ
@given(af=pair_fmts, bf=pair_fmts, m=st.sampled_from([1, 4]), n=st.sampled_from([8, 32]),
       k=st.sampled_from([128, 256]), kb=st.sampled_from([128, 256]),
       alpha=st.sampled_from([None, 1.0, float("nan"), "2", torch.ones(2), torch.tensor(0.5)]),
       out_dtype=st.sampled_from([torch.bfloat16, torch.float32, torch.int8, "bf16"]))
def test_scaled_mm(af, bf, m, n, k, kb, alpha, out_dtype):
    ao = {"block": (1, 128)} if af == "fp8_block" else {}
    bo = {"block": (128, 128)} if bf == "fp8_block" else {}
    a = lowbit.quantize(torch.randn(m, k), af, **ao)
    b = lowbit.quantize(torch.randn(n, kb), bf, **bo)
    before = _snapshot(a, b)
    y = _call(lowbit.scaled_mm, a, b, alpha, None, out_dtype)
    _same(before, [a, b])
    if isinstance(y, torch.Tensor):
        assert y.shape == (m, n)


def _tensor_or_junk(draw, shape_hint):
    kind = draw(st.sampled_from(["tensor", "none", "list", "int"]))
    if kind == "none":
        return None
    if kind == "list":
        return [1, 2]
    if kind == "int":
        return 3
    shape = draw(st.sampled_from([shape_hint, (shape_hint[0],), (1,), (), (0,), (shape_hint[0], 1)]))
    dtype = draw(st.sampled_from(DTYPES + [torch.float8_e8m0fnu]))
    return torch.zeros(shape, dtype=dtype)


@st.composite
def qtensor_fields(draw):
    fmt = draw(st.sampled_from(FORMATS + ["nope", 3]))
    shape = draw(st.sampled_from([(4, 64), (8, 32), (4, 63), (64,), (), (4, -64), "4x64", (2, 3, 32), (8, 256)]))
    good = lowbit.quantize(torch.randn(8, 256), fmt) if fmt in lowbit.FORMATS else None
    fields = dict(good.__dict__) if good is not None and hasattr(good, "__dict__") else {}
    fields.update(fmt=fmt, shape=shape if draw(st.booleans()) else fields.get("shape", shape))
    for name in ("data", "scale", "global_scale", "zeros", "nested_scale", "nested_offset"):
        if draw(st.integers(0, 3)) == 0 or name not in fields:
            fields[name] = _tensor_or_junk(draw, (4, 32))
    if draw(st.booleans()):
        fields["scale_layout"] = draw(st.sampled_from(["linear", "swizzled", "column_major", "foo", None]))
    if draw(st.booleans()):
        fields["params"] = draw(st.sampled_from([{}, {"blocksize": 48}, {"block": (1, 64)}, {"group_size": 0},
                                                 {"group_size": "a"}, [], {"per_tensor_scale": torch.ones(2)}]))
    if draw(st.booleans()):
        fields["dtype"] = draw(st.sampled_from([torch.float32, torch.int8, "float32", None]))
    fields.setdefault("data", None)
    fields.setdefault("scale", None)
    return fields


@FUZZ
@given(fields=qtensor_fields())
def test_qtensor_construction(fields):
    q = _call(QTensor, **fields)
    if isinstance(q, QTensor):
        # a QTensor that could be built decodes or refuses cleanly, never with a bare reshape/index error
        y = _call(lowbit.dequantize, q, backend="torch")
        if isinstance(y, torch.Tensor):
            assert y.shape == q.shape
        _call(replace, q)
        assert q.fmt in repr(q)


class _Tiny(nn.Module):
    def __init__(self, n=32, k=256):
        super().__init__()
        self.q_proj = nn.Linear(k, n)
        self.out = nn.Linear(n, k)

    def forward(self, x):
        return self.out(self.q_proj(x))


@FUZZ
@given(scheme=st.sampled_from(sorted(lowbit.SCHEMES) + ["w4a16-x", 4]),
       skip=st.sampled_from([None, (), "out", ["q_*"], 5, [5], "*"]),
       calibration=st.sampled_from([None, "abc", 3, [], [torch.randn(2, 256)], torch.randn(2, 256), [{"y": 1}]]),
       awq=st.sampled_from([None, True, False, "yes"]), backend=st.sampled_from([None, "torch", "cuda"]))
def test_quantize_model(scheme, skip, calibration, awq, backend):
    torch.manual_seed(0)
    model = _Tiny()
    cal_before = _snapshot(calibration) if isinstance(calibration, torch.Tensor) else None
    out = _call(lowbit.quantize_model, model, scheme, skip=skip, calibration=calibration, awq=awq, backend=backend)
    if cal_before is not None:
        _same(cal_before, [calibration])
    if isinstance(out, nn.Module):
        assert out(torch.randn(2, 256)).shape == (2, 256)


# ------------------------------------------------------------------------------ files and headers


def _safetensors_bytes(header, data: bytes = b"", header_len=None) -> bytes:
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    n = len(raw) if header_len is None else header_len
    return struct.pack("<Q", n) + raw + data


headers = st.fixed_dictionaries({
    "dtype": st.sampled_from(["F32", "BF16", "U8", "F8_E4M3", "I64", "XX", 3]),
    "shape": st.sampled_from([[4], [2, 2], [10**6, 10**6], [10**12], [-1], [], "4", [2**62, 4]]),
    "data_offsets": st.sampled_from([[0, 16], [0, 4 * 10**12], [16, 0], [0], "x", [0, 2**64]]),
})


@st.composite
def safetensors_files(draw):
    kind = draw(st.sampled_from(["header", "raw", "len", "metadata"]))
    if kind == "raw":
        return draw(st.binary(max_size=64))
    if kind == "len":  # the length prefix claims more (or far more) header than the file has
        return _safetensors_bytes(b'{"a":', header_len=draw(st.sampled_from([10**6, 2**40, 2**63, 0, 3])))
    header = {"weight": draw(headers)}
    if kind == "metadata":
        header["__metadata__"] = draw(st.sampled_from([{"format": "pt"}, {"quantization_config": "{"}, 5, []]))
    return _safetensors_bytes(header, b"\0" * draw(st.sampled_from([0, 16, 64])))


@FUZZ
@given(content=safetensors_files(), config=st.sampled_from([None, "{", "[]", '{"quantization_config": 5}',
                                                               '{"quantization_config": {"quant_method": "lowbit"}}']))
def test_checkpoint_readers(tmp_path_factory, content, config):
    from lowbit.io.files import TensorSource, safetensors_keys

    d = tmp_path_factory.mktemp("ckpt")
    (d / "model.safetensors").write_bytes(content)
    if config is not None:
        (d / "config.json").write_text(config)
    keys = _call(safetensors_keys, d / "model.safetensors")
    if isinstance(keys, list):
        src = _call(TensorSource, d)
        if isinstance(src, TensorSource):
            for k in src.keys():
                _call(src.get, k)
    _call(lowbit.io.inspect_checkpoint, d)
    _call(lowbit.load_quantized, d)
    assert (d / "model.safetensors").read_bytes() == content  # readers never write


@FUZZ
@given(path=st.sampled_from(["missing", "file", "empty_dir", 3, None]),
       device=st.sampled_from(["cpu", "meta", "cuda:99", 3]), dtype=st.sampled_from([None, torch.int8, "bf16"]))
def test_load_quantized_arguments(tmp_path_factory, path, device, dtype):
    d = tmp_path_factory.mktemp("load")
    target = {"missing": d / "nope", "file": d / "f.txt", "empty_dir": d}.get(path, path)
    (d / "f.txt").write_text("x")
    _call(lowbit.load_quantized, target, device=device, dtype=dtype)


@FUZZ
@given(fmt=st.sampled_from(["auto", "lowbit", "compressed-tensors", "nope", 3]),
       max_shard_size=st.sampled_from(["5GB", 1, 0, -5, "abc", "1e400GB", 10**30]),
       overwrite=st.sampled_from([False, True, "yes"]),
       model_kind=st.sampled_from(["quantized", "plain", "meta", "not_a_module"]))
def test_save_quantized_arguments(tmp_path_factory, fmt, max_shard_size, overwrite, model_kind):
    d = tmp_path_factory.mktemp("save")
    torch.manual_seed(0)
    if model_kind == "not_a_module":
        model = {"w": torch.ones(2)}
    elif model_kind == "meta":
        with torch.device("meta"):
            model = _Tiny()
        lowbit.quantize_model(model, "w4a16-nvfp4", skip=None)
    else:
        model = _Tiny()
        if model_kind == "quantized":
            lowbit.quantize_model(model, "w4a16-nvfp4", skip=None)
    before = {k: v.clone() for k, v in model.state_dict().items()} if isinstance(model, nn.Module) and \
        model_kind != "meta" else None
    out = _call(lowbit.save_quantized, model, d / "out", format=fmt, max_shard_size=max_shard_size,
                overwrite=overwrite)
    if before is not None:
        after = model.state_dict()
        assert all(torch.equal(before[k], after[k]) for k in before), "save_quantized modified the model"
    if not isinstance(out, Exception):
        assert model_kind == "quantized"
        back = _call(lowbit.load_quantized, out, model=_Tiny())
        assert isinstance(back, nn.Module), back


def test_header_claiming_a_huge_tensor_is_refused_without_allocating(tmp_path):
    from lowbit.io.files import TensorSource

    header = {"weight": {"dtype": "F32", "shape": [10**6, 10**6], "data_offsets": [0, 4 * 10**12]}}
    (tmp_path / "model.safetensors").write_bytes(_safetensors_bytes(header, b"\0" * 16))
    with pytest.raises(ValueError, match="model.safetensors"):
        TensorSource(tmp_path).get("weight")


@pytest.fixture(scope="module")
def saved_lowbit(tmp_path_factory):
    torch.manual_seed(0)
    model = lowbit.quantize_model(_Tiny(), "w4a16-nvfp4", skip=None)
    out = tmp_path_factory.mktemp("saved") / "ckpt"
    lowbit.save_quantized(model, out, format="lowbit")
    return out


module_meta = st.fixed_dictionaries({}, optional={
    "shape": st.sampled_from([[10**12, 256], [32, 10**12], [10**6, 10**6], [-32, 256], [32, 255], [32], "x",
                              [32.5, 256], [True, 256]]),
    "scheme": st.sampled_from(["w4a16-nope", 3, None, "w8a8-fp8-block", "w4a16-int4"]),
    "dtype": st.sampled_from(["float64", 3, None, "bfloat16"]),
    "params": st.sampled_from([[], {"convention": "nope"}, {"convention": 3}, None, {"per_tensor_scale": 2.0},
                               {"x": {"__fp32__": "a"}}]),
    "scale_layout": st.sampled_from(["swizzled", "foo", None, 3]),
})


@FUZZ
@given(change=module_meta)
def test_load_quantized_with_lying_config(tmp_path_factory, saved_lowbit, change):
    """The config's per-module metadata (shape, scheme, dtype, ...) never drives an allocation unchecked: a
    config claiming a 10^12-element weight is refused against the stored tensors."""
    import shutil

    d = tmp_path_factory.mktemp("lie") / "ckpt"
    shutil.copytree(saved_lowbit, d)
    cfg = json.loads((d / "config.json").read_text())
    cfg["quantization_config"]["modules"]["q_proj"].update(change)
    (d / "config.json").write_text(json.dumps(cfg))
    out = _call(lowbit.load_quantized, d, model=_Tiny())
    if isinstance(out, Exception):
        assert "q_proj" in str(out) or "config" in str(out), out
