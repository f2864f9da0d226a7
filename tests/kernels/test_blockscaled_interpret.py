"""Block-scaled kernels under TRITON_INTERPRET=1 on tiny CPU tensors (CI has no GPU).

The interpreter is trusted for indexing, masking, packing and fp32/integer arithmetic, not for fp8 casts,
so FP4/FP6 formats (MX scales, fp4_b32) are compared bit for bit and NVFP4 only where every fp8 cast is
exact (power-of-two scales, or the exact scales of ``lowbit.testing.nvfp4_order_ties``). The same comparisons run on the GPU for every format in test_blockscaled_gpu.py.
"""

import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("triton")

SCRIPT = textwrap.dedent(
    """
    import torch, triton, triton.language as tl
    from lowbit.formats import blockscaled as ref, codecs
    from lowbit.formats.spec import E2M1, E2M3, E3M2
    from lowbit.kernels import blockscaled as kb
    from lowbit.kernels._blockscaled import _encode_minifloat
    from lowbit.kernels.device import decode_minifloat
    from lowbit.testing import nvfp4_order_ties

    def same(a, b):
        return (torch.equal(a.data.view(torch.uint8), b.data.view(torch.uint8))
                and torch.equal(a.scale.contiguous().view(torch.uint8), b.scale.contiguous().view(torch.uint8)))

    def same_bits(a, b):
        return torch.equal(a.view(torch.int32), b.view(torch.int32))

    torch.manual_seed(0)
    x = torch.randn(5, 96) * torch.logspace(-4, 4, 5)[:, None]
    x[1, :32] = 0; x[1, 40] = -0.0; x[2, 3] = float("nan"); x[3, 40] = float("inf"); x[0, :32] = 1e-30
    bad = []
    for fmt in ("mxfp4", "mxfp6_e2m3", "mxfp6_e3m2"):
        for rounding in ("rceil", "floor"):
            for layout in ("linear", "swizzled"):
                r, k = ref.quantize_mx(x, fmt, rounding, layout), kb.quantize_mx(x, fmt, rounding, layout)
                if not same(r, k) or not same_bits(ref.dequantize_mx(r), kb.dequantize_mx(k)):
                    bad.append((fmt, rounding, layout))
    xb = x.to(torch.bfloat16)[:, :64].reshape(2, 5, 32)
    r, k = ref.quantize_fp4_b32(xb), kb.quantize_fp4_b32(xb)
    if not same(r, k) or not same_bits(ref.dequantize_fp4_b32(r), kb.dequantize_fp4_b32(k)):
        bad.append("fp4_b32")
    # nvfp4 single level with block maxima 6 * 2^k: every E4M3 scale is a power of two, so no inexact fp8 cast
    y = (torch.randint(-12, 13, (7, 64)).float() / 2).clamp(-6, 6)
    y[:, ::16] = 6.0
    y = y * torch.exp2(torch.randint(-6, 6, (7, 4)).float()).repeat_interleave(16, -1)
    for layout in ("linear", "swizzled"):
        r, k = ref.quantize_nvfp4(y, "none", "vllm", layout), kb.quantize_nvfp4(y, "none", "vllm", layout)
        if not same(r, k) or not same_bits(ref.dequantize_nvfp4(r), kb.dequantize_nvfp4(k)):
            bad.append(("nvfp4", layout))
    # nvfp4 with a global scale, on blocks whose E4M3 scales are exact and whose elements sit on E2M1 ties
    # where vLLM's multiplier 1/(sf*(1/S)) and LightX2V's S*(1/sf) round them differently: each convention's
    # kernel must give its own codes (the two references differ on this data)
    t, ts = nvfp4_order_ties()
    if torch.equal(ref.quantize_nvfp4(t, ts, "vllm").data, ref.quantize_nvfp4(t, ts, "lightx2v").data):
        bad.append("nvfp4 tie data does not separate the conventions")
    for conv in ("vllm", "lightx2v"):
        for layout in ("linear", "swizzled"):
            r, k = ref.quantize_nvfp4(t, ts, conv, layout), kb.quantize_nvfp4(t, ts, conv, layout)
            if not same(r, k) or r.params != k.params:
                bad.append(("nvfp4 ties", conv, layout))
    for n in (1, 4097, 70001):
        z = torch.randn(n) * 3
        z[0] = float("inf") if n > 1 else z[0]
        if kb.finite_absmax(z).item() != ref.finite_amax(z).float().item():
            bad.append(("absmax", n))

    @triton.jit
    def codec(x_ptr, c_ptr, v_ptr, N, EBITS: tl.constexpr, MBITS: tl.constexpr, BIAS: tl.constexpr,
              MAX: tl.constexpr, BLOCK: tl.constexpr):
        o = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        m = o < N
        c = _encode_minifloat(tl.load(x_ptr + o, mask=m, other=0.0), EBITS, MBITS, BIAS, MAX, True)
        tl.store(c_ptr + o, c, mask=m)
        tl.store(v_ptr + o, decode_minifloat(c, EBITS, MBITS, BIAS), mask=m)

    for spec in (E2M1, E2M3, E3M2):
        tab = codecs.minifloat_table(spec)[: spec.max_code + 1]
        mids = (tab[:-1] + tab[1:]) / 2
        pts = torch.cat([tab, mids, torch.nextafter(mids, torch.full_like(mids, 100.0)),
                         torch.nextafter(mids, torch.zeros_like(mids)), torch.randn(4000) * spec.max_normal / 3,
                         torch.tensor([1e-30, 1e-40, spec.max_normal * 1.01, 1e30, float("inf"), float("nan")])])
        v = torch.cat([pts, -pts])
        c = torch.empty(v.numel(), dtype=torch.int32)
        d = torch.empty(v.numel())
        codec[(triton.cdiv(v.numel(), 1024),)](v, c, d, v.numel(), EBITS=spec.ebits, MBITS=spec.mbits,
                                               BIAS=spec.bias, MAX=spec.max_normal, BLOCK=1024)
        want = codecs.encode_minifloat(v, spec)
        if not torch.equal(c, want.to(torch.int32)) or not same_bits(d, codecs.decode_minifloat(want, spec)):
            bad.append(("codec", spec.name))

    # mxfp4 re-encoded as fp8_block: ragged K, a dropped (out-of-window) block, a NaN block, swizzled scales.
    # Every E4M3 cast there is of an exactly representable value.
    w = torch.randn(37, 96 * 4 + 32) * torch.logspace(-20, 20, 37)[:, None]
    w[3, :32] *= 1e6
    w[4, 40] = float("nan")
    w[5, :32] = 0
    for layout in ("linear", "swizzled"):
        q = ref.quantize_mx(w, "mxfp4", "rceil", layout)
        for blk in ((1, 128), (128, 128)):
            (fr, er), (fk, ek) = ref.mxfp4_as_fp8_block(q, blk), kb.mxfp4_as_fp8_block(q, blk)
            if not (same(fr, fk) and not bool(er) and not bool(ek)):  # this data has dropped blocks
                bad.append(("mxfp4_as_fp8_block", layout, blk))
    # 128x128 blocks over 130 rows (a partial row block), all within the window: exact
    w2 = torch.randn(130, 256) * torch.logspace(-1, 1, 130)[:, None]
    q = ref.quantize_mx(w2, "mxfp4", "rceil", "linear")
    (fr, er), (fk, ek) = ref.mxfp4_as_fp8_block(q, (128, 128)), kb.mxfp4_as_fp8_block(q, (128, 128))
    if not (same(fr, fk) and bool(er) and bool(ek) and fr.scale.shape == (2, 2)):
        bad.append(("mxfp4_as_fp8_block", "130 rows"))
    # the scale layouts cuBLASLt reads: same values, (1, 128) M-major, (128, 128) rows padded to 4 K tiles
    # with zeros (K = 640: 5 tiles, so rows of 8)
    w3 = torch.randn(130, 640) * torch.logspace(-1, 1, 130)[:, None]
    q = ref.quantize_mx(w3, "mxfp4", "rceil", "linear")
    for blk in ((1, 128), (128, 128)):
        flag = torch.zeros(1, dtype=torch.int32)
        fr, _ = ref.mxfp4_as_fp8_block(q, blk)
        fk = kb.mxfp4_fold(q, blk, flag, cublas_scales=True)
        if blk == (1, 128):
            layout_ok = fk.scale.stride() == (1, 130)
        else:
            full = fk.scale.as_strided((2, 8), (8, 1))
            layout_ok = fk.scale.stride() == (8, 1) and torch.equal(full[:, 5:], torch.zeros(2, 3))
        if not (same(fr, fk) and layout_ok and int(flag) == 0):
            bad.append(("mxfp4_fold cublas_scales", blk))
    # the one-program NVFP4 round trip of decode activations: the bits of the quantize kernel (default global
    # scale, from the absmax kernel) then the dequantize kernel on the codes without the global scale, NaN,
    # Inf, zero blocks and ties included (kernel against kernel: the same fp8 casts on both sides)
    import dataclasses
    for shape, conv in (((1, 4096), "vllm"), ((2, 512), "lightx2v"), ((1, 16), "vllm"), ((1, 14336), "vllm"),
                        ((3, 80), "lightx2v")):
        xr = (torch.randn(shape) * torch.logspace(-3, 3, shape[-1])[None, :]).to(torch.bfloat16)
        xr[0, :16] = 0
        if shape[-1] >= 64:
            xr[0, 20] = float("inf"); xr[-1, 33] = float("nan"); xr[0, 40:56] = 3.0
        got, gs = kb.nvfp4_roundtrip_small(xr, conv)
        q = kb.quantize_nvfp4(xr, None, conv)
        want = kb.dequantize_nvfp4(dataclasses.replace(q, global_scale=None), torch.bfloat16)
        if not torch.equal(got.view(torch.int16), want.view(torch.int16)) or not torch.equal(gs, q.global_scale):
            bad.append(("nvfp4_roundtrip", shape, conv))
    # the many-program round trip of the dequant route (quantize_nvfp4_decoded): the same bits, derived, given
    # and no global scale, both conventions, a 3-D x
    for shape, conv, gsc in (((5, 96), "vllm", None), ((2, 3, 64), "lightx2v", None), ((4, 80), "vllm", 3.0),
                             ((2, 32), "lightx2v", "none")):
        xr = (torch.randn(shape) * torch.logspace(-3, 3, shape[-1])).to(torch.bfloat16)
        xr.view(-1, shape[-1])[0, :16] = 0
        xr.view(-1, shape[-1])[0, 20] = float("inf"); xr.view(-1, shape[-1])[-1, 17] = float("nan")
        got, gs = kb.quantize_nvfp4_decoded(xr, gsc, conv)
        q = kb.quantize_nvfp4(xr, gsc, conv)
        want = kb.dequantize_nvfp4(dataclasses.replace(q, global_scale=None), torch.bfloat16)
        same_gs = (gs is None and q.global_scale is None) or torch.equal(gs, q.global_scale)
        if got.shape != xr.shape or not torch.equal(got.view(torch.int16), want.view(torch.int16)) or not same_gs:
            bad.append(("quantize_nvfp4_decoded", shape, conv, gsc))
    # swizzled scales without padding (rows % 128 == 0, scale columns % 4 == 0) come in an unzeroed buffer:
    # every byte must be the kernel's (fresh uint8 buffers filled with 0x5A here to show one it missed)
    real_empty = torch.empty
    def poisoned_empty(*a, **kw):
        t = real_empty(*a, **kw)
        return t.fill_(0x5A) if t.dtype == torch.uint8 else t
    torch.empty = poisoned_empty
    try:
        z = torch.randn(128, 128) * torch.logspace(-3, 3, 128)[:, None]
        for fmt in ("mxfp4", "mxfp6_e3m2"):
            r, k = ref.quantize_mx(z, fmt, "rceil", "swizzled"), kb.quantize_mx(z, fmt, "rceil", "swizzled")
            if not same(r, k):
                bad.append(("unpadded swizzled", fmt))
        y2 = y.repeat(19, 1)[:128]
        r, k = ref.quantize_nvfp4(y2, "none", "vllm", "swizzled"), kb.quantize_nvfp4(y2, "none", "vllm", "swizzled")
        if not same(r, k):
            bad.append(("unpadded swizzled", "nvfp4"))
    finally:
        torch.empty = real_empty
    # a repeated quantize of one shape builds its QTensor without the checks: every field as the checked one
    from lowbit.formats.qtensor import QTensor
    names = [f.name for f in dataclasses.fields(QTensor)]
    for call in (lambda: kb.quantize_mx(x, "mxfp4", "floor", "swizzled"), lambda: kb.quantize_fp4_b32(xb),
                 lambda: kb.quantize_nvfp4(y, None, "lightx2v"), lambda: kb.quantize_nvfp4(y, 2.0)):
        first, again = call(), call()
        for name in names:
            a, b = getattr(first, name), getattr(again, name)
            ok = (torch.equal(a.view(torch.uint8), b.view(torch.uint8)) and a.dtype == b.dtype
                  and a.shape == b.shape) if isinstance(a, torch.Tensor) else (type(a) is type(b) and a == b)
            if not ok or sorted(vars(again)) != sorted(names) or again.params is first.params:
                bad.append(("unchecked QTensor", first.fmt, name))
    # the absmax pass and an nvfp4 weight's decoding in one launch: the bits of the two kernels
    from lowbit.kernels import _blockscaled as kk
    xa = (torch.randn(7, 96) * 40).to(torch.bfloat16); xa[2, 5] = float("inf"); xa[4, 9] = float("nan")
    qw = kb.quantize_nvfp4(torch.randn(48, 64) * 3, "none")
    dq = kb.dequantize_call(qw, torch.bfloat16)
    amax_f = torch.zeros(1, dtype=torch.int32)
    wd = torch.empty(dq.shape, dtype=torch.bfloat16)
    progs = -(-xa.numel() // 64)  # CHUNK * CHUNKS elements a program
    kk.absmax_and_dequantize_kernel[(progs + dq.launch.grid[0],)](
        xa.view(-1), amax_f, xa.numel(), progs, *dq.args[:3], wd.view(torch.int16), *dq.args[4:], CHUNK=64,
        CHUNKS=1, **dq.launch.consts, **dq.launch.options)
    if not (torch.equal(amax_f, kb._finite_absmax_bits(xa)) and torch.equal(wd.view(torch.int16),
                                                                            dq().view(torch.int16))):
        bad.append(("absmax_and_dequantize",))
    # the quantize kernel's E2M1 rounding to a value against encode-then-decode on every bf16 value, the E2M1
    # codes and midpoints with their neighbours, NaNs and random fp32 patterns
    import sys
    sys.path.insert(0, TESTS_DIR)
    from _e2m1_check import adversarial_fp32_bits, run_e2m1_decode_paths, run_e2m1_paths
    got, want = run_e2m1_paths(adversarial_fp32_bits(1 << 16), nan_fixup=True)
    if not torch.equal(got, want):
        bad.append(("e2m1 value path", int((got != want).sum())))
    got, want = run_e2m1_decode_paths()
    if not torch.equal(got, want):
        bad.append(("e2m1 decode path", got.tolist(), want.tolist()))
    print("BAD", bad)
    """
)


def test_blockscaled_kernels_under_the_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1")
    script = f"TESTS_DIR = {os.path.dirname(os.path.abspath(__file__))!r}\n" + SCRIPT
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "BAD []" in out.stdout, out.stdout[-2000:]


def test_nvfp4_roundtrip_launch_takes_only_what_one_program_holds():
    from lowbit.kernels import blockscaled as kb

    for n in (0, 8, 24, kb.ROUNDTRIP_MAX + 16):
        with pytest.raises(ValueError, match="multiple of 16"):
            kb.nvfp4_roundtrip_launch(n)
    lc = kb.nvfp4_roundtrip_launch(4096 + 16, "lightx2v")
    assert lc.grid == (1, 1, 1) and lc.consts["BLOCK_N"] == 8192 and lc.consts["E4M3_ORDER"] == 1
    for convention in ("modelopt", "torchao"):  # not a convention / one without the kernel's multiplier order
        with pytest.raises(ValueError, match="convention"):
            kb.nvfp4_roundtrip_launch(64, convention)


def test_quantize_nvfp4_decoded_checks_the_given_absmax():
    """The absmax bits a caller hands over must be int32 [1] on x's device, and only with a derived global scale:
    a clear ValueError before any launch otherwise."""
    import torch

    from lowbit.kernels import blockscaled as kb

    x = torch.randn(4, 32)
    good = torch.zeros(1, dtype=torch.int32)
    for amax, gs in ((good, 2.0), (good, "none"), (torch.zeros(1, dtype=torch.float32), None),
                     (torch.zeros(2, dtype=torch.int32), None), (torch.zeros(1, dtype=torch.int32, device="meta"), None)):
        with pytest.raises(ValueError, match="amax"):
            kb.quantize_nvfp4_decoded(x, gs, "vllm", amax=amax)
