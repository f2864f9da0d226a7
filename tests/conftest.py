import os
import tempfile

import pytest
import torch

# Inductor's on-disk cache keys do not include the host's CPU capability: a cache left by another machine or
# setting (a reused /tmp) can hand CPU tests code vectorized for the wrong ISA. Each test session gets its own.
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", tempfile.mkdtemp(prefix="lowbit-inductor-"))


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU; run benchmarks/gpu_check.py on the device machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


# ------------------------------------------------------------------------------------ bitsandbytes' NF4 decode
#
# bitsandbytes' CPU ``dequantize_4bit`` (``bitsandbytes::dequantize_4bit`` on "cpu", native
# ``dequantizeBlockwise4bitCpu``) takes an AVX-512 branch on hosts with AVX-512F whenever the last dim is a
# multiple of 16 and blocksize >= 16. That branch is not the format:
#   * it reads ``absmax[row * (n // blocksize) + col // blocksize]``, so when ``n % blocksize != 0`` (a block
#     straddles rows, e.g. a (4, 32) weight with blocksize 64) every row after the first uses the wrong
#     absmax;
#   * on hosts with AVX512-BF16 its bf16 output goes through ``vcvtneps2bf16``, which flushes subnormal
#     results to zero and quiets NaN differently from the scalar branch.
# Elsewhere the scalar branch runs and follows the formula. A cross-check against that op would therefore
# depend on the host CPU. The format is what bitsandbytes' CUDA kernel and its device-independent PyTorch
# kernel (``backends/default/ops.py::_dequantize_4bit_compute``, the one its CPU op itself uses for odd last
# dims) compute: ``code[q] * absmax[block]`` in fp32, rounded once to the output dtype. The CPU tests compare
# against that kernel, run eagerly; the GPU tests compare against bitsandbytes' CUDA ``dequantize_4bit``.


@pytest.fixture
def bnb_dequantize_4bit():
    """``fn(packed, quant_state) -> tensor``: bitsandbytes' ``dequantize_4bit`` values through its
    host-independent PyTorch kernel (see above), after bitsandbytes' own double-quant decode. The result has
    shape ``quant_state.shape``; the shape quirks of bitsandbytes' ops are tested on the ops themselves."""
    bnbf = pytest.importorskip("bitsandbytes.functional")
    from bitsandbytes.backends.default.ops import _dequantize_4bit_compute
    from bitsandbytes.backends.utils import _get_4bit_code

    def run(packed: torch.Tensor, state) -> torch.Tensor:
        absmax = state.absmax
        if state.nested:
            absmax = bnbf.dequantize_blockwise(state.absmax, state.state2) + state.offset
        a = packed.view(torch.uint8) if packed.dtype != torch.uint8 else packed
        code = _get_4bit_code(state.quant_type, a.device)
        with torch.compiler.set_stance("force_eager"):  # bnb wraps it in torch.compile (seconds per shape)
            out = _dequantize_4bit_compute(a.reshape(-1), absmax.float(), code, state.blocksize, state.shape,
                                           state.dtype)
        return out.reshape(state.shape)

    return run

