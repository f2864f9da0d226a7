"""fp8_block Triton kernels on the CPU: TRITON_INTERPRET=1 on tiny tensors, and the sm_90 PTX they compile to.

The interpreter runs the kernels' own indexing, masking, integer amax, scale arithmetic (``tl.div_rn`` is
an IEEE numpy division there) and the correction-step division, so scales must match the reference bit
for bit. Its float casts cannot be trusted, though: its fp32 -> fp8/bf16 rounding drops the mantissa
carry (a value that rounds up to the next power of two, 127.9 -> 128, comes out as 64) and rounds ties
away from zero, and its ``tl.fma`` is a float32 multiply then add (two roundings). The subprocess
therefore replaces exactly those two pieces of the interpreter with exact models of the GPU
instructions the kernels compile to: ``cvt.rn.satfinite.e4m3x2.f32`` (round to nearest even, saturate
to +-448, NaN -> 0x7F) and ``cvt.rn.bf16.f32`` through torch's casts, and ``fma.rn.f32`` through float64
(``x*y`` is exact there; the final double rounding can differ from one fma only when the float64 sum
lands exactly on a float32 midpoint, about 2^-29 of the cases, none on these fixed seeds). With those,
data bytes are compared exactly as well. What the interpreter cannot show -- the hardware's cvt and
div, 16-byte vectorisation, the direct launch path -- tests/kernels/test_fp8_block_gpu.py covers on a GPU;
``test_sm90_ptx`` below checks that the kernels compile to the instructions the models assume.
"""

import os
import subprocess
import sys
import textwrap

import pytest
from interpreter_compat import LOOP_BOUNDS  # this folder's interpreter patch

SCRIPT = LOOP_BOUNDS + textwrap.dedent(r'''
    import dataclasses

    import numpy as np
    import torch
    import triton.language as tl
    from triton.runtime import interpreter as ti

    from lowbit.formats import fp8_block as R
    from lowbit.formats.codecs import canonical_nan
    from lowbit.kernels import fp8_block as L

    np.seterr(all="ignore")
    _TORCH = {tl.float32: torch.float32, tl.bfloat16: torch.bfloat16, tl.float16: torch.float16,
              tl.float8e4nv: torch.float8_e4m3fn}
    _INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32}
    _orig_convert = ti._convert_float

    def _convert_float(data, src, dst, rounding_mode):
        """GPU casts: RNE; to E4M3 saturating to +-448 with NaN -> 0x7F (cvt.rn.satfinite.e4m3x2.f32)."""
        if src not in _TORCH or dst not in _TORCH:
            return _orig_convert(data, src, dst, rounding_mode)
        t = torch.from_numpy(np.ascontiguousarray(data)).view(_INT[data.dtype.itemsize]).view(_TORCH[src])
        if dst == tl.float8e4nv:
            f = t.float()
            out = f.clamp(-448.0, 448.0).to(torch.float8_e4m3fn).view(torch.uint8)
            out = torch.where(f.isnan(), torch.full_like(out, 0x7F), out)
        else:
            out = t.to(_TORCH[dst])
        size = out.element_size()
        return out.view(_INT[size]).numpy().view({1: np.uint8, 2: np.uint16, 4: np.uint32}[size])

    def _fma(self, x, y, z):
        r = x.data.astype(np.float64) * y.data.astype(np.float64) + z.data.astype(np.float64)
        return ti.TensorHandle(r.astype(np.float32), z.dtype.scalar)

    ti._convert_float = _convert_float
    ti.InterpreterBuilder.create_fma = _fma

    def tie_row(dtype):
        """128 values of one block whose x / s is exactly an E4M3 midpoint while x * fp32(1/s) is not:
        the divide form (DeepSeek) and the multiply form (DeepGEMM) give different codes on them."""
        e4 = torch.arange(0, 127, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
        mids = (e4[1:] + e4[:-1]) / 2
        for num in range(3, 64, 2):
            for e in range(-6, 4):
                s = torch.tensor(num * 2.0 ** e)
                amax = 448.0 * s
                if amax.to(dtype).float() != amax:
                    continue
                xs = mids * s
                ok = (xs.to(dtype).float() == xs) & (xs.to(dtype).float().isfinite())
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

    def adversarial(rows, k, dtype, seed):
        g = torch.Generator().manual_seed(seed)
        x = torch.randn(rows, k, generator=g) * torch.logspace(-3, 3, rows)[:, None]
        if rows >= 10 and k >= 256:
            x[0, :128] = 0.0                                       # zero block: amax clamped to 1e-4
            x[1, :128] = -0.0                                      # -0 stays -0 (code 0x80)
            x[2, :128] = 1e-30                                     # tiny block, clamped amax
            x[2, 128:256] = torch.tensor([1e-40, -1e-40] * 64)     # fp32 subnormals
            x[3, :128] = torch.linspace(-448.0, 448.0, 128)        # s = 1: ties of the E4M3 grid
            x[3, :8] = torch.tensor([448.0, 0.65625, -0.65625, 17.0, 232.0, -232.0, 0.0009765625, 0.0029296875])
            x[4, :128] = tie_row(dtype)                            # x / s on ties, x * (1/s) off them
            x[5, 3] = float("nan")                                 # NaN block: NaN scale, codes 0x7F
            x[5, 130] = -float("nan")
            x[6, 7] = float("inf")                                 # Inf block: scale Inf, codes +-0 / 0x7F
            x[6, 200] = -float("inf")
            x[7, :128] = torch.tensor([448.0, -448.0] * 64) * 7.1  # +-max
            x[8, :128] = torch.tensor([3.0e38, -3.3e38] * 64)      # huge fp32
            x[9, 5] = 5.0e-5                                       # amax below the clamp
        return x.to(dtype)

    def bits(t):
        return t.contiguous().view(_INT[t.element_size()])

    def storage(t):
        return torch.empty(0, dtype=t.dtype).set_(t.untyped_storage())

    def check(x, block=(1, 128), scale_fmt=None, layout="linear", what=""):
        r = R.quantize_fp8_block(x, block, scale_fmt)
        q = L.quantize_fp8_block(x, block, scale_fmt, layout)
        tag = f"{what} {tuple(x.shape)} {x.dtype} {block} {scale_fmt} {layout}"
        assert q.fmt == r.fmt and q.shape == r.shape and q.dtype == r.dtype and q.params == r.params, tag
        assert q.scale_layout == layout, tag
        for f in dataclasses.fields(q):  # every field as the reference's (the launcher copies a template)
            if f.name not in ("data", "scale", "scale_layout"):
                assert getattr(q, f.name) == getattr(r, f.name), (f.name, tag)
        assert q.params is not r.params
        assert q.data.dtype == r.data.dtype and q.data.shape == r.data.shape and q.data.is_contiguous(), tag
        assert torch.equal(bits(q.data), bits(r.data)), f"data {tag}: " + str(
            (bits(q.data) != bits(r.data)).nonzero()[:5].tolist())
        want = R.column_major_scales(r.scale) if layout == "column_major" else r.scale
        assert q.scale.shape == want.shape and q.scale.stride() == want.stride(), (
            tag, q.scale.shape, q.scale.stride(), want.stride())
        assert torch.equal(bits(q.scale), bits(want)), f"scale {tag}"
        if layout == "column_major":  # padding rows of the storage are zero, as column_major_scales
            assert torch.equal(bits(storage(q.scale)), bits(storage(want))), f"scale storage {tag}"
        for out in (torch.float32, torch.bfloat16, torch.float16):
            w = canonical_nan(R.dequantize_fp8_block(r, out), out)
            for src in ((r, q) if layout == "column_major" else (r,)):
                got = L.dequantize_fp8_block(src, out)
                assert got.shape == w.shape and got.dtype == out, tag
                assert torch.equal(bits(got), bits(w)), f"dequantize {out} {tag}: " + str(
                    (bits(got) != bits(w)).nonzero()[:5].tolist())
        return q

    bf, f16, f32 = torch.bfloat16, torch.float16, torch.float32
    n = 0
    # (1, 128): any leading dims, K not a multiple of 128, both scale formats, every input dtype
    for dt in (bf, f16, f32):
        for fmt in (None, "ue8m0"):
            check(adversarial(12, 300, dt, 1), scale_fmt=fmt, what="adversarial")
            n += 1
    check(adversarial(5, 200, bf, 2).reshape(5, 2, 100)[:, :, :].reshape(5, 200), what="2-D")
    check(adversarial(6, 260, f16, 3).reshape(2, 3, 260), scale_fmt="ue8m0", what="3-D")
    check(adversarial(1, 7, f32, 4), what="K < 128")
    check(adversarial(1, 7, f32, 4)[0], what="1-D")
    check(adversarial(3, 1024, bf, 5), what="wide K")
    check(adversarial(70, 128, bf, 6), what="tall, BLOCK_M 64")
    # non-contiguous inputs
    base = adversarial(12, 390, f32, 7)
    check(base[:, :300], what="row stride")                       # strided rows, no copy
    check(adversarial(260, 3, bf, 8).t(), what="transposed")      # last dim not contiguous: copied
    check(adversarial(12, 130, f16, 9).reshape(2, 2, 3, 130).permute(1, 0, 2, 3), what="4-D permuted")
    # column-major (MN-major, TMA-aligned) scales
    check(adversarial(12, 300, bf, 10), layout="column_major", what="adversarial")
    check(adversarial(5, 200, bf, 11), layout="column_major")
    check(adversarial(10, 130, f32, 12).reshape(2, 5, 130), scale_fmt="ue8m0", layout="column_major")
    check(adversarial(1, 128, f32, 13), layout="column_major", what="M=1")
    check(adversarial(8, 384, bf, 14), layout="column_major", what="M%4=0")
    check(adversarial(10, 130, bf, 15).reshape(5, 2, 130).transpose(0, 1), layout="column_major",
          what="3-D strided")
    # (128, 128)
    for dt in (bf, f16, f32):
        for fmt in (None, "ue8m0"):
            check(adversarial(130, 260, dt, 20), (128, 128), fmt, what="adversarial")
            n += 1
    check(adversarial(1, 5, f16, 21), (128, 128))
    check(adversarial(129, 128, f32, 22), (128, 128), "ue8m0")
    check(adversarial(150, 200, bf, 23).t(), (128, 128), what="transposed")
    check(adversarial(140, 300, f32, 24)[:, 10:270], (128, 128), what="row stride")
    # empty tensors: no launch, shapes as the reference
    check(torch.zeros(0, 128), what="empty")
    check(torch.zeros(3, 0), what="empty K")
    check(torch.zeros(0, 5), (128, 128), what="empty")

    # fp8_rowwise (per-token scale over the whole row, two passes of BLOCK_K columns)
    from lowbit.formats import fp8_rowwise as RR
    from lowbit.kernels import fp8_rowwise as LR

    def check_rowwise(x, what=""):
        r, q = RR.quantize_fp8_rowwise(x), LR.quantize_fp8_rowwise(x)
        tag = f"rowwise {what} {tuple(x.shape)} {x.dtype}"
        assert q.shape == r.shape and q.scale.shape == r.scale.shape and q.data.shape == r.data.shape, tag
        assert torch.equal(bits(q.data), bits(r.data)), f"data {tag}: " + str(
            (bits(q.data) != bits(r.data)).nonzero()[:5].tolist())
        assert torch.equal(bits(q.scale), bits(r.scale)), f"scale {tag}"

    for dt in (bf, f16, f32):
        x = adversarial(12, 300, dt, 30)
        x[10] = 0.0                                              # all-zero row: MIN_SCALE
        x[11] = 1e-30 if dt == f32 else 0.0
        check_rowwise(x, "adversarial")
        n += 1
    check_rowwise(adversarial(3, 2500, bf, 31), "K > BLOCK_K")
    check_rowwise(adversarial(6, 260, f16, 32).reshape(2, 3, 260)[:, :, ::2], "3-D strided")
    check_rowwise(torch.zeros(0, 64), "empty")
    print("ok", n)
''')


def test_kernels_match_reference_under_the_interpreter():
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True,
                          timeout=300, check=False)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-8000:]
    assert "ok" in proc.stdout


def test_sm90_ptx():
    """The instructions the interpreter models stand for: satfinite E4M3 cvt, IEEE div/fma, 16-byte access."""
    triton = pytest.importorskip("triton")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from lowbit.kernels import _fp8_block as k
    from lowbit.kernels import fp8_block

    variants = list(fp8_block.compile_variants())
    picked = [variants[0], variants[2], next(v for v in variants if v[0] is k.dequantize_fp8_block_kernel)]
    for fn, sig, consts in picked:
        full = dict(sig, **{n: "constexpr" for n in consts})
        # specialise as a launch with 16-byte aligned pointers and K, strides multiples of 16
        attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]]
                 for n in sig if sig[n].startswith("*") or n in ("K", "stride_xb", "stride_xm", "stride_xn")}
        ptx = triton.compile(ASTSource(fn=fn, signature=full, constexprs=consts, attrs=attrs),
                             target=GPUTarget("cuda", 90, 32)).asm["ptx"]
        assert "div.full" not in ptx and "div.approx" not in ptx and "rcp.approx" not in ptx
        assert "ld.global.v4" in ptx and "st.global.v4" in ptx, fn.__name__
        if fn is not k.dequantize_fp8_block_kernel:
            assert "cvt.rn.satfinite.e4m3x2.f32" in ptx
            assert "div.rn.f32" in ptx
        if fn is k.quantize_1x128_kernel:
            assert "fma.rn.f32" in ptx
