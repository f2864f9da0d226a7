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
