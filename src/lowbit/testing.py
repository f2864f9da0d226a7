"""Assertions and fixtures for tests and benchmarks (no pytest import): bit-exact comparison with a useful report,
the W4A16 oracle, adversarial NVFP4 ties, and small checkpoints on disk with a digest of a directory's files."""

from __future__ import annotations

import os
from pathlib import Path

import torch

_INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def assert_bitexact(got: torch.Tensor, want: torch.Tensor, what: str = "tensor", any_nan: bool = False) -> None:
    """Raise AssertionError unless ``got`` and ``want`` have the same shape, dtype and bytes.

    With ``any_nan``, NaNs only have to sit in the same places (their bits may differ): torch's bf16 cast
    writes NaN as 0xFFFF in vectorised loops and 0x7FC0 in scalar tails, whose length depends on the host ISA.
    The message counts the differing elements and shows the first few with their values and bits.
    """
    if got.shape != want.shape or got.dtype != want.dtype:
        raise AssertionError(f"{what}: got {got.dtype}{tuple(got.shape)}, want {want.dtype}{tuple(want.shape)}")
    g = got.detach().cpu().contiguous()
    w = want.detach().cpu().contiguous()
    iv = _INT_VIEW[g.element_size()]
    gb, wb = g.view(iv), w.view(iv)
    diff = gb != wb
    if any_nan and g.is_floating_point():
        diff &= ~(g.isnan() & w.isnan())
    if not diff.any():
        return
    idx = diff.nonzero()[:6].tolist()
    lines = []
    for i in idx:
        t = tuple(i)
        lines.append(f"  at {t}: got {g[t].item()!r} (0x{gb[t].item() & 0xFFFFFFFF:x}) want {w[t].item()!r} "
                     f"(0x{wb[t].item() & 0xFFFFFFFF:x})")
    raise AssertionError(f"{what}: {int(diff.sum())} of {diff.numel()} elements differ\n" + "\n".join(lines))


def linear_oracle(x: torch.Tensor, w, bias: torch.Tensor | None = None, activation: str | None = None) -> torch.Tensor:
    """fp32 ``act(x @ dequant(w).T + bias)`` with the product and the bias add in float64: the oracle of the
    W4A16 kernel tests, one rounding away from exact (``lowbit.ops.linear_reference`` multiplies in fp32)."""
    from .api import dequantize
    from .ops.linear import apply_activation

    y = x.double() @ dequantize(w, torch.float32).double().T
    if bias is not None:
        y = y + bias.double()
    return apply_activation(y.float(), activation)


def nvfp4_order_ties() -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 ``x [R, 16]`` and a global scale ``S`` where NVFP4's two multiplier orders give different codes.

    vLLM computes the element multiplier as ``1/(sf * (1/S))``, LightX2V as ``S * (1/sf)``; for ``S = 3`` and
    block scales ``sf = 3.75 * 2^k`` the two differ in the last bit. Each row is one block whose absmax
    ``7.5 * 2^k`` makes ``S * (absmax * fp32(1/6)) = sf`` exactly (no E4M3 rounding: the Triton interpreter,
    whose fp8 casts are not trusted, can check these blocks too); its other 15 elements sit on and one ulp
    either side of ``t / m`` for every E2M1 tie ``t`` and both multipliers ``m``, with alternating signs.
    """
    s = torch.tensor(3.0)
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    rows = []
    for k in range(-6, 3):
        sf = torch.tensor(3.75 * 2.0**k)
        cands = []
        for m in (1.0 / (sf * (1.0 / s)), s * (1.0 / sf)):
            base = ties / m
            cands += [base, torch.nextafter(base, torch.full_like(base, float("inf"))),
                      torch.nextafter(base, torch.zeros_like(base))]
        c = torch.cat(cands)
        c = c * torch.tensor([1.0, -1.0]).repeat(c.numel() // 2 + 1)[: c.numel()]
        c = torch.cat([c, c[: -c.numel() % 15]]) if c.numel() % 15 else c
        blocks = c.reshape(-1, 15)
        amax = torch.full((blocks.shape[0], 1), 7.5 * 2.0**k)
        rows.append(torch.cat([amax, blocks], 1))
    return torch.cat(rows), s


def tree_digest(root: Path | str) -> dict[str, str]:
    """``{path relative to root: sha256}`` of every file below ``root``: two conversions wrote the same bytes iff
    their digests are equal. Files are read in 16 MB pieces over threads (hashlib releases the GIL on large
    buffers), so checkpoints of many GB take seconds."""
    from concurrent.futures import ThreadPoolExecutor

    from .io.files import file_sha256

    root = Path(root)
    files = sorted(p for p in root.rglob("*") if p.is_file())
    with ThreadPoolExecutor(max_workers=min(16, os.cpu_count() or 1)) as pool:
        return dict(zip((str(p.relative_to(root)) for p in files), pool.map(file_sha256, files)))


def write_tiny_llama(directory: Path | str, *, hidden: int = 64, intermediate: int = 128, layers: int = 2,
                     heads: int = 4, kv_heads: int = 2, vocab: int = 96, max_shard_size: str = "20KB",
                     seed: int = 0) -> Path:
    """A random bf16 transformers ``LlamaForCausalLM`` saved to ``directory`` in shards of ``max_shard_size``
    (several files even at these sizes); needs transformers."""
    import transformers

    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    transformers.LlamaForCausalLM._from_config(cfg, dtype=torch.bfloat16).save_pretrained(
        directory, max_shard_size=max_shard_size)
    return Path(directory)


def write_bare_blocks(directory: Path | str, blocks: tuple[int, ...], seed: int,
                      names: tuple[str, ...] = ("attn1.to_q", "attn1.to_k", "attn1.to_v", "ffn.net.0.proj")) -> Path:
    """Files ``part-<i>.safetensors`` holding ``blocks[i]`` DiT-style blocks each (a 64 x 64 bf16 weight per name
    and a norm weight), no config.json: the name rules decide which tensors are Linear weights."""
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(seed)
    d = Path(directory)
    d.mkdir(parents=True)
    for i, n_blocks in enumerate(blocks):
        t = {}
        for b in range(n_blocks):
            for name in names:
                t[f"blocks.{i}.{b}.{name}.weight"] = torch.randn(64, 64, generator=g).to(torch.bfloat16)
            t[f"blocks.{i}.{b}.norm1.weight"] = torch.ones(64)
        save_file(t, str(d / f"part-{i}.safetensors"))
    return d

