"""transformers' ``LlamaForCausalLM.generate()`` on the end-to-end benchmark's shapes: greedy, eager decode
tokens/s per config, every config's model timed in interleaved rounds."""

from __future__ import annotations

import time

import torch

from .decoder import DecoderShape, bf16_model_bytes
from .e2e_configs import apply_config
from .e2e_timing import interleaved_rounds
from .timing import sync

def _generate_model(s: DecoderShape, config: str, device):
    import transformers

    cfg = transformers.LlamaConfig(
        hidden_size=s.hidden, intermediate_size=s.intermediate, num_attention_heads=s.heads,
        num_key_value_heads=s.kv_heads, head_dim=s.head_dim, vocab_size=s.vocab, num_hidden_layers=s.layers,
        max_position_embeddings=4096, rope_theta=500000.0,
    )  # fmt: skip
    torch.manual_seed(0)
    with torch.device(device):
        model = transformers.LlamaForCausalLM(cfg).to(torch.bfloat16).eval()
    return apply_config(model, config)



def generate_rounds(s: DecoderShape, configs: list[str], new_tokens: int, device, rounds: int = 3
                    ) -> dict[str, float | str]:
    """Decode tokens/s of transformers' ``LlamaForCausalLM.generate`` (greedy, eager) per config, the same
    shapes, in :func:`interleaved_rounds`: per round a one-token call (prefill and setup) and ``new_tokens + 1``;
    the best of each is kept and their difference gives the decode steps alone."""
    ids = torch.randint(0, s.vocab, (1, 16), device=device, generator=torch.Generator(device).manual_seed(0))
    kw = {"do_sample": False, "pad_token_id": 0}

    def timed(model, n: int) -> float:
        sync(device)
        t0 = time.perf_counter()
        with torch.inference_mode():
            model.generate(ids, max_new_tokens=n, min_new_tokens=n, **kw)
        sync(device)
        return time.perf_counter() - t0

    def warm(model) -> None:
        with torch.inference_mode():
            model.generate(ids, max_new_tokens=4, min_new_tokens=4, **kw)

    raw = interleaved_rounds(configs, lambda c: _generate_model(s, c, device), warm,
                             lambda m: (timed(m, 1), timed(m, new_tokens + 1)),
                             int(bf16_model_bytes(s) * 1.15) + (2 << 30), device, rounds)
    out: dict[str, float | str] = {}
    for config, v in raw.items():
        if isinstance(v, str):
            out[config] = v
            continue
        one, full = min(t[0] for t in v), min(t[1] for t in v)
        # decode steps alone: the one-token call subtracted, when the difference is measurable
        out[config] = new_tokens / (full - one) if full > 1.5 * one else (new_tokens + 1) / full
    return out


__all__ = ["generate_rounds"]
