"""Triton block-scaled kernels are byte-identical to the CPU reference (data bytes and scale bytes)."""

import pytest
import torch

import lowbit
from lowbit.testing import assert_bitexact, nvfp4_order_ties

pytestmark = pytest.mark.gpu

MX = ["mxfp4", "mxfp6_e2m3", "mxfp6_e3m2", "mxfp8_e4m3", "mxfp8_e5m2"]
CASES = [
    ("nvfp4", {}), ("nvfp4", {"global_scale": "none"}), ("fp4_b32", {}), ("nvfp4", {"convention": "lightx2v"})
] + [
    (f, {"scale_rounding": r}) for f in MX for r in ("rceil", "floor")
]


def _adversarial(rows: int, k: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=g) * torch.logspace(-6, 6, rows)[:, None].clamp(min=1e-30)
    if rows >= 8 and k >= 64:
        x[0, :32] = 0.0                                   # zero blocks
        x[1, :32] = -0.0                                  # negative zero block
        x[2, :32] = torch.tensor([6.0, -6.0] * 16)        # all +-max
        x[3, :32] = 1e-7                                  # tiny: subnormal / zero scales
        # exact ties of the element grids once scaled (0.25 .. 5 are E2M1 midpoints)
        x[4, :32] = torch.tensor([6, .25, .75, 1.25, 1.75, 2.5, 3.5, 5] * 4)
        x[5, 3] = float("nan")
        x[6, 40] = float("inf")
        x[7, 33] = -float("inf")
    return x.to(dtype)


def _check(q, r):
    assert q.fmt == r.fmt and q.shape == r.shape and q.scale_layout == r.scale_layout
    assert_bitexact(q.data.view(torch.uint8), r.data.view(torch.uint8), "data bytes")
    assert_bitexact(q.scale.contiguous().view(torch.uint8), r.scale.contiguous().view(torch.uint8), "scale bytes")
    if r.global_scale is None:
        assert q.global_scale is None
    else:
        assert torch.equal(q.global_scale.cpu(), r.global_scale)


@pytest.mark.parametrize("fmt, opts", CASES, ids=[f"{f}-{'-'.join(map(str, o.values()))}" for f, o in CASES])
@pytest.mark.parametrize("rows", [1, 3, 127, 129, 4099])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("layout", ["linear", "swizzled"])
def test_quantize_bit_exact(fmt, opts, rows, dtype, layout):
    if layout == "swizzled" and fmt == "fp4_b32":
        pytest.skip("fp4_b32 has fp32 scales, no swizzled layout")
    opts = dict(opts, **({"scale_layout": layout} if fmt != "fp4_b32" else {}))
    x = _adversarial(rows, 320, dtype, seed=rows)
    r = lowbit.quantize(x, fmt, backend="torch", **opts)
    q = lowbit.quantize(x.cuda(), fmt, backend="triton", **opts)
    _check(q, r)
    for out in (torch.float32, torch.bfloat16, torch.float16):
        want = lowbit.dequantize(r, out, backend="torch")
        got = lowbit.dequantize(r.to("cuda"), out, backend="triton").cpu()
        assert_bitexact(got, want, f"dequantize to {out}")


@pytest.mark.parametrize("fmt, opts", CASES[:5] + CASES[-2:])
def test_batch_dims_noncontiguous_and_default_scale(fmt, opts):
    x = torch.randn(4, 3, 96, 256).transpose(1, 2)  # leading dims, not contiguous
    r = lowbit.quantize(x, fmt, backend="torch", **opts)
    q = lowbit.quantize(x.cuda(), fmt, backend="triton", **opts)
    _check(q, r)
    assert_bitexact(lowbit.dequantize(q, backend="triton"), lowbit.dequantize(r, backend="torch"), "dequantize")


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4", "mxfp8_e5m2"])
def test_hundred_thousand_rows(fmt):
    x = _adversarial(100_000, 256, torch.bfloat16, seed=5)
    _check(lowbit.quantize(x.cuda(), fmt, backend="triton"), lowbit.quantize(x, fmt, backend="torch"))


def test_auto_backend_uses_kernels_on_cuda():
    x = torch.randn(64, 128, device="cuda")
    q = lowbit.quantize(x, "mxfp4")  # auto
    r = lowbit.quantize(x.cpu(), "mxfp4")
    _check(q, r)


def test_int64_indexing_beyond_2_31_elements():
    k = 8192
    rows = (1 << 31) // k + 64
    x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
    q = lowbit.quantize(x, "mxfp8_e4m3", backend="triton")
    tail = x[-64:].cpu()
    r = lowbit.quantize(tail, "mxfp8_e4m3", backend="torch")
    assert torch.equal(q.data[-64:].cpu().view(torch.uint8), r.data.view(torch.uint8))
    assert torch.equal(q.scale[-64:].cpu().view(torch.uint8), r.scale.view(torch.uint8))
    d = lowbit.dequantize(q, torch.bfloat16, backend="triton")
    assert torch.equal(d[-64:].cpu(), lowbit.dequantize(r, torch.bfloat16, backend="torch"))


def test_cuda_global_scale_matches_cpu_scale():
    x = torch.randn(300, 512)
    g = torch.tensor(3.5)
    r = lowbit.quantize(x, "nvfp4", global_scale=g, backend="torch")
    q = lowbit.quantize(x.cuda(), "nvfp4", global_scale=g.cuda(), backend="triton")
    _check(q, r)


@pytest.mark.parametrize("convention", ["vllm", "lightx2v"])
@pytest.mark.parametrize("layout", ["linear", "swizzled"])
def test_nvfp4_convention_multiplier_order_at_ties(convention, layout):
    """vLLM's element multiplier 1/(sf*(1/S)) and LightX2V's S*(1/sf) differ in the last bit for some (sf, S);
    elements on E2M1 ties then get different codes. Each convention's kernel must give its own reference's
    bytes: on constructed ties (fp32 and the same values' bf16 images), and on random bf16 data with a given
    and with the default global scale (237 of its 1M bytes differ between the conventions)."""
    t, ts = nvfp4_order_ties()
    other = {"vllm": "lightx2v", "lightx2v": "vllm"}[convention]
    g = torch.Generator().manual_seed(11)
    rnd = torch.randn(512, 4096, generator=g).to(torch.bfloat16)
    cases = [(t, ts), (t.to(torch.bfloat16), ts), (rnd, 2688.0 / rnd.float().abs().max()), (rnd, None)]
    for x, s in cases:
        opts = dict(global_scale=s, convention=convention, scale_layout=layout)
        r = lowbit.quantize(x, "nvfp4", backend="torch", **opts)
        q = lowbit.quantize(x.cuda(), "nvfp4", backend="triton", **opts)
        _check(q, r)
        assert q.params["convention"] == convention
        # every case separates the conventions, so a kernel with the other order fails on it
        o = lowbit.quantize(x, "nvfp4", backend="torch", **dict(opts, convention=other))
        assert not torch.equal(o.data, r.data)


@pytest.mark.parametrize("block", [(1, 128), (128, 128)])
@pytest.mark.parametrize("layout", ["linear", "swizzled"])
@pytest.mark.parametrize("rows, k", [(1, 32), (37, 416), (300, 4096), (1000, 1600)])
def test_mxfp4_as_fp8_block_bit_exact(rows, k, layout, block):
    """The FP8 re-encoding of mxfp4 (scaled_mm's fold route) equals the CPU reference: E4M3 bytes, fp32 scale
    bits and the exact flag; on adversarial data (zero, +-max, tiny, NaN/Inf, blocks 20 binades apart)."""
    from lowbit.formats import blockscaled as ref
    from lowbit.kernels import blockscaled as kb

    x = _adversarial(rows, k, torch.float32, seed=rows + k)
    if rows >= 16 and k >= 128:
        x[9, :32] *= 1e6      # the tile's other blocks fall out of the window: dropped
        x[10, 64:96] *= 1e-5  # 17 binades below the rest of its tile
    q = ref.quantize_mx(x, "mxfp4", "rceil", layout)
    qc = q.to("cuda")
    flag = torch.zeros(1, dtype=torch.int32, device="cuda")
    fk, ek = kb.mxfp4_as_fp8_block(qc, block, flag)
    fr, er = ref.mxfp4_as_fp8_block(q, block)
    assert_bitexact(fk.data.view(torch.uint8).cpu(), fr.data.view(torch.uint8), "E4M3 bytes")
    assert_bitexact(fk.scale.view(torch.int32).cpu(), fr.scale.view(torch.int32), "scale bits")
    assert bool(ek) == bool(er) and flag.item() == int(not bool(er))
    if rows >= 16 and k >= 128:
        assert not bool(er)
    # real weights rarely span 15 binades in a 128x128 block: a plain random one folds exactly
    w = ref.quantize_mx(torch.randn(rows, k) * 0.02, "mxfp4", "rceil", layout)
    fk, ek = kb.mxfp4_as_fp8_block(w.to("cuda"), block)
    fr, er = ref.mxfp4_as_fp8_block(w, block)
    assert bool(ek) and bool(er)
    assert_bitexact(fk.data.view(torch.uint8).cpu(), fr.data.view(torch.uint8), "E4M3 bytes")
    assert_bitexact(fk.scale.view(torch.int32).cpu(), fr.scale.view(torch.int32), "scale bits")


def _nvfp4_activation_rows(shape, x_dtype):
    """Random activations of ``shape`` (any leading dims) with an outlier channel ramp, a zero block, +-Inf,
    NaN and values on E2M1 ties in the first / last row."""
    g = torch.Generator(device="cuda").manual_seed(sum(shape))
    x = torch.randn(shape, generator=g, device="cuda") * torch.logspace(-3, 3, shape[-1], device="cuda")
    rows = x.view(-1, shape[-1])
    rows[0, :16] = 0
    if shape[-1] >= 64:
        rows[0, 20] = float("inf")
        rows[-1, 33] = -float("inf")
        rows[-1, 35] = float("nan")
        rows[0, 40:56] = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0] * 2, device="cuda")
    return x.to(x_dtype)


@pytest.mark.parametrize("convention", ["vllm", "lightx2v"])
@pytest.mark.parametrize("shape", [(1, 16), (1, 4096), (1, 14336), (4, 4096), (16, 1024), (3, 80)])
@pytest.mark.parametrize("x_dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_nvfp4_roundtrip_small_equals_quantize_then_decode(shape, convention, x_dtype):
    """The one-launch round trip of decode activations gives the bits of the absmax and quantize kernels then
    the dequantize kernel without the global scale (and that global scale), on random rows with an outlier
    channel, zero blocks, +-Inf, NaN and values on E2M1 ties."""
    import dataclasses

    from lowbit.kernels import blockscaled as kb

    x = _nvfp4_activation_rows(shape, x_dtype)
    got, gs = kb.nvfp4_roundtrip_small(x, convention)
    q = kb.quantize_nvfp4(x, None, convention)
    want = kb.dequantize_nvfp4(dataclasses.replace(q, global_scale=None), torch.bfloat16)
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))
    assert torch.equal(gs, q.global_scale)


@pytest.mark.parametrize("convention", ["vllm", "lightx2v"])
@pytest.mark.parametrize("shape, global_scale", [((8190, 512), None), ((3, 7, 1024), None), ((300, 160), 448.0),
                                                 ((64, 4096), "none"), ((1, 16), None)])
@pytest.mark.parametrize("x_dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_quantize_nvfp4_decoded_equals_quantize_then_decode(shape, global_scale, convention, x_dtype):
    """The dequant route's one-pass activation (quantize, then decode without the global scale) gives the bits
    of the quantize kernel then the dequantize kernel, and the same global scale: derived (absmax pass), given
    (a float and a CUDA tensor) and none; outliers, zero blocks, +-Inf, NaN, E2M1 ties; x not modified."""
    import dataclasses

    from lowbit.kernels import blockscaled as kb

    x = _nvfp4_activation_rows(shape, x_dtype)
    keep = x.clone()
    scales = [global_scale] if not isinstance(global_scale, float) else [global_scale,
                                                                         torch.tensor([global_scale], device="cuda")]
    for gsc in scales:
        got, gs = kb.quantize_nvfp4_decoded(x, gsc, convention)
        q = kb.quantize_nvfp4(x, gsc, convention)
        want = kb.dequantize_nvfp4(dataclasses.replace(q, global_scale=None), torch.bfloat16)
        assert got.shape == x.shape and got.dtype == torch.bfloat16
        assert torch.equal(got.view(torch.int16), want.view(torch.int16))
        assert (gs is None and q.global_scale is None) or torch.equal(gs, q.global_scale)
    assert torch.equal(x.view(torch.uint8), keep.view(torch.uint8))


def test_e2m1_value_rounding_equals_encode_then_decode_on_the_gpu():
    """The dequantize kernel's E2M1 decoding against ``decode_minifloat`` on the 16 codes, and the quantize
    kernel's E2M1 rounding to a value (the one-pass nvfp4 activation) against the code path it replaces, with
    the GPU's own min/NaN semantics: every bf16 value, the E2M1 codes and midpoints with
    their neighbours, NaNs of both signs and 2^24 random fp32 patterns."""
    import os
    import sys

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from _e2m1_check import adversarial_fp32_bits, run_e2m1_decode_paths, run_e2m1_paths

    got, want = run_e2m1_decode_paths("cuda")
    assert torch.equal(got, want), (got.tolist(), want.tolist())
    bits = adversarial_fp32_bits(1 << 24, seed=1).cuda()
    got, want = run_e2m1_paths(bits, nan_fixup=False)
    bad = (got != want).nonzero().flatten()
    assert bad.numel() == 0, [(hex(int(bits[i]) & 0xFFFFFFFF), hex(int(got[i])), hex(int(want[i]))) for i in bad[:8]]


@pytest.mark.parametrize("x_shape, w_shape, layout", [((8190, 512), (640, 512), "linear"), ((3, 37, 256), (300, 256),
                                                                                            "swizzled"),
                                                     ((1, 16), (128, 64), "linear")])
def test_finite_absmax_and_dequantize_equals_the_two_passes(x_shape, w_shape, layout):
    """One launch of the absmax pass (an activation with +-Inf, NaN, a zero block) and an nvfp4 weight's
    decoding (without its global scale, bf16): the bits of the two kernels launched apart."""
    import dataclasses

    from lowbit.kernels import blockscaled as kb

    x = _nvfp4_activation_rows(x_shape, torch.bfloat16)
    w = torch.randn(w_shape, device="cuda") * torch.logspace(-3, 3, w_shape[0], device="cuda")[:, None]
    q = dataclasses.replace(kb.quantize_nvfp4(w, None, "vllm", layout), global_scale=None)
    keep_x, keep_w = x.clone(), q.data.clone()
    amax, wd = kb.finite_absmax_and_dequantize(x, q, torch.bfloat16)
    assert torch.equal(amax, kb._finite_absmax_bits(x))
    assert torch.equal(wd.view(torch.int16), kb.dequantize_nvfp4(q, torch.bfloat16).view(torch.int16))
    got, gs = kb.quantize_nvfp4_decoded(x, None, "vllm", amax=amax)
    want, want_gs = kb.quantize_nvfp4_decoded(x, None, "vllm")
    assert torch.equal(got.view(torch.int16), want.view(torch.int16)) and torch.equal(gs, want_gs)
    assert torch.equal(x.view(torch.int16), keep_x.view(torch.int16)) and torch.equal(q.data, keep_w)
    with pytest.raises(ValueError, match="amax"):
        kb.quantize_nvfp4_decoded(x, 2.0, "vllm", amax=amax)
