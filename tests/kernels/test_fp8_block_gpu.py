"""fp8_block Triton kernels are byte-identical to the CPU reference on a GPU (data, scales, dequantize).

Dequantize is compared with ``canonical_nan(reference)``: the reference's NaN bits depend on the CPU
(0x7FF00000 / 0xFFC00000 payloads, bf16 0xFFFF), the kernels write the canonical NaN like every other
lowbit kernel. Speed is measured by ``lowbit bench`` (benchmarks/gpu_check.py), not here.
"""

import math

import pytest
import torch

import lowbit
from lowbit.formats import fp8_block as R
from lowbit.formats.codecs import canonical_nan
from lowbit.testing import assert_bitexact

pytestmark = pytest.mark.gpu

BLOCKS = [(1, 128), (128, 128)]
FMTS = [None, "ue8m0"]
DTYPES = [torch.bfloat16, torch.float16, torch.float32]


def _kernels():
    from lowbit.kernels import fp8_block
    return fp8_block


def tie_row(dtype: torch.dtype) -> torch.Tensor:
    """One block whose ``x / s`` lands exactly on E4M3 midpoints while ``x * fp32(1/s)`` does not."""
    e4 = torch.arange(0, 127, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    mids = (e4[1:] + e4[:-1]) / 2
    for num in range(3, 64, 2):
        for e in range(-6, 4):
            s = torch.tensor(num * 2.0 ** e)
            amax = 448.0 * s
            if amax.to(dtype).float() != amax:
                continue
            xs = mids * s
            ok = (xs.to(dtype).float() == xs) & xs.to(dtype).float().isfinite()
            mul = (xs * (1.0 / s)).to(torch.float8_e4m3fn).view(torch.uint8)
            div = mids.to(torch.float8_e4m3fn).view(torch.uint8)
            pick = xs[ok & (mul != div)]
            if pick.numel() >= 16:
                pick = pick[:63]
                row = torch.zeros(128)
                row[0] = amax
                row[1:1 + pick.numel()] = pick
                row[64:64 + pick.numel()] = -pick
                return row
    raise AssertionError(f"no tie row for {dtype}")


def _nan(bits: int) -> float:
    return torch.tensor(bits, dtype=torch.int64).to(torch.int32).view(torch.float32).item()


def adversarial(rows: int, k: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=g) * torch.logspace(-4, 4, rows)[:, None]
    if rows >= 12 and k >= 256:
        x[0, :128] = 0.0                                       # zero block: amax clamped to 1e-4
        x[1, :128] = -0.0                                      # -0 -> code 0x80
        x[2, :128] = 1e-30                                     # tiny, clamped amax
        x[2, 128:256] = torch.tensor([1e-40, -1e-40] * 64)     # fp32 subnormals
        x[3, :128] = torch.linspace(-448.0, 448.0, 128)        # s = 1: the E4M3 grid and its ties
        x[4, :128] = tie_row(dtype)                            # divide vs multiply ties
        x[5, 3] = float("nan")                                 # NaN block -> NaN scale, codes 0x7F
        x[5, 130] = _nan(0xFFC00000)                           # negative NaN
        x[6, 7] = float("inf")                                 # Inf block -> scale Inf, +-0 and 0x7F
        x[6, 200] = -float("inf")
        x[7, :128] = torch.tensor([448.0, -448.0] * 64) * 7.1  # +-max
        x[8, :128] = torch.tensor([3.0e38, -3.3e38] * 64)      # huge (fp32; inf in bf16/fp16 casts)
        x[9, 5] = 5.0e-5                                       # amax below the clamp
        x[9, 6:128] = 0.0
        x[10, 0:128] = _nan(0x7F800001)                        # signalling NaN payloads
        x[11, 1] = _nan(0xFFFFFFFF)
    return x.to(dtype)


def _check_quant(q, r, layout="linear"):
    assert q.fmt == r.fmt and q.shape == r.shape and q.dtype == r.dtype and q.params == r.params
    assert q.scale_layout == layout
    assert q.data.is_contiguous()
    assert_bitexact(q.data, r.data, "data bytes")
    want = R.column_major_scales(r.scale) if layout == "column_major" else r.scale
    assert q.scale.shape == want.shape and q.scale.stride() == want.stride(), (q.scale.stride(), want.stride())
    assert_bitexact(q.scale, want, "scale bits")
    if layout == "column_major":  # whole storage, padding rows included (zero)
        got = torch.empty(0, device=q.scale.device).set_(q.scale.untyped_storage())
        ref = torch.empty(0).set_(want.untyped_storage())
        assert_bitexact(got, ref, "scale storage")


def _check_dequant(q_gpu, r):
    k = _kernels()
    for out in DTYPES:
        want = canonical_nan(R.dequantize_fp8_block(r, out), out)
        assert_bitexact(k.dequantize_fp8_block(q_gpu, out), want, f"dequantize to {out}")


@pytest.mark.parametrize("block", BLOCKS, ids=["1x128", "128x128"])
@pytest.mark.parametrize("scale_fmt", FMTS, ids=["fp32", "ue8m0"])
@pytest.mark.parametrize("rows", [1, 3, 127, 129, 100_000])
@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16", "fp32"])
def test_quantize_and_dequantize_bit_exact(block, scale_fmt, rows, dtype):
    x = adversarial(rows, 320, dtype, seed=rows)
    r = R.quantize_fp8_block(x, block, scale_fmt)
    q = _kernels().quantize_fp8_block(x.cuda(), block, scale_fmt)
    _check_quant(q, r)
    _check_dequant(r.to("cuda") if rows < 100_000 else q, r)


@pytest.mark.parametrize("k", [1, 7, 127, 128, 129, 255, 640, 1000, 7168])
@pytest.mark.parametrize("block", BLOCKS, ids=["1x128", "128x128"])
def test_every_k(k, block):
    x = adversarial(130, k, torch.bfloat16, seed=k)
    for fmt in FMTS:
        r = R.quantize_fp8_block(x, block, fmt)
        q = _kernels().quantize_fp8_block(x.cuda(), block, fmt)
        _check_quant(q, r)
        _check_dequant(q, r)


@pytest.mark.parametrize("scale_fmt", FMTS, ids=["fp32", "ue8m0"])
@pytest.mark.parametrize("shape", [(1, 128), (3, 300), (4, 7168), (127, 320), (129, 320), (4096, 7168),
                                   (2, 5, 320), (3, 129, 200)])
def test_column_major_scales(shape, scale_fmt):
    x = adversarial(math.prod(shape[:-1]), shape[-1], torch.bfloat16, seed=len(shape)).reshape(shape)
    r = R.quantize_fp8_block(x, (1, 128), scale_fmt)
    q = _kernels().quantize_fp8_block(x.cuda(), (1, 128), scale_fmt, scale_layout="column_major")
    _check_quant(q, r, "column_major")
    _check_dequant(q, r)  # dequantize reads the strided scales in place


def test_column_major_bad_shapes():
    k = _kernels()
    with pytest.raises(ValueError):
        k.quantize_fp8_block(torch.randn(2, 2, 2, 128, device="cuda"), scale_layout="column_major")
    with pytest.raises(ValueError):
        k.quantize_fp8_block(torch.randn(256, 256, device="cuda"), (128, 128), scale_layout="column_major")
    with pytest.raises(ValueError):
        k.quantize_fp8_block(torch.randn(4, 128, device="cuda"), scale_layout="mn_major")


def _noncontiguous_cases():
    base = adversarial(12, 390, torch.float32, 7)
    return [
        ("row stride", base[:, :300], (1, 128)),
        ("transposed", adversarial(260, 3, torch.bfloat16, 8).t(), (1, 128)),
        ("4-D permuted", adversarial(12, 130, torch.float16, 9).reshape(2, 2, 3, 130).permute(1, 0, 2, 3), (1, 128)),
        ("batch dims", torch.randn(4, 3, 96, 256).transpose(1, 2), (1, 128)),
        ("128 transposed", adversarial(150, 200, torch.bfloat16, 23).t(), (128, 128)),
        ("128 row stride", adversarial(140, 300, torch.float32, 24)[:, 10:270], (128, 128)),
    ]


@pytest.mark.parametrize("case", range(6))
def test_noncontiguous_and_batch_dims(case):
    _, x, block = _noncontiguous_cases()[case]
    xc = x.cuda() if x.is_contiguous() else _same_strides_on_cuda(x)
    assert xc.stride() == x.stride()
    for fmt in FMTS:
        r = R.quantize_fp8_block(x, block, fmt)
        q = _kernels().quantize_fp8_block(xc, block, fmt)
        _check_quant(q, r)
        _check_dequant(q, r)


def _same_strides_on_cuda(x):
    """A CUDA tensor with x's values and x's strides (x.cuda() keeps them only for dense x)."""
    return torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device="cuda").copy_(x)


def test_column_major_3d_strided_input():
    x = adversarial(10, 130, torch.bfloat16, 15).reshape(5, 2, 130).transpose(0, 1)
    r = R.quantize_fp8_block(x, (1, 128))
    q = _kernels().quantize_fp8_block(_same_strides_on_cuda(x), (1, 128), scale_layout="column_major")
    _check_quant(q, r, "column_major")


@pytest.mark.parametrize("block", BLOCKS, ids=["1x128", "128x128"])
@pytest.mark.parametrize("scale_fmt", FMTS, ids=["fp32", "ue8m0"])
def test_nan_inf_blocks_of_every_kind(block, scale_fmt):
    """NaNs of both signs and any payload give codes 0x7F (no explicit select in the kernel: checked here)."""
    x = torch.randn(256, 384)
    nans = [0x7FC00000, 0xFFC00000, 0x7F800001, 0xFF800001, 0x7FFFFFFF, 0xFFFFFFFF, 0x7FC00123]
    for i, b in enumerate(nans):
        x[i * 2, 5 + i] = _nan(b)
        x[130 + i, 131 + 7 * i] = _nan(b)
    x[20, 0] = float("inf")
    x[21, 1] = -float("inf")
    x[22, :] = float("inf")
    for dtype in DTYPES:
        xd = x.to(dtype)
        r = R.quantize_fp8_block(xd, block, scale_fmt)
        q = _kernels().quantize_fp8_block(xd.cuda(), block, scale_fmt)
        _check_quant(q, r)
        _check_dequant(q, r)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_division_stress(dtype):
    """2^24 elements, block amax log-uniform over 2^-40..2^40: the correction-step division is exact."""
    g = torch.Generator().manual_seed(1234)
    rows, k = 8192, 2048
    x = torch.rand(rows, k, generator=g) * 2 - 1
    x *= torch.exp2(torch.randint(-40, 41, (rows, k // 128), generator=g).float()).repeat_interleave(128, -1)
    x = x.to(dtype)
    r = R.quantize_fp8_block(x, (1, 128))
    q = _kernels().quantize_fp8_block(x.cuda(), (1, 128))
    _check_quant(q, r)


def test_through_the_api():
    x = adversarial(129, 320, torch.bfloat16, 3)
    for block in BLOCKS:
        for fmt in FMTS:
            r = lowbit.quantize(x, "fp8_block", backend="torch", block=block, scale_fmt=fmt)
            q = lowbit.quantize(x.cuda(), "fp8_block", backend="triton", block=block, scale_fmt=fmt)
            _check_quant(q, r)
            auto = lowbit.quantize(x.cuda(), "fp8_block", block=block, scale_fmt=fmt)
            _check_quant(auto, r)
            for out in DTYPES:
                want = canonical_nan(lowbit.dequantize(r, out, backend="torch"), out)
                assert_bitexact(lowbit.dequantize(q, out, backend="triton"), want, f"api dequantize {out}")


def test_direct_launch_matches_triton_launch():
    """Calls after the first of a shape skip Triton's binder; results must not depend on that, nor on the
    input's alignment (a 2-byte offset view must not reuse a kernel specialised for 16-byte alignment)."""
    k = _kernels()
    buf = adversarial(65, 7168, torch.bfloat16, 9).cuda()
    for x in (buf[:64], buf.view(-1)[1:1 + 64 * 7168].view(64, 7168), buf[:64]):
        for fmt in FMTS:
            for layout in ("linear", "column_major"):
                got = [k.quantize_fp8_block(x, (1, 128), fmt, layout) for _ in range(3)]
                k.DIRECT_LAUNCH = False
                try:
                    slow = k.quantize_fp8_block(x, (1, 128), fmt, layout)
                finally:
                    k.DIRECT_LAUNCH = True
                for q in got:
                    assert torch.equal(q.data.view(torch.uint8), slow.data.view(torch.uint8))
                    assert torch.equal(q.scale.view(torch.int32), slow.scale.view(torch.int32))
                    d = [k.dequantize_fp8_block(q, torch.bfloat16).view(torch.int16) for _ in range(2)]
                    assert torch.equal(d[0], d[1])
    r = R.quantize_fp8_block(buf[:64].cpu())
    _check_quant(k.quantize_fp8_block(buf[:64]), r)


def test_streams_and_cuda_graphs():
    k = _kernels()
    x = torch.randn(16, 7168, device="cuda", dtype=torch.bfloat16)
    ref = k.quantize_fp8_block(x)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        q = k.quantize_fp8_block(x)
    s.synchronize()
    assert torch.equal(q.data.view(torch.uint8), ref.data.view(torch.uint8))
    k.quantize_fp8_block(x, scale_layout="column_major")  # compile and load outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        qg = k.quantize_fp8_block(x, scale_layout="column_major")
    x.copy_(torch.randn_like(x))
    graph.replay()
    torch.cuda.synchronize()
    r = R.quantize_fp8_block(x.cpu())
    _check_quant(qg, r, "column_major")


def test_empty():
    k = _kernels()
    for shape, block in [((0, 128), (1, 128)), ((3, 0), (1, 128)), ((0, 5), (128, 128))]:
        x = torch.zeros(shape)
        r = R.quantize_fp8_block(x, block)
        q = k.quantize_fp8_block(x.cuda(), block)
        _check_quant(q, r)
        assert k.dequantize_fp8_block(q).shape == x.shape


def test_int64_indexing_beyond_2_31_elements():
    k = _kernels()
    kd = 7168
    rows = (1 << 31) // kd + 64
    x = torch.randn(rows, kd, device="cuda", dtype=torch.bfloat16)
    q = k.quantize_fp8_block(x)
    tail = x[-64:].cpu()
    r = R.quantize_fp8_block(tail)
    assert_bitexact(q.data[-64:], r.data, "tail data")
    assert_bitexact(q.scale[-64:], r.scale, "tail scales")
    d = k.dequantize_fp8_block(q, torch.bfloat16)
    assert_bitexact(d[-64:], R.dequantize_fp8_block(r, torch.bfloat16), "tail dequantize")
    del d
    qc = k.quantize_fp8_block(x, scale_layout="column_major")
    assert_bitexact(qc.scale[-64:], r.scale, "tail column-major scales")
    del q, qc
    n = (1 << 31) // 8192 + 128
    w = torch.randn(n, 8192, device="cuda", dtype=torch.bfloat16)
    qw = k.quantize_fp8_block(w, (128, 128))
    rw = R.quantize_fp8_block(w[-128:].cpu(), (128, 128))
    assert_bitexact(qw.data[-128:], rw.data, "128x128 tail data")
    assert_bitexact(qw.scale[-1:], rw.scale, "128x128 tail scales")
