"""slice_rows: a row range of a quantized weight decodes to exactly those rows of the whole weight."""

import pytest
import torch

import lowbit
from lowbit.formats.rows import ROW_ALIGN, nf4_without_double_quant, slice_rows, slice_rows_reason

CASES = [
    ("nvfp4", {}), ("nvfp4", {"scale_layout": "swizzled"}), ("mxfp4", {}), ("mxfp4", {"scale_layout": "swizzled"}),
    ("fp4_b32", {}), ("nf4", {}), ("nf4", {"double_quant": True}), ("int4_awq", {"group_size": 64}),
]


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA"))]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fmt, opts", CASES, ids=[f"{f}-{o}" for f, o in CASES])
def test_row_ranges_decode_to_the_same_rows(fmt, opts, device):
    """On CUDA the slices go through the Triton dequantize kernels (int4_awq: strided column views)."""
    gen = torch.Generator().manual_seed(7)
    n, k = 392, 256  # N not a multiple of 128: the last swizzled tile is partial
    w = torch.randn(n, k, generator=gen) * torch.logspace(-3, 1, n)[:, None]
    w[5] = 0.0
    q = lowbit.quantize((w.half() if fmt == "int4_awq" else w).to(device), fmt, **opts)
    full = lowbit.dequantize(q, torch.float32)
    align = ROW_ALIGN[fmt]
    for n0, n1 in [(0, n), (0, 128), (align * 1, 264), (256, n), (align * 2, align * 2 + 8)]:
        part = lowbit.dequantize(slice_rows(q, n0, n1), torch.float32)
        assert part.shape == (n1 - n0, k)
        assert torch.equal(part.view(torch.int32), full[n0:n1].contiguous().view(torch.int32)), (n0, n1)


def test_slices_stay_compact():
    """nf4 slices starting on a nested block (256 absmax blocks) keep the absmax double-quantized; int4_awq
    slices are views of the packed tensors, not copies."""
    w = torch.randn(512, 256)
    q = lowbit.quantize(w, "nf4", double_quant=True)
    assert slice_rows(q, 64, 512).nested_scale is not None      # 64 rows x 4 blocks = one nested block
    assert slice_rows(q, 65, 512).nested_scale is None          # decoded to fp32 absmax
    a = lowbit.quantize(w.half(), "int4_awq", group_size=64)
    part = slice_rows(a, 128, 256)
    for t, whole in ((part.data, a.data), (part.zeros, a.zeros), (part.scale, a.scale)):
        assert t.untyped_storage().data_ptr() == whole.untyped_storage().data_ptr()


def test_nf4_double_quant_decoded_once_is_the_same_weight():
    w = torch.randn(128, 128)
    q = lowbit.quantize(w, "nf4", double_quant=True)
    plain = nf4_without_double_quant(q)
    assert plain.nested_scale is None and plain.scale.dtype == torch.float32
    assert torch.equal(lowbit.dequantize(plain), lowbit.dequantize(q))


def test_bad_ranges_and_formats_are_refused():
    q = lowbit.quantize(torch.randn(256, 128), "nvfp4")
    with pytest.raises(ValueError, match="n0 % 128"):
        slice_rows(q, 64, 128)
    with pytest.raises(ValueError, match="0 <= n0 < n1"):
        slice_rows(q, 128, 512)
    assert "no row slicing" in slice_rows_reason(lowbit.quantize(torch.randn(256, 256), "fp8_block"))
    q = lowbit.quantize(torch.randn(16, 96), "nf4", blocksize=64)
    assert "not a multiple of the blocksize" in slice_rows_reason(q)
