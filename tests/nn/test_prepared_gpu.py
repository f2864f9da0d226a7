"""Prepared QuantLinear on CUDA: the per-M GEMV runners give the bits lowbit.linear gives, for every W4A16
format, x dtype, bias and activation; misaligned and strided x; CUDA graphs; in-place weight updates and
load_state_dict re-prepare; torch.inference_mode and no_grad for every scheme at quantize and call time;
torch.compile (Inductor, fullgraph) launches the GEMV kernels from its generated code, equals eager, and does not
recompile per M within the GEMV regime.

The register-operand route (big tiles at M = 192..512, nvfp4 at M = 49..64, large layers) and the GEMV's blocks
of x rows (nvfp4 and mxfp4 at M = 17..48) through prepared layers, lowbit.linear and torch.compile.

Run on the device machine: ``python -m pytest -q -p no:cacheprovider tests/nn/test_prepared_gpu.py``.
"""

import pytest
import torch._dynamo.testing
import torch
from torch import nn

import lowbit
from lowbit.nn import SCHEMES, QuantLinear
from lowbit.ops.scaled_mm import scaled_linear

pytestmark = pytest.mark.gpu

W4A16 = [s for s in SCHEMES if SCHEMES[s].weight_only]
SCALED = [s for s in SCHEMES if not SCHEMES[s].weight_only]


def _bits(t):
    return t.view(torch.int16) if t.element_size() == 2 else t.view(torch.int32)


def _layer(scheme, n=384, k=512, bias=True, activation=None, seed=0, dtype=torch.bfloat16):
    torch.manual_seed(seed)
    lin = nn.Linear(k, n, bias=bias, device="cuda", dtype=dtype)
    return QuantLinear.from_linear(lin, scheme, activation=activation)


def _want(layer, x):
    w = layer.weight_qtensor
    b = None if layer.bias is None else layer.bias.to(x.dtype)
    if layer.scheme.weight_only:
        return lowbit.linear(x, w, b, layer.activation)
    y = scaled_linear(x, w, layer.scheme.act_format, act_options=dict(layer.scheme.act_options) or None,
                      act_global_scale=layer.input_global_scale, bias=b, out_dtype=x.dtype)
    from lowbit.ops.linear import apply_activation

    return apply_activation(y, layer.activation)


@pytest.mark.parametrize("scheme", W4A16)
@pytest.mark.parametrize("x_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bias, activation", [(True, None), (False, "silu"), (True, "gelu")])
def test_runner_bits_equal_linear(scheme, x_dtype, bias, activation):
    from lowbit.ops import policy

    layer = _layer(scheme, bias=bias, activation=activation, dtype=x_dtype)
    prep = layer._prepared
    # formats no W4A16 kernel reads (policy.DEQUANT_ONLY_FORMATS) get no GEMV layouts: dequantize + cuBLAS always
    dequant_only = policy.dequant_only(layer.weight_qtensor)
    assert prep is not None and (prep.gemv is None) == dequant_only, "prepared at construction on CUDA"
    for shape in [(1, 512), (3, 512), (16, 512), (2, 5, 512), (1, 1, 512), (17, 512), (300, 512), (2048, 512),
                  (2, 1100, 512)]:
        x = torch.randn(shape, device="cuda", dtype=x_dtype)
        got = layer(x)
        want = _want(layer, x)
        assert got.shape == want.shape == (*shape[:-1], 384)
        assert torch.equal(_bits(got), _bits(want)), (scheme, shape)
    if dequant_only:
        return
    # the GEMV regime and the tensor-core GEMM regime ran through runners (GemvRunner / GemmRunner)
    w = layer.weight_qtensor
    kinds = {"gemv_w4": "GemvRunner", "gemm_w4": "GemmRunner"}
    want_kinds = {}
    for m in (1, 3, 16, 10, 17, 300):
        path = policy.linear_decide(m, w.data.device, w, "auto", x_dtype)[0]
        if path in kinds:
            want_kinds[m] = kinds[path]
    assert {k[0]: type(r).__name__ for k, r in prep.runners.items()} == want_kinds
    # M = 17: the tensor-core GEMV's blocks of x rows where gemv_w4.MMA["row_blocks_max_m"] covers the format (and
    # x is bf16), the GEMM otherwise
    from lowbit.kernels.gemv_w4 import row_blocks_apply

    assert want_kinds[17] == ("GemvRunner" if row_blocks_apply(w, 17, x_dtype) else "GemmRunner")
    from lowbit.ops.linear import weight_chunks

    chunks = weight_chunks(w, torch.empty((), dtype=x_dtype).element_size())
    assert len(prep._chunks[x_dtype]) == len(chunks), "the dequantize-then-BLAS regime ran through prepared decodes"


@pytest.mark.parametrize("scheme", ["w4a16-nvfp4", "w4a16-int4"])
def test_misaligned_strided_x_and_bias_cast(scheme):
    layer = _layer(scheme)
    x = torch.randn(4, 512, device="cuda", dtype=torch.bfloat16)
    want = _want(layer, x)
    buf = torch.empty(4 * 512 + 1, device="cuda", dtype=torch.bfloat16)
    xm = buf[1:].view(4, 512)
    xm.copy_(x)
    assert torch.equal(layer(xm), want)
    xt = x.t().contiguous().t()
    assert torch.equal(layer(xt), want)
    layer.bias.data = layer.bias.float()  # an fp32 bias is cast to x's dtype per call
    assert torch.equal(layer(x), want)


@pytest.mark.parametrize("scheme", W4A16)
@pytest.mark.parametrize("m", [2, 64])  # the GEMV and the GEMM regime's runners
def test_cuda_graph_capture_and_replay(scheme, m):
    layer = _layer(scheme)
    x = torch.randn(m, 512, device="cuda", dtype=torch.bfloat16)
    layer(x)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        y = layer(x)
    x2 = torch.randn_like(x)
    x.copy_(x2)
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(y, _want(layer, x2))


def test_in_place_update_and_load_state_dict_re_prepare():
    layer = _layer("w4a16-int4")
    x = torch.randn(1, 512, device="cuda", dtype=torch.bfloat16)
    before = layer(x)
    with torch.no_grad():
        layer.weight_scale.mul_(2)
    after = layer(x)
    assert not torch.equal(after, before)
    assert torch.equal(after, _want(layer, x))
    other = _layer("w4a16-int4", seed=3)
    layer.load_state_dict(other.state_dict())
    assert torch.equal(layer(x), other(x))


@pytest.mark.parametrize("scheme", list(SCHEMES))
def test_inference_mode_and_no_grad(scheme):
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(512, 256), nn.GELU(), nn.Linear(256, 128)).cuda().to(torch.bfloat16)
    x = torch.randn(3, 512, device="cuda", dtype=torch.bfloat16)
    plain = lowbit.quantize_model(_copy(model), scheme, skip=())
    want = plain(x)
    with torch.inference_mode():
        q = lowbit.quantize_model(_copy(model), scheme, skip=())  # quantized inside inference_mode
        for m in (1, 3, 16, 40):
            xm = torch.randn(m, 512, device="cuda", dtype=torch.bfloat16)
            assert torch.equal(q(xm), plain(xm)), (scheme, m)
        assert torch.equal(plain(x), want)  # a layer made outside, called inside
    assert torch.equal(q(x), want)           # a layer made inside, called outside
    with torch.no_grad():
        assert torch.equal(q(x), want)
        q2 = lowbit.quantize_model(_copy(model), scheme, skip=())
        assert torch.equal(q2(x), want)


def _copy(model):
    import copy

    return copy.deepcopy(model)


@pytest.mark.parametrize("scheme", SCALED)
@pytest.mark.parametrize("bias, activation", [(True, None), (False, "silu")])
def test_scaled_schemes_unchanged(scheme, bias, activation):
    """Every call, first or repeated (the decode runners of fp8_block activations take the repeats), 2-D or
    3-D x, gives the bits of lowbit.ops.scaled_linear."""
    layer = _layer(scheme, n=256, k=512, bias=bias, activation=activation)
    for m in (1, 2, 16, 100):
        for rep in range(3):
            x = torch.randn(m, 512, device="cuda", dtype=torch.bfloat16)
            assert torch.equal(layer(x), _want(layer, x)), (scheme, m, rep)
        x3 = torch.randn(1, m, 512, device="cuda", dtype=torch.bfloat16)
        assert torch.equal(layer(x3), _want(layer, x3.reshape(m, 512)).reshape(1, m, 256)), (scheme, m)
    if layer.scheme.act_format in ("nvfp4", "mxfp4"):  # the GEMV route at decode: its runner
        assert type(layer._prepared.scaled_runners.get((1, torch.bfloat16, not bias))).__name__ == "GemvRouteDecode"
    if layer.scheme.act_format == "mxfp8_e4m3":  # lowbit's decoding GEMM at every M here: the MX runner
        assert type(layer._prepared.scaled_runners.get((1, torch.bfloat16, not bias))).__name__ == "MXDecode"
    if layer.scheme.act_format == "fp8_block":
        runners = layer._prepared.scaled_runners
        assert (1, torch.bfloat16, not bias) in runners, "the decode runner was not made"
        from lowbit.kernels import cublas_fp8_block

        if scheme == "w8a8-fp8-block" and cublas_fp8_block._unavailable(0) is None:
            assert type(runners.get((100, torch.bfloat16, not bias))).__name__ == "Fp8BlockLibraryGemm"
        if scheme in ("w8a8-fp8-block", "w4a8-mxfp4"):  # decode: the activation quantized in the GEMM, one launch
            for m in (1, 2, 16):
                assert type(runners.get((m, torch.bfloat16, not bias))).__name__ == "QuantInGemm", m
    # a model's decode calls a layer with 3-D x [B, 1, K] only: its calls get a runner too
    fresh = _layer(scheme, n=256, k=512, bias=bias, activation=activation)
    x3 = torch.randn(1, 1, 512, device="cuda", dtype=torch.bfloat16)
    for _ in range(2):
        assert torch.equal(fresh(x3), _want(fresh, x3.reshape(1, 512)).reshape(1, 1, 256)), scheme
    if layer.scheme.act_format in ("nvfp4", "mxfp4", "mxfp8_e4m3", "fp8_block"):
        assert (1, torch.bfloat16, not bias) in fresh._prepared.scaled_runners, "no runner for 3-D x"


@pytest.mark.parametrize("x_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bias, activation", [(True, None), (False, "gelu")])
@pytest.mark.parametrize("act_options", [{}, {"convention": "lightx2v"}, {"global_scale": 2.5}])
def test_nvfp4_dequant_runner_bits_equal_scaled_linear(x_dtype, bias, activation, act_options):
    """w4a4-nvfp4 at prefill / DiT sizes (the "dequant" route): the kept runner quantizes and decodes the
    activation in one pass and gives the bits of lowbit.ops.scaled_linear (quantize, then the route), 2-D and
    3-D x, repeated calls, adversarial rows, a CUDA graph replayed on new inputs."""
    import dataclasses

    from lowbit.nn.schemes import SCHEMES as ALL
    from lowbit.ops import policy

    scheme = dataclasses.replace(ALL["w4a4-nvfp4"], act_options=dict(act_options))
    torch.manual_seed(3)
    lin = nn.Linear(1024, 640, bias=bias, device="cuda", dtype=x_dtype)
    layer = QuantLinear.from_linear(lin, scheme, activation=activation)
    m = policy.DEQUANT_MM_MIN_M + 88
    xs = [_adversarial_rows(m, 1024, x_dtype) if i == 0 else torch.randn(m, 1024, device="cuda", dtype=x_dtype)
          for i in range(3)]
    for x in xs:
        assert torch.equal(_bits(layer(x)), _bits(_want(layer, x)))
    runner = layer._prepared.scaled_runners.get((m, x_dtype, not bias))
    assert type(runner).__name__ == "Nvfp4DequantGemm"
    # a derived global scale: the absmax pass and the weight's decoding in one launch (one chunk here)
    assert (runner.absmax_and_decode is not None) == ("global_scale" not in act_options)
    x3 = xs[1].reshape(2, m // 2, 1024)
    assert torch.equal(_bits(layer(x3)), _bits(_want(layer, xs[1]).reshape(2, m // 2, 640)))
    static_x = xs[0].clone()
    layer(static_x)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = layer(static_x)
    for x in xs:
        static_x.copy_(x)
        graph.replay()
        assert torch.equal(_bits(static_out), _bits(_want(layer, x)))


@pytest.mark.parametrize(("scheme", "runner_type"), [("w4a4-nvfp4", "GemvRouteDecode"),
                                                      ("w4a4-mxfp4", "GemvRouteDecode"),
                                                      ("w8a8-mxfp8", "MXDecode")])
def test_decode_runner_scratch_per_stream_and_graph(scheme, runner_type):
    """The decode runners keep their intermediates per stream: calls interleaved on two streams, calls whose
    outputs are kept alive, and a CUDA graph captured after eager calls (fresh, graph-owned scratch) and
    replayed between eager calls all give the bits of lowbit.ops.scaled_linear."""
    layer = _layer(scheme, n=256, k=512, bias=True)
    xs = [torch.randn(1, 512, device="cuda", dtype=torch.bfloat16) for _ in range(4)]
    wants = [_want(layer, x) for x in xs]
    layer(xs[0])
    runner = layer._prepared.scaled_runners.get((1, torch.bfloat16, False))
    assert type(runner).__name__ == runner_type
    outs = [layer(x) for x in xs]  # kept alive together: each call's output is its own
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        outs_side = [layer(x) for x in reversed(xs)]
    torch.cuda.current_stream().wait_stream(side)
    for got, want in zip(outs + outs_side[::-1], wants + wants, strict=True):
        assert torch.equal(got, want)
    assert len(runner.kept) == 2
    static_x = xs[0].clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = layer(static_x)
    for i, (x, want) in enumerate(zip(xs, wants, strict=True)):
        static_x.copy_(x)
        graph.replay()
        eager = layer(xs[(i + 1) % 4])  # an eager call between replays reuses the stream's scratch
        assert torch.equal(static_out, want)
        assert torch.equal(eager, wants[(i + 1) % 4])


def _adversarial_rows(m, k, dtype):
    """Random rows with an outlier channel, a zero block, +-max of the dtype, ties at the E4M3 grid, and NaN/Inf
    in the last row (its 128-blocks' scales become NaN/Inf)."""
    x = torch.randn(m, k, device="cuda", dtype=torch.float32)
    x[:, 3] *= 50
    if k >= 256:
        x[0, 128:256] = 0
    big = torch.finfo(dtype).max
    x[0, 5] = big
    x[-1, 7] = -big
    x[0, 9:17] = torch.tensor([1.0, 1.125, 1.0625, 3.5, -448.0, 0.001953125, -0.0, 2.75])
    if m > 1:
        x[-1, 1] = float("nan")
        x[-1, k - 1] = float("inf")
    return x.to(dtype)


@pytest.mark.parametrize("x_dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("scale_fmt", [None, "ue8m0"])
@pytest.mark.parametrize("k", [512, 544])  # 544: a masked last K block
@pytest.mark.parametrize("m, bias", [(1, True), (5, False), (16, True)])
@pytest.mark.parametrize("w_fmt", ["fp8_block", "mxfp4"])  # w8a8-fp8-block, w4a8-mxfp4
def test_quant_in_gemm_bits_equal_quantize_then_gemm(x_dtype, scale_fmt, k, m, bias, w_fmt):
    """The decode launch that quantizes x to fp8_block inside the GEMM gives the bits of the two launches
    (lowbit's quantize kernel, then the decoding GEMM) on random and adversarial rows, NaN/Inf included: the
    fp8_block decode kernel on fp8_block weights, the decoding GEMM with A_QUANT on mxfp4 weights."""
    from lowbit.kernels import scaled_mm as ksm

    torch.manual_seed(k + m)
    wf = torch.randn(384, k, device="cuda", dtype=torch.bfloat16)
    w = lowbit.quantize(wf, "fp8_block", block=(128, 128)) if w_fmt == "fp8_block" else lowbit.quantize(wf, "mxfp4")
    opts = {} if scale_fmt is None else {"scale_fmt": scale_fmt}
    x = _adversarial_rows(m, k, x_dtype)
    b = torch.randn(384, device="cuda", dtype=x_dtype) if bias else None
    a = lowbit.quantize(x, "fp8_block", block=(1, 128), **opts)
    route = ksm.KernelRoute(a, w, False, bias, x_dtype)
    run = route.quant_in_gemm(scale_fmt == "ue8m0")
    assert run is not None and run.minimal == (w_fmt == "fp8_block")
    for _ in range(2):  # the first launch compiles, the second runs the cached kernel directly
        got = run(x, b)
        want = scaled_linear(x, w, "fp8_block", act_options=opts or None, bias=b, out_dtype=x_dtype)
        torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)
    if m > 2:  # the rows between the adversarial first and last: close to the fp32 product of the operands
        ref = (lowbit.dequantize(a, torch.float32)[1:-1] @ lowbit.dequantize(w, torch.float32).T)
        if b is not None:
            ref = ref + b.float()
        err = ((got[1:-1].float() - ref).norm() / ref.norm()).item()
        assert err < 1e-2, err


# ------------------------------------------------------------------------------------------- torch.compile


class _MLP(nn.Module):
    def __init__(self, scheme):
        super().__init__()
        torch.manual_seed(0)
        self.up = QuantLinear.from_linear(nn.Linear(512, 1024, device="cuda", dtype=torch.bfloat16), scheme,
                                          activation="silu")
        self.down = QuantLinear.from_linear(nn.Linear(1024, 512, bias=False, device="cuda", dtype=torch.bfloat16),
                                            scheme)

    def forward(self, x):
        return self.down(self.up(x)) + x


def _compiled_mlp(scheme):
    """(model, its fullgraph torch.compile, Inductor's generated source of an M = 1 call); the call's output
    equals eager's."""
    from torch._inductor.utils import run_and_get_code

    torch._dynamo.reset()
    model = _MLP(scheme)
    cf = torch.compile(model, fullgraph=True)
    x = torch.randn(1, 512, device="cuda", dtype=torch.bfloat16)
    with torch.inference_mode():
        got, code = run_and_get_code(cf, x)
        assert torch.equal(got, model(x))
    return model, cf, "\n".join(code)


@pytest.mark.parametrize("scheme", ["w4a16-nvfp4", "w4a16-nf4", "w4a16-int4"])  # FP4, NF4 table, int4 layouts
def test_compile_inductor_launches_the_gemv_kernels(scheme):
    _model, _cf, src = _compiled_mlp(scheme)
    assert "lowbit.w4a16_gemv" not in src and "lowbit::w4a16_gemv" not in src, "the triton_op was traced into"
    assert "gemv_mma_kernel" in src or "gemv_w4_fma_kernel" in src or "gemv_w4_dot_kernel" in src


def test_compile_inductor_launches_the_fp8_block_decode_kernel():
    """w8a8-fp8-block under torch.compile (fullgraph): decode is the lowbit::fp8_block_decode triton_op, traced
    into, its kernel launched from Inductor's code with the activation quantized inside; the bits equal eager
    for every M of the regime, and M above it goes through the general op."""
    model, cf, src = _compiled_mlp("w8a8-fp8-block")
    assert "lowbit.fp8_block_decode" not in src and "lowbit::fp8_block_decode" not in src, "not traced into"
    assert "fp8_block_decode_kernel" in src
    with torch.inference_mode():
        for m in (2, 7, 16, 17, 64):
            xm = torch.randn(m, 512, device="cuda", dtype=torch.bfloat16)
            assert torch.equal(cf(xm), model(xm)), m


@pytest.mark.parametrize("scheme", ["w4a16-nvfp4"])
def test_compile_matches_eager_across_regimes_without_recompiling_per_m(scheme):
    torch._dynamo.reset()
    model = _MLP(scheme)
    counter = torch._dynamo.testing.CompileCounterWithBackend("inductor")
    cf = torch.compile(model, fullgraph=True, dynamic=True, backend=counter)
    with torch.inference_mode():
        for m in (2, 3, 5, 8, 9, 12, 16, 40, 64, 200):
            x = torch.randn(m, 512, device="cuda", dtype=torch.bfloat16)
            assert torch.equal(cf(x), model(x)), m
    # buckets: the GEMV regime splits at M = 4 (FMA vs dot kernel) and M = 8 (tensor-core tile), then M > 16
    assert counter.frame_count <= 5, counter.frame_count


@pytest.mark.parametrize("scheme", ["w4a16-int4", "w8a8-fp8-block"])
def test_compile_reduce_overhead(scheme):
    torch._dynamo.reset()
    model = _MLP(scheme)
    cf = torch.compile(model, mode="reduce-overhead", fullgraph=True)
    with torch.inference_mode():
        for _ in range(3):
            x = torch.randn(1, 512, device="cuda", dtype=torch.bfloat16)
            torch.compiler.cudagraph_mark_step_begin()
            assert torch.equal(cf(x).clone(), model(x))


@pytest.mark.parametrize("scheme, n, k, m, activation", [
    ("w4a16-nvfp4", 28672, 8192, 64, None), ("w4a16-nvfp4", 28672, 4096, 256, "silu"),
    ("w4a16-int4", 28672, 4096, 200, None), ("w4a16-mxfp4", 4096, 8192, 512, "gelu"),
    ("w4a16-nvfp4", 28672, 2048, 768, None), ("w4a16-nvfp4", 28672, 4096, 128, "gelu"),
    ("w4a16-nvfp4", 6144, 4096, 56, None), ("w4a16-mxfp4", 28672, 4096, 64, None),
    ("w4a16-int4", 28672, 4096, 128, "silu")])
def test_register_operand_route(scheme, n, k, m, activation):
    # where policy.register_operand_config takes the call (132-SM Hopper): the prepared layer and lowbit.linear
    # run gemm_w4_ra with the same config, the same bits; close to the fp32 reference; CUDA-graph replay
    from lowbit.ops import policy

    layer = _layer(scheme, n=n, k=k, activation=activation)
    w = layer.weight_qtensor
    path, _, facts = policy.linear_decide(m, w.data.device, w, "auto")
    assert path == "gemm_w4_ra", (path, policy.sm_count(w.data.device))
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    got = layer(x)
    assert layer._prepared._ra_configs[m] == facts[0]
    want = _want(layer, x)
    assert torch.equal(_bits(got), _bits(want))
    ref = lowbit.linear(x, w, layer.bias.to(x.dtype), activation, backend="torch").float()
    assert ((got.float() - ref).norm() / ref.norm()).item() < 1e-2
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        y = layer(x)
    x.copy_(torch.randn_like(x))
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(_bits(y), _bits(_want(layer, x)))


def test_register_operand_route_gated_and_misaligned():
    # a gated activation: the product, then the gating (as the other GEMM routes); a misaligned x is copied
    from lowbit.ops import policy
    from lowbit.ops.linear import apply_activation

    torch.manual_seed(0)
    w = lowbit.quantize(torch.randn(28672, 2048, device="cuda") * 0.05, "nvfp4")
    buf = torch.randn(256 * 2048 + 1, device="cuda", dtype=torch.bfloat16)
    x = buf[1:].view(256, 2048)
    assert policy.linear_decide(256, x.device, w, "auto")[0] == "gemm_w4_ra"
    got = lowbit.linear(x, w, activation="silu_and_mul")
    want = apply_activation(lowbit.linear(x.clone(), w), "silu_and_mul")
    assert got.shape == (256, 14336) and torch.equal(got, want)


@pytest.mark.parametrize("scheme", ["w4a16-nvfp4", "w4a16-mxfp4"])
def test_gemv_row_blocks_route(scheme, monkeypatch):
    """With the measured row-block limits (gemv_w4.ROW_BLOCKS_MAX_M), M = 17..48 with bf16 x: lowbit.linear, the
    prepared layer (a GemvRunner), a CUDA graph of it and its fullgraph torch.compile run the tensor-core GEMV in
    blocks of x rows, the same bits, close to the fp32 reference; fp16 x and M = 49 take the GEMM."""
    from lowbit.kernels import gemv_w4
    from lowbit.ops import policy

    monkeypatch.setitem(gemv_w4.MMA, "row_blocks_max_m", gemv_w4.ROW_BLOCKS_MAX_M)  # before the layer is prepared
    layer = _layer(scheme, n=1040, k=4096, activation="silu")
    w = layer.weight_qtensor
    for m in (17, 24, 32, 48):
        x = torch.randn(m, 4096, device="cuda", dtype=torch.bfloat16)
        plan = lowbit.ops.plan_linear(x, w)
        assert plan.path == "gemv_w4" and "blocks of x rows" in plan.reason, plan
        got = layer(x)
        assert type(layer._prepared.runners[(m, torch.bfloat16, False)]).__name__ == "GemvRunner"
        want = _want(layer, x)
        assert torch.equal(_bits(got), _bits(want)), m
        ref = lowbit.linear(x, w, layer.bias.to(x.dtype), "silu", backend="torch").float()
        assert ((got.float() - ref).norm() / ref.norm()).item() < 1e-2
        x3 = x.view(1, m, 4096)
        assert torch.equal(_bits(layer(x3)), _bits(want.view(1, m, -1)))
    assert policy.linear_decide(24, w.data.device, w, "auto", torch.float16)[0] != "gemv_w4"
    assert policy.linear_decide(49, w.data.device, w, "auto", torch.bfloat16)[0] != "gemv_w4"
    x = torch.randn(24, 4096, device="cuda", dtype=torch.bfloat16)
    want = _want(layer, x)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        y = layer(x)
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(_bits(y), _bits(want))
    torch._dynamo.reset()
    cf = torch.compile(layer, fullgraph=True)
    with torch.inference_mode():
        assert torch.equal(_bits(cf(x)), _bits(want))

