"""Tensor-core W4A16 GEMV (``gemv_w4`` with the ``_gemv_mma`` kernel: NVFP4 / MXFP4 weights with bf16 x, int4_awq
and NF4 with bf16 or fp16 x, M <= 16)
on the GPU. Against the fp64 reference of the decoded weight, the path is exact up to fp32 accumulation
order, so the errors are the bf16 output rounding; adversarial codes and scales (every E2M1 code incl. -0
and the subnormal 0.5, subnormal and maximal E4M3 scales, zero blocks, extreme E8M0 codes) are included."""

import pytest
import torch

import lowbit
from lowbit.formats.int4_awq import pack_awq
from lowbit.formats.qtensor import QTensor
from lowbit.kernels import gemv_w4 as G
from lowbit.kernels.gemv_mma_layout import mma_layout
from lowbit.kernels.gemv_prepack import prepare_w4
from lowbit.testing import linear_oracle

pytestmark = pytest.mark.gpu
ALL_M = {**G.MMA, "min_m": 1, "m1_min_weights": 0}  # the default leaves M = 1 on small weights to the FMA kernel


def _reference(x, q, bias=None, act=None):
    return linear_oracle(x, q, bias, act)


def _check(got, ref, what, rel=4e-3):
    got, ref = got.double(), ref.double()
    err = (got - ref).norm() / ref.norm().clamp_min(1e-300)
    peak = (got - ref).abs().max() / ref.abs().max().clamp_min(1e-300)
    assert err <= rel and peak <= 2e-2, f"{what}: rel {err:.2e} peak {peak:.2e}"


def _adversarial(fmt, n, k, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    data = torch.randint(0, 256, (n, k // 2), device="cuda", generator=g, dtype=torch.int32).to(torch.uint8)
    data[: n // 8] = 0x88 if seed % 2 else 0x11        # rows of -0 / of the subnormal 0.5
    if fmt == "nvfp4":
        pool = torch.tensor([0x01, 0x02, 0x07, 0x08, 0x30, 0x38, 0x40, 0x7E], device="cuda", dtype=torch.uint8)
        sc = pool[torch.randint(0, len(pool), (n, k // 16), device="cuda", generator=g)].view(torch.float8_e4m3fn)
        return QTensor(data=data, scale=sc, fmt="nvfp4", shape=(n, k), dtype=torch.bfloat16,
                       global_scale=torch.tensor([3.0], device="cuda"), params={"convention": "vllm"})
    pool = torch.tensor([60, 100, 120, 127, 130, 150, 191], device="cuda", dtype=torch.uint8)
    sc = pool[torch.randint(0, len(pool), (n, k // 32), device="cuda", generator=g)].view(torch.float8_e8m0fnu)
    return QTensor(data=data, scale=sc, fmt="mxfp4", shape=(n, k), dtype=torch.bfloat16,
                   params={"scale_rounding": "rceil"})


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
@pytest.mark.parametrize("n,k", [(4096, 4096), (100, 256), (6144, 4096), (1040, 8192)])
@pytest.mark.parametrize("m", [1, 2, 7, 8, 9, 16])
def test_mma_random_weights(fmt, n, k, m):
    w = torch.randn(n, k, device="cuda") * 0.05
    q = lowbit.quantize(w, fmt)
    p = prepare_w4(q)
    assert mma_layout(p) is not None
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    _check(G.gemv_w4(x, p, mma_config=ALL_M), _reference(x, q), f"{fmt} {n}x{k} M={m}")


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
@pytest.mark.parametrize("m", [1, 5, 16])
def test_mma_adversarial_codes_and_scales(fmt, m):
    q = _adversarial(fmt, 528, 1024, seed=m)
    x = torch.randn(m, 1024, device="cuda", dtype=torch.bfloat16)
    got = G.gemv_w4(x, q, mma_config=ALL_M)
    ref = _reference(x, q)
    _check(got, ref, f"{fmt} adversarial M={m}")
    # the FMA kernels decode the same codes independently
    other = G.gemv_w4(x, q, mma_config=False)
    _check(got, other.float(), f"{fmt} adversarial M={m} vs FMA kernel", rel=8e-3)


@pytest.mark.parametrize("act", [None, "gelu", "gelu_tanh", "silu"])
@pytest.mark.parametrize("m", [1, 12])
def test_mma_bias_activation_split_k(act, m):
    q = lowbit.quantize(torch.randn(1000, 8192, device="cuda") * 0.05, "nvfp4")
    x = torch.randn(m, 8192, device="cuda", dtype=torch.bfloat16)
    bias = torch.randn(1000, device="cuda", dtype=torch.bfloat16)
    for cfg in (ALL_M, {**ALL_M, "rg": 1, "j": 2, "ctas_per_sm": 16}, {**ALL_M, "rg": 8, "j": 8, "warps": 8},
                {**ALL_M, "rg": 4, "j": 4, "warps": 2, "ctas_per_sm": 1}):
        got = G.gemv_w4(x, q, bias, act, mma_config=cfg)
        _check(got, _reference(x, q, bias, act), f"act={act} M={m} cfg={cfg}")


def test_mma_same_weight_every_m():
    # one prepared weight, M changing between calls (launch plans are per M)
    q = lowbit.quantize(torch.randn(2048, 4096, device="cuda") * 0.05, "nvfp4")
    for m in (2, 4, 8, 9, 16, 3, 2):
        x = torch.randn(m, 4096, device="cuda", dtype=torch.bfloat16)
        _check(G.gemv_w4(x, q), _reference(x, q), f"M={m}")


def test_mma_repeated_calls_identical_and_graph_capturable():
    q = lowbit.quantize(torch.randn(4096, 4096, device="cuda") * 0.05, "nvfp4")
    x = torch.randn(3, 4096, device="cuda", dtype=torch.bfloat16)
    first = G.gemv_w4(x, q)
    for _ in range(10):
        assert torch.equal(G.gemv_w4(x, q), first)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = G.gemv_w4(x, q)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, first)


def test_mma_not_used_where_it_does_not_apply():
    # K not a multiple of 64, MXFP4 scale codes above 191, fp16 x: the FMA kernels run, still correct
    q = lowbit.quantize(torch.randn(256, 96, device="cuda"), "nvfp4")
    assert mma_layout(prepare_w4(q)) is None
    x = torch.randn(2, 96, device="cuda", dtype=torch.bfloat16)
    _check(G.gemv_w4(x, q), _reference(x, q), "K=96")
    q = _adversarial("mxfp4", 64, 256, seed=3)
    q.scale.view(torch.uint8)[0, 0] = 200
    assert mma_layout(prepare_w4(q)) is None
    x = torch.randn(2, 256, device="cuda", dtype=torch.bfloat16)
    _check(G.gemv_w4(x, q), _reference(x, q), "E8M0 code 200")


def test_default_routes_m1_by_weight_size():
    """M = 1 runs the tensor-core GEMV on weights of at least MMA["m1_min_weights"] elements and the FMA kernel
    below; both give the reference result."""
    cfg = {**G.MMA, "m1_min_weights": 4096 * 8192}
    q_small = lowbit.quantize(torch.randn(1024, 4096, device="cuda") * 0.05, "nvfp4")
    q_big = lowbit.quantize(torch.randn(4096, 8192, device="cuda") * 0.05, "mxfp4")
    for q, want_mma in ((q_small, False), (q_big, True)):
        p = prepare_w4(q)
        x = torch.randn(1, q.shape[1], device="cuda", dtype=torch.bfloat16)
        _check(G.gemv_w4(x, p, mma_config=cfg), _reference(x, q), f"{q.shape} M=1")
        used_mma = any(key[0] == 1 for key in mma_layout(p).plans)
        assert used_mma == want_mma, f"{q.shape}: tensor-core GEMV used at M=1: {used_mma}"


def test_graph_capture_of_split_k_launches_has_no_memset():
    """A captured split-K launch takes zeroed arrival counters from a pool made outside the capture (no memset
    node in the graph); replays, with eager calls on the same stream between them, stay exact."""
    from lowbit.kernels import scratch as _scratch

    q = lowbit.quantize(torch.randn(1024, 8192, device="cuda") * 0.05, "nvfp4")   # few row tiles: split-K
    p = prepare_w4(q)
    xs = [torch.randn(m, 8192, device="cuda", dtype=torch.bfloat16) for m in (1, 4, 16)]
    eager = [G.gemv_w4(x, p) for x in xs]
    plans = list(p.plans.values()) + list(mma_layout(p).plans.values())
    assert len(plans) == len(xs) and all(plan.split > 1 for plan in plans), [plan.split for plan in plans]
    dev = torch.cuda.current_device()
    chunk, start, _ = _scratch._GRAPH_POOL[dev]
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = [G.gemv_w4(x, p) for x in xs]
    assert _scratch._GRAPH_POOL[dev][0] is chunk
    used = _scratch._GRAPH_POOL[dev][1] - start
    assert used >= sum(plan.n_tiles for plan in plans), f"captured launches took {used} pooled counters"
    for _ in range(3):
        for o in outs:
            o.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        for o, e in zip(outs, eager):
            assert torch.equal(o, e)
        for x, e in zip(xs, eager):
            assert torch.equal(G.gemv_w4(x, p), e)


def _int4(n, k, group, seed, adversarial=False):
    """An int4_awq weight from random codes, zeros and fp16 scales; adversarial: codes and zeros at 0 and 15,
    subnormal, zero and large scales, a zero row."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    codes = torch.randint(0, 16, (k, n), device="cuda", generator=g, dtype=torch.int32)
    zeros = torch.randint(0, 16, (k // group, n), device="cuda", generator=g, dtype=torch.int32)
    scales = (torch.rand(k // group, n, device="cuda", generator=g) * 0.02 + 1e-3).half()
    if adversarial:
        codes[:, : n // 4] = 15 * (codes[:, : n // 4] % 2)            # only 0 and 15
        zeros[:, : n // 8] = 0
        zeros[:, n // 8: n // 4] = 15
        pool = torch.tensor([6e-8, 2.5e-5, 0.0, 1.0, 64.0], device="cuda", dtype=torch.float16)
        pick = torch.randint(0, len(pool), (k // group, n), device="cuda", generator=g)
        scales[:, n // 2:] = pool[pick][:, n // 2:]
        codes[:, n - 1] = 0
        zeros[:, n - 1] = 0                                              # a zero row
    return QTensor(data=pack_awq(codes), zeros=pack_awq(zeros), scale=scales.contiguous(), fmt="int4_awq",
                   shape=(n, k), dtype=torch.float16, params={"group_size": group})


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("group", [64, 128, 256])
@pytest.mark.parametrize("n,k", [(4096, 4096), (104, 512), (1040, 8192)])
@pytest.mark.parametrize("m", [1, 2, 7, 9, 16])
def test_mma_int4_random_weights(n, k, group, m, dtype):
    q = _int4(n, k, group, seed=n + k + group + m)
    p = prepare_w4(q)
    lay = mma_layout(p)
    assert lay is not None and lay.cpg == group // 64
    x = torch.randn(m, k, device="cuda", dtype=dtype)
    got = G.gemv_w4(x, p, mma_config=ALL_M)
    assert got.dtype == dtype
    _check(got, _reference(x, q), f"int4 g{group} {n}x{k} M={m} {dtype}")
    assert any(key[0] == m for key in lay.plans), "the tensor-core GEMV did not run"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("m", [1, 5, 16])
def test_mma_int4_adversarial(m, dtype):
    q = _int4(528, 1024, 128, seed=m, adversarial=True)
    x = torch.randn(m, 1024, device="cuda", dtype=dtype)
    got = G.gemv_w4(x, q, mma_config=ALL_M)
    _check(got, _reference(x, q), f"int4 adversarial M={m} {dtype}")
    other = G.gemv_w4(x, q, mma_config=False)
    _check(got, other.float(), f"int4 adversarial M={m} {dtype} vs FMA kernel", rel=8e-3)


@pytest.mark.parametrize("act", [None, "gelu", "silu"])
@pytest.mark.parametrize("m", [1, 12])
def test_mma_int4_bias_activation_split_k(act, m):
    q = _int4(1000, 8192, 128, seed=5)
    x = torch.randn(m, 8192, device="cuda", dtype=torch.float16)
    bias = torch.randn(1000, device="cuda", dtype=torch.float16)
    for cfg in (ALL_M, {**ALL_M, "rg": 1, "j": 2, "ctas_per_sm": 16}, {**ALL_M, "rg": 4, "j": 4, "warps": 2}):
        got = G.gemv_w4(x, q, bias, act, mma_config=cfg)
        _check(got, _reference(x, q, bias, act), f"int4 act={act} M={m} cfg={cfg}")


def test_mma_int4_not_used_for_small_groups():
    # a 64-column chunk must lie in one group: group 32 runs the FMA / dot kernels, still correct
    q = _int4(256, 512, 32, seed=1)
    assert mma_layout(prepare_w4(q)) is None
    x = torch.randn(4, 512, device="cuda", dtype=torch.bfloat16)
    _check(G.gemv_w4(x, q, mma_config=ALL_M), _reference(x, q), "int4 g32")


def _nf4(n, k, blocksize, dq, seed, adversarial=False, decades=30):
    """An nf4 weight from random data; adversarial: zero blocks, rows of one code (0 = -1.0, 15 = 1.0), absmax
    spanning 10^-decades .. 10^decades by block in the lower half of the rows."""
    from lowbit.formats.nf4 import quantize_nf4

    g = torch.Generator(device="cuda").manual_seed(seed)
    w = torch.randn(n, k, device="cuda", generator=g) * 0.05
    if adversarial:
        w[: n // 8, :blocksize] = 0
        w[n // 8: n // 4] = -1.0
        w[n // 4: n // 4 + 3] = 1.0
        scale = 10.0 ** torch.randint(-decades, decades + 1, (n, k // blocksize), device="cuda", generator=g).float()
        w[n // 2:] *= scale.repeat_interleave(blocksize, dim=1)[n // 2:]
    return quantize_nf4(w, blocksize=blocksize, double_quant=dq)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("blocksize,dq", [(64, False), (64, True), (128, True), (256, False)])
@pytest.mark.parametrize("n,k", [(4096, 4096), (104, 512), (1040, 8192)])
@pytest.mark.parametrize("m", [1, 2, 7, 9, 16])
def test_mma_nf4_random_weights(n, k, blocksize, dq, m, dtype):
    """NF4 levels are rounded to the mma operand type (bf16: 8 significant bits) and the fp32 absmax is applied
    per chunk after the mmas: a relative error of a few 1e-3 against the fp32 dequantization."""
    q = _nf4(n, k, blocksize, dq, seed=n + k + blocksize + m)
    p = prepare_w4(q)
    lay = mma_layout(p)
    assert lay is not None and lay.cpg == blocksize // 64
    x = torch.randn(m, k, device="cuda", dtype=dtype)
    got = G.gemv_w4(x, p, mma_config=ALL_M)
    assert got.dtype == dtype
    _check(got, _reference(x, q), f"nf4 b{blocksize} dq={dq} {n}x{k} M={m} {dtype}", rel=6e-3)
    assert any(key[0] == m for key in lay.plans), "the tensor-core GEMV did not run"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("dq", [False, True])
@pytest.mark.parametrize("m", [1, 5, 16])
def test_mma_nf4_adversarial(m, dq, dtype):
    # fp16 output holds about 10^-5 .. 10^4
    q = _nf4(528, 1024, 64, dq, seed=m, adversarial=True, decades=30 if dtype == torch.bfloat16 else 2)
    x = torch.randn(m, 1024, device="cuda", dtype=dtype)
    got = G.gemv_w4(x, q, mma_config=ALL_M).double()
    ref = _reference(x, q).double()
    # elementwise against the dot-product error bound sum_k |x w| (the absmax of a row's blocks spans up to 60
    # decades, so a norm over the whole output would only see the largest rows): level rounding (2^-9 in bf16)
    # plus the output rounding
    bound = x.double().abs() @ lowbit.dequantize(q, torch.float32).double().abs().T
    assert torch.isfinite(got).all()
    worst = float(((got - ref).abs() / bound.clamp_min(1e-300)).max())
    assert worst <= 8e-3, f"nf4 adversarial M={m} dq={dq} {dtype}: error {worst:.2e} of the bound"
    other = G.gemv_w4(x, q, mma_config=False).double()
    worst = float(((got - other).abs() / bound.clamp_min(1e-300)).max())
    assert worst <= 1.6e-2, f"vs the FMA / dot kernel: {worst:.2e} of the bound"


@pytest.mark.parametrize("act", [None, "gelu", "silu"])
@pytest.mark.parametrize("m", [1, 12])
def test_mma_nf4_bias_activation_split_k(act, m):
    q = _nf4(1000, 8192, 64, True, seed=7)
    x = torch.randn(m, 8192, device="cuda", dtype=torch.bfloat16)
    bias = torch.randn(1000, device="cuda", dtype=torch.bfloat16)
    for cfg in (ALL_M, {**ALL_M, "rg": 1, "j": 2, "ctas_per_sm": 16}, {**ALL_M, "rg": 4, "j": 4, "warps": 2}):
        got = G.gemv_w4(x, q, bias, act, mma_config=cfg)
        _check(got, _reference(x, q, bias, act), f"nf4 act={act} M={m} cfg={cfg}", rel=6e-3)


def test_mma_nf4_graph_capture_and_not_used_for_blocksize_32():
    q = _nf4(4096, 4096, 64, False, seed=3)
    p = prepare_w4(q)
    mma_layout(p)
    x = torch.randn(4, 4096, device="cuda", dtype=torch.bfloat16)
    first = G.gemv_w4(x, p)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = G.gemv_w4(x, p)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, first)
    q32 = _nf4(256, 512, 32, False, seed=1)
    assert mma_layout(prepare_w4(q32)) is None
    x = torch.randn(4, 512, device="cuda", dtype=torch.bfloat16)
    _check(G.gemv_w4(x, q32, mma_config=ALL_M), _reference(x, q32), "nf4 b32", rel=4e-3)


# --------------------------------------------------------------------- M > 16: blocks of x rows

ROW_BLOCKS = {**ALL_M, "max_m": G.MMA_MAX_M}   # blocks of up to MMA["block_rows"] (24) rows: 2 or 3 n-tiles
ROW_BLOCKS_16 = {**ROW_BLOCKS, "block_rows": 16}
ROW_BLOCKS_32 = {**ROW_BLOCKS, "block_rows": 32}  # up to 4 n-tiles


def _any_format(fmt, n, k, seed):
    if fmt == "int4_awq":
        return _int4(n, k, 128, seed=seed)
    if fmt == "nf4":
        return _nf4(n, k, 64, True, seed=seed)
    return lowbit.quantize(torch.randn(n, k, device="cuda") * 0.05, fmt)


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4", "int4_awq", "nf4"])
@pytest.mark.parametrize("m", [17, 24, 25, 32, 33, 48, 64])
def test_mma_row_blocks_random_weights(fmt, m):
    q = _any_format(fmt, 1040, 4096, seed=m)
    p = prepare_w4(q)
    x = torch.randn(m, 4096, device="cuda", dtype=torch.bfloat16)
    for cfg in (ROW_BLOCKS, ROW_BLOCKS_16, ROW_BLOCKS_32):
        got = G.gemv_w4(x, p, mma_config=cfg)
        _check(got, _reference(x, q), f"{fmt} M={m} block_rows={cfg['block_rows']}",
               rel=6e-3 if fmt == "nf4" else 4e-3)
    assert any(key[0] == m for key in mma_layout(p).plans), "the tensor-core GEMV did not run"


@pytest.mark.parametrize("fmt", ["nvfp4", "int4_awq", "nf4"])
def test_mma_fp16_x_and_row_blocks_of_24(fmt):
    """fp16 x (the post-scaled formats) and blocks of 3 n-tiles (block_rows 24: 40 rows as 24 + 16)."""
    q = _any_format(fmt, 520, 2048, seed=3)
    x = torch.randn(40, 2048, device="cuda", dtype=torch.bfloat16)
    cfg = {**ROW_BLOCKS, "block_rows": 24}
    _check(G.gemv_w4(x, q, mma_config=cfg), _reference(x, q), f"{fmt} M=40 block_rows=24", rel=6e-3)
    if fmt != "nvfp4":
        xh = x.half()
        _check(G.gemv_w4(xh, q, mma_config=cfg), _reference(xh, q), f"{fmt} fp16 M=40", rel=6e-3)


@pytest.mark.parametrize("m", [20, 40, 64])
def test_mma_row_blocks_bias_activation_split_k_row_scale(m):
    q = lowbit.quantize(torch.randn(1000, 8192, device="cuda") * 0.05, "nvfp4")
    x = torch.randn(m, 8192, device="cuda", dtype=torch.bfloat16)
    bias = torch.randn(1000, device="cuda", dtype=torch.bfloat16)
    rs = torch.rand(m, device="cuda") + 0.5
    for cfg in (ROW_BLOCKS, {**ROW_BLOCKS, "rg": 1, "j": 2, "ctas_per_sm": 16},
                {**ROW_BLOCKS, "rg": 4, "j": 4, "warps": 2, "ctas_per_sm": 1}):
        for act in (None, "silu"):
            got = G.gemv_w4(x, q, bias, act, mma_config=cfg)
            _check(got, _reference(x, q, bias, act), f"act={act} M={m} cfg={cfg}")
        ref = _reference(x, q).double() * rs.double()[:, None]
        _check(G.gemv_w4(x, q, mma_config=cfg, row_scale=rs), ref, f"per-row scale M={m} cfg={cfg}")


@pytest.mark.parametrize("m", [17, 32, 50])
def test_mma_row_blocks_gated(m):
    """[gate; up] with the gated epilogue: out is [M, N / 2], each block of rows at its place."""
    q = lowbit.quantize(torch.randn(2048, 4096, device="cuda") * 0.05, "nvfp4")
    x = torch.randn(m, 4096, device="cuda", dtype=torch.bfloat16)
    full = _reference(x, q).double()
    ref = torch.nn.functional.silu(full[:, :1024]) * full[:, 1024:]
    for cfg in (ROW_BLOCKS, {**ROW_BLOCKS, "ctas_per_sm": 16}):
        _check(G.gemv_w4(x, q, activation="silu_and_mul", mma_config=cfg), ref, f"gated M={m} cfg={cfg}")


@pytest.mark.parametrize("block_rows", [16, 24, 32])
def test_mma_row_blocks_equal_the_16_row_calls_without_split_k(block_rows):
    """Without split K every n-tile of 8 rows sums in the order of an M = 16 call on its rows, however many
    n-tiles share a block: the bits match."""
    q = lowbit.quantize(torch.randn(4096, 4096, device="cuda") * 0.05, "mxfp4")
    p = prepare_w4(q)
    cfg = {**ROW_BLOCKS, "ctas_per_sm": 1, "block_rows": block_rows}
    x = torch.randn(40, 4096, device="cuda", dtype=torch.bfloat16)
    got = G.gemv_w4(x, p, mma_config=cfg)
    parts = [G.gemv_w4(x[a:a + 16], p, mma_config=cfg) for a in (0, 16, 32)]
    assert all(plan.split == 1 for key, plan in mma_layout(p).plans.items())
    assert torch.equal(got, torch.cat(parts))
    assert torch.equal(G.gemv_w4(x[:32], p, mma_config=cfg), got[:32])


def test_mma_row_blocks_repeated_calls_identical_and_graph_capturable():
    q = lowbit.quantize(torch.randn(6144, 4096, device="cuda") * 0.05, "nvfp4")
    x = torch.randn(48, 4096, device="cuda", dtype=torch.bfloat16)
    cfg = {**ROW_BLOCKS, "ctas_per_sm": 8}
    first = G.gemv_w4(x, q, mma_config=cfg)
    for _ in range(10):
        assert torch.equal(G.gemv_w4(x, q, mma_config=cfg), first)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = G.gemv_w4(x, q, mma_config=cfg)
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, first)


def test_m_past_16_needs_the_tensor_core_gemv(monkeypatch):
    q = lowbit.quantize(torch.randn(256, 512, device="cuda") * 0.05, "nvfp4")
    x = torch.randn(17, 512, device="cuda", dtype=torch.bfloat16)
    monkeypatch.setitem(G.MMA, "row_blocks_max_m", {})
    with pytest.raises(ValueError, match="M=17 rows"):
        G.gemv_w4(x, q)                                   # without row blocks the tensor-core GEMV stops at 16
    monkeypatch.setitem(G.MMA, "row_blocks_max_m", G.ROW_BLOCKS_MAX_M)   # the default
    with pytest.raises(ValueError, match="M=17 rows"):
        G.gemv_w4(x, _int4(256, 512, 128, seed=1))        # int4 is not among the measured row-block formats
    assert G.row_blocks_apply(q, 17, torch.bfloat16) and not G.row_blocks_apply(q, 49, torch.bfloat16)
    _check(G.gemv_w4(x, q), _reference(x, q), "nvfp4 M=17, default MMA with the row-block limits")
    with pytest.raises(ValueError, match="M=17 rows"):
        G.gemv_w4(x.half(), q, mma_config=ROW_BLOCKS)     # fp16 x: no tensor-core GEMV for nvfp4
    with pytest.raises(ValueError, match="M=65 rows"):
        G.gemv_w4(torch.randn(65, 512, device="cuda", dtype=torch.bfloat16), q, mma_config=ROW_BLOCKS)
