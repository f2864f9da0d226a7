"""The custom-op plumbing shared by lowbit.linear and lowbit.scaled_mm (CPU)."""

import random

import pytest
import torch

from lowbit.ops import op_common


@pytest.mark.parametrize("seed", range(3))
def test_decimal_matches_str(seed):
    rng = random.Random(seed)
    values = [0, 1, 9, 10, 99, 100, 128, 7168, -1, -10, -128] + [rng.randint(-(10**12), 10**12) for _ in range(500)]
    for v in values:
        assert op_common._decimal(v) == str(v)


def test_encode_symint_params_under_dynamic_compile():
    # under dynamic=True the ints reach encode() as SymInts; str() of one is not traceable, the encoding must be
    def f(t):
        k = t.shape[0] * 8 + 64
        meta = op_common.encode("block", (1, k), [], op="t", what="w", extended=True)
        meta += ";" + op_common.encode("n", k, [], op="t", what="w", extended=True)
        items = dict(op_common.decode_items(meta, []))
        return t * items["block"][1] + items["n"]

    compiled = torch.compile(f, fullgraph=True, dynamic=True, backend="eager")
    for m in (3, 17, 250):
        t = torch.ones(m)
        assert torch.equal(compiled(t), f(t))
        assert compiled(t)[0].item() == 2 * (m * 8 + 64)
