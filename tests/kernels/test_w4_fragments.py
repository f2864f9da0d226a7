"""``kernels.w4_fragments``: the register-fragment layout of a packed 4-bit weight (CPU)."""

import pytest
import torch

from lowbit.kernels.w4_fragments import fragment_codes, fragment_words


def _codes(n, k, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n, k // 2), generator=g, dtype=torch.uint8)


@pytest.mark.parametrize("n, k", [(64, 64), (200, 160), (1, 32), (130, 4096)])
def test_round_trip_and_padding(n, k):
    codes = _codes(n, k)
    words = fragment_words(codes, k)
    assert words.dtype == torch.int32 and words.shape == (-(-n // 64), -(-k // 64), 512)
    assert torch.equal(fragment_codes(words, n, k), codes)
    # padded rows and columns hold zero codes
    full = fragment_codes(words, words.shape[0] * 64, words.shape[1] * 64)
    assert not full[n:].any() and not full[:, k // 2:].any()


def test_each_thread_finds_its_fragment():
    # what the kernel computes per thread: row 16 w + 8 h + l, column 16 c + 8 g + 2 q + j is nibble h + 2 g + 4 j
    # of word (w, l, q, c) of its tile and K step
    n, k = 128, 128
    codes = _codes(n, k, seed=1)
    nib = torch.stack((codes & 15, codes >> 4), dim=-1).reshape(n, k)
    words = fragment_words(codes, k)
    for t in range(2):
        for s in range(2):
            for w in range(4):
                for l in (0, 5, 7):
                    for q in range(4):
                        for c in range(4):
                            word = int(words[t, s, ((w * 8 + l) * 4 + q) * 4 + c]) & 0xFFFFFFFF
                            for h in range(2):
                                for g in range(2):
                                    for j in range(2):
                                        r, col = 64 * t + 16 * w + 8 * h + l, 64 * s + 16 * c + 8 * g + 2 * q + j
                                        assert (word >> (4 * (h + 2 * g + 4 * j))) & 15 == nib[r, col]


def test_refuses_bad_codes():
    with pytest.raises(ValueError, match="uint8"):
        fragment_words(torch.zeros(4, 8, dtype=torch.int32), 16)
    with pytest.raises(ValueError, match="K = 32"):
        fragment_words(torch.zeros(4, 8, dtype=torch.uint8), 32)


def _run_ptx(asm: str, word: int) -> list[int]:
    """Execute the shift / and / or PTX of a register-fragment decode on one input word (``$4``, the first of
    the pack's eight copies): the four 32-bit outputs ``$0`` .. ``$3``."""
    import re

    regs = {"$4": word & 0xFFFFFFFF}
    body = asm.strip().strip("{}")
    for stmt in body.split(";"):
        stmt = stmt.strip()
        if not stmt or stmt.startswith(".reg"):
            continue
        op, args = stmt.split(None, 1)
        d, *src = [a.strip() for a in args.split(",")]
        vals = [int(a, 16) if a.startswith("0x") else (int(a) if re.fullmatch(r"\d+", a) else regs[a]) for a in src]
        if op == "shl.b32":
            r = vals[0] << vals[1]
        elif op == "shr.b32":
            r = vals[0] >> vals[1]
        elif op == "and.b32":
            r = vals[0] & vals[1]
        elif op == "or.b32":
            r = vals[0] | vals[1]
        else:
            raise AssertionError(f"unexpected PTX op {op}")
        regs[d] = r & 0xFFFFFFFF
    return [regs[f"${i}"] for i in range(4)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("fmt", ["fp4", "int4"])
def test_the_kernels_pair_decode_gives_every_codes_value(fmt, dtype):
    # the inline PTX of _gemm_w4_rf, run on CPU for random words: output register p holds nibble p in its low
    # half and nibble p + 4 in its high half, as E2M1 bits (times 2^126 for bf16, 2^14 for fp16, done after the
    # PTX) or as magic + code (128 + q in bf16, 1024 + q in fp16)
    pytest.importorskip("triton.experimental.gluon")
    from lowbit.kernels import _gemm_w4_rf as rf

    e2m1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]

    bf16 = dtype == torch.bfloat16
    if fmt == "fp4":
        asm = (rf._FP4_BF16 if bf16 else rf._FP4_F16).value
    else:
        asm = (rf._INT4_BF16 if bf16 else rf._INT4_F16).value
    g = torch.Generator().manual_seed(3)
    words = torch.randint(0, 2**32, (200,), generator=g, dtype=torch.int64).tolist() + [0, 0xFFFFFFFF, 0x76543210]
    for word in words:
        out = _run_ptx(asm, word)
        halves = torch.tensor([[o & 0xFFFF, o >> 16] for o in out], dtype=torch.int32).to(torch.int16)
        vals = halves.view(dtype).float()
        for p in range(4):
            for j in range(2):
                code = (word >> (4 * (p + 4 * j))) & 15
                if fmt == "fp4":
                    want = e2m1[code] if code < 8 else -e2m1[code - 8]
                    got = vals[p, j].item() * (2.0**126 if bf16 else 2.0**14)
                    assert got == want or (want == 0 and got == 0), (hex(word), p, j, code, got)
                    if code == 8:
                        assert halves[p, j].item() & 0xFFFF == 0x8000  # -0 keeps its sign
                else:
                    assert vals[p, j].item() == (128.0 if bf16 else 1024.0) + code, (hex(word), p, j)


@pytest.mark.parametrize("wg", [1, 2])
@pytest.mark.parametrize("n, k", [(200, 160), (64, 64), (130, 4096)])
def test_the_kernels_indexing_reads_the_weight(n, k, wg):
    # the register-fragment kernel's offsets, mirrored in torch: program tile n0 (64 wg rows), K step s, warp ww
    # (64-row tile n0 / 64 + ww // 4), lane (l, q), chunk c -> word ((t64 * KS) * 4 + ww % 4) * 128 + (4 l + q) * 4 +
    # c + 512 s; element (h, g, j) of the word at row n0 + 16 ww + 8 h + l, column 64 s + 16 c + 8 g + 2 q + j, with
    # the block scale of column (64 s + 16 c) // 16: together they must give dequantize(w) for nvfp4
    import lowbit

    torch.manual_seed(n + k)
    w = lowbit.quantize(torch.randn(n, k), "nvfp4", global_scale=torch.tensor(1.0))  # the epilogue's factor: 1
    codes = w.data.view(torch.uint8)
    words = fragment_words(codes, k).reshape(-1)
    ks = -(-k // 64)
    e2m1 = torch.tensor([0.0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6])
    scales = w.scale.view(torch.float8_e4m3fn).float()
    got = torch.full((-(-n // (64 * wg)) * 64 * wg, ks * 64), float("nan"))
    ww, h, l, c, g, q, j = torch.meshgrid(*[torch.arange(d) for d in (4 * wg, 2, 8, 4, 2, 4, 2)], indexing="ij")
    for n0 in range(0, n, 64 * wg):
        t64 = n0 // 64 + ww // 4
        for s in range(ks):
            off = ((t64 * ks) * 4 + ww % 4) * 128 + (4 * l + q) * 4 + c + 512 * s
            ok = t64 < -(-n // 64)
            word = torch.where(ok, words[off.clamp(max=words.numel() - 1)].long() & 0xFFFFFFFF, 0)
            code = (word >> (4 * (h + 2 * g + 4 * j))) & 15
            rows = n0 + 16 * ww + 8 * h + l
            cols = 64 * s + 16 * c + 8 * g + 2 * q + j
            scol = (64 * s + 16 * c) // 16
            sc = torch.where((rows < n) & (scol < k // 16),
                             scales[rows.clamp(max=n - 1), scol.clamp(max=k // 16 - 1)], 0.0)
            got[rows, cols] = e2m1[code] * sc
    assert torch.equal(got[:n, :k], lowbit.dequantize(w, torch.float32))
