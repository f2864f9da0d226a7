"""Repeated ``lowbit.quantize`` / ``lowbit.dequantize`` calls on CUDA run kept launches: every call still gives
the reference's bits, whatever changes between calls (values, alignment, layout, scales, in-place updates)."""

import pytest
import torch

import lowbit
from lowbit import api
from lowbit.testing import assert_bitexact

pytestmark = pytest.mark.gpu


def _same(q, r):
    assert (q.fmt, q.shape, q.scale_layout) == (r.fmt, r.shape, r.scale_layout)
    assert_bitexact(q.data.view(torch.uint8).cpu(), r.data.view(torch.uint8), "data bytes")
    assert_bitexact(q.scale.contiguous().view(torch.uint8).cpu(), r.scale.view(torch.uint8), "scale bytes")
    if r.global_scale is None:
        assert q.global_scale is None
    else:
        assert torch.equal(q.global_scale.cpu(), r.global_scale)


def _inputs(shape, seed):
    """The same shape as a plain tensor, a 2-byte-offset view (another alignment), a transposed copy's
    transpose (non-contiguous) and the plain tensor in fp32 and fp16 (other input dtypes), each with fresh
    values."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    plain = torch.randn(shape, generator=g, device="cuda").bfloat16()
    buf = torch.randn(shape[0] * shape[1] + 1, generator=g, device="cuda").bfloat16()
    offset = buf[1:].view(shape)
    strided = torch.randn(shape[::-1], generator=g, device="cuda").bfloat16().t()
    return [plain, offset, strided, plain * 3, plain.float() * 5, plain.half(), plain]


CASES = [("nvfp4", {}), ("nvfp4", {"scale_layout": "swizzled"}), ("nvfp4", {"convention": "lightx2v"}),
         ("mxfp4", {}), ("mxfp8_e4m3", {"scale_layout": "swizzled"}), ("mxfp6_e3m2", {"scale_rounding": "floor"}),
         ("fp4_b32", {})]


@pytest.mark.parametrize("fmt, opts", CASES, ids=[f"{f}-{'-'.join(o.values())}" for f, o in CASES])
def test_repeated_quantize_matches_the_reference_every_call(fmt, opts):
    for x in _inputs((256, 512), 0) + _inputs((256, 512), 1):
        q = lowbit.quantize(x, fmt, **opts)
        _same(q, lowbit.quantize(x.cpu(), fmt, backend="torch", **opts))


def test_repeated_quantize_reads_each_calls_global_scale():
    x = torch.randn(128, 256, device="cuda").bfloat16()
    for g in (1.0, 448.0 * 6 / 3.0, 0.5, 1.0):
        gs = torch.tensor([g], device="cuda")
        _same(lowbit.quantize(x, "nvfp4", global_scale=gs),
              lowbit.quantize(x.cpu(), "nvfp4", global_scale=gs.cpu(), backend="torch"))
    # a scale that is a view at a 4-byte offset: another alignment of the same argument
    pair = torch.tensor([3.0, 7.0], device="cuda")
    _same(lowbit.quantize(x, "nvfp4", global_scale=pair[1:]),
          lowbit.quantize(x.cpu(), "nvfp4", global_scale=torch.tensor([7.0]), backend="torch"))


def _decode_case(fmt):
    """A fresh random QTensor of ``fmt`` on the GPU (the formats with a dequantize kernel)."""
    if fmt == "int4_awq":
        return lowbit.quantize(torch.randn(512, 256).half(), "int4_awq", group_size=128).to("cuda")
    x = torch.randn(256, 512, device="cuda").bfloat16()
    if fmt in ("nf4", "bnb_fp4"):  # quantized by the reference (no quantize kernel)
        return lowbit.quantize(x.cpu(), fmt, double_quant=fmt == "nf4").to("cuda")
    return lowbit.quantize(x, fmt)


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4", "fp4_b32", "nf4", "bnb_fp4", "int4_awq"])
def test_a_kept_dequantize_sees_in_place_updates(fmt):
    q, other = _decode_case(fmt), _decode_case(fmt)
    for dtype in (torch.bfloat16, torch.float32, torch.bfloat16):
        got = lowbit.dequantize(q, dtype)
        assert_bitexact(got.cpu(), lowbit.dequantize(q.to("cpu"), dtype, backend="torch"), f"{q.fmt} {dtype}")
    assert api._DEQUANT_CALLS.get(q), "the call was kept"
    # new codes and scales written into the QTensor's own tensors: the next call decodes them
    for name, t in q.tensors().items():
        t.copy_(getattr(other, name))
    got = lowbit.dequantize(q, torch.bfloat16)
    assert_bitexact(got.cpu(), lowbit.dequantize(other.to("cpu"), torch.bfloat16, backend="torch"), "after update")


def test_a_dequantize_that_copies_its_input_is_not_kept():
    """nf4 codes at an odd address are copied for the kernel: that call is not kept, so an update is seen."""
    x = torch.randn(64, 128)
    q = lowbit.quantize(x, "nf4")
    buf = torch.zeros(q.data.numel() + 1, dtype=torch.uint8, device="cuda")
    data = buf[1:].view(q.data.shape)
    data.copy_(q.data)
    qc = type(q)(**{**q.__dict__, "data": data, "scale": q.scale.cuda()})
    first = lowbit.dequantize(qc, torch.bfloat16)
    assert not api._DEQUANT_CALLS.get(qc)
    data.copy_(lowbit.quantize(torch.randn(64, 128), "nf4").data)  # other codes (x * 2 would keep them)
    second = lowbit.dequantize(qc, torch.bfloat16)
    want = lowbit.dequantize(type(q)(**{**q.__dict__, "data": data.cpu()}), torch.bfloat16, backend="torch")
    assert_bitexact(second.cpu(), want, "after update")
    assert not torch.equal(first, second)


def test_repeated_calls_under_inference_mode():
    with torch.inference_mode():
        x = torch.randn(128, 256, device="cuda").bfloat16()
        for _ in range(3):
            q = lowbit.quantize(x, "nvfp4")
            out = lowbit.dequantize(q, torch.bfloat16)
        r = lowbit.quantize(x.cpu(), "nvfp4", backend="torch")
        _same(q, r)
        assert_bitexact(out.cpu(), lowbit.dequantize(r, torch.bfloat16, backend="torch"), "dequantize")
