"""The W4A16 GEMV kernels under ``TRITON_INTERPRET=1`` on tiny CPU tensors, against the fp32 reference.

The data are chosen so that every product and every partial sum is exact in fp32 (small dyadic x,
power-of-two scales, random 4-bit codes covering every code), so the kernel's fp32 accumulator equals the
reference bit for bit whatever the summation order; only the final cast may differ (the interpreter's
fp32 -> bf16 cast truncates, so a bf16 output may be the truncated value). That checks the indexing
(word/nibble order, chunk and scale-block mapping, row masking of a partial N tile, clamped x rows), the
split-K workspace/counter reduction and the epilogue (global scale, bias) exactly. Activations are checked
to a few output ulps. nf4's table levels are not dyadic: checked to one output ulp.

The interpreter cannot run inline asm, fp8 casts or bf16 ``tl.dot``: the launcher passes ``ON_GPU=False``
there (plain-Triton decode, fp32 ``tl.dot``). The GPU paths are covered by ``test_gemv_w4_gpu.py`` and the
sm_90 compile test.
"""

import os
import subprocess
import sys
import textwrap

import pytest
import torch

pytest.importorskip("triton")

SCRIPT = textwrap.dedent(
    """
    import time
    from dataclasses import replace
    import torch
    import lowbit
    from lowbit.formats import int4_awq as ref_awq
    from lowbit.formats.packing import swizzle_scales
    from lowbit.formats.qtensor import QTensor
    from lowbit.kernels import gemv_w4 as G
    from lowbit.kernels.gemv_prepack import prepare_w4
    from lowbit.testing import linear_oracle

    t_start = time.time()
    g = torch.Generator().manual_seed(0)
    # small tiles: several N tiles (the last one partial), several K iterations, split-K
    SMALL = {"fma_max_m": 4, "fma": {"bn": 16, "chunks": 2, "warps": 4, "stages": 2},
             "dot": {"bn": 16, "chunks": 1, "warps": 4, "stages": 2}, "ctas_per_sm": 8, "max_split": 4,
             "min_iters": 1, "ws_ratio": 64.0}
    NOSPLIT = dict(SMALL, max_split=1)
    DOT = dict(SMALL, fma_max_m=0)
    N, K = 24, 256

    def codes(*shape):
        return torch.randint(0, 256, shape, generator=g, dtype=torch.int32).to(torch.uint8)

    def pick(values, *shape):
        v = torch.tensor(values)
        return v[torch.randint(0, len(values), shape, generator=g)]

    def x_exact(m, dt):
        return pick([-2.0, -1.0, -0.5, 0.0, 0.5, 1.0, 2.0], m, K).to(dt)

    reference = linear_oracle

    def truncate(y, dt):
        if dt != torch.bfloat16:
            return y.to(dt)
        return (y.contiguous().view(torch.int32) >> 16).to(torch.int16).view(torch.bfloat16)

    n_calls = 0

    def check(q, m, dt, bias_dt=None, act=None, cfg=SMALL, exact=True, what=""):
        global n_calls
        n_calls += 1
        x = x_exact(m, dt)
        bias = None if bias_dt is None else pick([-1.0, -0.25, 0.0, 0.5, 3.0], N).to(bias_dt)
        got = G.gemv_w4(x, q, bias, act, config=cfg)
        assert got.shape == (m, q.shape[0]) and got.dtype == dt, (got.shape, got.dtype)
        ref = reference(x, q, bias, act)
        tag = f"{q.fmt} {what} M={m} {dt} bias={bias_dt} act={act}"
        if exact and act is None:
            ok = (got == ref.to(dt)) | (got == truncate(ref, dt))
            assert ok.all(), f"{tag}: {int((~ok).sum())} outputs differ, e.g. got {got[~ok][:4]} want {ref[~ok][:4]}"
        else:
            ulp = 2.0 ** (-7 if dt == torch.bfloat16 else -10)
            tol = (2 * ulp) * ref.abs() + 1e-3
            err = (got.float() - ref).abs()
            assert (err <= tol).all(), f"{tag}: max error {err.max().item()} at {err.argmax().item()}"

    def fp4_case(fmt):
        data = codes(N, K // 2)
        if fmt == "nvfp4":
            sc = pick([0x30, 0x38, 0x40, 0x48], N, K // 16).to(torch.uint8).view(torch.float8_e4m3fn)
            return QTensor(data=data, scale=sc, fmt="nvfp4", shape=(N, K), dtype=torch.bfloat16,
                           global_scale=torch.tensor([2.0]), params={"convention": "vllm"})
        if fmt == "mxfp4":
            sc = pick([125, 126, 127, 128, 129], N, K // 32).to(torch.uint8).view(torch.float8_e8m0fnu)
            return QTensor(data=data, scale=sc, fmt="mxfp4", shape=(N, K), dtype=torch.bfloat16,
                           params={"scale_rounding": "rceil"})
        sc = pick([0.25, 0.5, 1.0, 2.0], N, K // 32)
        return QTensor(data=data, scale=sc, fmt="fp4_b32", shape=(N, K), dtype=torch.bfloat16)

    def nf4_case(blocksize, dq):
        q = lowbit.quantize(torch.randn(N, K, generator=g), "nf4", blocksize=blocksize, double_quant=dq)
        data = codes(N * K // 2)
        if dq:
            return replace(q, data=data)
        return replace(q, data=data, scale=pick([0.5, 1.0, 2.0, 4.0], N * K // blocksize))

    def awq_case(group):
        ng = K // group
        qw = ref_awq.pack_awq(torch.randint(0, 16, (K, N), generator=g, dtype=torch.int32))
        qz = ref_awq.pack_awq(torch.randint(0, 16, (ng, N), generator=g, dtype=torch.int32))
        sc = pick([0.125, 0.25, 0.5, 1.0], ng, N).to(torch.float16)
        return QTensor(data=qw, scale=sc, fmt="int4_awq", shape=(N, K), dtype=torch.float16, zeros=qz,
                       params={"group_size": group})

    cases = [("nvfp4", fp4_case("nvfp4")), ("mxfp4", fp4_case("mxfp4")), ("fp4_b32", fp4_case("fp4_b32")),
             ("awq g32", awq_case(32)), ("awq g128", awq_case(128))]
    # the row-scale epilogue (lowbit.scaled_mm's decode route) and fp32 output: power-of-two factors keep
    # every value exact, so the result equals reference * factor bit for bit
    qn = fp4_case("nvfp4")
    for m, cfg in ((1, SMALL), (3, NOSPLIT), (5, SMALL)):
        x = x_exact(m, torch.bfloat16)
        bias = pick([-1.0, 0.5, 3.0], N)
        rows = pick([0.25, 0.5, 2.0, 4.0], m)
        ref = reference(x, qn, None, None)
        got = G.gemv_w4(x, qn, bias, config=cfg, row_scale=rows, out_dtype=torch.float32)
        assert got.dtype == torch.float32 and torch.equal(got, ref * rows[:, None] + bias), f"row_scale M={m}"
        got = G.gemv_w4(x, qn, config=cfg, row_scale=torch.tensor([0.5]), out_dtype=torch.float32)
        assert torch.equal(got, ref * 0.5), f"scalar row_scale M={m}"
        got = G.gemv_w4(x, qn, config=cfg, divide_by=torch.tensor([4.0]), out_dtype=torch.float32)
        assert torch.equal(got, ref / 4.0), f"divide_by M={m}"
        n_calls += 3

    for what, q in cases:
        assert G.supports(q) is None, (what, G.supports(q))
        check(q, 1, torch.bfloat16, what=what)                                  # FMA, split-K 4
        check(q, 2, torch.float16, torch.float16, what=what)                   # FMA MP=2 + bias
        check(q, 3, torch.bfloat16, torch.float32, cfg=NOSPLIT, what=what)     # FMA MP=4, clamped x row
        check(q, 5, torch.float16, torch.bfloat16, what=what)                  # dot (fp32 under interpreter)
        check(q, 16, torch.bfloat16, cfg=dict(NOSPLIT, fma_max_m=0), what=what)
        check(q, 1, torch.float16, cfg=DOT, what=what)                         # dot at M=1, split-K

    # nvfp4 variants: per_tensor_scale (torchao), single level, swizzled scales
    q = fp4_case("nvfp4")
    check(replace(q, global_scale=None, params={"convention": "torchao", "per_tensor_scale": 0.5}), 2,
          torch.bfloat16, torch.bfloat16, what="per_tensor_scale")
    check(replace(q, global_scale=None, params={"convention": "torchao"}), 1, torch.float16, what="single level")
    check(replace(q, scale=swizzle_scales(q.scale), scale_layout="swizzled"), 4, torch.bfloat16,
          what="swizzled")
    # nf4 (table levels are not dyadic: one output ulp)
    for bs, dq in ((64, False), (32, True), (128, True)):
        q = nf4_case(bs, dq)
        check(q, 1, torch.bfloat16, torch.bfloat16, exact=False, what=f"bs={bs} dq={dq}")
        check(q, 3, torch.float16, exact=False, what=f"bs={bs} dq={dq}")
        check(q, 7, torch.bfloat16, exact=False, what=f"bs={bs} dq={dq}")
    # epilogue: each activation, FMA and dot paths
    q = fp4_case("nvfp4")
    for act in ("gelu", "gelu_tanh", "silu"):
        check(q, 1, torch.bfloat16, torch.bfloat16, act, what="act")
        check(q, 6, torch.float16, None, act, what="act")
    # the split-K counters reset themselves: a second identical call gives the same bits
    x = x_exact(1, torch.bfloat16)
    a = G.gemv_w4(x, q, config=SMALL)
    b = G.gemv_w4(x, q, config=SMALL)
    assert torch.equal(a.view(torch.int16), b.view(torch.int16))
    # a non-contiguous x is copied, M = 0 gives an empty result
    xt = x_exact(4, torch.bfloat16).t().contiguous().t()
    assert torch.equal(G.gemv_w4(xt, q, config=SMALL).view(torch.int16),
                       G.gemv_w4(xt.contiguous(), q, config=SMALL).view(torch.int16))
    assert G.gemv_w4(torch.empty(0, K, dtype=torch.bfloat16), q).shape == (0, N)
    # the prepared layout is cached and re-made after an in-place update of the QTensor
    q = awq_case(64)
    p1 = prepare_w4(q)
    assert prepare_w4(q) is p1
    check(q, 1, torch.float16, what="awq g64")
    q.scale.mul_(2.0)
    assert prepare_w4(q) is not p1
    check(q, 1, torch.float16, what="awq g64 after in-place update")
    print(f"interpreter checks passed ({n_calls} calls, {time.time() - t_start:.1f} s)")
    """
)


def test_gemv_w4_under_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONWARNINGS="ignore")
    proc = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=300,
                          check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    assert "interpreter checks passed" in proc.stdout


# ------------------------------------------------------------------------------ argument checks (no launch)

def _nvfp4(n=64, k=128):
    import lowbit

    return lowbit.quantize(torch.randn(n, k), "nvfp4")


def test_supports_reasons():
    import lowbit
    from lowbit.kernels import gemv_w4 as G

    assert G.supports(_nvfp4()) is None
    assert "K must be a positive multiple of 32" in G.supports(_nvfp4(64, 48))
    assert "covers" in G.supports(lowbit.quantize(torch.randn(64, 128), "mxfp8_e4m3"))
    assert "2-D" in G.supports(lowbit.quantize(torch.randn(2, 64, 128), "nvfp4"))
    assert "group_size must be a multiple of 32" in G.supports(
        lowbit.quantize(torch.randn(64, 96).half(), "int4_awq", group_size=48))
    assert "blocksize" in G.supports(lowbit.quantize(torch.randn(64, 96), "nf4", blocksize=64))
    assert "QTensor" in G.supports(torch.zeros(3))


def test_bad_arguments_raise():
    from lowbit.kernels import gemv_w4 as G

    q = _nvfp4()
    x = torch.zeros(1, 128, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="K=64"):
        G.gemv_w4(torch.zeros(1, 64, dtype=torch.bfloat16), q)
    with pytest.raises(TypeError, match="bfloat16 or float16"):
        G.gemv_w4(x.float(), q)
    with pytest.raises(ValueError, match="M <= 16"):
        G.gemv_w4(torch.zeros(17, 128, dtype=torch.bfloat16), q)
    with pytest.raises(ValueError, match="2-D"):
        G.gemv_w4(torch.zeros(128, dtype=torch.bfloat16), q)
    with pytest.raises(ValueError, match="bias"):
        G.gemv_w4(x, q, bias=torch.zeros(63))
    with pytest.raises(ValueError, match="activation"):
        G.gemv_w4(x, q, activation="relu")
    with pytest.raises(ValueError, match="gemv_w4: K must"):
        G.gemv_w4(x, _nvfp4(64, 48))
    with pytest.raises(TypeError, match="row_scale must be a float32"):
        G.gemv_w4(x, q, row_scale=torch.ones(1, dtype=torch.float16))
    with pytest.raises(ValueError, match="1 or M = 1 elements"):
        G.gemv_w4(x, q, row_scale=torch.ones(3))
    with pytest.raises(ValueError, match="not both"):
        G.gemv_w4(x, q, row_scale=torch.ones(1), divide_by=torch.ones(1))
    with pytest.raises(ValueError, match="divide_by must have 1 element"):
        G.gemv_w4(torch.zeros(2, 128, dtype=torch.bfloat16), q, divide_by=torch.ones(2))
    with pytest.raises(TypeError, match="out_dtype"):
        G.gemv_w4(x, q, out_dtype=torch.int32)


GATED_SCRIPT = textwrap.dedent(
    """
    import torch
    import lowbit
    from lowbit.kernels import gemv_w4 as G
    from lowbit.kernels.gemv_prepack import gated_layout, gated_why_not, prepare_w4
    from lowbit.testing import linear_oracle

    g = torch.Generator().manual_seed(1)
    SMALL = {"fma_max_m": 4, "fma": {"bn": 16, "chunks": 2, "warps": 4, "stages": 2},
             "dot": {"bn": 32, "chunks": 1, "warps": 4, "stages": 2}, "ctas_per_sm": 8, "max_split": 4,
             "min_iters": 1, "ws_ratio": 64.0}
    NOSPLIT = dict(SMALL, max_split=1)
    K = 256
    calls = 0
    for fmt, opts in (("nvfp4", {}), ("mxfp4", {}), ("fp4_b32", {}), ("nf4", {"blocksize": 64}),
                      ("int4_awq", {"group_size": 64})):
        for n in (32, 80):                       # 2 and 5 blocks of 16 rows (a partial last dot tile)
            w = torch.randn(n, K, generator=g) * 0.1
            q = lowbit.quantize(w.half() if fmt == "int4_awq" else w, fmt, **opts)
            p = prepare_w4(q)
            assert gated_why_not(p) is None and gated_layout(p) is gated_layout(p)
            for m, cfg, act in ((1, SMALL, "silu_and_mul"), (3, NOSPLIT, "gelu_tanh_and_mul"),
                                (6, SMALL, "gelu_and_mul"), (16, NOSPLIT, "silu_and_mul")):
                for bias in (None, (torch.randn(n, generator=g) * 0.5).to(torch.bfloat16)):
                    x = torch.randn(m, K, generator=g).to(torch.bfloat16)
                    got = G.gemv_w4(x, q, bias, act, config=cfg)
                    ref = linear_oracle(x, q, bias, act)
                    assert got.shape == (m, n // 2), (fmt, got.shape)
                    # one gate/up mix-up moves an output by O(1) of its size; rounding stays near 2^-8
                    err = ((got.float() - ref).abs() / (ref.abs() + 0.05)).max().item()
                    assert err < 2e-2, (fmt, n, m, act, bias is not None, err)
                    calls += 1
    # rows that are not a multiple of 16 cannot be laid out gated: a clear error
    q = lowbit.quantize(torch.randn(40, K, generator=g), "nvfp4")
    try:
        G.gemv_w4(torch.randn(1, K).to(torch.bfloat16), q, None, "silu_and_mul")
    except ValueError as e:
        assert "multiple of 16" in str(e), e
    else:
        raise AssertionError("N = 40 was accepted")
    print(f"gated checks passed ({calls} calls)")
    """
)


def test_gated_gemv_under_interpreter():
    # the gated epilogue (act(gate) * up, the weight's rows interleaved in blocks of 8) on the FMA and dot
    # kernels, with and without split-K and bias, for every format, against the fp32 oracle of [gate; up]
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONWARNINGS="ignore")
    proc = subprocess.run([sys.executable, "-c", GATED_SCRIPT], env=env, capture_output=True, text=True,
                          timeout=600, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    assert "gated checks passed" in proc.stdout
