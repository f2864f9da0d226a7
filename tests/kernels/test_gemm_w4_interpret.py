"""The W4A16 GEMM kernel under ``TRITON_INTERPRET=1`` on tiny CPU tensors (CI has no GPU).

What the interpreter can be trusted with here, and how each part is checked:

- The full kernel (tile order, row/column/K masking, scale and absmax indexing of every format and layout,
  split-K and its reduction, bias, global scale, activations) runs with **fp16** activations: the
  interpreter's fp16 ``tl.dot`` is a numpy fp32 matmul. Inputs are small integers and the weights' decoded
  values are short dyadic fractions, so the fp32 sums are exact and the output matches the fp32 reference
  rounded to fp16 (to 1 ulp where an activation's transcendental differs between numpy and torch).
- Its **bf16** ``tl.dot`` returns garbage, so the bf16 path is checked without it: a test-only kernel runs the
  same tile loaders and decoder (``_load_bytes``, ``_load_scales``, ``_decode_tile``) for bf16 and fp16 and
  stores the decoded tiles, which must equal ``lowbit.dequantize`` (bit for bit where the kernel's decode is
  exact: every FP4 format with one-byte scales, int4 in fp16; within 2 bf16 ulps where it rounds a scale).
- Inline asm (the NF4 table load, ``tanh.approx``) cannot run here: the launcher passes ``ON_GPU=False`` and
  the kernel uses ``tl.load`` and an exp-based tanh instead. wgmma itself is covered by the sm_90 compile
  test and the GPU tests.

The script starts with ``interpreter_compat.LOOP_BOUNDS`` (triton 3.6's interpreter and numpy >= 2.4 disagree
on runtime loop bounds).
"""

import os
import subprocess
import sys
import textwrap

import pytest
from interpreter_compat import LOOP_BOUNDS  # this folder's interpreter patch

pytest.importorskip("triton")

SCRIPT = LOOP_BOUNDS + textwrap.dedent(
    '''
    import torch
    import triton
    import triton.language as tl
    import lowbit
    from lowbit.formats.packing import swizzle_scales
    from lowbit.kernels import gemm_w4 as g
    from lowbit.testing import linear_oracle
    from lowbit.kernels._gemm_w4 import _decode_tile, _load_bytes, _load_scales, _u4_pairs
    from lowbit.kernels.device import e2m1_bits, e8m0_to

    gen = torch.Generator().manual_seed(0)
    failures = []
    n_checks = 0

    def ints(*shape, lo=-3, hi=4):
        return torch.randint(lo, hi, shape, generator=gen).float()

    def weight(n, k, fmt, **opts):
        """A QTensor whose decoded values are short dyadic fractions (exact fp32 sums)."""
        if fmt == "int4_awq":
            return lowbit.quantize(ints(n, k, lo=-8, hi=8) / 4, fmt, **opts)
        if fmt == "nf4":
            w = lowbit.quantize(torch.randn(n, k, generator=gen), fmt, **opts)
            return w
        # FP4: e2m1 values times power-of-two-ish scales
        return lowbit.quantize(ints(n, k, lo=-6, hi=7) / 2 * 2.0 ** ints(n, 1, lo=-2, hi=2), fmt, **opts)

    reference = linear_oracle

    def check(name, m, w, cfg, bias=False, act=None, exact=True):
        global n_checks
        n_checks += 1
        n, k = w.shape
        x = ints(m, k).half()
        b = ints(n).half() if bias else None
        out = g.gemm_w4(x, w, b, act, config=cfg)
        want = reference(x, w, b, act)
        if out.shape != (m, n) or out.dtype != torch.float16:
            failures.append(f"{name}: got {out.dtype}{tuple(out.shape)}")
            return
        want16 = want.half().float()
        err = (out.float() - want16).abs()
        if exact:
            # one fp16 rounding of (nearly) the same fp32 sum: at most an ulp apart
            tol = want16.abs() * 2.0 ** -10 + want.abs().max() * 2.0 ** -16
        else:
            tol = want.abs().max() * 2e-3 + 1e-3
        bad = err > tol
        if bad.any():
            i, j = bad.nonzero()[0].tolist()
            failures.append(f"{name}: {int(bad.sum())}/{bad.numel()} wrong, e.g. [{i},{j}] got {out[i, j].item()} "
                            f"want {want[i, j].item()}")

    def cfg(bm=16, bn=16, bk=32, gm=2, split=1, tma=True):
        # x is read through a TMA descriptor when its rows are 16-byte aligned (K % 8 == 0 in fp16), else
        # (or with tma=False) through pointers
        return dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, num_warps=4, num_stages=2, GROUP_M=gm, SPLIT_K=split,
                    X_TMA=tma)

    # --- FP4 formats: layouts, word/byte scale reads, edges ---------------------------------------------
    for fmt, opts in (("nvfp4", {}), ("nvfp4", {"scale_layout": "swizzled"}), ("mxfp4", {}),
                      ("mxfp4", {"scale_layout": "swizzled"}), ("fp4_b32", {})):
        for n, k, c in ((40, 128, cfg()), (48, 96, cfg()), (24, 256, cfg(bk=64)), (33, 192, cfg(bk=128, bn=32)),
                        (16, 64, cfg(bk=16))):
            if k % (16 if fmt == "nvfp4" else 32):
                continue
            opts2 = dict(opts)
            if fmt == "nvfp4":
                opts2["global_scale"] = 1.0
            w = weight(n, k, fmt, **opts2)
            check(f"{fmt} {opts} {n}x{k} bk={c['BLOCK_K']}", 37, w, c, exact=fmt != "fp4_b32")
    # nvfp4 global multiplier and torchao's exact divisor, epilogue on the fp32 accumulator
    w = weight(40, 128, "nvfp4", global_scale=4.0)
    check("nvfp4 S=4", 19, w, cfg(), bias=True)
    w = weight(40, 128, "nvfp4", convention="torchao", global_scale=0.5)
    check("nvfp4 torchao p", 19, w, cfg())
    w = weight(40, 128, "nvfp4")   # default S = 2688 / amax: 1/S rounds
    check("nvfp4 default S", 19, w, cfg(), exact=False)

    # --- nf4: absmax per tile row / several per row / straddling rows; double quant ----------------------
    for blocksize, n, k, c in ((64, 40, 128, cfg()), (32, 24, 128, cfg(bk=64)), (128, 16, 256, cfg(bk=64)),
                               (64, 20, 96, cfg()), (32, 9, 100, cfg(bk=32))):
        for dq in (False, True):
            w = weight(n, k, "nf4", blocksize=blocksize, double_quant=dq)
            check(f"nf4 bs={blocksize} dq={dq} {n}x{k}", 21, w, c, exact=False)

    # --- int4 (AutoAWQ): group sizes, groups smaller than and larger than BLOCK_K, K and N edges ---------
    for gs, n, k, c in ((32, 40, 128, cfg()), (64, 24, 128, cfg(bk=32)), (128, 16, 256, cfg(bk=64)),
                        (32, 48, 96, cfg(bk=64)), (48, 16, 96, cfg(bk=32))):
        w = weight(n, k, "int4_awq", group_size=gs)
        check(f"int4 g={gs} {n}x{k}", 23, w, c)

    # --- program order, split-K, epilogues ------------------------------------------------------------------
    w = weight(64, 128, "mxfp4")
    check("GROUP_M=3 many tiles", 70, w, cfg(bm=16, bn=16, gm=3))
    check("split-K 3", 18, w, cfg(bk=32, split=3), bias=True)
    for act in ("gelu", "gelu_tanh", "silu"):
        check(f"act {act}", 18, w, cfg(), bias=True, act=act, exact=False)
        check(f"act {act} split", 18, w, cfg(split=2), act=act, exact=False)
    w = weight(64, 128, "int4_awq", group_size=64)
    check("int4 bias", 5, w, cfg(bm=16), bias=True)
    # x through pointers (masked rows and K tail) instead of TMA
    check("int4 no TMA", 37, weight(40, 96, "int4_awq", group_size=32), cfg(bk=64, tma=False))
    check("nvfp4 no TMA", 37, weight(40, 128, "nvfp4", global_scale=1.0), cfg(tma=False), bias=True)

    # --- default configuration path (choose_config) on a small problem --------------------------------------
    w = weight(64, 256, "nvfp4", global_scale=1.0)
    x = ints(3, 256).half()
    got = g.gemm_w4(x, w)
    want = reference(x, w, None, None).half()
    n_checks += 1
    if not torch.equal(got, want):
        failures.append("default config")

    # --- decoded tiles (fp16) and the bf16 bit patterns (no tl.dot) --------------------------------------------
    @triton.jit
    def decode_kernel(w_ptr, s_ptr, z_ptr, nested_ptr, offset_ptr, lut_ptr, dmap_ptr, out_ptr, N, K,
                      stride_wn, stride_sn, s_cols4,
                      FMT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP: tl.constexpr,
                      SCALE_SWIZZLED: tl.constexpr, SCALE_WORDS: tl.constexpr, DOUBLE_QUANT: tl.constexpr,
                      NF4_MODE: tl.constexpr, EVEN_K: tl.constexpr):
        offs_n = (tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)) % N
        k0 = tl.program_id(1) * BLOCK_K
        if FMT == 3:
            rows = offs_n.to(tl.int64) * (K // 2)
        else:
            rows = offs_n.to(tl.int64) * stride_wn
        b = _load_bytes(w_ptr, rows, k0, K, BLOCK_K, EVEN_K, 0x77 if FMT == 3 else 0)
        sa, sb = _load_scales(s_ptr, z_ptr, nested_ptr, offs_n, k0, K, stride_sn, s_cols4, FMT, BLOCK_K, GROUP,
                              SCALE_SWIZZLED, SCALE_WORDS, DOUBLE_QUANT, NF4_MODE, EVEN_K)
        w = _decode_tile(b, sa, sb, offset_ptr, lut_ptr, dmap_ptr, FMT, GROUP, DOUBLE_QUANT, NF4_MODE,
                         tl.float16, False)
        n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        kk = k0 + tl.arange(0, BLOCK_K)
        tl.store(out_ptr + n[:, None] * K + kk[None, :], w, mask=(n < N)[:, None] & (kk < K)[None, :])

    def check_decode(name, w, bk, exact):
        global n_checks
        n_checks += 1
        n, k = w.shape
        args, consts = g._format_args(w, torch.device("cpu"), torch.float16)
        if w.fmt == "nf4":
            consts["NF4_MODE"] = g._nf4_mode(k, consts["GROUP"], bk)
        consts.pop("GSCALE_MODE")
        got = torch.zeros(n, k, dtype=torch.float16)
        bn = 16
        decode_kernel[(triton.cdiv(n, bn), triton.cdiv(k, bk))](
            *args[:7], got, n, k, *args[8:], BLOCK_N=bn, BLOCK_K=bk, EVEN_K=k % bk == 0, **consts)
        want = lowbit.dequantize(w, torch.float32)
        if exact:
            ok = torch.equal(got, want.half())
        else:
            # the kernel rounds the scale (the NF4 level, the absmax) to fp16, then the product
            ok = bool(((got.float() - want).abs() <= want.abs() * 2.0 ** -9 + 2.0 ** -24).all())
        if not ok:
            d = (got.float() - want).abs().argmax().item()
            failures.append(f"decode {name}: e.g. flat {d} got {got.view(-1)[d].item()} want {want.view(-1)[d].item()}")

    rnd = lambda n, k: torch.randn(n, k, generator=gen) * 0.1
    # global scale 1: the kernel applies 1/S to the accumulator, not to the decoded tile
    one = {"global_scale": 1.0}
    check_decode("nvfp4", lowbit.quantize(rnd(40, 128), "nvfp4", **one), 64, True)
    check_decode("nvfp4 swizzled", lowbit.quantize(rnd(40, 128), "nvfp4", scale_layout="swizzled", **one), 32, True)
    check_decode("nvfp4 odd groups", lowbit.quantize(rnd(24, 80), "nvfp4", **one), 32, True)
    check_decode("mxfp4", lowbit.quantize(rnd(40, 256), "mxfp4"), 64, True)
    check_decode("mxfp4 swizzled bk128", lowbit.quantize(rnd(40, 256), "mxfp4", scale_layout="swizzled"), 128, True)
    check_decode("fp4_b32", lowbit.quantize(rnd(40, 128), "fp4_b32"), 64, False)
    for bs, dq in ((64, False), (64, True), (32, True), (128, False)):
        check_decode(f"nf4 bs={bs} dq={dq}", lowbit.quantize(rnd(40, 128), "nf4", blocksize=bs, double_quant=dq),
                     64, False)
    check_decode("nf4 straddling", lowbit.quantize(rnd(9, 100), "nf4", blocksize=64), 32, False)
    for gs in (32, 128):
        # (q - z) * s rounds once in fp16, as the reference's fp16 multiply
        check_decode(f"int4 g={gs}", lowbit.quantize(rnd(40, 256).half(), "int4_awq", group_size=gs), 64, True)

    # bf16 arithmetic is broken in the interpreter (bf16 x bf16 products, bf16 subnormals read as 0), so the
    # bf16 decode is checked on its integer part, exhaustively: every byte's two E2M1 and two INT4 patterns
    # and every E8M0 scale; the float multiplies are the fp16 path's with another dtype
    @triton.jit
    def bits_kernel(b_ptr, out_ptr, WHICH: tl.constexpr, DT: tl.constexpr):
        i = tl.arange(0, 256)[None, :]
        b = tl.load(b_ptr + i)
        if WHICH == 0:
            r = e2m1_bits(b, DT)
        elif WHICH == 1:
            # MAGIC + q as 16-bit patterns, element 2i at the even columns
            r = tl.reshape(_u4_pairs(b, DT).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF, (256, 2))
            lo, hi = tl.split(r)
            r = lo[None, :] | (hi[None, :] << 16)
        else:
            r = e8m0_to(b, DT).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
        tl.store(out_ptr + i, r)

    from lowbit.formats.codecs import decode_minifloat
    from lowbit.formats.spec import E2M1
    byte = torch.arange(256, dtype=torch.int32)
    e2m1 = lambda c: decode_minifloat(c.to(torch.uint8), E2M1).double()
    for dt, tdt, pow2, magic in ((tl.bfloat16, torch.bfloat16, 2.0 ** 126, 128.0), (tl.float16, torch.float16, 2.0 ** 14, 1024.0)):
        halves = lambda r: ((r & 0xFFFF).to(torch.int16).view(tdt).double(), ((r >> 16) & 0xFFFF).to(torch.int16).view(tdt).double())
        for which in range(3):
            n_checks += 1
            r = torch.zeros(256, dtype=torch.int32)
            bits_kernel[(1,)](byte, r, which, dt)
            if which == 0:
                lo, hi = halves(r)
                ok = torch.equal(lo * pow2, e2m1(byte & 15)) and torch.equal(hi * pow2, e2m1(byte >> 4))
            elif which == 1:
                lo, hi = halves(r)
                ok = torch.equal(lo, magic + (byte & 15).double()) and torch.equal(hi, magic + (byte >> 4).double())
            else:
                want = torch.exp2(byte.double() - 127).to(tdt)
                want[255] = float("nan")
                got = r.to(torch.int16).view(tdt)
                ok = torch.equal(got[:255], want[:255]) and bool(got[255].isnan())
            if not ok:
                failures.append(f"bit patterns {which} {tdt}")

    # the prepared layer's runner (the plan decided once, kept launches) gives gemm_w4's bits: default tiles
    # and an explicit config, split-K, bias and activation, every format
    for fmt, opts in (("nvfp4", {"global_scale": 4.0}), ("mxfp4", {}), ("fp4_b32", {}), ("int4_awq", {}),
                      ("nf4", {"double_quant": True})):
        n_checks += 1
        w = weight(40, 128, fmt, **opts)
        x = ints(37, 128).half()
        b = ints(40).half()
        for cfg_, bias_, act_ in ((cfg(), None, None), (cfg(split=2), b, "silu"), (cfg(tma=False), b, "gelu")):
            want = g.gemm_w4(x, w, bias_, act_, config=cfg_)
            got = torch.empty_like(want)
            g.GemmPlan(w, 37, x.device, x.dtype, act_, cfg_).launch(x, bias_, got)
            run = g.GemmRunner(w, 37, torch.float16, act_)
            got2, want2 = run(x, bias_), g.gemm_w4(x, w, bias_, act_)
            if not (torch.equal(got.view(torch.int16), want.view(torch.int16))
                    and torch.equal(got2.view(torch.int16), want2.view(torch.int16))):
                failures.append(f"runner {fmt} {cfg_} {act_}")

    if failures:
        print("\\n".join(failures))
        raise SystemExit(1)
    print(f"interpreter checks passed ({n_checks})")
    '''
)


def test_gemm_w4_under_interpreter(tmp_path):
    script = tmp_path / "gemm_w4_interpret.py"
    script.write_text(SCRIPT)
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONWARNINGS="ignore")
    proc = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=300,
                          check=False)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-6000:]
    assert "interpreter checks passed" in proc.stdout


def test_int4_prelayout_and_cache_cpu():
    """The int4 pre-layout (plain torch) holds the AutoAWQ codes transposed, and the per-weight cache keys on
    the weight's tensors: a QTensor rebuilt from them hits, an in-place change of them rebuilds."""
    from dataclasses import replace

    import torch

    import lowbit
    from lowbit.formats import int4_awq as ref_awq
    from lowbit.kernels import gemm_w4 as g

    gen = torch.Generator().manual_seed(1)
    w = lowbit.quantize(torch.randn(48, 2112, generator=gen).half(), "int4_awq", group_size=64)
    codes, sz = g.prelayout_int4_awq(w)
    q, z = ref_awq.int4_awq_codes(w)                       # int32 [K, N], [K/g, N]
    assert torch.equal((codes & 15).int(), q[0::2].t()) and torch.equal((codes >> 4).int(), q[1::2].t())
    assert torch.equal(sz >> 16, z.t()) and torch.equal((sz & 0xFFFF).to(torch.int16), w.scale.view(torch.int16).t())
    assert g.prelayout_int4_awq(replace(w))[0] is codes
    w.scale.mul_(2)
    codes2, sz2 = g.prelayout_int4_awq(w)
    assert codes2 is not codes and torch.equal((sz2 & 0xFFFF).to(torch.int16), w.scale.view(torch.int16).t())
    # during a CUDA-graph capture a layout serves that call only (its memory is the graph's): nothing is kept
    w2 = lowbit.quantize(torch.randn(48, 2112, generator=gen).half(), "int4_awq", group_size=64)
    capturing = torch.cuda.is_current_stream_capturing, torch.cuda.is_available
    torch.cuda.is_current_stream_capturing, torch.cuda.is_available = (lambda: True), (lambda: True)
    try:
        first = g.prelayout_int4_awq(w2)[0]
        assert g.prelayout_int4_awq(w2)[0] is not first
    finally:
        torch.cuda.is_current_stream_capturing, torch.cuda.is_available = capturing
    kept = g.prelayout_int4_awq(w2)[0]
    assert g.prelayout_int4_awq(w2)[0] is kept
    # a layout kept before the capture is what the capture uses (no rebuild on every replay)
    torch.cuda.is_current_stream_capturing, torch.cuda.is_available = (lambda: True), (lambda: True)
    try:
        assert g.prelayout_int4_awq(w2)[0] is kept
    finally:
        torch.cuda.is_current_stream_capturing, torch.cuda.is_available = capturing


def test_input_errors_cpu():
    """Bad inputs are refused before any launch (no GPU needed)."""
    import torch

    import lowbit
    from lowbit.kernels import gemm_w4 as g

    w = lowbit.quantize(torch.randn(64, 128), "nvfp4")
    x = torch.randn(4, 128, dtype=torch.bfloat16)
    assert g.supports(w) is None
    assert "format" in g.supports(lowbit.quantize(torch.randn(64, 128), "mxfp8_e4m3"))
    assert "odd" in g.supports(lowbit.quantize(torch.randn(4, 33), "nf4"))
    assert "multiple of 16" in g.supports(lowbit.quantize(torch.randn(8, 96).half(), "int4_awq", group_size=24))
    for kwargs, exc in ((dict(x=x[:, :64]), ValueError), (dict(x=x.float()), TypeError),
                        (dict(activation="relu"), ValueError), (dict(bias=torch.zeros(63)), ValueError),
                        (dict(x=x[0]), ValueError), (dict(bias=torch.zeros(64, dtype=torch.int32)), TypeError)):
        args = dict(x=x, w=w, bias=None, activation=None)
        args.update(kwargs)
        with pytest.raises(exc):
            g.gemm_w4(**args)
