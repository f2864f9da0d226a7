"""Every shipped kernel variant compiles for Hopper (sm_90) on this CPU-only machine, with the PTX we expect."""

import pytest

triton = pytest.importorskip("triton")
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from lowbit.kernels import blockscaled  # noqa: E402

HOPPER = GPUTarget("cuda", 90, 32)


def _compile(fn, signature, constexprs):
    sig = dict(signature)
    sig.update({name: "constexpr" for name in constexprs})
    return triton.compile(ASTSource(fn=fn, signature=sig, constexprs=constexprs), target=HOPPER)


def _ids(variants):
    return [f"{c['SCALE_KIND']}-{c.get('ELEM_KIND')}-{c.get('EBITS')}{c.get('MBITS')}-k{c['BLOCK_K']}-"
            f"g{int(c['HAS_GSCALE'])}-s{int(c['SWIZZLED'])}-{s.get('out_ptr', '')}" for _, s, c in variants]


QUANT = list(blockscaled.quantize_variants())
DEQUANT = list(blockscaled.dequantize_variants())


@pytest.mark.parametrize("fn, signature, constexprs", QUANT, ids=_ids(QUANT))
def test_quantize_variant_compiles_for_sm90(fn, signature, constexprs):
    ptx = _compile(fn, signature, constexprs).asm["ptx"]
    # bits must match the reference: no approximate fp32 division or reciprocal anywhere
    assert "div.full.f32" not in ptx and "div.approx" not in ptx and "rcp.approx" not in ptx
    assert ".target sm_90" in ptx


@pytest.mark.parametrize("fn, signature, constexprs", DEQUANT, ids=_ids(DEQUANT))
def test_dequantize_variant_compiles_for_sm90(fn, signature, constexprs):
    ptx = _compile(fn, signature, constexprs).asm["ptx"]
    assert "div.full.f32" not in ptx and "div.approx" not in ptx and "rcp.approx" not in ptx
