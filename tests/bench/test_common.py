"""lowbit.bench.common helpers on CPU."""

import torch

import lowbit


def test_weight_bytes_counts_each_tensor_once():
    """Parameters, persistent buffers and tied weights once each; non-persistent buffers not at all (a plain
    state_dict() detaches its tensors into new objects, so pairing them with the parameters by identity
    counted every parameter twice)."""
    from torch import nn

    from lowbit.bench.common import weight_bytes

    lin = nn.Linear(8, 4).to(torch.bfloat16)
    lin.register_buffer("cache", torch.zeros(100), persistent=False)
    assert weight_bytes(lin) == (8 * 4 + 4) * 2
    emb = nn.Embedding(10, 4)
    head = nn.Linear(4, 10, bias=False)
    head.weight = emb.weight
    assert weight_bytes(nn.ModuleList([emb, head])) == 10 * 4 * 4
    q = lowbit.quantize_model(nn.Sequential(nn.Linear(64, 32)), "w4a16-nvfp4")
    assert weight_bytes(q) == sum(t.numel() * t.element_size() for t in q.state_dict().values())
