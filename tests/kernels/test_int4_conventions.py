"""int4_awq decode conventions and the Triton kernels: the kernels implement AutoAWQ's float16 decode only.

A compressed-tensors weight whose scales are bfloat16 or float32 decodes in that dtype (one rounding, as
compressed-tensors' ``_dequantize``); no kernel may run it with the fp16 arithmetic. The CPU tests check that
every kernel entry point refuses such a weight with its reason; the ``gpu`` tests (skipped without CUDA) check
the routing on the device: the dequantize dispatch runs the reference (bit-identical to it), ``lowbit.linear``
refuses loudly instead of computing other bits, and fp16-scaled compressed-tensors weights, which decode the
same in both conventions, run on the kernels bit for bit.
"""

import warnings

import pytest
import torch

import lowbit
from lowbit import kernels
from lowbit.formats.int4_awq import dequantize_int4_awq, quantize_int4_awq
from lowbit.io._ct_int4 import from_ct_pack_quantized, to_ct_pack_quantized
from lowbit.testing import assert_bitexact

pytest.importorskip("triton")


def _ct_weight(scale_dtype: torch.dtype, n: int = 256, k: int = 512, group: int = 128, seed: int = 0):
    """A pack-quantized int4 weight as llm-compressor writes it for a model of ``scale_dtype``: the codes and
    zero points of an AutoAWQ quantization, scales in the model's dtype (not representable in fp16 for
    fp32)."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * torch.logspace(-6, 0, n)[:, None]
    ct = to_ct_pack_quantized(quantize_int4_awq(w, group))
    scale = ct["weight_scale"].to(scale_dtype)
    if scale_dtype == torch.float32:
        scale = scale * (1 + 2.0**-20)  # fp32 scales carry bits fp16 cannot hold
    return from_ct_pack_quantized(dict(ct, weight_scale=scale))


@pytest.mark.parametrize("scale_dtype", [torch.bfloat16, torch.float32])
def test_cuda_dispatch_decodes_then_gemm_at_every_m(scale_dtype):
    """On CUDA, lowbit.linear runs these weights through the exact chunked decode + cuBLAS at every M (the kernels'
    fp16 decode would round twice); fp16 scales keep the kernels."""
    from lowbit.ops import policy

    q = _ct_weight(scale_dtype)
    for m in (1, 16, 100, 4096):
        path, _, facts = policy.linear_decide(m, torch.device("cuda"), q, "auto")
        assert (path, facts) == ("dequant_gemm", ("dequant_only",)), m
        assert "dequant_only" in policy.linear_reason(path, facts, m, torch.device("cuda"), q, 64)
    assert not policy.dequant_only(_ct_weight(torch.float16))
    assert policy.linear_decide(1, torch.device("cpu"), q, "auto")[0] == "reference"


@pytest.mark.parametrize("scale_dtype", [torch.bfloat16, torch.float32])
def test_kernels_refuse_non_fp16_decodes(scale_dtype):
    from lowbit.kernels import gemm_w4, gemv_w4
    from lowbit.kernels import int4_awq as k_awq

    q = _ct_weight(scale_dtype)
    assert q.params["convention"] == "compressed-tensors" and q.scale.dtype == scale_dtype
    for supports in (gemv_w4.supports, gemm_w4.supports):
        reason = supports(q)
        assert reason is not None and "float16" in reason and str(scale_dtype) in reason
    assert not callable(kernels.dequantize_kernel("int4_awq", q))
    with pytest.raises(ValueError, match="decodes .* in float16"):
        k_awq.dequantize_call(q, torch.bfloat16)
    # an fp16-scaled weight of either convention is the kernels' arithmetic
    q16 = _ct_weight(torch.float16)
    assert "convention" not in q16.params
    assert gemv_w4.supports(q16) is None and gemm_w4.supports(q16) is None
    assert callable(kernels.dequantize_kernel("int4_awq", q16))



@pytest.mark.gpu
@pytest.mark.parametrize("scale_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("out", [torch.float32, torch.bfloat16, torch.float16])
def test_gpu_dequantize_routes_to_the_reference(scale_dtype, out):
    q = _ct_weight(scale_dtype)
    want = dequantize_int4_awq(q, out)
    with warnings.catch_warnings():
        # the dispatch warns once per process that the reference runs on CUDA
        warnings.simplefilter("ignore")
        got = lowbit.dequantize(q.to("cuda"), out)
    assert_bitexact(got.cpu(), want, f"{scale_dtype} scales -> {out}")
    with pytest.raises(RuntimeError, match="cannot run the triton backend"):
        lowbit.dequantize(q.to("cuda"), out, backend="triton")


@pytest.mark.gpu
@pytest.mark.parametrize("scale_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("m", [1, 16, 64])
def test_gpu_linear_decodes_in_the_scale_dtype_then_cublas(scale_dtype, m):
    """No int4 kernel decodes in bf16/fp32: lowbit.linear decodes exactly (the reference, in torch ops on the GPU)
    and multiplies with cuBLAS at every M, never the kernels' fp16 decode."""
    import sys

    lin = sys.modules["lowbit.ops.linear"]  # the package's `linear` attribute is the function

    q = _ct_weight(scale_dtype).to("cuda")
    x = torch.randn(m, q.shape[1], device="cuda", dtype=torch.bfloat16)
    plan = lin.plan_linear(tuple(x.shape), q)
    assert plan.path == "dequant_gemm" and "dequant_only" in plan.reason, str(plan)
    got = lowbit.linear(x, q)
    w = dequantize_int4_awq(q, torch.bfloat16)  # the compressed-tensors decode, one rounding
    want = torch.nn.functional.linear(x.float(), w.float())
    err = ((got.float() - want).norm() / want.norm()).item()
    assert got.dtype == torch.bfloat16 and err < 1e-2, err


@pytest.mark.gpu
@pytest.mark.parametrize("out", [torch.float32, torch.bfloat16, torch.float16])
def test_gpu_fp16_scaled_ct_weight_runs_on_the_kernel(out):
    q = _ct_weight(torch.float16)
    got = lowbit.dequantize(q.to("cuda"), out, backend="triton")
    assert_bitexact(got.cpu(), dequantize_int4_awq(q, out), f"fp16 scales -> {out}")
