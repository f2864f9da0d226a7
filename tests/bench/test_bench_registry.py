"""The op registry: every format's ops are there with their shapes, byte counts are right (by hand for one
shape each, and equal to the bytes of the tensors a CPU setup really makes), selection and plans."""

import math

import pytest
import torch

import lowbit
from lowbit import bench
from lowbit.bench import quant
from lowbit.bench.registry import Case, Context, Op

SQ = [(4096, 4096), (8192, 8192), (16384, 16384)]
ACT = [(1, 7168), (16, 7168), (4096, 7168)]
BF16_4096 = 4096 * 4096 * 2  # 33_554_432: the bf16 input (quantize) or output (dequantize) at 4096^2

# op -> (shape, bytes computed by hand): input read once + output written once
HAND_BYTES = {
    # E2M1 data n/2 = 8_388_608, E4M3 scales n/16 = 1_048_576, fp32 global scale 4
    "quantize.nvfp4": ((4096, 4096), BF16_4096 + 8_388_608 + 1_048_576 + 4),
    "quantize.nvfp4.gs": ((4096, 4096), BF16_4096 + 8_388_608 + 1_048_576 + 4),
    # swizzled scales [round_up(4096,128), round_up(256,4)] = the same 1_048_576 bytes here
    "quantize.nvfp4.swizzled": ((4096, 4096), BF16_4096 + 8_388_608 + 4096 * 256 + 4),
    # MX: data n*bits/8, E8M0 scales n/32 = 524_288
    "quantize.mxfp4": ((4096, 4096), BF16_4096 + 8_388_608 + 524_288),
    "quantize.mxfp6_e2m3": ((4096, 4096), BF16_4096 + 12_582_912 + 524_288),
    "quantize.mxfp6_e3m2": ((4096, 4096), BF16_4096 + 12_582_912 + 524_288),
    "quantize.mxfp8_e4m3": ((4096, 4096), BF16_4096 + 16_777_216 + 524_288),
    "quantize.mxfp8_e5m2": ((4096, 4096), BF16_4096 + 16_777_216 + 524_288),
    # fp32 scale per 32 elements: 524_288 * 4
    "quantize.fp4_b32": ((4096, 4096), BF16_4096 + 8_388_608 + 2_097_152),
    # one token: 7168 bf16 in, 7168 e4m3 out, 56 fp32 scales
    "quantize.fp8_block.1x128": ((1, 7168), 7168 * 2 + 7168 + 56 * 4),
    # 32 x 32 fp32 block scales
    "quantize.fp8_block.128x128": ((4096, 4096), BF16_4096 + 16_777_216 + 32 * 32 * 4),
    "dequantize.nvfp4": ((4096, 4096), 8_388_608 + 1_048_576 + 4 + BF16_4096),
    "dequantize.mxfp4": ((4096, 4096), 8_388_608 + 524_288 + BF16_4096),
    "dequantize.mxfp6_e2m3": ((4096, 4096), 12_582_912 + 524_288 + BF16_4096),
    "dequantize.mxfp6_e3m2": ((4096, 4096), 12_582_912 + 524_288 + BF16_4096),
    "dequantize.mxfp8_e4m3": ((4096, 4096), 16_777_216 + 524_288 + BF16_4096),
    "dequantize.mxfp8_e5m2": ((4096, 4096), 16_777_216 + 524_288 + BF16_4096),
    "dequantize.fp4_b32": ((4096, 4096), 8_388_608 + 2_097_152 + BF16_4096),
    # 4096 rows x 32 fp32 scales
    "dequantize.fp8_block.1x128": ((4096, 4096), 16_777_216 + 4096 * 32 * 4 + BF16_4096),
    "dequantize.fp8_block.128x128": ((4096, 4096), 16_777_216 + 32 * 32 * 4 + BF16_4096),
    # nf4, blocksize 64, double quant: codes n/2, uint8 absmax codes n/64 = 262_144, fp32 nested scale per
    # 256 absmax = 1024 * 4, fp32 offset 4
    "dequantize.nf4.dq": ((4096, 4096), 8_388_608 + 262_144 + 1024 * 4 + 4 + BF16_4096),
    # bnb_fp4: nf4's layout with bitsandbytes' FP4 table
    "dequantize.bnb_fp4.dq": ((4096, 4096), 8_388_608 + 262_144 + 1024 * 4 + 4 + BF16_4096),
    # AWQ g128: qweight int32 [in, out/8], qzeros int32 [in/128, out/8], scales fp16 [in/128, out]
    "dequantize.int4_awq": ((4096, 4096), 4096 * 512 * 4 + 32 * 512 * 4 + 32 * 4096 * 2 + BF16_4096),
}


QUANT_OPS = {n for n in bench.REGISTRY if n.split(".")[0] in ("quantize", "dequantize")}


def test_registry_has_every_format_op():
    assert QUANT_OPS == set(HAND_BYTES)
    fmts = {name.split(".")[1] for name in QUANT_OPS}
    # fp8_rowwise (per-token FP8 activations for lowbit.scaled_mm) has no Triton quantize/dequantize kernel of
    # its own yet, so no bench op
    assert fmts == set(lowbit.FORMATS) - {"fp8_rowwise"}


@pytest.mark.parametrize("name", sorted(HAND_BYTES))
def test_shapes(name):
    op = bench.REGISTRY[name]
    if name == "quantize.fp8_block.1x128":
        assert list(op.shapes) == ACT + SQ
        assert op.baseline_shape == (4096, 7168)
    else:
        assert list(op.shapes) == SQ
        assert op.quick_shapes == ((4096, 4096),) and op.baseline_shape == (8192, 8192)


@pytest.mark.parametrize("name", sorted(HAND_BYTES))
def test_bytes_by_hand(name):
    shape, want = HAND_BYTES[name]
    assert bench.REGISTRY[name].nbytes(shape) == want


@pytest.mark.parametrize("name", sorted(HAND_BYTES))
@pytest.mark.parametrize("shape", [(128, 256), (256, 384)], ids=["128x256", "256x384"])
def test_setup_on_cpu_moves_the_formula_bytes(name, shape):
    """A CPU setup (torch backend) builds the real tensors; its byte count must equal the op's formula."""
    op = bench.REGISTRY[name]
    case = op.setup(shape, Context(device="cpu", backend="torch", baselines=False, check=True))
    assert case.bytes == op.nbytes(shape)
    assert case.flops == 0 and case.baselines == {}
    case.check()  # torch against torch: must pass
    out = case.fn()
    if name.startswith("dequantize"):
        assert out.shape == shape and out.dtype == torch.bfloat16
    else:
        assert isinstance(out, lowbit.QTensor) and out.nbytes + math.prod(shape) * 2 == case.bytes


def test_swizzled_scales_padding_counted():
    # 100 rows x 64: linear nvfp4 scales 100*4 = 400 bytes, swizzled [128, 4] = 512
    assert quant.qtensor_nbytes("nvfp4", (100, 64)) == 3200 + 400 + 4
    assert quant.qtensor_nbytes("nvfp4", (100, 64), scale_layout="swizzled") == 3200 + 512 + 4
    x = torch.randn(100, 64)
    assert lowbit.quantize(x, "nvfp4", scale_layout="swizzled").nbytes == 3200 + 512 + 4
    assert quant.qtensor_nbytes("nvfp4", (100, 64), global_scale="none") == 3600


def test_unavailable_follows_the_kernel_table():
    pytest.importorskip("triton")
    import types

    from lowbit import kernels

    ctx = Context(device="cuda", backend="triton")
    for op in bench.select(sorted(QUANT_OPS)):
        kind, fmt = op.name.split(".")[:2]
        if kind == "quantize":
            found = kernels.quantize_kernel(fmt, {})
        else:
            found = kernels.dequantize_kernel(fmt, types.SimpleNamespace(
                params={"convention": "vllm"}, scale=torch.empty(0, dtype=torch.float16)))
        assert op.unavailable(ctx) == (found if isinstance(found, str) else None), op.name
        assert op.unavailable(Context(device="cpu", backend="torch")) is None


def test_cpu_baselines_are_built_or_explained():
    """With baselines on, each op gets the compiled reference plus its external baselines, each a callable
    or a reason string; none is compiled or run here."""
    want = {
        "quantize.nvfp4": {"torchao.to_nvfp4[compiled]"},
        "quantize.mxfp8_e4m3": {"torchao.to_mx[compiled]"},
        "quantize.fp8_block.1x128": {"torchao.fp8_blockwise_act_quant"},
        "quantize.fp8_block.128x128": {"torchao.fp8_blockwise_weight_quant"},
        "dequantize.fp8_block.128x128": {"torchao.fp8_blockwise_weight_dequant"},
        "dequantize.nf4.dq": {"bitsandbytes.dequantize_4bit"},
        "dequantize.mxfp4": set(),
    }
    for name, external in want.items():
        case = bench.REGISTRY[name].setup((128, 256), Context(device="cpu", backend="torch", check=False))
        assert set(case.baselines) == {"lowbit.formats[compiled]"} | external, name
        assert all(callable(b) or isinstance(b, str) for b in case.baselines.values())


def test_bnb_baseline_matches_lowbit_nf4_on_cpu():
    pytest.importorskip("bitsandbytes")
    case = bench.REGISTRY["dequantize.nf4.dq"].setup((128, 256), Context(device="cpu", backend="torch"))
    ours, theirs = case.fn(), case.baselines["bitsandbytes.dequantize_4bit"]()
    assert theirs.dtype == torch.bfloat16 and theirs.shape == ours.shape
    assert torch.equal(ours.view(torch.int16), theirs.view(torch.int16))


def test_select_and_match():
    names = [op.name for op in bench.select(["nvfp4"])]
    assert names[:4] == ["quantize.nvfp4", "quantize.nvfp4.gs", "quantize.nvfp4.swizzled", "dequantize.nvfp4"]
    assert set(names[4:]) == {"linear.nvfp4.decode", "linear.nvfp4.prefill", "scaled_mm.nvfp4.prefill",
                              "scaled_mm.nvfp4.decode", "scaled_linear.nvfp4"}  # name parts match
    assert [op.name for op in bench.select(["*quantize.nvfp4"])] == ["quantize.nvfp4", "dequantize.nvfp4"]
    assert [op.name for op in bench.select(["quantize.mx*"])] == [f"quantize.{f}" for f in quant.MX]
    assert len(bench.select(["dequantize"])) == 12 and len(bench.select(None)) == len(bench.REGISTRY)
    with pytest.raises(ValueError, match="matches no registered op"):
        bench.select(["nope"])


def test_parse_shapes():
    assert bench.parse_shapes("4096x4096, 1x7168,8192") == [(4096, 4096), (1, 7168), (8192, 8192)]
    assert bench.parse_shapes("16x4096x4096") == [(16, 4096, 4096)]
    for bad in ("", "4096xa", "0x4"):
        with pytest.raises(ValueError):
            bench.parse_shapes(bad)


def test_plan():
    op = bench.REGISTRY["quantize.mxfp4"]
    assert bench.plan([op]) == [
        (op, (4096, 4096), False),
        (op, (8192, 8192), True),
        (op, (16384, 16384), False),
    ]
    assert bench.plan([op], quick=True) == [(op, (4096, 4096), True)]
    assert [b for *_, b in bench.plan([op], baselines="all")] == [True] * 3
    assert [b for *_, b in bench.plan([op], baselines="none")] == [False] * 3
    assert bench.plan([op], shapes=[(256, 256), (512, 512)]) == [
        (op, (256, 256), False),
        (op, (512, 512), True),
    ]
    fp8 = bench.REGISTRY["quantize.fp8_block.1x128"]
    assert bench.plan([fp8], quick=True) == [(fp8, (1, 7168), False), (fp8, (4096, 7168), True)]
    with pytest.raises(ValueError):
        bench.plan([op], baselines="some")


def test_register_generic_op():
    """A later issue's op (a GEMV, say) registers with its own shape rank, FLOPs and baselines."""

    def setup(shape, ctx):
        m, n, k = shape
        w, x = torch.randn(n, k), torch.randn(m, k)
        return Case(
            fn=lambda: x @ w.T,
            bytes=(n * k + m * k + m * n) * 4,
            flops=2 * m * n * k,
            baselines={"eager": lambda: x @ w.T},
        )

    op = Op("gemv.test", setup=setup, shapes=((1, 64, 128), (16, 64, 128)))
    assert op.quick_shapes == ((1, 64, 128),) and op.baseline_shape == (16, 64, 128)
    bench.register(op)
    try:
        with pytest.raises(ValueError, match="already registered"):
            bench.register(op)
        assert bench.select(["gemv"]) == [op]
    finally:
        del bench.REGISTRY["gemv.test"]
