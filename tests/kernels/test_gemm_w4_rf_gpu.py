"""The register-fragment W4A16 GEMM (``lowbit.kernels.gemm_w4.gemm_w4_rf``) on the GPU.

Against the fp32 reference (``test_gemm_w4_ws_gpu.run_ws``: relative Frobenius error <= 1e-2, max error / max
|ref| <= 2e-2) for nvfp4 (linear and swizzled scales, both global scale conventions), mxfp4 and int4 (group
32/64/128), bf16 and fp16 (M from 17 to 4096 and ragged N and K in ``test_gemm_w4_ra_gpu.py``, which runs its
shape tests on both kernels), one or two warpgroups, BM 64 / 128 / 256, split K; the same decoded values as the
register-operand kernel (whose decode is the reference's), with and without bias; bit-equal repeated calls, kept
direct launches and CUDA-graph replay.
"""

import pytest
import torch
from test_gemm_w4_gpu import weight  # this folder's helpers
from test_gemm_w4_ws_gpu import run_ws

import lowbit
from lowbit.kernels import gemm_w4 as g

pytestmark = pytest.mark.gpu

def run_rf(name, m, n, k, **kw):
    return run_ws(name, m, n, k, kernel="gemm_w4_rf", **kw)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("name", ["nvfp4", "mxfp4", "int4_g128"])
def test_activation_dtypes_and_epilogues(name, dtype):
    for act in (None, "gelu", "silu"):
        run_rf(name, 300, 2048, 2048, dtype=dtype, act=act)


@pytest.mark.parametrize("config", [{"BM": 64, "WG": 1, "SPLIT": 4}, {"BM": 128, "WG": 2, "SPLIT": 1},
                                    {"BM": 256, "WG": 2, "SPLIT": 3}, {"BM": 256, "WG": 1, "SPLIT": 1},
                                    {"BM": 64, "WG": 1, "SPLIT": 4, "DEEP": 1},
                                    {"BM": 64, "WG": 1, "SPLIT": 1, "DEEP": 1}])
@pytest.mark.parametrize("name", ["nvfp4_swizzled", "mxfp4", "int4_g32"])
def test_configs_and_the_register_operand_kernels_values(name, config):
    # the same decoded weight as gemm_w4_ra: only the fp32 accumulation order may differ (split K), so with one
    # split the outputs are bit-equal; N = 4160: a 64-row tile past the last one of two warpgroups
    x, w, b, out = run_rf(name, 300, 4160, 4128, config=config)
    ra = g.gemm_w4_ra(x, w, b, config=config)
    if config["SPLIT"] == 1:
        assert torch.equal(out, ra)
    else:
        assert ((out.float() - ra.float()).norm() / ra.float().norm()).item() <= 5e-3
    for _ in range(3):
        assert torch.equal(g.gemm_w4_rf(x, w, b, config=config), out)


@pytest.mark.parametrize("config", [{"BM": 128, "WG": 1, "SPLIT": 1}, {"BM": 128, "WG": 2, "SPLIT": 1},
                                    {"BM": 256, "WG": 2, "SPLIT": 1}, {"BM": 64, "WG": 1, "SPLIT": 1, "DEEP": 1}])
@pytest.mark.parametrize("name", ["nvfp4", "mxfp4", "int4_g128"])
def test_no_bias_at_aligned_shapes(name, config):
    # no bias, activation or global scale, one split, M, N, K multiples of 16: the epilogue starts by converting
    # the accumulator, which ptxas once scheduled above the final wait (the last K step partly lost, differently
    # on each call); bits equal to the register-operand kernel's, call after call
    x, w, _, out = run_rf(name, 256, 6144, 4096, bias=False, config=config)
    ra = g.gemm_w4_ra(x, w, None, config=config)
    assert torch.equal(out, ra)
    for _ in range(3):
        assert torch.equal(g.gemm_w4_rf(x, w, None, config=config), out)


def test_nan_scale_and_zero_rows():
    from dataclasses import replace

    n, k = 256, 1024
    w = lowbit.quantize(torch.randn(n, k, device="cuda") * 0.05, "mxfp4")
    scale = w.scale.clone().view(torch.uint8)
    scale[3, 5] = 255
    data = w.data.clone()
    data.view(torch.uint8)[7, :] = 0
    bad = replace(w, data=data, scale=scale.view(w.scale.dtype))
    x = torch.randn(130, k, device="cuda", dtype=torch.bfloat16)
    out = g.gemm_w4_rf(x, bad)
    assert torch.isnan(out[:, 3]).all()
    assert torch.isfinite(out[:, torch.arange(n, device="cuda") != 3]).all()
    assert (out[:, 7] == 0).all()


def test_runner_and_cuda_graph_replay():
    w = weight("nvfp4", 2048, 2048)
    config = {"BM": 128, "WG": 2, "SPLIT": 2}
    plan = g.RaPlan(w, 500, torch.bfloat16, None, {**g.RA_CONFIG, **config}, fragments=True)
    store = {}
    x = torch.randn(500, 2048, device="cuda", dtype=torch.bfloat16)
    eager = g.gemm_w4_rf(x, w, config=config)
    for _ in range(2):
        out = torch.empty_like(eager)
        plan.launch(x, None, out, store, (torch.cuda.current_device(),))
        assert torch.equal(out, eager)
    (lc,) = store.values()
    assert lc.compiled is not None and lc._c_launch is not None and len(lc._desc) == 1
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = g.gemm_w4_rf(x, w, config=config)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(y, eager)


def test_refuses_what_it_cannot_run():
    w = weight("nvfp4", 256, 512)
    x = torch.randn(8, 512, device="cuda", dtype=torch.bfloat16)
    nf4 = lowbit.quantize(torch.randn(256, 512, device="cuda"), "nf4")
    with pytest.raises(ValueError):
        g.gemm_w4_rf(x, nf4)
    with pytest.raises(ValueError, match="BK"):
        g.gemm_w4_rf(x, w, config={"BK": 32})
