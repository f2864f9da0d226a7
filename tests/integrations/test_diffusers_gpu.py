"""diffusers' own ``from_pretrained`` loads a lowbit-written NF4 transformer (bitsandbytes layout) on CUDA, and
the quantized denoising step runs on lowbit's kernels with the errors the CPU tests hold.

Needs a CUDA GPU, diffusers, bitsandbytes and accelerate (diffusers' bitsandbytes loader requires it)."""

import copy
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.gpu
diffusers = pytest.importorskip("diffusers")

sys.path.insert(0, str(Path(__file__).parent))
from test_diffusers import EIGHT_BIT, W4A4, W4A16, tiny_wan, wan_inputs  # noqa: E402

from lowbit.integrations import diffusers as lbd  # noqa: E402


def _cuda(inputs):
    return {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}


def test_diffusers_from_pretrained_reads_lowbit_nf4(tmp_path):
    pytest.importorskip("accelerate")
    bnb = pytest.importorskip("bitsandbytes")
    q = lbd.quantize_transformer(tiny_wan(), "w4a16-nf4")
    out = lbd.save_transformer(q, tmp_path / "transformer")
    theirs = diffusers.WanTransformer3DModel.from_pretrained(out, torch_dtype=torch.bfloat16).cuda().eval()
    assert isinstance(theirs.blocks[0].attn1.to_q, bnb.nn.Linear4bit)
    assert type(theirs.proj_out) is torch.nn.Linear
    ours = lbd.load_transformer(out, device="cuda")
    err = lbd.denoise_step_error(ours, theirs, _cuda(wan_inputs()))
    # the same NF4 codes and absmax; bitsandbytes dequantizes to bf16 before its GEMM, lowbit's kernel
    # accumulates in fp32: equal up to rounding
    assert err["cosine"] >= 0.9999, err


@pytest.mark.parametrize("scheme", EIGHT_BIT + W4A16 + W4A4)
def test_wan_denoising_step_error_on_cuda(scheme):
    ref = tiny_wan().cuda()
    q = lbd.quantize_transformer(copy.deepcopy(ref), scheme)
    err = lbd.denoise_step_error(ref, q, _cuda(wan_inputs()))
    assert err["cosine"] >= (0.999 if scheme in EIGHT_BIT else 0.99), err
