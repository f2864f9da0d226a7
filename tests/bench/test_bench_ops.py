"""The matmul ops of the registry (W4A16 ``lowbit.linear``, ``QuantLinear``, ``scaled_mm`` / ``scaled_linear``)
on CPU with the torch backend: every op is registered, sets up at tiny shapes with the bytes its formula says,
passes its tolerance check (and fails it on a wrong result), offers each baseline as a callable or a reason,
and runs through the runner with a fake timer (the timing itself needs CUDA)."""

import json

import pytest
import torch

import lowbit
from lowbit import bench
from lowbit.bench import common, envinfo
from lowbit.bench.registry import Context, Skip

CPU = Context(device="cpu", backend="torch", baselines=True, check=True)
TINY = (2, 128, 256)  # M, N, K: K a multiple of 128 (fp8_block), N of 128 (its 128x128 weight blocks)

W4A16 = ("nvfp4", "mxfp4", "fp4_b32", "nf4", "nf4.dq", "int4_awq")
PAIRS = ("fp8_block", "nvfp4", "mxfp4", "mxfp8", "mxfp6_mxfp8", "w4a8_mxfp4")
SCHEMES = ("w4a16-nvfp4", "w4a16-mxfp4", "w4a16-nf4", "w4a16-bnb-fp4", "w4a16-int4", "w4a16-fp4b32",
           "w8a8-fp8-block", "w4a4-nvfp4", "w4a4-mxfp4", "w4a8-mxfp4", "w8a8-mxfp8")
MATMUL_OPS = {
    *(f"linear.{f}.decode" for f in W4A16),
    *(f"linear.{f}.prefill" for f in W4A16 if f != "nf4"),
    *(f"qlinear.{s}" for s in SCHEMES),
    "qlinear.w4a4-nvfp4+fp8", "qlinear.w4a4-nvfp4+fp8-kept",
    *(f"scaled_mm.{p}.prefill" for p in PAIRS),
    *(f"scaled_mm.{p}.decode" for p in PAIRS),
    *(f"scaled_linear.{p}" for p in PAIRS),
}


def test_registry_lists_every_op():
    kinds = {"quantize", "dequantize"}
    others = {n for n in bench.REGISTRY if n.split(".")[0] not in kinds}
    assert others == MATMUL_OPS
    assert set(lowbit.SCHEMES) == set(SCHEMES), "a new scheme needs its qlinear op here"
    for name in MATMUL_OPS:
        op = bench.REGISTRY[name]
        assert op.baselines_everywhere and op.doc and op.nbytes is not None, name
        assert all(len(s) == 3 for s in op.shapes + op.quick_shapes), name
        assert set(op.quick_shapes) <= set(op.shapes), name
    assert set(bench.SUITES) == {"e2e", "dit", "offload", "tp", "gptq"}


def test_shapes_follow_the_regimes():
    assert {s[0] for s in bench.REGISTRY["linear.nvfp4.decode"].shapes} == {1, 16}
    assert {s[0] for s in bench.REGISTRY["linear.nvfp4.prefill"].shapes} == {33, 128, 1000, 4096}
    assert {s[0] for s in bench.REGISTRY["scaled_mm.nvfp4.decode"].shapes} == {1, 16, 64}
    prefill = bench.REGISTRY["scaled_mm.fp8_block.prefill"].shapes
    assert (4096, 7168, 2048) in prefill and (8192, 8192, 8192) in prefill and (4096, 8192, 8192) not in prefill


# by hand: the quantized operands, x and the bf16 output, each once
HAND_BYTES = {
    # nvfp4 4096^2: E2M1 8_388_608 + E4M3 scales 1_048_576 + global scale 4; x 1x4096 bf16, out 1x4096 bf16
    ("linear.nvfp4.decode", (1, 4096, 4096)): 8_388_608 + 1_048_576 + 4 + 8192 + 8192,
    # int4_awq group 128, [N=4096, K=4096]: qweight 4096*512*4, qzeros 32*512*4, fp16 scales 32*4096*2
    ("linear.int4_awq.prefill", (33, 4096, 4096)): 4096 * 512 * 4 + 32 * 512 * 4 + 32 * 4096 * 2
    + 33 * 4096 * 2 + 33 * 4096 * 2,
    # a: 4096x2048 e4m3 + 4096 x 16 fp32 scales; w: 7168x2048 e4m3 + 56 x 16 fp32 scales; out bf16
    ("scaled_mm.fp8_block.prefill", (4096, 7168, 2048)): 4096 * 2048 + 4096 * 16 * 4 + 7168 * 2048 + 56 * 16 * 4
    + 4096 * 7168 * 2,
    # fp8_rowwise a: 16x1536 e4m3 + 16 fp32 scales; mxfp4 w: 24576*1536/2 + E8M0 24576*48
    ("scaled_mm.w4a8_mxfp4.decode", (16, 24576, 1536)): 16 * 1536 + 16 * 4 + 24576 * 768 + 24576 * 48
    + 16 * 24576 * 2,
    # the fused entry reads the bf16 activation instead of a quantized one
    ("scaled_linear.nvfp4", (16, 4096, 7168)): 16 * 7168 * 2 + 4096 * 3584 + 4096 * 448 + 4 + 16 * 4096 * 2,
    # QuantLinear w8a8-fp8-block: fp8 weight 4096^2 + 32x32 fp32 block scales
    ("qlinear.w8a8-fp8-block", (1, 4096, 4096)): 4096 * 4096 + 32 * 32 * 4 + 8192 + 8192,
}


@pytest.mark.parametrize("name,shape", list(HAND_BYTES), ids=[n for n, _ in HAND_BYTES])
def test_bytes_by_hand(name, shape):
    assert bench.REGISTRY[name].nbytes(shape) == HAND_BYTES[(name, shape)]


@pytest.fixture(scope="module")
def cases():
    """Every matmul op set up once on CPU at TINY (baselines and check built)."""
    out = {}
    for name in sorted(MATMUL_OPS):
        try:
            out[name] = bench.REGISTRY[name].setup(TINY, CPU)
        except Skip as e:
            out[name] = e
    return out


@pytest.mark.parametrize("name", sorted(MATMUL_OPS))
def test_cpu_setup_runs_checks_and_counts(name, cases):
    case = cases[name]
    if isinstance(case, Skip):  # allowed by the harness, but every op here runs on CPU
        pytest.fail(f"{name} skipped on CPU: {case}")
    m, n, k = TINY
    op = bench.REGISTRY[name]
    assert case.bytes == op.nbytes(TINY) and case.flops == 2 * m * n * k
    out = case.fn()
    assert out.shape == (m, n) and out.dtype == torch.bfloat16
    said = case.check()
    assert said.startswith("rel_fro ") and "rel_max" in said, said
    assert case.graph is True and case.check_numel < m * n * k
    assert "cublas.bf16" in case.baselines
    for bname, b in case.baselines.items():
        assert callable(b) or (isinstance(b, str) and b), (name, bname)
    assert case.baselines["cublas.bf16"]().shape == (m, n)


def test_peer_baselines_named_per_format(cases):
    assert "bitsandbytes.matmul_4bit" in cases["linear.nf4.dq.decode"].baselines
    assert {"gemlite.A16Wn[int4]", "torchao.int4[tile_packed_to_4d]"} <= set(cases["linear.int4_awq.decode"].baselines)
    assert "gemlite.A16W4_MXFP" in cases["linear.mxfp4.prefill"].baselines
    assert "deep_gemm.fp8_gemm_nt" in cases["scaled_mm.fp8_block.prefill"].baselines
    assert "deep_gemm.fp8_gemm_nt" not in cases["scaled_mm.nvfp4.prefill"].baselines
    # off CUDA the FP8 cuBLASLt and Triton-only baselines say why instead of failing
    assert "CUDA" in cases["scaled_mm.nvfp4.decode"].baselines["torch._scaled_mm[fp8]"]
    # every W4A16 op and QuantLinear op also against per-tensor FP8 (cuBLASLt), as the scaled_mm ops
    for name in ("linear.nvfp4.decode", "linear.int4_awq.prefill", "qlinear.w4a16-nvfp4", "qlinear.w8a8-fp8-block"):
        assert "CUDA" in cases[name].baselines["torch._scaled_mm[fp8]"], name
    assert "CUDA" in cases["linear.nvfp4.prefill"].baselines["lowbit.gemm_w4"]
    assert "lowbit.linear+bias+gelu" not in cases["linear.nvfp4.decode"].baselines  # M = 1 only
    one = bench.REGISTRY["linear.nvfp4.decode"].setup((1, 128, 256), CPU)
    assert one.baselines["lowbit.linear+bias+gelu"]().shape == (1, 128)


def test_bnb_peer_runs_on_cpu(cases):
    pytest.importorskip("bitsandbytes")
    b = cases["linear.nf4.decode"].baselines["bitsandbytes.matmul_4bit"]
    if isinstance(b, str):
        pytest.skip(b)
    assert b().shape == (2, 128)


def test_the_check_fails_on_a_wrong_result(monkeypatch):
    """The gate: a kernel that computes the wrong thing fails its check (and reports no numbers)."""
    case = bench.REGISTRY["linear.nvfp4.decode"].setup(TINY, Context(device="cpu", backend="torch", baselines=False))
    real = lowbit.linear
    monkeypatch.setattr(lowbit, "linear", lambda x, w, *a, **kw: real(x, w, *a, **kw) * 1.05)
    with pytest.raises(AssertionError, match="rel_fro"):
        case.check()
    case = bench.REGISTRY["scaled_mm.mxfp4.prefill"].setup(TINY, Context(device="cpu", backend="torch", baselines=False))
    monkeypatch.setattr(lowbit, "scaled_mm", lambda a, b, **kw: torch.zeros(a.shape[0], b.shape[0], dtype=torch.bfloat16))
    with pytest.raises(AssertionError):
        case.check()


def test_close_bounds():
    ref = torch.randn(64, 64)
    assert common.close(ref.bfloat16(), ref).startswith("rel_fro ")
    with pytest.raises(AssertionError, match="shape"):
        common.close(ref[:32], ref)
    with pytest.raises(AssertionError, match="non-finite"):
        common.close(torch.full_like(ref, float("nan")), ref)
    with pytest.raises(AssertionError, match="must be <="):
        common.close(ref * 1.1, ref)
    fro, mx = common.rel_errors(ref * 1.01, ref)
    assert fro == pytest.approx(0.01, rel=1e-4) and mx == pytest.approx(0.01, rel=1e-3)


def test_rotating_and_copies():
    calls = []
    f = common.rotating([lambda i=i: calls.append(i) for i in range(3)])
    for _ in range(7):
        f()
    assert calls == [0, 1, 2, 0, 1, 2, 0]
    assert common.copies(1 << 30, "cpu") == 1  # no L2 to defeat off CUDA


def test_plan_times_cheap_baselines_at_every_shape():
    op = bench.REGISTRY["linear.nvfp4.decode"]
    planned = bench.plan([op])
    assert len(planned) == len(op.shapes) and all(b for *_, b in planned)
    assert not any(b for *_, b in bench.plan([op], baselines="none"))


def test_runner_on_cpu(tmp_path, fake_timer):
    ops = bench.select(["linear.nvfp4.decode", "scaled_mm.w4a8_mxfp4.prefill", "qlinear.w4a16-int4"])
    path = tmp_path / "r.json"
    result = bench.run(ops, shapes=[TINY], timer=fake_timer, device="cpu", backend="torch", json_path=path,
                       progress=None, header=envinfo.header())
    bench.validate(result)
    assert json.loads(path.read_text()) == json.loads(json.dumps(result, default=str))
    rows = {r["op"]: r for r in result["rows"]}
    assert [r["status"] for r in rows.values()] == ["ok"] * 3
    for row in rows.values():
        assert row["check"].startswith("rel_fro") and row["ms_graph"] == fake_timer.ms / 2
        assert row["TFLOPS"] == pytest.approx(2 * 2 * 128 * 256 / fake_timer.ms / 1e9)
        b = row["baselines"]["cublas.bf16"]
        assert b["speedup"] == pytest.approx(1.0) and b["speedup_graph"] == pytest.approx(1.0)
    assert rows["scaled_mm.w4a8_mxfp4.prefill"]["note"] == "route reference"
    text = bench.format_table(result)
    assert "tol" in text and "(graph 1.00x)" in text and "3 ok / 3 cases" in text
    ratios = bench.ratios(result)
    assert ratios["qlinear.w4a16-int4 2x128x256"]["vs cublas.bf16 [graph]"] == pytest.approx(1.0)


def test_runner_writes_the_json_after_every_case(tmp_path, fake_timer):
    """A run killed by a time limit keeps the cases it measured."""
    path = tmp_path / "r.json"
    seen = []

    def progress(line):
        if path.exists():
            seen.append(len(json.loads(path.read_text())["rows"]))

    bench.run(bench.select(["linear.mxfp4.decode", "linear.fp4_b32.decode"]), shapes=[TINY], timer=fake_timer,
              device="cpu", backend="torch", baselines="none", json_path=path, progress=progress,
              header=envinfo.header())
    assert seen == [1, 2]  # each case's row is on disk by the time its progress line is printed


@pytest.mark.parametrize("name", ["qlinear.w4a4-nvfp4+fp8", "qlinear.w4a4-nvfp4+fp8-kept"])
def test_fp8_compute_ops_run_the_fp8_mode(name):
    """From FP8_COMPUTE_MIN_M rows the op's layer is in the FP8 compute mode (kept weight or not), and its check
    holds it to the same mode on the PyTorch backend (the exact product would be off by the mode's error)."""
    from lowbit.ops.policy import FP8_COMPUTE_MIN_M

    shape = (FP8_COMPUTE_MIN_M, 128, 256)
    case = bench.REGISTRY[name].setup(shape, Context(device="cpu", backend="torch", baselines=False, check=True))
    assert "FP8 compute mode" in case.note
    assert case.check().startswith("rel_fro")
    assert set(bench.REGISTRY[name].shapes) >= {(32760, 5120, 5120), (8190, 13824, 5120), (32760, 5120, 13824)}
