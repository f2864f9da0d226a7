"""Where transformers' ``LlamaForCausalLM.generate`` (eager, greedy) spends host time per config: tokens/s and
a cProfile of the decode steps (the ``lowbit e2e`` generate model, fewer layers).

    python benchmarks/experiments/profile_generate.py --configs bf16,bnb:nf4,lowbit:w4a16-nvfp4 --layers 4
"""

from __future__ import annotations

import argparse
import cProfile
import dataclasses
import io
import pstats
import time

import torch

from lowbit.bench import e2e


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--configs", default="bf16,bnb:nf4,lowbit:w4a16-nvfp4")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=24)
    ap.add_argument("--top", type=int, default=30)
    args = ap.parse_args()
    import transformers

    s = dataclasses.replace(e2e.SHAPES["llama3-8b"], layers=args.layers)
    for config in args.configs.split(","):
        cfg = transformers.LlamaConfig(
            hidden_size=s.hidden, intermediate_size=s.intermediate, num_attention_heads=s.heads,
            num_key_value_heads=s.kv_heads, head_dim=s.head_dim, vocab_size=s.vocab, num_hidden_layers=s.layers,
            max_position_embeddings=4096, rope_theta=500000.0)
        torch.manual_seed(0)
        with torch.device("cuda"):
            model = transformers.LlamaForCausalLM(cfg).to(torch.bfloat16).eval()
        e2e.apply_config(model, config)
        ids = torch.randint(0, s.vocab, (1, 16), device="cuda")
        kw = {"do_sample": False, "pad_token_id": 0, "max_new_tokens": args.tokens, "min_new_tokens": args.tokens}
        with torch.inference_mode():
            model.generate(ids, **kw)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            model.generate(ids, **kw)
            torch.cuda.synchronize()
            dt = time.perf_counter() - t0
            pr = cProfile.Profile()
            pr.enable()
            model.generate(ids, **kw)
            torch.cuda.synchronize()
            pr.disable()
        buf = io.StringIO()
        pstats.Stats(pr, stream=buf).sort_stats("tottime").print_stats(args.top)
        print(f"== {config}: {args.tokens / dt:.1f} tok/s incl. prefill ({args.layers} layers)")
        print(buf.getvalue()[:7000], flush=True)
        buf = io.StringIO()
        pstats.Stats(pr, stream=buf).sort_stats("cumtime").print_stats(args.top)
        print(buf.getvalue()[:7000], flush=True)
        del model
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
