"""The warp-specialized W4A16 GEMM (``lowbit.kernels.gemm_w4.gemm_w4_ws``) on the GPU.

Against the fp32 reference (``x.float() @ lowbit.dequantize(w).float().T``, same bounds as the Triton GEMM's
tests: relative Frobenius error <= 1e-2, max error / max |ref| <= 2e-2) for nvfp4 (linear and swizzled scales,
both global-scale conventions), mxfp4 and int4 (group 32/64/128); M from 17 to 4096, ragged N and K, bf16 and
fp16, every epilogue. Against the Triton GEMM, which decodes to the same values: the two differ only by fp32
accumulation order. Adversarial weights: a NaN block scale poisons exactly its rows, zero blocks stay zero.
CUDA graphs: a captured call replays to the same bits.
"""

from dataclasses import replace

import pytest
import torch
from test_gemm_w4_gpu import check_output, weight  # this folder's helpers

import lowbit
from lowbit.kernels import gemm_w4 as g

pytestmark = pytest.mark.gpu

WS_NAMES = ("nvfp4", "nvfp4_swizzled", "nvfp4_torchao", "mxfp4", "mxfp4_swizzled", "int4_g128", "int4_g64",
            "int4_g32")


def run_ws(name, m, n, k, dtype=torch.bfloat16, bias=True, act=None, config=None, kernel="gemm_w4_ws"):
    """``kernel`` (either Gluon GEMM: they take the same calls) on a random problem, checked against the fp32
    reference; returns (x, w, bias, out)."""
    w = weight(name, n, k)
    gen = torch.Generator(device="cuda").manual_seed(m * 13 + n + k)
    x = torch.randn(m, k, device="cuda", generator=gen).to(dtype)
    b = torch.randn(n, device="cuda", generator=gen).to(dtype) if bias else None
    assert g.ws_supports(x, w) is None
    out = getattr(g, kernel)(x, w, b, act, config=config)
    check_output(out, x, name, n, b, act)
    return x, w, b, out


@pytest.mark.parametrize("m", [17, 64, 200, 1024, 4096])
@pytest.mark.parametrize("name", WS_NAMES)
def test_formats_by_m(name, m):
    run_ws(name, m, 4096, 4096)


@pytest.mark.parametrize("name", ["nvfp4", "mxfp4", "int4_g128", "int4_g64"])
@pytest.mark.parametrize("m, n, k", [(33, 200, 160), (300, 1032, 4160), (129, 6144, 96), (1000, 4096, 14336)])
def test_ragged_shapes(name, m, n, k):
    # N and K not multiples of the tile (K a multiple of 32); K = 14336 (the down projection)
    if name.startswith("int4") and k % int(name[6:]):
        name = "int4_g32"
    run_ws(name, m, n, k)


# the tests below run both Gluon kernels (the register-operand one: tests/kernels/test_gemm_w4_ra_gpu.py)
KERNELS = ["gemm_w4_ws", "gemm_w4_ra"]


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("name", ["nvfp4", "mxfp4", "int4_g128"])
@pytest.mark.parametrize("m", [64, 2048])
def test_fp16(name, m, kernel):
    run_ws(name, m, 2048, 4096, dtype=torch.float16, kernel=kernel)


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("bias, act", [(False, None), (True, "gelu"), (True, "gelu_tanh"), (True, "silu")])
def test_epilogue(bias, act, kernel):
    run_ws("nvfp4", 300, 2048, 2048, bias=bias, act=act, kernel=kernel)
    run_ws("int4_g128", 300, 2048, 2048, bias=bias, act=act, kernel=kernel)


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("name", ["nvfp4", "mxfp4_swizzled", "int4_g64"])
def test_matches_triton_gemm(name, kernel):
    # same decoded operand values: only the fp32 accumulation order differs; repeated calls give the same bits
    # (a register operand rewritten while its wgmma runs would show as varying outputs)
    x, w, b, out = run_ws(name, 512, 3072, 4096, kernel=kernel)
    other = g.gemm_w4(x, w, b)
    err = (out.float() - other.float()).abs().max().item()
    assert err <= 2e-2 * other.float().abs().max().item(), err
    assert (out == other).float().mean().item() > 0.5
    for _ in range(5):
        assert torch.equal(getattr(g, kernel)(x, w, b), out)


@pytest.mark.parametrize("kernel", KERNELS)
def test_nan_scale_and_zero_blocks(kernel):
    n, k = 256, 1024
    w = lowbit.quantize(torch.randn(n, k, device="cuda") * 0.05, "mxfp4")
    scale = w.scale.clone().view(torch.uint8)
    scale[3, 5] = 255            # NaN block scale in row 3
    data = w.data.clone()
    data.view(torch.uint8)[7, :] = 0   # row 7: every code zero
    bad = replace(w, data=data, scale=scale.view(w.scale.dtype))
    x = torch.randn(130, k, device="cuda", dtype=torch.bfloat16)
    out = getattr(g, kernel)(x, bad)
    assert torch.isnan(out[:, 3]).all()
    assert torch.isfinite(out[:, torch.arange(n, device="cuda") != 3]).all()
    assert (out[:, 7] == 0).all()


@pytest.mark.parametrize("kernel", KERNELS)
def test_cuda_graph_replay(kernel):
    w = weight("nvfp4", 2048, 2048)
    x = torch.randn(500, 2048, device="cuda", dtype=torch.bfloat16)
    eager = getattr(g, kernel)(x, w)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = getattr(g, kernel)(x, w)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)


def test_refuses_what_it_cannot_run():
    w = weight("nvfp4", 256, 512)
    x = torch.randn(8, 512, device="cuda", dtype=torch.bfloat16)
    assert "16-byte" in g.ws_supports(torch.randn(8, 520, device="cuda", dtype=torch.bfloat16)[:, 4:516], w)
    nf4 = lowbit.quantize(torch.randn(256, 512, device="cuda"), "nf4")
    assert "warp-specialized" in g.ws_supports(x, nf4)
    with pytest.raises(ValueError):
        g.gemm_w4_ws(x, nf4)
    with pytest.raises(ValueError):
        g.gemm_w4_ws(x[:, :256], w)
