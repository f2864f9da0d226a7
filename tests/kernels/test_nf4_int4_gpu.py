"""Triton NF4 (and bnb_fp4) and AutoAWQ INT4 dequantize kernels are bit-identical to the CPU reference.

NaN bits: the kernels reproduce what the reference writes on an x86 host with vectorized ATen kernels
(AVX2; see ``_host_has_x86_vector_nans``). Elsewhere NaN elements are compared by position only.

Run on the device machine: ``python -m pytest -q -p no:cacheprovider -m gpu tests/kernels/test_nf4_int4_gpu.py``.
``test_bandwidth`` writes measured GB/s to ``$OUT/nf4_int4_bandwidth.json`` (``LOWBIT_SWEEP=1`` adds a
tile sweep).
"""

from dataclasses import replace

import pytest
import torch

import lowbit
from lowbit.formats import int4_awq as ref_awq
from lowbit.formats import nf4 as ref_nf4
from lowbit.formats import bnb_fp4 as ref_fp4
from lowbit.formats.packing import unpack_nibbles_high_first
from lowbit.formats.qtensor import QTensor
from lowbit.kernels import int4_awq as k_awq
from lowbit.kernels import nf4 as k_nf4
from lowbit.testing import assert_bitexact

pytestmark = pytest.mark.gpu

OUT_DTYPES = [torch.float32, torch.bfloat16, torch.float16]
ELEMS = k_nf4.TILE["elems"]


def _bits(values, dtype=torch.int32):
    return torch.tensor([v - (1 << 32) if v >= 1 << 31 else v for v in values], dtype=dtype)


def _f32(*bits):
    return _bits(bits).view(torch.float32)


def _host_has_x86_vector_nans() -> bool:
    """Whether this host's torch CPU kernels give the NaN bits the kernels reproduce: x86 default NaN
    0xFFC00000 for 0 * inf, payloads kept (quieted) through fp32 ops and F16C half conversions. A scalar
    ATen build (ATEN_CPU_CAPABILITY=default) or an aarch64 host writes other NaN bits."""
    zero_inf = (torch.zeros(64) * torch.full((64,), float("inf"))).view(torch.int32)[0].item()
    f = torch.full((64,), 0x7F812345, dtype=torch.int32).view(torch.float32)
    to_half = (f * 1.0).half().view(torch.int16)[0].item() & 0xFFFF
    h = torch.full((64,), 0x7D23, dtype=torch.int16).view(torch.float16)
    half_mul = (h * torch.ones(64, dtype=torch.float16)).view(torch.int16)[0].item() & 0xFFFF
    return zero_inf == -0x400000 and to_half == 0x7E09 and half_mul == 0x7F23


X86_NANS = _host_has_x86_vector_nans()


def _assert_matches(got, want, what):
    """Bit-exact; on a host whose reference writes other NaN bits, NaN positions must still agree and every
    other element must be bit-exact."""
    if X86_NANS:
        assert_bitexact(got, want, what)
        return
    got = got.cpu()
    nan = want.float().isnan()
    assert torch.equal(got.float().isnan(), nan), f"{what}: NaN positions differ"
    assert_bitexact(got[~nan], want[~nan], what + " (non-NaN elements; host NaN bits are not x86's)")


def _check_nf4(q, what=""):
    for dt in OUT_DTYPES:
        want = ref_nf4.dequantize_nf4(q, dt)
        got = k_nf4.dequantize_nf4(q.to("cuda"), dt)
        _assert_matches(got, want, f"nf4 {what} -> {dt}")


def _nf4_input(n, seed, adversarial=True):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * torch.logspace(-3, 3, n).clamp(min=1e-30)
    if adversarial and n >= 4096:
        x[:128] = 0.0                                   # all-zero blocks: absmax 0, codes 7
        x[128:256] = -0.0
        x[300] = float("nan")                           # NaN block: absmax NaN, every product NaN
        x[700] = float("inf")                           # inf block: 0 * inf for code 7
        x[1100] = -float("inf")
        x[1500:1564] = 1e-40                            # subnormal absmax
        x[2000:2064] = torch.tensor([3e38, -3e38] * 32)  # huge absmax
    return x


# ---------------------------------------------------------------------------------------------------- NF4

@pytest.mark.parametrize("blocksize", ref_nf4.BLOCKSIZES)
@pytest.mark.parametrize("double_quant", [False, True])
@pytest.mark.parametrize("n", [1, 7, 4096, ELEMS * 3, ELEMS * 3 + 1, 100_003])
def test_nf4_random_and_adversarial(blocksize, double_quant, n):
    for dtype in (torch.float32, torch.bfloat16):
        x = _nf4_input(n, seed=n + blocksize, adversarial=True).to(dtype)
        _check_nf4(ref_nf4.quantize_nf4(x, blocksize, double_quant), f"n={n} bs={blocksize} dq={double_quant}")


@pytest.mark.parametrize("shape", [(4096, 4096), (14336, 4096), (3, 5, 7), (1, 2049)])
def test_nf4_shapes_via_api(shape):
    x = torch.randn(shape, dtype=torch.bfloat16)
    for dq in (False, True):
        q = lowbit.quantize(x, "nf4", backend="torch", blocksize=64, double_quant=dq)
        qc = q.to("cuda")
        for dt in OUT_DTYPES:
            want = lowbit.dequantize(q, dt, backend="torch")
            _assert_matches(lowbit.dequantize(qc, dt, backend="triton"), want, f"triton {shape} dq={dq} {dt}")
            _assert_matches(lowbit.dequantize(qc, dt), want, f"auto {shape} dq={dq} {dt}")


def _flush(y):
    return torch.where(y.abs() < torch.finfo(torch.float32).tiny, y * 0.0, y)


def _flush_subnormal_products(q, dtype):
    """The reference's decode with fp32 subnormal products flushed to a signed zero, which is what
    bitsandbytes' CUDA ``dequantize_4bit`` computes (its kernels run with subnormals flushed; H100, bnb
    0.50.2: every subnormal product came back as +-0, every normal one bit for bit): the product of the
    double-quantized absmax decode (``dmap[code] * nested``, before the offset is added) and the final one."""
    if q.nested_scale is not None:
        n = q.scale.numel()
        nested = q.nested_scale.reshape(-1).repeat_interleave(ref_nf4.NESTED_BLOCKSIZE)[:n]
        absmax = _flush(ref_nf4.dynamic_map()[q.scale.reshape(-1).long()] * nested) + q.nested_offset.reshape(())
        q = replace(q, scale=absmax, nested_scale=None, nested_offset=None,
                                params={**q.params, "double_quant": False})
    y = _flush(ref_nf4.dequantize_nf4(q, torch.float32))
    if dtype == torch.bfloat16:
        return ref_nf4._to_bf16_bnb(y).reshape(q.shape)
    return y.to(dtype)


@pytest.mark.interop
@pytest.mark.parametrize("blocksize", [64, 128, 256])
@pytest.mark.parametrize("double_quant", [False, True])
@pytest.mark.parametrize("dtype", OUT_DTYPES)
def test_nf4_matches_bitsandbytes_cuda_dequantize(blocksize, double_quant, dtype):
    """bitsandbytes' CUDA ``dequantize_4bit`` against the reference and the kernel, bit for bit on finite
    values, NaN in the same places. Inputs come from bnb's CPU ``quantize_4bit``; blocks straddle rows
    ((5, 100)), tails, subnormal and huge absmax, zero blocks. Products below fp32's normal range are where
    bnb's CUDA kernel departs from the format (it flushes them to +-0): the reference and lowbit's kernel keep
    them, and bnb matches the reference with those flushed."""
    bnbf = pytest.importorskip("bitsandbytes.functional")
    g = torch.Generator().manual_seed(blocksize + double_quant)
    cases = [torch.randn(64, 256, generator=g) * 3, torch.randn(5, 100, generator=g), torch.randn(4, 32, generator=g),
             _nf4_input(4096 + 77, seed=blocksize, adversarial=True).reshape(1, -1)]
    tiny = torch.full((2, 64), torch.finfo(torch.bfloat16).tiny) * torch.randn(2, 64, generator=g)  # subnormal out
    cases.append(tiny)
    for x in cases:
        x = x.to(dtype)
        packed, state = bnbf.quantize_4bit(x, blocksize=blocksize, compress_statistics=double_quant,
                                           quant_type="nf4")
        q = ref_nf4.quantize_nf4(x, blocksize, double_quant)
        assert torch.equal(packed.reshape(-1), q.data)
        state.to("cuda")
        theirs = bnbf.dequantize_4bit(packed.cuda(), state, quant_type="nf4").cpu().reshape(-1)
        want = ref_nf4.dequantize_nf4(q, dtype).reshape(-1)
        got = k_nf4.dequantize_nf4(q.to("cuda"), dtype).cpu().reshape(-1)
        what = f"{tuple(x.shape)} bs={blocksize} dq={double_quant} {dtype}"
        assert_bitexact(got, want, "kernel vs reference " + what, any_nan=True)
        assert_bitexact(_flush_subnormal_products(q, dtype).reshape(-1), theirs, "bnb CUDA " + what, any_nan=True)
        normal = ref_nf4.dequantize_nf4(q, torch.float32).reshape(-1).abs() >= torch.finfo(torch.float32).tiny
        if double_quant:  # and the block's absmax decode is normal (else bnb decodes another absmax)
            nested = q.nested_scale.reshape(-1).repeat_interleave(ref_nf4.NESTED_BLOCKSIZE)[:q.scale.numel()]
            product = ref_nf4.dynamic_map()[q.scale.reshape(-1).long()] * nested
            ok = (product.abs() >= torch.finfo(torch.float32).tiny) | (product == 0)
            normal &= ok.repeat_interleave(blocksize)[:normal.numel()]
        assert_bitexact(want[normal], theirs[normal], "reference vs bnb CUDA, normal products " + what, any_nan=True)


def test_nf4_nan_payloads_plain_absmax():
    """NaN absmax keeps its payload (quieted), 0 * inf is the x86 default NaN 0xFFC00000, -0 / negative /
    subnormal absmax."""
    n = 64 * 40 + 17
    q = ref_nf4.quantize_nf4(torch.randn(n), 64)
    scale = q.scale.clone()
    special = _f32(0x7F812345, 0xFFA00001, 0x7FFFFFFF, 0xFFFFE001, 0x7F800000, 0xFF800000, 0x80000000,
                   0x00000001, 0x807FFFFF, 0xBF800000, 0x7F7FFFFF, 0x7FC00000)
    scale[: special.numel()] = special
    scale[-1] = float("nan")                            # the tail block
    data = q.data.clone()
    data[:64] = torch.arange(64, dtype=torch.uint8) * 4 + 3  # every code, incl. 7 (0.0) next to inf absmax
    _check_nf4(replace(q, scale=scale, data=data), "nan payloads")


def test_nf4_double_quant_nan_rules():
    """Decoded absmax fp32(dmap[c] * nested) + offset with x86 NaN rules: NaN nested and offset payloads
    (the offset's NaN wins when both are NaN), 0 * inf (dmap has 0.0), inf - inf."""
    n = 64 * 256 * 3 + 64 * 5 + 3
    q = ref_nf4.quantize_nf4(torch.randn(n), 64, double_quant=True)
    codes = q.scale.clone()
    codes[:256] = torch.arange(256, dtype=torch.uint8)  # every dynamic-map code, incl. 0.0
    variants = []
    for nested_bits in ([0x7F812345, 0x7F800000, 0x3F800000, 0x00000001],
                        [0xFF800000, 0x7FFFFFFF, 0x80000000, 0x7F7FFFFF]):
        for off_bits in (0x3C000000, 0xFF854321, 0x7F800000, 0xFF800000, 0x80000000, 0x7FFFFFFF):
            variants.append((_f32(*nested_bits), _f32(off_bits).reshape(())))
    for nested, off in variants:
        qq = replace(q, scale=codes, nested_scale=nested, nested_offset=off)
        _check_nf4(qq, f"nested={nested.view(torch.int32).tolist()} off={off.view(torch.int32).item():#x}")


def test_nf4_every_byte_value():
    data = torch.arange(256, dtype=torch.uint8).repeat(64)
    n = data.numel() * 2
    scale = torch.linspace(-3, 3, n // 64)
    q = QTensor(data=data, scale=scale, fmt="nf4", shape=torch.Size([n]), dtype=torch.float32,
                params={"blocksize": 64, "double_quant": False})
    _check_nf4(q, "every byte")


def test_nf4_unaligned_packed_bytes():
    """A packed payload that is a view at an odd offset is copied to an aligned buffer (word loads)."""
    n = 64 * 100
    q = ref_nf4.quantize_nf4(torch.randn(n), 64, double_quant=True)
    qc = q.to("cuda")
    buf = torch.empty(qc.data.numel() + 1, dtype=torch.uint8, device="cuda")
    buf[1:] = qc.data
    for dt in OUT_DTYPES:
        _assert_matches(k_nf4.dequantize_nf4(replace(qc, data=buf[1:]), dt), ref_nf4.dequantize_nf4(q, dt), "odd")


def test_nf4_int64_indexing_beyond_2_31_elements():
    bs = 64
    n = (1 << 31) + 3 * ELEMS + 4099   # > 2^31 elements, tail program and odd count
    nbytes = (n + 1) // 2
    nblocks = -(-n // bs)
    g = torch.Generator(device="cuda").manual_seed(0)
    data = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device="cuda", generator=g)
    codes = torch.randint(0, 256, (nblocks,), dtype=torch.uint8, device="cuda", generator=g)
    nested = torch.rand(-(-nblocks // 256), device="cuda", generator=g) + 0.5
    off = torch.tensor(0.25, device="cuda")
    q = QTensor(data=data, scale=codes, fmt="nf4", shape=torch.Size([n]), dtype=torch.bfloat16,
                params={"blocksize": bs, "double_quant": True}, nested_scale=nested, nested_offset=off)
    got = k_nf4.dequantize_nf4(q, torch.bfloat16)
    # the reference on the last nested group(s), which start at an element multiple of 256 * bs
    start = ((n - 5 * ELEMS) // (256 * bs)) * (256 * bs)
    sub = QTensor(data=data[start // 2:].cpu(), scale=codes[start // bs:].cpu(), fmt="nf4",
                  shape=torch.Size([n - start]), dtype=torch.bfloat16,
                  params={"blocksize": bs, "double_quant": True},
                  nested_scale=nested[start // (256 * bs):].cpu(), nested_offset=off.cpu())
    assert_bitexact(got[start:], ref_nf4.dequantize_nf4(sub, torch.bfloat16), "tail beyond 2^31")


# ------------------------------------------------------------------------------------------------ bnb_fp4
# bitsandbytes' FP4 type: the NF4 kernel with the FP4 table (kernels.nf4.dequantize_bnb_fp4)


def _check_fp4(q, what=""):
    for dt in OUT_DTYPES:
        want = ref_fp4.dequantize_bnb_fp4(q, dt)
        got = k_nf4.dequantize_bnb_fp4(q.to("cuda"), dt)
        _assert_matches(got, want, f"bnb_fp4 {what} -> {dt}")


@pytest.mark.parametrize("blocksize", ref_nf4.BLOCKSIZES)
@pytest.mark.parametrize("double_quant", [False, True])
@pytest.mark.parametrize("n", [1, 7, 4096, ELEMS * 3 + 1, 100_003])
def test_bnb_fp4_random_and_adversarial(blocksize, double_quant, n):
    for dtype in (torch.float32, torch.bfloat16):
        x = _nf4_input(n, seed=n + blocksize, adversarial=True).to(dtype)
        q = ref_fp4.quantize_bnb_fp4(x, blocksize, double_quant)
        _check_fp4(q, f"n={n} bs={blocksize} dq={double_quant}")


@pytest.mark.parametrize("shape", [(4096, 4096), (3, 5, 7), (1, 2049)])
def test_bnb_fp4_shapes_via_api(shape):
    x = torch.randn(shape, dtype=torch.bfloat16)
    for dq in (False, True):
        q = lowbit.quantize(x, "bnb_fp4", backend="torch", blocksize=64, double_quant=dq)
        qc = q.to("cuda")
        for dt in OUT_DTYPES:
            want = lowbit.dequantize(q, dt, backend="torch")
            _assert_matches(lowbit.dequantize(qc, dt, backend="triton"), want, f"triton {shape} dq={dq} {dt}")
            _assert_matches(lowbit.dequantize(qc, dt), want, f"auto {shape} dq={dq} {dt}")


def test_bnb_fp4_every_byte_value_and_nan_rules():
    data = torch.arange(256, dtype=torch.uint8).repeat(64)
    n = data.numel() * 2
    scale = torch.linspace(-3, 3, n // 64)
    scale[:4] = _f32(0x7F812345, 0x7F800000, 0xFF800000, 0x80000000)  # NaN payload, +-inf, -0
    q = QTensor(data=data, scale=scale, fmt="bnb_fp4", shape=torch.Size([n]), dtype=torch.float32,
                params={"blocksize": 64, "double_quant": False})
    _check_fp4(q, "every byte")
    q = ref_fp4.quantize_bnb_fp4(torch.randn(64 * 600), 64, double_quant=True)
    for nested, off in ((_f32(0x7F800000, 0x3F000000, 0x3F800000), _f32(0x3C23D70A)),
                        (_f32(0x3F800000, 0x7FC01234, 0x3F800000), _f32(0xFF800000))):
        _check_fp4(replace(q, nested_scale=nested, nested_offset=off.reshape(())), "dq nan rules")


@pytest.mark.interop
@pytest.mark.parametrize("blocksize", [64, 128, 256])
@pytest.mark.parametrize("double_quant", [False, True])
@pytest.mark.parametrize("dtype", OUT_DTYPES)
def test_bnb_fp4_matches_bitsandbytes_cuda_dequantize(blocksize, double_quant, dtype):
    """bitsandbytes' CUDA ``dequantize_4bit(quant_type="fp4")`` against the reference and the kernel on codes
    from bnb's CPU ``quantize_4bit``. Two places where bnb's CUDA decode departs from its own table, which the
    reference follows: code 8 decodes to -0.0 there (a sign multiply; the table holds +0.0), and subnormal
    fp32 products flush to +-0 (as for nf4). Everything else is bit for bit; NaN in the same places."""
    bnbf = pytest.importorskip("bitsandbytes.functional")
    g = torch.Generator().manual_seed(blocksize + double_quant)
    cases = [torch.randn(64, 256, generator=g) * 3, torch.randn(5, 100, generator=g), torch.randn(4, 32, generator=g),
             _nf4_input(4096 + 77, seed=blocksize, adversarial=True).reshape(1, -1),
             torch.randn(2, 64, generator=g) * 1e-4 * torch.tensor([1e4] + [1.0] * 63)]  # code 8 and 0 zeros
    for x in cases:
        x = x.to(dtype)
        packed, state = bnbf.quantize_4bit(x, blocksize=blocksize, compress_statistics=double_quant,
                                           quant_type="fp4")
        q = ref_fp4.quantize_bnb_fp4(x, blocksize, double_quant)
        assert torch.equal(packed.reshape(-1), q.data)
        state.to("cuda")
        theirs = bnbf.dequantize_4bit(packed.cuda(), state, quant_type="fp4").cpu().reshape(-1)
        want = ref_fp4.dequantize_bnb_fp4(q, dtype).reshape(-1)
        got = k_nf4.dequantize_bnb_fp4(q.to("cuda"), dtype).cpu().reshape(-1)
        what = f"{tuple(x.shape)} bs={blocksize} dq={double_quant} {dtype}"
        assert_bitexact(got, want, "kernel vs reference " + what, any_nan=True)
        y = ref_fp4.dequantize_bnb_fp4(q, torch.float32).reshape(-1)
        code8 = unpack_nibbles_high_first(q.data, x.numel()) == 8
        normal = (y.abs() >= torch.finfo(torch.float32).tiny) & ~code8
        assert_bitexact(want[normal], theirs[normal], "reference vs bnb CUDA, normal products " + what, any_nan=True)
        zero = ~normal & ~y.isnan()
        assert (theirs[zero].float() == 0).all(), "bnb CUDA: code 8 and subnormal products are +-0 " + what


# ---------------------------------------------------------------------------------------------- INT4 AWQ

def _check_awq(q, what=""):
    for dt in OUT_DTYPES:
        want = ref_awq.dequantize_int4_awq(q, dt)
        got = k_awq.dequantize_int4_awq(q.to("cuda"), dt)
        _assert_matches(got, want, f"int4_awq {what} -> {dt}")


def _random_awq(out_f, in_f, group, seed, special_scales=False):
    """A QTensor with arbitrary packed words (every nibble pattern) and random fp16 scales."""
    g = torch.Generator().manual_seed(seed)
    ng = in_f // group
    qweight = torch.randint(-(1 << 31), 1 << 31, (in_f, out_f // 8), generator=g, dtype=torch.int64).to(torch.int32)
    qzeros = torch.randint(-(1 << 31), 1 << 31, (ng, out_f // 8), generator=g, dtype=torch.int64).to(torch.int32)
    scales = (torch.randn(ng, out_f, generator=g) * torch.logspace(-8, 4, out_f)).to(torch.float16)
    if special_scales:
        sv = scales.view(torch.int16).view(-1)
        # +-inf, NaN payloads (signalling, negative, all ones), max, subnormals, +-0
        pats = [0x7C00, 0xFC00, 0x7D23, 0xFFFF, 0x7E01, 0xFE00, 0x7BFF, 0x0001, 0x8000, 0x0000, 0x8001, 0x03FF,
                0x7FFF, 0xFC01]
        pats = torch.tensor([p - (1 << 16) if p >= 1 << 15 else p for p in pats], dtype=torch.int16)
        idx = torch.randperm(sv.numel(), generator=g)[: 4 * pats.numel()]
        sv[idx] = pats.repeat(4)[: idx.numel()]
    return QTensor(data=qweight, scale=scales, fmt="int4_awq", shape=torch.Size((out_f, in_f)),
                   dtype=torch.float16, zeros=qzeros, params={"group_size": group})


@pytest.mark.parametrize("out_f, in_f", [(6144, 4096), (4096, 14336), (14336, 4096), (8, 32), (24, 96), (1032, 384)])
@pytest.mark.parametrize("group", [32, 64, 128])
def test_int4_awq_random_words(out_f, in_f, group):
    if in_f % group:
        pytest.skip("group must divide in")
    _check_awq(_random_awq(out_f, in_f, group, seed=out_f + in_f + group, special_scales=True), f"{out_f}x{in_f} g{group}")


@pytest.mark.parametrize("out_f, in_f, group", [(16, 96, 96), (8, 12, 3), (40, 48, 6), (24, 28, 7), (16, 160, 160),
                                                (256, 14336, 14336), (8, 16, 1), (16, 384, 192)])
def test_int4_awq_any_group_dividing_in(out_f, in_f, group):
    _check_awq(_random_awq(out_f, in_f, group, seed=group, special_scales=True), f"{out_f}x{in_f} g{group}")


@pytest.mark.parametrize("group", [32, 64, 128])
def test_int4_awq_quantized_weight_via_api(group):
    x = torch.randn(6144, 4096, dtype=torch.bfloat16)
    q = lowbit.quantize(x[:1536, :], "int4_awq", backend="torch", group_size=group)
    qc = q.to("cuda")
    for dt in OUT_DTYPES:
        want = lowbit.dequantize(q, dt, backend="torch")
        _assert_matches(lowbit.dequantize(qc, dt, backend="triton"), want, f"triton g{group} {dt}")
        _assert_matches(lowbit.dequantize(qc, dt), want, f"auto g{group} {dt}")


def test_int4_awq_int64_indexing_beyond_2_31_elements():
    out_f, in_f, group = 8 * 32 * 1025, 8192, 128   # 262400 x 8192 > 2^31 outputs
    g = torch.Generator(device="cuda").manual_seed(0)
    qweight = torch.randint(-(1 << 31), 1 << 31, (in_f, out_f // 8), device="cuda", generator=g, dtype=torch.int64)
    qweight = qweight.to(torch.int32)
    qzeros = torch.randint(-(1 << 31), 1 << 31, (in_f // group, out_f // 8), device="cuda", generator=g,
                           dtype=torch.int64).to(torch.int32)
    scales = torch.rand(in_f // group, out_f, device="cuda", generator=g).to(torch.float16)
    q = QTensor(data=qweight, scale=scales, fmt="int4_awq", shape=torch.Size((out_f, in_f)), dtype=torch.float16,
                zeros=qzeros, params={"group_size": group})
    got = k_awq.dequantize_int4_awq(q, torch.float16)
    w = 40   # last 8 * w rows
    sub = QTensor(data=qweight[:, -w:].cpu().contiguous(), scale=scales[:, -8 * w:].cpu().contiguous(),
                  fmt="int4_awq", shape=torch.Size((8 * w, in_f)), dtype=torch.float16,
                  zeros=qzeros[:, -w:].cpu().contiguous(), params={"group_size": group})
    assert_bitexact(got[-8 * w:], ref_awq.dequantize_int4_awq(sub, torch.float16), "rows beyond 2^31")


# --------------------------------------------------------------------------------------------- bandwidth

def _gbs(fn, nbytes):
    from triton.testing import do_bench
    return nbytes / do_bench(fn, return_mode="median", warmup=25, rep=200) / 1e6


def _copy_gbs():
    src = torch.empty(1 << 29, dtype=torch.bfloat16, device="cuda")
    dst = torch.empty_like(src)
    return _gbs(lambda: dst.copy_(src), 2 * src.numel() * 2)

