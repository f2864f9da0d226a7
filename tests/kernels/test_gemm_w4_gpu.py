"""Prefill W4A16 GEMM (``lowbit.kernels.gemm_w4``) against the fp32 reference, on the GPU.

``act(x.float() @ lowbit.dequantize(w).float().T + bias)`` must match the kernel's output with relative
Frobenius error <= 1e-2 and max error / max |ref| <= 2e-2, for every weight format and layout, M from 17 to
4096 (every tile regime, split-K included), non-power-of-two N, K = 14336 and K not a multiple of the tile,
int4 group sizes 32/64/128, nf4 with and without double quantization, each activation with and without bias,
bf16 and fp16 activations.

Run on the device machine: ``python -m pytest -q -p no:cacheprovider -m gpu tests/kernels/test_gemm_w4_gpu.py``
(about 60 kernel variants are compiled; the whole file is meant to stay under two minutes on an H100).
"""

import zlib

import pytest
import torch

import lowbit
from lowbit.formats.qtensor import QTensor
from lowbit.kernels import gemm_w4 as g

pytestmark = pytest.mark.gpu

REL_FRO = 1e-2
REL_MAX = 2e-2

# (format, quantize options); "nf4" with double quantization and int4 group sizes are separate entries
WEIGHTS = {
    "nvfp4": ("nvfp4", {}),
    "nvfp4_swizzled": ("nvfp4", {"scale_layout": "swizzled"}),
    "nvfp4_torchao": ("nvfp4", {"convention": "torchao"}),
    "mxfp4": ("mxfp4", {}),
    "mxfp4_swizzled": ("mxfp4", {"scale_layout": "swizzled", "scale_rounding": "floor"}),
    "fp4_b32": ("fp4_b32", {}),
    "nf4": ("nf4", {}),
    "nf4_dq": ("nf4", {"double_quant": True}),
    "nf4_dq_bs128": ("nf4", {"double_quant": True, "blocksize": 128}),
    "int4_g128": ("int4_awq", {"group_size": 128}),
    "int4_g64": ("int4_awq", {"group_size": 64}),
    "int4_g32": ("int4_awq", {"group_size": 32}),
}
CORE = ("nvfp4", "mxfp4", "fp4_b32", "nf4", "nf4_dq", "int4_g128")

_weights: dict = {}


def weight(name: str, n: int, k: int) -> QTensor:
    """Quantized random weight, cached per (name, n, k) for the whole module (quantization is not under test)."""
    key = (name, n, k)
    if key not in _weights:
        fmt, opts = WEIGHTS[name]
        gen = torch.Generator(device="cuda").manual_seed(zlib.crc32(repr(key).encode()))
        w = torch.randn(n, k, device="cuda", generator=gen) * 0.05
        if fmt == "int4_awq":
            w = w.half()
        _weights[key] = lowbit.quantize(w, fmt, **opts)
    return _weights[key]


_dequant: dict = {}


def dequantized(name: str, n: int, k: int) -> torch.Tensor:
    key = (name, n, k)
    if key not in _dequant:
        _dequant[key] = lowbit.dequantize(weight(name, n, k), torch.float32)
    return _dequant[key]


def reference(x, wf, bias, act):
    torch.backends.cuda.matmul.allow_tf32 = False
    acc = x.float() @ wf.T
    if bias is not None:
        acc = acc + bias.float()
    return g._torch_epilogue(acc, None, act)


def run_case(name, m, n, k, dtype=torch.bfloat16, bias=True, act=None, config=None, row_pad=0):
    w = weight(name, n, k)
    gen = torch.Generator(device="cuda").manual_seed(m * 7 + n)
    # row_pad > 0: x is a column slice of a wider tensor (rows not 16-byte aligned: no TMA for x)
    x = torch.randn(m, k + row_pad, device="cuda", generator=gen).to(dtype)[:, :k]
    b = torch.randn(n, device="cuda", generator=gen).to(dtype) if bias else None
    out = g.gemm_w4(x, w, b, act, config=config)
    check_output(out, x, name, n, b, act)


def check_output(out, x, name, n, b, act):
    """``out`` of a W4A16 GEMM of ``x`` with weight ``weight(name, n, K)``: shape, dtype, finite, and within
    REL_FRO / REL_MAX of the fp32 reference."""
    m, k = x.shape
    assert out.shape == (m, n) and out.dtype == x.dtype
    ref = reference(x, dequantized(name, n, k), b, act)
    err = out.float() - ref
    rel_fro = (err.norm() / ref.norm()).item()
    rel_max = (err.abs().max() / ref.abs().max()).item()
    what = f"{name} {x.dtype} M={m} N={n} K={k} bias={b is not None} act={act}"
    assert torch.isfinite(out).all(), what
    assert rel_fro <= REL_FRO and rel_max <= REL_MAX, f"{what}: rel Frobenius {rel_fro:.2e}, rel max {rel_max:.2e}"


# every format x every M regime, N = 6144 (not a power of two)
@pytest.mark.parametrize("m", [17, 33, 128, 1000, 4096])
@pytest.mark.parametrize("name", CORE)
def test_formats_by_m(name, m):
    run_case(name, m, 6144, 4096)


@pytest.mark.parametrize("name, m", [(name, 4096) for name in CORE] + [("nvfp4", 128), ("int4_g128", 128)])
def test_fp16(name, m):
    run_case(name, m, 4096, 4096, dtype=torch.float16)


@pytest.mark.parametrize("bias, act", [(False, None), (True, "gelu"), (True, "gelu_tanh"), (True, "silu"),
                                       (False, "silu")])
@pytest.mark.parametrize("name, m", [("nvfp4", 33), ("int4_g128", 1000)])
def test_epilogue(name, m, bias, act):
    run_case(name, m, 4096, 4096, bias=bias, act=act)


@pytest.mark.parametrize("name, m", [("int4_g32", 128), ("int4_g32", 1000), ("int4_g64", 128), ("int4_g64", 1000),
                                     ("nf4_dq_bs128", 1000)])
def test_groups(name, m):
    run_case(name, m, 4096, 4096)


@pytest.mark.parametrize("name", ["nvfp4_swizzled", "mxfp4_swizzled", "nvfp4_torchao"])
@pytest.mark.parametrize("m", [33, 4096])
def test_layouts_and_conventions(name, m):
    run_case(name, m, 4096, 4096)


@pytest.mark.parametrize("name, m", [("nvfp4", 128), ("int4_g128", 1000), ("nf4_dq", 17), ("mxfp4", 4096)])
def test_k14336(name, m):
    # 4096 x 14336 (the down projection of an 8B model); M = 17 takes the split-K path
    run_case(name, m, 4096, 14336)


@pytest.mark.parametrize("name, m", [(name, 1000) for name in ("nvfp4", "mxfp4", "fp4_b32", "nf4", "nf4_dq",
                                                                 "int4_g64")] + [("nvfp4", 33), ("int4_g64", 33)])
def test_ragged_k_and_n(name, m):
    # K not a multiple of BLOCK_K (and, for nvfp4, K/16 not a multiple of 4: byte-wise scale reads);
    # N not a multiple of BLOCK_N
    k = 4160 if name != "nvfp4" else 4112
    run_case(name, m, 1032, k)


def test_split_k_explicit_and_config_override():
    cfg = dict(g.CONFIGS["m64"], SPLIT_K=4)
    run_case("nvfp4", 40, 2048, 4096, config=cfg)
    cfg = dict(g.CONFIGS["m512"], SPLIT_K=3)
    run_case("int4_g128", 300, 2048, 4096, config=cfg, act="silu")


@pytest.mark.parametrize("name", ["nvfp4", "int4_g128", "nf4_dq"])
def test_x_without_tma(name):
    run_case(name, 1000, 2048, 4096, row_pad=4)                                   # strided rows
    run_case(name, 4096, 2048, 4096, config=dict(g.CONFIGS["large"], X_TMA=False))


def test_weight_untouched_and_prelayout_cached():
    w = weight("int4_g128", 1024, 2048)
    before = {k: v.clone() for k, v in w.tensors().items()}
    x = torch.randn(64, 2048, device="cuda", dtype=torch.bfloat16)
    a = g.gemm_w4(x, w)
    packed = g.prelayout_int4_awq(w)
    b = g.gemm_w4(x, w)
    assert g.prelayout_int4_awq(w)[0] is packed[0]
    assert torch.equal(a, b)
    for k, v in w.tensors().items():
        assert torch.equal(v, before[k]), k


def test_supports_and_errors():
    w = weight("nvfp4", 256, 512)
    assert g.supports(w) is None
    assert g.supports(lowbit.quantize(torch.randn(64, 64, device="cuda"), "mxfp8_e4m3")) is not None
    x = torch.randn(8, 512, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(ValueError):
        g.gemm_w4(x[:, :256], w)
    with pytest.raises(TypeError):
        g.gemm_w4(x.float(), w)
    with pytest.raises(ValueError):
        g.gemm_w4(x, w, activation="relu")
    with pytest.raises(ValueError):
        g.gemm_w4(x, w, bias=torch.zeros(255, device="cuda"))
