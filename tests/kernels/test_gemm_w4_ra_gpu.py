"""The register-operand W4A16 GEMM (``lowbit.kernels.gemm_w4.gemm_w4_ra``) on the GPU.

Against the fp32 reference (``x.float() @ lowbit.dequantize(w).float().T``, the Triton GEMM's bounds: relative
Frobenius error <= 1e-2, max error / max |ref| <= 2e-2) for nvfp4 (linear and swizzled scales, both global
scale conventions), mxfp4 and int4 (group 32/64/128); M from 17 to 4096, ragged N and K (odd and even counts
of K steps, a K that is no multiple of the step), BM 64 / 128 / 256, one or two warpgroups, split K
(deterministic, CUDA-graph replay). In ``test_gemm_w4_ws_gpu.py``, for both
Gluon kernels: fp16, the epilogues, agreement with the Triton GEMM and bit-equal repeated calls (a register
operand rewritten while its wgmma runs would show as varying outputs), a NaN block scale, zero blocks and
CUDA-graph replay.
"""

import pytest
import torch
from test_gemm_w4_gpu import weight  # this folder's helpers
from test_gemm_w4_ws_gpu import run_ws

import lowbit
from lowbit.kernels import gemm_w4 as g

pytestmark = pytest.mark.gpu

NAMES = ("nvfp4", "nvfp4_swizzled", "nvfp4_torchao", "mxfp4", "mxfp4_swizzled", "int4_g128", "int4_g64", "int4_g32")


def run_ra(name, m, n, k, **kw):
    return run_ws(name, m, n, k, kernel="gemm_w4_ra", **kw)


# the register-fragment kernel (test_gemm_w4_rf_gpu.py) takes the same calls: both run the shape tests here
KERNELS = ("gemm_w4_ra", "gemm_w4_rf")


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("m", [17, 64, 200, 1024, 4096])
@pytest.mark.parametrize("name", NAMES)
def test_formats_by_m(name, m, kernel):
    run_ws(name, m, 4096, 4096, kernel=kernel)


@pytest.mark.parametrize("name", ["nvfp4", "mxfp4", "int4_g128", "int4_g64"])
@pytest.mark.parametrize("m, n, k", [(33, 200, 160), (300, 1032, 4160), (129, 6144, 96), (1000, 4096, 14336),
                                     (64, 256, 4128)])
@pytest.mark.parametrize("kernel", KERNELS)
def test_ragged_shapes(name, m, n, k, kernel):
    # N and K not multiples of the tile; 160 / 4160 / 96 / 4128 columns: an odd number of 64-wide K steps or a
    # last step cut short (K a multiple of 32); K = 14336 (the down projection)
    if name.startswith("int4") and k % int(name[6:]):
        name = "int4_g32"
    run_ws(name, m, n, k, kernel=kernel)


@pytest.mark.parametrize("wg", [1, 2])
@pytest.mark.parametrize("bm", [64, 128, 256])
@pytest.mark.parametrize("name", ["nvfp4", "int4_g128"])
def test_tile_widths(name, bm, wg):
    run_ra(name, 300, 2048, 2048, config={"BM": bm, "WG": wg})


@pytest.mark.parametrize("name", ["nvfp4_swizzled", "mxfp4", "int4_g32"])
@pytest.mark.parametrize("m, n, k", [(33, 200, 160), (1000, 4160, 4128), (256, 6144, 4096)])
def test_two_warpgroups(name, m, n, k):
    # 128 weight rows per program: N not a multiple of 128, an odd count of K steps
    run_ra(name, m, n, k, config={"WG": 2, "BM": 256 if m > 64 else 64})


@pytest.mark.parametrize("split", [2, 3, 5])
@pytest.mark.parametrize("name", ["nvfp4", "mxfp4_swizzled", "int4_g32"])
@pytest.mark.parametrize("m, n, k, wg", [(33, 200, 160, 1), (256, 6144, 4096, 2), (700, 1032, 4160, 2),
                                         (64, 256, 4128, 1)])
def test_split_k(name, m, n, k, wg, split):
    # K runs split over several programs per tile, summed by the last to arrive: some splits get only steps
    # past the end (K = 160 in 5 splits), runs end mid-pair; the sum's order is fixed, so repeated calls (and
    # the counters each launch leaves at zero) give the same bits
    config = {"WG": wg, "BM": 64 if m <= 64 else 256, "SPLIT": split}
    x, w, b, out = run_ra(name, m, n, k, config=config)
    one = g.gemm_w4_ra(x, w, b, config={**config, "SPLIT": 1})
    assert ((out.float() - one.float()).norm() / one.float().norm()).item() <= 5e-3
    for _ in range(3):
        assert torch.equal(g.gemm_w4_ra(x, w, b, config=config), out)


def test_split_k_cuda_graph_replay():
    w = weight("int4_g128", 2048, 4096)
    x = torch.randn(300, 4096, device="cuda", dtype=torch.bfloat16)
    config = {"WG": 2, "BM": 256, "SPLIT": 4}
    eager = g.gemm_w4_ra(x, w, config=config)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = g.gemm_w4_ra(x, w, config=config)
    for _ in range(3):
        out.zero_()
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
    with pytest.raises(ValueError, match="WG"):
        g.gemm_w4_ra(x, w, config={"WG": 4})
    with pytest.raises(ValueError, match="SPLIT"):
        g.gemm_w4_ra(x, w, config={"SPLIT": 0})


@pytest.mark.parametrize("config", [{"BM": 64, "WG": 1, "SPLIT": 4}, {"BM": 256, "WG": 2, "SPLIT": 1},
                                    {"BM": 256, "WG": 2, "SPLIT": 2}])
@pytest.mark.parametrize("name", ["nvfp4", "int4_g128"])
def test_runner_keeps_a_direct_launch_with_the_same_bits(name, config):
    # RaRunner (a prepared layer's call): compiled once, then launched through the C launcher with the host
    # descriptors encoded per x address; the same bits as gemm_w4_ra, with and without bias, new x each call
    w = weight(name, 4096, 2048)
    run = g.RaRunner(w, 256, torch.bfloat16, "silu", config)
    b = torch.randn(4096, device="cuda", dtype=torch.bfloat16)
    for i in range(6):
        x = torch.randn(256, 2048, device="cuda", dtype=torch.bfloat16)
        bias = b if i % 2 else None
        assert torch.equal(run(x, bias), g.gemm_w4_ra(x, w, bias, "silu", config=config)), i
    assert len(run.launches) == 2
    for lc in run.launches.values():
        assert lc.compiled is not None and lc._c_launch is not None and len(lc._desc) == 2
