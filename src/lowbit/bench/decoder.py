"""The decoder the model-level benchmarks time: a Llama-shaped model with random weights (no downloads) over a
static KV cache.

:class:`DecoderShape` sizes it (:data:`SHAPES`: Llama-3-8B, and a tiny one for CPU tests);
:class:`DecoderBlock` is one layer (RMSNorm, RoPE, SDPA over the cache with a position mask, SwiGLU MLP), its
heads sized from its projections so that a tensor-parallel rank can hold its share of them
(:mod:`lowbit.bench.tp`); :func:`register_decode_buffers` adds the cache and the RoPE tables; :class:`Decoder`
and :func:`build_decoder` make the whole model.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class DecoderShape:
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    layers: int



SHAPES = {
    "llama3-8b": DecoderShape(4096, 14336, 32, 8, 128, 128256, 32),
    "tiny": DecoderShape(128, 256, 4, 2, 32, 512, 2),
}



class DecoderMLP(nn.Module):
    """Llama's MLP, laid out as transformers' ``LlamaMLP`` (``gate_proj``, ``up_proj``, ``down_proj``, ``act_fn``):
    ``down_proj(act_fn(gate_proj(x)) * up_proj(x))``."""

    def __init__(self, s: DecoderShape, dtype: torch.dtype, device) -> None:
        super().__init__()
        kw = {"bias": False, "dtype": dtype, "device": device}
        self.gate_proj = nn.Linear(s.hidden, s.intermediate, **kw)
        self.up_proj = nn.Linear(s.hidden, s.intermediate, **kw)
        self.down_proj = nn.Linear(s.intermediate, s.hidden, **kw)
        self.act_fn = nn.SiLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class DecoderBlock(nn.Module):
    """One Llama decoder layer over a static KV cache (the heads it holds are sized from its projections)."""

    def __init__(self, s: DecoderShape, dtype: torch.dtype, device) -> None:
        super().__init__()
        kw = {"bias": False, "dtype": dtype, "device": device}
        self.q_proj = nn.Linear(s.hidden, s.heads * s.head_dim, **kw)
        self.k_proj = nn.Linear(s.hidden, s.kv_heads * s.head_dim, **kw)
        self.v_proj = nn.Linear(s.hidden, s.kv_heads * s.head_dim, **kw)
        self.o_proj = nn.Linear(s.heads * s.head_dim, s.hidden, **kw)
        self.mlp = DecoderMLP(s, dtype, device)
        self.attn_norm = nn.RMSNorm(s.hidden, eps=1e-5, dtype=dtype, device=device)
        self.mlp_norm = nn.RMSNorm(s.hidden, eps=1e-5, dtype=dtype, device=device)
        self.s = s

    def attention_inputs(self, h):
        """q, k, v ``[b, heads, t, head_dim]`` of the normed ``h`` (before RoPE)."""
        b, t, _ = h.shape
        x = self.attn_norm(h)
        d = self.s.head_dim  # heads sized from the projections: a tensor-parallel rank holds its share of them
        q = self.q_proj(x).view(b, t, -1, d).transpose(1, 2)
        k = self.k_proj(x).view(b, t, -1, d).transpose(1, 2)
        v = self.v_proj(x).view(b, t, -1, d).transpose(1, 2)
        return q, k, v

    def attention_output_and_mlp(self, h, a):
        """The rest of the layer from the attention output ``a`` ``[b, heads, t, head_dim]``."""
        b, t, _ = h.shape
        h = h + self.o_proj(a.transpose(1, 2).reshape(b, t, -1))
        x = self.mlp_norm(h)
        return h + self.mlp(x)

    def forward(self, h, cos, sin, pos, mask, k_cache, v_cache):
        q, k, v = self.attention_inputs(h)
        q, k = _rope(q, cos, sin), _rope(k, cos, sin)
        k_cache.index_copy_(2, pos, k.to(k_cache.dtype))
        v_cache.index_copy_(2, pos, v.to(v_cache.dtype))
        a = F.scaled_dot_product_attention(q, k_cache, v_cache, attn_mask=mask, enable_gqa=True)
        return self.attention_output_and_mlp(h, a)



def _rope(x, cos, sin):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)



def register_decode_buffers(module: nn.Module, s: DecoderShape, layers: int, batch: int, kv_heads: int,
                            max_len: int, dtype: torch.dtype, device) -> None:
    """The non-persistent buffers a decoder's step reads: the static KV cache, one ``k_cache_<i>`` /
    ``v_cache_<i>`` ``[batch, kv_heads, max_len, head_dim]`` per layer (:func:`layer_cache`), the RoPE tables
    ``cos`` / ``sin`` and ``key_pos``.

    One tensor per layer, as transformers' ``StaticCache`` keeps it: ``index_copy_`` into a slice of one
    stacked tensor makes a compiled step copy the whole stacked cache every token (Inductor does not write
    through a view of a mutated input in place), time no serving stack spends."""
    cache = (batch, kv_heads, max_len, s.head_dim)
    for i in range(layers):
        module.register_buffer(f"k_cache_{i}", torch.zeros(cache, dtype=dtype, device=device), persistent=False)
        module.register_buffer(f"v_cache_{i}", torch.zeros(cache, dtype=dtype, device=device), persistent=False)
    inv = 1.0 / (500000.0 ** (torch.arange(0, s.head_dim, 2, device=device, dtype=torch.float32) / s.head_dim))
    ang = torch.arange(max_len, device=device, dtype=torch.float32)[:, None] * inv[None, :]
    module.register_buffer("cos", ang.cos().to(dtype), persistent=False)
    module.register_buffer("sin", ang.sin().to(dtype), persistent=False)
    module.register_buffer("key_pos", torch.arange(max_len, device=device), persistent=False)



def layer_cache(module: nn.Module, i: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Layer ``i``'s ``(k_cache, v_cache)`` of a module given :func:`register_decode_buffers`."""
    return getattr(module, f"k_cache_{i}"), getattr(module, f"v_cache_{i}")


def clear_cache(module: nn.Module) -> None:
    """Zero every layer's KV cache of a module given :func:`register_decode_buffers`."""
    for name, buf in module.named_buffers(recurse=False):
        if name.startswith(("k_cache_", "v_cache_")):
            buf.zero_()



class Decoder(nn.Module):
    """Llama-style decoder with a static KV cache of ``max_len`` positions (batch ``batch``)."""

    def __init__(self, s: DecoderShape, max_len: int, batch: int = 1, dtype=torch.bfloat16, device="cuda") -> None:
        super().__init__()
        self.s = s
        self.embed = nn.Embedding(s.vocab, s.hidden, dtype=dtype, device=device)
        self.layers = nn.ModuleList(DecoderBlock(s, dtype, device) for _ in range(s.layers))
        self.norm = nn.RMSNorm(s.hidden, eps=1e-5, dtype=dtype, device=device)
        self.lm_head = nn.Linear(s.hidden, s.vocab, bias=False, dtype=dtype, device=device)
        register_decode_buffers(self, s, s.layers, batch, s.kv_heads, max_len, dtype, device)

    def forward(self, tokens: torch.Tensor, pos: torch.Tensor, n_layers: int | None = None) -> torch.Tensor:
        """Logits of the last position ``[B, vocab]`` for ``tokens [B, T]`` at positions ``pos [T]``."""
        if tokens.shape[-1] > self.key_pos.shape[0]:
            # checked on shapes only (no device sync); a position past the cache would index out of bounds on
            # the device and poison the CUDA context
            raise ValueError(f"tokens: {tokens.shape[-1]} positions do not fit the KV cache of "
                             f"{self.key_pos.shape[0]} (max_len)")
        h = self.embed(tokens)
        cos, sin = self.cos[pos], self.sin[pos]
        mask = self.key_pos[None, :] <= pos[:, None]
        for i, layer in enumerate(self.layers[: n_layers or len(self.layers)]):
            h = layer(h, cos, sin, pos, mask, *layer_cache(self, i))
        return self.lm_head(self.norm(h[:, -1]))



def build_decoder(s: DecoderShape, max_len: int, device="cuda", seed: int = 0) -> Decoder:
    torch.manual_seed(seed)
    with torch.no_grad():
        m = Decoder(s, max_len, device=device)
        for p in m.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.02)
    return m.eval()



def bf16_model_bytes(s: DecoderShape) -> int:
    """Bytes of the bf16 transformers model of shape ``s`` (each config's model is built in bf16 first)."""
    attn = s.hidden * s.heads * s.head_dim * 2 + s.hidden * s.kv_heads * s.head_dim * 2
    per_layer = attn + 3 * s.hidden * s.intermediate + 2 * s.hidden
    return 2 * (2 * s.vocab * s.hidden + s.layers * per_layer + s.hidden)


__all__ = [
    "SHAPES", "Decoder", "DecoderBlock", "DecoderShape", "bf16_model_bytes", "build_decoder", "clear_cache",
    "layer_cache", "register_decode_buffers",
]
