"""The tensor-core GEMV's pre-layout (``gemv_mma_layout.mma_layout``), checked on CPU: every E2M1 code and scale lands
where the kernel's decode (``_gemv_mma``) reads it. The kernel itself is GPU-only (inline PTX mma.sync): see
test_gemv_mma_gpu.py."""

import pytest
import torch

import lowbit
from lowbit.formats.packing import unpack_fp4
from lowbit.kernels import gemv_mma_layout as L
from lowbit.kernels import gemv_w4 as G
from lowbit.kernels.gemv_prepack import prepare_w4


def _decoded_codes(words: torch.Tensor, h: int, c: int) -> torch.Tensor:
    w = words.to(torch.int64) & 0xFFFFFFFF
    pos = L._MMA_BITS[(h, c)]
    return sum(((w >> pos[b]) & 1) << b for b in range(4))     # [G, KQ, 32, 4]


@pytest.mark.parametrize("fmt,n,k", [("nvfp4", 40, 128), ("mxfp4", 16, 192), ("nvfp4", 33, 64)])
def test_layout_round_trip(fmt, n, k):
    q = lowbit.quantize(torch.randn(n, k, generator=torch.Generator().manual_seed(n)), fmt)
    lay = L.mma_layout(prepare_w4(q))
    n16 = -(-n // 16)
    assert lay.words.shape == (n16, k // 64, 32, 4) and lay.words.dtype == torch.int32
    codes = torch.zeros(16 * n16, k, dtype=torch.int64)
    codes[:n] = unpack_fp4(q.data).to(torch.int64)
    rg = torch.arange(n16)[:, None, None, None]
    kq = torch.arange(k // 64)[None, :, None, None]
    lane = torch.arange(32)[None, None, :, None]
    i = torch.arange(4)[None, None, None, :]
    for (h, c) in L._MMA_BITS:
        rows = 16 * rg + 8 * h + lane // 4
        cols = 64 * kq + 16 * (lane % 4) + 4 * i + c
        assert torch.equal(_decoded_codes(lay.words, h, c), codes[rows, cols]), (h, c)
    # the 32 bit positions are a permutation: every bit of a word is one element's
    bits = sorted(b for pos in L._MMA_BITS.values() for b in pos)
    assert bits == list(range(32))
    sc = torch.zeros(16 * n16, q.scale.shape[1], dtype=torch.int64)
    sc[:n] = q.scale.view(torch.uint8).to(torch.int64)
    pairs = lay.scales.to(torch.int64) & 0xFFFF                  # [G, SB, 8]
    g = torch.arange(8)
    for r in range(n16):
        assert torch.equal(pairs[r] & 0xFF, sc[16 * r + g].T)
        assert torch.equal(pairs[r] >> 8, sc[16 * r + 8 + g].T)


def test_layout_not_made_where_the_kernel_does_not_apply():
    assert L.mma_layout(prepare_w4(lowbit.quantize(torch.randn(32, 96), "nvfp4"))) is None       # K % 64
    # NF4 blocks of 32 columns: a 64-column chunk would span two absmax blocks
    assert L.mma_layout(prepare_w4(lowbit.quantize(torch.randn(32, 128), "nf4", blocksize=32))) is None
    q = lowbit.quantize(torch.randn(32, 128), "mxfp4")
    q.scale.view(torch.uint8)[3, 1] = 192
    assert L.mma_layout(prepare_w4(q)) is None


def test_describe_names_the_kernel_the_default_runs():
    from types import SimpleNamespace

    small = lowbit.quantize(torch.randn(64, 128), "nvfp4")
    assert G.describe(small, 1) == "CUDA-core FMA GEMV"                         # M = 1, small weight
    assert G.describe(small, 2).startswith("tensor-core mma.sync GEMV for bf16 x (CUDA-core FMA")
    assert G.describe(small, 16).startswith("tensor-core mma.sync GEMV for bf16 x (tl.dot")
    big = SimpleNamespace(fmt="mxfp4", shape=(16384, G.MMA["m1_min_weights"]["other"] // 16384))
    assert G.describe(big, 1).startswith("tensor-core") and "scale codes above 191" in G.describe(big, 1)
    odd_k = lowbit.quantize(torch.randn(64, 96), "nvfp4")                       # K % 64 != 0
    assert G.describe(odd_k, 8) == "tl.dot GEMV"
    awq = lowbit.quantize(torch.randn(64, 128, dtype=torch.float16), "int4_awq", group_size=64)
    assert G.describe(awq, 3) == G.describe(awq, 16) == "tensor-core mma.sync GEMV (bf16 or fp16 x)"
    assert G.describe(awq, 1) == "CUDA-core FMA GEMV"
    # M = 1: NF4 switches to the tensor-core GEMV on smaller weights than the FP4 formats
    nf4_mid = SimpleNamespace(fmt="nf4", shape=(8192, 8192), params={"blocksize": 64})
    assert G.describe(nf4_mid, 1).startswith("tensor-core")
    assert G.describe(SimpleNamespace(fmt="nvfp4", shape=(8192, 8192)), 1) == "CUDA-core FMA GEMV"
    assert G.describe(SimpleNamespace(fmt="nf4", shape=(4096, 4096), params={"blocksize": 64}), 1) \
        == "CUDA-core FMA GEMV"
    nf4 = lowbit.quantize(torch.randn(64, 128), "nf4")
    assert G.describe(nf4, 5) == "tensor-core mma.sync GEMV (bf16 or fp16 x)"
    assert G.describe(lowbit.quantize(torch.randn(64, 128), "nf4", blocksize=32), 5) == "tl.dot GEMV"
    awq32 = lowbit.quantize(torch.randn(64, 128, dtype=torch.float16), "int4_awq", group_size=32)
    assert G.describe(awq32, 3) == "CUDA-core FMA GEMV" and G.describe(awq32, 16) == "tl.dot GEMV"


@pytest.mark.parametrize("n,k,group", [(40, 256, 128), (16, 192, 64), (104, 512, 256)])
def test_int4_layout_round_trip(n, k, group):
    """Every int4 code lands at the nibble the kernel's decode reads, and each lane's (scale, zero) pairs hold
    the fp16 scale and the zero of its rows g and g + 8 in the chunk's group."""
    from lowbit.formats.int4_awq import int4_awq_codes

    q = lowbit.quantize(torch.randn(n, k, generator=torch.Generator().manual_seed(k), dtype=torch.float32).half(),
                        "int4_awq", group_size=group)
    lay = L.mma_layout(prepare_w4(q))
    n16 = -(-n // 16)
    assert lay.words.shape == (n16, k // 64, 32, 4) and lay.cpg == group // 64
    assert lay.scales.shape == (n16, k // group, 8, 2) and lay.scales.dtype == torch.int32
    codes = torch.zeros(16 * n16, k, dtype=torch.int64)
    q_codes, q_zeros = int4_awq_codes(q)
    codes[:n] = q_codes.t().to(torch.int64)
    w = lay.words.to(torch.int64) & 0xFFFFFFFF
    rg = torch.arange(n16)[:, None, None, None]
    kq = torch.arange(k // 64)[None, :, None, None]
    lane = torch.arange(32)[None, None, :, None]
    i = torch.arange(4)[None, None, None, :]
    for (h, c), pos in L._MMA_INT4_BITS.items():
        rows = 16 * rg + 8 * h + lane // 4
        cols = 64 * kq + 16 * (lane % 4) + 4 * i + c
        assert torch.equal((w >> pos) & 0xF, codes[rows, cols]), (h, c)
    assert sorted(b for pos in L._MMA_INT4_BITS.values() for b in range(pos, pos + 4)) == list(range(32))
    s_bits = torch.zeros(16 * n16, k // group, dtype=torch.int64)
    s_bits[:n] = q.scale.t().contiguous().view(torch.int16).to(torch.int64) & 0xFFFF
    zeros = torch.zeros(16 * n16, k // group, dtype=torch.int64)
    zeros[:n] = q_zeros.t().to(torch.int64)
    pairs = lay.scales.to(torch.int64) & 0xFFFFFFFF                 # [G, NG, 8, 2]
    g = torch.arange(8)
    for r in range(n16):
        assert torch.equal(pairs[r, :, :, 0] & 0xFFFF, s_bits[16 * r + g].T)
        assert torch.equal(pairs[r, :, :, 0] >> 16, s_bits[16 * r + 8 + g].T)
        assert torch.equal(pairs[r, :, :, 1] & 0xFFFF, zeros[16 * r + g].T)
        assert torch.equal(pairs[r, :, :, 1] >> 16, zeros[16 * r + 8 + g].T)


def _prmt(a: torch.Tensor, b: torch.Tensor, sel) -> torch.Tensor:
    """PTX ``prmt.b32`` (default mode) on int64 tensors holding 32-bit values."""
    src = [(a >> (8 * i)) & 0xFF for i in range(4)] + [(b >> (8 * i)) & 0xFF for i in range(4)]
    out = torch.zeros_like(a)
    for k in range(4):
        s = (sel >> (4 * k)) & 0xF
        s = torch.as_tensor(s, dtype=torch.int64).expand_as(a)
        byte = torch.zeros_like(a)
        for idx in range(8):
            byte = torch.where((s & 7) == idx, src[idx], byte)
        byte = torch.where((s & 8) != 0, torch.where((byte & 0x80) != 0, 0xFF, 0), byte)
        out |= byte << (8 * k)
    return out


def _nf4_decode_word(w: torch.Tensor, table: tuple) -> list:
    """The NF4 asm of one word (``_gemv_mma._nf4_word``), instruction for instruction: the 4 A registers."""
    from lowbit.kernels import _gemv_mma as km

    t = [v & 0xFFFFFFFF for v in table]
    lo, hi = t[:4], t[4:]
    s = w & 0x77777777
    u = (w << 4) & 0xFFFFFFFF
    masks = (_prmt(u, w, km.NF4_MASK_LO), _prmt(u, w, km.NF4_MASK_HI))
    regs = []
    for half in range(2):
        if half:
            s = s >> 16
        m = masks[half]
        a, b = _prmt(torch.full_like(w, lo[0]), torch.full_like(w, lo[1]), s), \
            _prmt(torch.full_like(w, lo[2]), torch.full_like(w, lo[3]), s)
        xl = (a & ~m) | (b & m)                                         # lop3 0xD8
        a, b = _prmt(torch.full_like(w, hi[0]), torch.full_like(w, hi[1]), s), \
            _prmt(torch.full_like(w, hi[2]), torch.full_like(w, hi[3]), s)
        xh = (a & ~m) | (b & m)
        regs += [_prmt(xl, xh, km.NF4_PAIR_01), _prmt(xl, xh, km.NF4_PAIR_23)]
    return regs


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("n,k,blocksize,dq", [(40, 256, 64, False), (16, 192, 64, True), (104, 512, 128, True),
                                              (33, 256, 256, False)])
def test_nf4_layout_and_table_decode(n, k, blocksize, dq, dtype):
    """Every NF4 code lands where the kernel's prmt decode reads it, and that decode (emulated instruction for
    instruction) gives each A register the level of the right element, rounded to the mma operand type; each
    lane's absmax pair is bit for bit bitsandbytes' fp32 absmax (double quantization decoded)."""
    from lowbit.formats.nf4 import nf4_absmax, quantize_nf4
    from lowbit.formats.packing import unpack_nibbles_high_first
    from lowbit.formats.spec import NF4

    x = torch.randn(n, k, generator=torch.Generator().manual_seed(n + k))
    x[0, :blocksize] = 0                                               # a zero block
    q = quantize_nf4(x, blocksize=blocksize, double_quant=dq)
    lay = L.mma_layout(prepare_w4(q))
    n16 = -(-n // 16)
    assert lay.words.shape == (n16, k // 64, 32, 4) and lay.cpg == blocksize // 64
    assert lay.scales.shape == (n16, k // blocksize, 8, 2) and lay.scales.dtype == torch.int32
    codes = torch.zeros(16 * n16, k, dtype=torch.int64)
    codes[:n] = unpack_nibbles_high_first(q.data, n * k).reshape(n, k).to(torch.int64)
    levels = torch.tensor(NF4.levels, dtype=torch.float32).to(dtype).view(torch.int16).to(torch.int64) & 0xFFFF
    w = lay.words.to(torch.int64) & 0xFFFFFFFF
    regs = _nf4_decode_word(w, lay.table(dtype))
    rg = torch.arange(n16)[:, None, None, None]
    kq = torch.arange(k // 64)[None, :, None, None]
    lane = torch.arange(32)[None, None, :, None]
    i = torch.arange(4)[None, None, None, :]
    # A register j: rows g (j even) / g + 8 (j odd), columns c = 0, 1 (j < 2) / 2, 3; half e is column c + e
    for j in range(4):
        h = j % 2
        for e in range(2):
            c = 2 * (j // 2) + e
            rows = 16 * rg + 8 * h + lane // 4
            cols = 64 * kq + 16 * (lane % 4) + 4 * i + c
            got = (regs[j] >> (16 * e)) & 0xFFFF
            assert torch.equal(got, levels[codes[rows, cols]]), (j, e)
    assert sorted(b for pos in L._MMA_NF4_BITS.values() for b in range(pos, pos + 4)) == list(range(32))
    absmax = torch.zeros(16 * n16, k // blocksize, dtype=torch.float32)
    absmax[:n] = nf4_absmax(q).reshape(n, k // blocksize)
    bits = absmax.view(torch.int32)
    g = torch.arange(8)
    for r in range(n16):
        assert torch.equal(lay.scales[r, :, :, 0], bits[16 * r + g].T)
        assert torch.equal(lay.scales[r, :, :, 1], bits[16 * r + 8 + g].T)


@pytest.mark.parametrize("routes", [{}, G.ROW_BLOCKS_MAX_M])
def test_plan_key_is_hashable_and_ignores_routing_keys(routes):
    """Launch plans are cached per key: the config's per-format routing dicts must not enter it."""
    cfg = {**G.MMA, "row_blocks_max_m": dict(routes)}
    key = G.mma_plan_key(24, None, 0, torch.bfloat16, cfg, 0, torch.bfloat16)
    hash(key)
    assert key == G.mma_plan_key(24, None, 0, torch.bfloat16, {**cfg, "row_blocks_max_m": {"nvfp4": 17}}, 0,
                                 torch.bfloat16)
    assert key != G.mma_plan_key(24, None, 0, torch.bfloat16, {**cfg, "rg": 4}, 0, torch.bfloat16)


@pytest.mark.parametrize("m, block_rows, nt, mb", [
    (1, 32, 1, 1), (9, 32, 2, 1), (16, 32, 2, 1), (17, 32, 3, 1), (24, 32, 3, 1), (25, 32, 4, 1), (32, 32, 4, 1),
    (33, 32, 3, 2), (40, 32, 3, 2), (64, 32, 4, 2), (17, 16, 2, 2), (40, 16, 2, 3), (64, 16, 2, 4), (40, 24, 3, 2),
])
def test_plan_blocks_of_x_rows(monkeypatch, m, block_rows, nt, mb):
    """M past 16 goes in the fewest blocks of at most block_rows rows, each of ceil(rows / 8) n-tiles; the
    grid, workspace rows and counters follow."""
    monkeypatch.setattr(G, "_num_sms", lambda index: 132)
    cfg = {**G.MMA, "block_rows": block_rows}
    plan = G.mma_plan(m, 4096, 4096, 0, 1, 1, 1.0, False, 0, torch.bfloat16, 0, cfg)
    assert (plan.consts["NT"], plan.consts["MB"]) == (nt, mb)
    assert 8 * nt * mb >= m and plan.mp == 8 * nt * mb and plan.grid[0] % mb == 0


@pytest.mark.parametrize("block_rows", [0, 12, 40, 64, "32"])
def test_plan_block_rows_checked(monkeypatch, block_rows):
    monkeypatch.setattr(G, "_num_sms", lambda index: 132)
    with pytest.raises(ValueError, match="block_rows"):
        G.mma_plan(40, 4096, 4096, 0, 1, 1, 1.0, False, 0, torch.bfloat16, 0, {**G.MMA, "block_rows": block_rows})
