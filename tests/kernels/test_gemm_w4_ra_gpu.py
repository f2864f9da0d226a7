"""The register-operand W4A16 GEMM (``lowbit.kernels.gemm_w4.gemm_w4_ra``) on the GPU.

Against the fp32 reference (``x.float() @ lowbit.dequantize(w).float().T``, the Triton GEMM's bounds: relative
Frobenius error <= 1e-2, max error / max |ref| <= 2e-2) for nvfp4 (linear and swizzled scales, both global
scale conventions), mxfp4 and int4 (group 32/64/128); M from 17 to 4096, ragged N and K (odd and even counts
of K steps, a K that is no multiple of the step), bf16 and fp16, every epilogue, BM 64 / 128 / 256. Against the
Triton GEMM, which decodes to the same values: only the fp32 accumulation order differs. Repeated calls give
the same bits (a register operand rewritten while its wgmma runs would show here first, as varying outputs).
Adversarial weights: a NaN block scale poisons exactly its rows, zero blocks stay zero. CUDA graphs replay to
the same bits.
"""

from dataclasses import replace

import pytest
import torch
from test_gemm_w4_gpu import check_output, weight  # this folder's helpers

import lowbit
from lowbit.kernels import gemm_w4 as g

pytestmark = pytest.mark.gpu

NAMES = ("nvfp4", "nvfp4_swizzled", "nvfp4_torchao", "mxfp4", "mxfp4_swizzled", "int4_g128", "int4_g64", "int4_g32")


def run_ra(name, m, n, k, dtype=torch.bfloat16, bias=True, act=None, config=None):
    w = weight(name, n, k)
    gen = torch.Generator(device="cuda").manual_seed(m * 13 + n + k)
    x = torch.randn(m, k, device="cuda", generator=gen).to(dtype)
    b = torch.randn(n, device="cuda", generator=gen).to(dtype) if bias else None
    assert g.ws_supports(x, w) is None
    out = g.gemm_w4_ra(x, w, b, act, config=config)
    check_output(out, x, name, n, b, act)
    return x, w, b, out


@pytest.mark.parametrize("m", [17, 64, 200, 1024, 4096])
@pytest.mark.parametrize("name", NAMES)
def test_formats_by_m(name, m):
    run_ra(name, m, 4096, 4096)


@pytest.mark.parametrize("name", ["nvfp4", "mxfp4", "int4_g128", "int4_g64"])
@pytest.mark.parametrize("m, n, k", [(33, 200, 160), (300, 1032, 4160), (129, 6144, 96), (1000, 4096, 14336),
                                     (64, 256, 4128)])
def test_ragged_shapes(name, m, n, k):
    # N and K not multiples of the tile; 160 / 4160 / 96 / 4128 columns: an odd number of 64-wide K steps or a
    # last step cut short (K a multiple of 32); K = 14336 (the down projection)
    if name.startswith("int4") and k % int(name[6:]):
        name = "int4_g32"
    run_ra(name, m, n, k)


@pytest.mark.parametrize("bm", [64, 128, 256])
@pytest.mark.parametrize("name", ["nvfp4", "int4_g128"])
def test_tile_widths(name, bm):
    run_ra(name, 300, 2048, 2048, config={"BM": bm})


@pytest.mark.parametrize("name", ["nvfp4", "mxfp4", "int4_g128"])
@pytest.mark.parametrize("m", [64, 2048])
def test_fp16(name, m):
    run_ra(name, m, 2048, 4096, dtype=torch.float16)


@pytest.mark.parametrize("bias, act", [(False, None), (True, "gelu"), (True, "gelu_tanh"), (True, "silu")])
def test_epilogue(bias, act):
    run_ra("nvfp4", 300, 2048, 2048, bias=bias, act=act)
    run_ra("int4_g128", 300, 2048, 2048, bias=bias, act=act)


@pytest.mark.parametrize("name", ["nvfp4", "mxfp4_swizzled", "int4_g64"])
def test_matches_triton_gemm_and_repeats(name):
    x, w, b, out = run_ra(name, 512, 3072, 4096)
    other = g.gemm_w4(x, w, b)
    err = (out.float() - other.float()).abs().max().item()
    assert err <= 2e-2 * other.float().abs().max().item(), err
    assert (out == other).float().mean().item() > 0.5
    for _ in range(5):
        assert torch.equal(g.gemm_w4_ra(x, w, b), out)


def test_nan_scale_and_zero_blocks():
    n, k = 256, 1024
    w = lowbit.quantize(torch.randn(n, k, device="cuda") * 0.05, "mxfp4")
    scale = w.scale.clone().view(torch.uint8)
    scale[3, 5] = 255            # NaN block scale in row 3
    data = w.data.clone()
    data.view(torch.uint8)[7, :] = 0   # row 7: every code zero
    bad = replace(w, data=data, scale=scale.view(w.scale.dtype))
    x = torch.randn(130, k, device="cuda", dtype=torch.bfloat16)
    out = g.gemm_w4_ra(x, bad)
    assert torch.isnan(out[:, 3]).all()
    assert torch.isfinite(out[:, torch.arange(n, device="cuda") != 3]).all()
    assert (out[:, 7] == 0).all()


def test_cuda_graph_replay():
    w = weight("nvfp4", 2048, 2048)
    x = torch.randn(500, 2048, device="cuda", dtype=torch.bfloat16)
    eager = g.gemm_w4_ra(x, w)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = g.gemm_w4_ra(x, w)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)


def test_refuses_what_it_cannot_run():
    w = weight("nvfp4", 256, 512)
    x = torch.randn(8, 512, device="cuda", dtype=torch.bfloat16)
    nf4 = lowbit.quantize(torch.randn(256, 512, device="cuda"), "nf4")
    with pytest.raises(ValueError):
        g.gemm_w4_ra(x, nf4)
    with pytest.raises(ValueError):
        g.gemm_w4_ra(x[:, :256], w)
    with pytest.raises(ValueError, match="STAGES"):
        g.gemm_w4_ra(x, w, config={"STAGES": 2})
