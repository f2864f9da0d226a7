"""End-to-end decoder benchmark: a Llama-3-8B-shaped model, quantized as a user would, in every run mode.

``lowbit e2e`` (or ``python -m lowbit.bench.e2e``) builds a decoder with random weights (no downloads) for each
configuration (bf16, lowbit schemes, torchao int4 / fp8-rowwise, bitsandbytes nf4 when installed), and
measures in one run, on one GPU:

- decode tokens/s at batch 1 with a static KV cache: eager (every config's model built, then timed in
  interleaved rounds), ``torch.compile`` (default mode), ``torch.compile(mode="reduce-overhead")`` (CUDA-graph
  trees) and a manually captured CUDA graph;
- prefill time of ``--prefill`` tokens, eager;
- transformers' ``LlamaForCausalLM.generate()`` decode tokens/s on the same shapes, eager (every config's model
  built, then timed in interleaved rounds);
- weight bytes, and host time of one linear call at M = 1 (the config's q_proj against ``F.linear`` on the
  same shape: CPU time per call with no synchronization, which is what an eager model pays per layer).

Every number is also given as a ratio to bf16 measured in the same run. Results go to a JSON file and a table.
A mode that fails records its error (type and message) in place of a number; the run goes on.

The model: ``hidden`` 4096, 32 heads of 128 (8 KV heads), MLP 14336, vocabulary 128256, RMSNorm, RoPE,
SDPA over a static cache with a position mask; every ``nn.Linear`` but ``lm_head`` is quantized.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .common import modes_and_device, short_error
from .timing import capture_graph, replay_seconds, sync


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
LOWBIT_SCHEMES = ("w4a16-nvfp4", "w4a16-int4", "w4a16-nf4", "w8a8-fp8-block", "w4a8-mxfp4", "w4a4-nvfp4")
PEERS = ("torchao:int4", "torchao:fp8-rowwise", "bnb:nf4")
DEFAULT_CONFIGS = ("bf16", *(f"lowbit:{s}" for s in LOWBIT_SCHEMES), *PEERS)
MODES = ("eager", "graph", "compile", "compile-ro", "prefill", "generate", "host")


# ---------------------------------------------------------------------------------------------- the model


class DecoderBlock(nn.Module):
    """One Llama decoder layer over a static KV cache (the heads it holds are sized from its projections)."""

    def __init__(self, s: DecoderShape, dtype: torch.dtype, device) -> None:
        super().__init__()
        kw = {"bias": False, "dtype": dtype, "device": device}
        self.q_proj = nn.Linear(s.hidden, s.heads * s.head_dim, **kw)
        self.k_proj = nn.Linear(s.hidden, s.kv_heads * s.head_dim, **kw)
        self.v_proj = nn.Linear(s.hidden, s.kv_heads * s.head_dim, **kw)
        self.o_proj = nn.Linear(s.heads * s.head_dim, s.hidden, **kw)
        self.gate_proj = nn.Linear(s.hidden, s.intermediate, **kw)
        self.up_proj = nn.Linear(s.hidden, s.intermediate, **kw)
        self.down_proj = nn.Linear(s.intermediate, s.hidden, **kw)
        self.attn_norm = nn.RMSNorm(s.hidden, eps=1e-5, dtype=dtype, device=device)
        self.mlp_norm = nn.RMSNorm(s.hidden, eps=1e-5, dtype=dtype, device=device)
        self.s = s

    def forward(self, h, cos, sin, pos, mask, k_cache, v_cache):
        s = self.s
        b, t, _ = h.shape
        x = self.attn_norm(h)
        # heads sized from the projections: a tensor-parallel rank holds its share of them
        q = self.q_proj(x).view(b, t, -1, s.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, -1, s.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, -1, s.head_dim).transpose(1, 2)
        q, k = _rope(q, cos, sin), _rope(k, cos, sin)
        k_cache.index_copy_(2, pos, k.to(k_cache.dtype))
        v_cache.index_copy_(2, pos, v.to(v_cache.dtype))
        a = F.scaled_dot_product_attention(q, k_cache, v_cache, attn_mask=mask, enable_gqa=True)
        h = h + self.o_proj(a.transpose(1, 2).reshape(b, t, -1))
        x = self.mlp_norm(h)
        return h + self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def _rope(x, cos, sin):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def register_decode_buffers(module: nn.Module, s: DecoderShape, layers: int, batch: int, kv_heads: int,
                            max_len: int, dtype: torch.dtype, device) -> None:
    """The non-persistent buffers a decoder's step reads: the static KV cache ``k_cache`` / ``v_cache``
    ``[layers, batch, kv_heads, max_len, head_dim]``, the RoPE tables ``cos`` / ``sin`` and ``key_pos``."""
    cache = (layers, batch, kv_heads, max_len, s.head_dim)
    module.register_buffer("k_cache", torch.zeros(cache, dtype=dtype, device=device), persistent=False)
    module.register_buffer("v_cache", torch.zeros(cache, dtype=dtype, device=device), persistent=False)
    inv = 1.0 / (500000.0 ** (torch.arange(0, s.head_dim, 2, device=device, dtype=torch.float32) / s.head_dim))
    ang = torch.arange(max_len, device=device, dtype=torch.float32)[:, None] * inv[None, :]
    module.register_buffer("cos", ang.cos().to(dtype), persistent=False)
    module.register_buffer("sin", ang.sin().to(dtype), persistent=False)
    module.register_buffer("key_pos", torch.arange(max_len, device=device), persistent=False)


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
        h = self.embed(tokens)
        cos, sin = self.cos[pos], self.sin[pos]
        mask = self.key_pos[None, :] <= pos[:, None]
        for i, layer in enumerate(self.layers[: n_layers or len(self.layers)]):
            h = layer(h, cos, sin, pos, mask, self.k_cache[i], self.v_cache[i])
        return self.lm_head(self.norm(h[:, -1]))


def build_decoder(s: DecoderShape, max_len: int, device="cuda", seed: int = 0) -> Decoder:
    torch.manual_seed(seed)
    with torch.no_grad():
        m = Decoder(s, max_len, device=device)
        for p in m.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.02)
    return m.eval()


# ---------------------------------------------------------------------------------------------- configs


def _linear_filter(module: nn.Module, fqn: str) -> bool:
    return isinstance(module, nn.Linear) and not fqn.endswith("lm_head")


def apply_config(model: nn.Module, config: str) -> nn.Module:
    """Quantize ``model`` in place as ``config`` says: ``bf16``, ``lowbit:<scheme>``, ``torchao:int4``,
    ``torchao:fp8-rowwise`` or ``bnb:nf4`` (ImportError where the peer is not installed)."""
    if config == "bf16":
        return model
    kind, _, name = config.partition(":")
    if kind == "lowbit":
        import lowbit

        return lowbit.quantize_model(model, name)
    if kind == "torchao":
        from torchao.quantization import quantize_

        if name == "int4":
            from torchao.quantization import Int4WeightOnlyConfig

            cfg = Int4WeightOnlyConfig(group_size=128, int4_packing_format="tile_packed_to_4d")
        elif name == "fp8-rowwise":
            from torchao.quantization import Float8DynamicActivationFloat8WeightConfig, PerRow

            cfg = Float8DynamicActivationFloat8WeightConfig(granularity=PerRow())
        else:
            raise ValueError(f"unknown torchao config {name!r}")
        quantize_(model, cfg, filter_fn=_linear_filter)
        return model
    if kind == "bnb" and name == "nf4":
        import bitsandbytes as bnb

        for parent in list(model.modules()):
            for cname, child in list(parent.named_children()):
                if isinstance(child, nn.Linear) and cname != "lm_head":
                    dev = child.weight.device
                    new = bnb.nn.Linear4bit(child.in_features, child.out_features, bias=child.bias is not None,
                                            compute_dtype=child.weight.dtype, quant_type="nf4",
                                            compress_statistics=False)
                    # quantized where the weight already is (.to(dev) quantizes): no round trip through the host
                    new.weight = bnb.nn.Params4bit(child.weight.data, requires_grad=False, quant_type="nf4",
                                                   compress_statistics=False)
                    setattr(parent, cname, new.to(dev))
        return model
    raise ValueError(f"unknown config {config!r}; known: {', '.join(DEFAULT_CONFIGS)}")


def weight_bytes(model: nn.Module) -> int:
    """Bytes of the parameters and persistent buffers (the KV cache and RoPE tables are not weights)."""
    seen: set[int] = set()
    total = 0
    for t in list(model.parameters()) + [b for _, b in model.state_dict().items()]:
        if not isinstance(t, torch.Tensor) or id(t) in seen:
            continue
        seen.add(id(t))
        if hasattr(t, "__tensor_flatten__"):  # a tensor subclass (torchao): its inner tensors
            names, _ = t.__tensor_flatten__()
            total += sum(getattr(t, n).numel() * getattr(t, n).element_size() for n in names)
        else:
            total += t.numel() * t.element_size()
    return total


# ---------------------------------------------------------------------------------------------- timing


REPEATS = 3
"""Timed windows per decode mode; the best is reported (the lent machines' host CPUs are shared and noisy)."""


def decode_graph(model: Decoder, steps: int, start: int) -> float:
    """Tokens/s of replays of one decode step captured in a CUDA graph (token and position updated in place)."""
    tok = torch.zeros(1, 1, dtype=torch.long, device="cuda")
    pos = torch.tensor([start], device="cuda")
    def step():
        nxt = model(tok, pos).argmax(-1, keepdim=True)
        tok.copy_(nxt)
        pos.add_(1)

    with torch.inference_mode():
        g = capture_graph(step, warm=lambda: model(tok, pos))
        return 1.0 / replay_seconds(g, steps, warm_replays=2)


def decode_compiled(model: Decoder, steps: int, start: int, mode: str | None, n_layers: int, device) -> dict:
    """Tokens/s of a ``torch.compile``d decode step over the first ``n_layers`` layers, and compile seconds."""
    import torch._dynamo

    torch._dynamo.reset()

    def step(tok, pos):
        return model(tok, pos, n_layers).argmax(-1, keepdim=True)

    fn = torch.compile(step, mode=mode, fullgraph=True)
    tok = torch.zeros(1, 1, dtype=torch.long, device=device)
    pos = torch.tensor([start], device=device)
    with torch.inference_mode():
        t0 = time.perf_counter()
        for _ in range(3):
            if mode == "reduce-overhead":
                torch.compiler.cudagraph_mark_step_begin()
            tok = fn(tok, pos).clone()
        sync(device)
        compile_s = time.perf_counter() - t0
        best = 0.0
        for _ in range(REPEATS):
            pos.fill_(start)
            t0 = time.perf_counter()
            for _ in range(steps):
                if mode == "reduce-overhead":
                    torch.compiler.cudagraph_mark_step_begin()
                tok = fn(tok, pos).clone()
                pos += 1
            sync(device)
            best = max(best, steps / (time.perf_counter() - t0))
    return {"tok_s": best, "compile_s": compile_s, "layers": n_layers}


def prefill_ms(model: Decoder, tokens: int, device, repeats: int = 3) -> float:
    ids = torch.randint(0, model.s.vocab, (1, tokens), device=device)
    pos = torch.arange(tokens, device=device)
    with torch.inference_mode():
        model(ids, pos)
        sync(device)
        best = math.inf
        for _ in range(repeats):
            t0 = time.perf_counter()
            model(ids, pos)
            sync(device)
            best = min(best, time.perf_counter() - t0)
    return best * 1e3


def host_us_per_call(fn: Callable[[], Any], device, calls: int = 200) -> float:
    """CPU microseconds per call of ``fn``, issued back to back without synchronizing (the GPU queue absorbs
    the kernels: at M = 1 they take less time than the host)."""
    with torch.inference_mode():
        for _ in range(10):
            fn()
        sync(device)
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        t = time.perf_counter() - t0
        sync(device)
    return t / calls * 1e6


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


def _bf16_bytes(s: DecoderShape) -> int:
    """Bytes of the bf16 transformers model of shape ``s`` (each config's model is built in bf16 first)."""
    attn = s.hidden * s.heads * s.head_dim * 2 + s.hidden * s.kv_heads * s.head_dim * 2
    per_layer = attn + 3 * s.hidden * s.intermediate + 2 * s.hidden
    return 2 * (2 * s.vocab * s.hidden + s.layers * per_layer + s.hidden)


def interleaved_rounds(configs: list[str], build: Callable[[str], Any], warm: Callable[[Any], None],
                       measure: Callable[[Any], Any], need_bytes: int, device, rounds: int = 3
                       ) -> dict[str, list | str]:
    """Measure every config in interleaved rounds: the configs' models are built together, as many as the
    device holds beside ``need_bytes`` free for the next build (bf16's stays for every group), warmed up, then
    each round runs ``measure(model)`` for each model in turn, so a drifting host CPU weighs on all of them
    alike. Returns config -> the list of its measurements (one per round), or the error that stopped it."""
    out: dict[str, list | str] = {}
    models: dict = {}
    cuda = torch.device(device).type == "cuda"

    def run_group() -> None:
        for config, model in list(models.items()):
            if config in out:
                continue
            try:
                warm(model)
                out[config] = []
            except Exception as e:  # noqa: BLE001 - reported per config, the others still run
                out[config] = short_error(e)
                del models[config]
        for _ in range(rounds):
            for config, model in models.items():
                out[config].append(measure(model))
        for config in [c for c in models if c != "bf16"]:
            del models[config]
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()

    for config in configs:
        if cuda and len(models) > ("bf16" in models):
            free, _total = torch.cuda.mem_get_info(device)
            if free < need_bytes:  # the next build would not fit beside this group: measure it, then free it
                run_group()
        try:
            models[config] = build(config)
        except Exception as e:  # noqa: BLE001
            out[config] = short_error(e)
            gc.collect()
            if cuda:
                torch.cuda.empty_cache()
    run_group()
    models.clear()
    gc.collect()
    return out


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
                             int(_bf16_bytes(s) * 1.15) + (2 << 30), device, rounds)
    out: dict[str, float | str] = {}
    for config, v in raw.items():
        if isinstance(v, str):
            out[config] = v
            continue
        one, full = min(t[0] for t in v), min(t[1] for t in v)
        # decode steps alone: the one-token call subtracted, when the difference is measurable
        out[config] = new_tokens / (full - one) if full > 1.5 * one else (new_tokens + 1) / full
    return out


def eager_rounds(s: DecoderShape, configs: list[str], steps: int, max_len: int, start: int, device,
                 rounds: int = 3) -> dict[str, float | str]:
    """Eager decode tokens/s of the decoder per config in :func:`interleaved_rounds` (one window of ``steps``
    steps per round and config, the best kept): the eager ratios of separate builds moved by a third between
    lent machines, so the configs share the machine state instead."""

    def window(model) -> float:
        tok = torch.zeros(1, 1, dtype=torch.long, device=device)
        pos = torch.tensor([start], device=device)
        with torch.inference_mode():
            sync(device)
            t0 = time.perf_counter()
            for _ in range(steps):
                tok = model(tok, pos).argmax(-1, keepdim=True)
                pos += 1
            sync(device)
        return steps / (time.perf_counter() - t0)

    def warm(model) -> None:
        tok = torch.zeros(1, 1, dtype=torch.long, device=device)
        pos = torch.tensor([start], device=device)
        with torch.inference_mode():
            for _ in range(2):
                model(tok, pos)
        sync(device)

    raw = interleaved_rounds(configs, lambda c: apply_config(build_decoder(s, max_len, device), c), warm, window,
                             int(_bf16_bytes(s) * 1.15) + (2 << 30), device, rounds)
    return {c: v if isinstance(v, str) else max(v) for c, v in raw.items()}


def run_config(config: str, s: DecoderShape, args: argparse.Namespace, device) -> dict:
    row: dict[str, Any] = {"config": config, "errors": {}}
    modes = set(args.modes)
    max_len = args.prefill + args.steps + 16
    try:
        model = apply_config(build_decoder(s, max_len, device), config)
    except Exception as e:  # noqa: BLE001 - a config that cannot be built is reported, the run goes on
        row["errors"]["build"] = short_error(e)
        return row
    row["weight_gb"] = weight_bytes(model) / 1e9

    def attempt(name: str, fn: Callable[[], Any]) -> None:
        if name not in modes:
            return
        try:
            row[name] = fn()
        except Exception as e:  # noqa: BLE001
            row["errors"][name] = short_error(e)
        gc.collect()

    start = args.prefill
    attempt("host", lambda: _host_row(model, device))
    attempt("graph", lambda: decode_graph(model, args.steps, start))
    attempt("compile", lambda: decode_compiled(model, args.steps, start, None, args.compile_layers, device))
    attempt("compile-ro", lambda: decode_compiled(model, args.steps, start, "reduce-overhead",
                                                  args.compile_layers, device))
    attempt("prefill", lambda: prefill_ms(model, args.prefill, device))
    model = None  # frees the weights before the next model is built
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return row


def _host_row(model: Decoder, device) -> dict:
    lin = model.layers[0].q_proj
    # [batch, tokens, hidden], as the decoder calls its projections (a 2-D x could take another path)
    x = torch.randn(1, 1, lin.in_features, dtype=torch.bfloat16, device=device)
    w = torch.randn(lin.out_features, lin.in_features, dtype=torch.bfloat16, device=device)
    return {"us": host_us_per_call(lambda: lin(x), device),
            "f_linear_us": host_us_per_call(lambda: F.linear(x, w), device)}


def ratios(rows: list[dict]) -> None:
    """Adds ``ratio`` (to bf16 in the same run) to every row: decode and generate tokens/s over bf16's,
    bf16's prefill ms over the row's, host time over F.linear's."""
    base = next((r for r in rows if r["config"] == "bf16"), None)
    for r in rows:
        rr: dict[str, float] = {}
        if "host" in r:
            rr["host_vs_f_linear"] = r["host"]["us"] / r["host"]["f_linear_us"]
        if base is not None:
            for k in ("eager", "graph", "generate"):
                if isinstance(r.get(k), float) and isinstance(base.get(k), float):
                    rr[k] = r[k] / base[k]
            for k in ("compile", "compile-ro"):
                if isinstance(r.get(k), dict) and isinstance(base.get(k), dict):
                    rr[k] = r[k]["tok_s"] / base[k]["tok_s"]
            if isinstance(r.get("prefill"), float) and isinstance(base.get("prefill"), float):
                rr["prefill"] = base["prefill"] / r["prefill"]
        r["ratio"] = rr


def _ratios_of(run: Mapping[str, Any]) -> dict[str, dict[str, float]]:
    return {row["config"]: row.get("ratio", {}) for row in run.get("rows", []) if "config" in row}


def compare(result: dict, baseline: dict) -> str:
    """A table of each config's ratios to bf16 in ``result`` against the same ratios in ``baseline`` (a result
    dict, or a curated file holding ``{"runs": [...]}``: each ratio from the newest run that has it). Ratios,
    not tokens/s, since the two runs may have had different host CPUs (:mod:`lowbit.bench.comparison`)."""
    from .comparison import newest, table

    return table(_ratios_of(result), newest(baseline, _ratios_of), key="config",
                 skip=lambda config, key: config == "bf16" and key != "host_vs_f_linear")  # bf16: 1.0 by definition


def format_table(result: dict) -> str:
    rows = result["rows"]
    head = ("config", "GB", "host us (xF.lin)", "eager tok/s", "graph tok/s", "compile tok/s",
            "compile-ro tok/s", "prefill ms", "generate tok/s")
    lines = [" | ".join(head), " | ".join("---" for _ in head)]

    def cell(r, k, fmt="{:.1f}"):
        if k in r["errors"]:
            return "error"
        v = r.get(k)
        if v is None:
            return "-"
        val = v["tok_s"] if isinstance(v, dict) else v
        ratio = r.get("ratio", {}).get(k)
        return fmt.format(val) + (f" ({ratio:.2f}x)" if ratio is not None and r["config"] != "bf16" else "")

    for r in rows:
        host = "-"
        if "host" in r:
            host = f"{r['host']['us']:.1f} ({r['ratio']['host_vs_f_linear']:.2f}x)"
        elif "host" in r["errors"]:
            host = "error"
        gb = f"{r['weight_gb']:.2f}" if "weight_gb" in r else "-"
        lines.append(" | ".join([r["config"], gb, host, cell(r, "eager"), cell(r, "graph"), cell(r, "compile"),
                                 cell(r, "compile-ro"), cell(r, "prefill", "{:.2f}"), cell(r, "generate")]))
    errs = [f"- {r['config']} {k}: {v}" for r in rows for k, v in r["errors"].items()]
    return "\n".join(lines + (["", "errors:"] + errs if errs else []))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="lowbit e2e", description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", choices=sorted(SHAPES), default="llama3-8b")
    p.add_argument("--layers", type=int, default=None, help="decoder layers (default: the shape's)")
    p.add_argument("--compile-layers", type=int, default=8, help="layers of the torch.compile'd decode step")
    p.add_argument("--configs", default=",".join(DEFAULT_CONFIGS),
                   help="comma-separated: bf16, lowbit:<scheme>, torchao:int4, torchao:fp8-rowwise, bnb:nf4")
    p.add_argument("--modes", default=",".join(MODES), help=f"comma-separated subset of {','.join(MODES)}")
    p.add_argument("--steps", type=int, default=32, help="decode steps timed per mode")
    p.add_argument("--prefill", type=int, default=2048, help="prefill tokens")
    p.add_argument("--device", default="cuda")
    p.add_argument("--json", dest="json_path", default=None, help="write the results to this file")
    p.add_argument("--compare", default=None, metavar="BASELINE.json",
                   help="also print each ratio against a baseline result (a lowbit e2e JSON, or a curated file "
                   "of runs)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    baseline = None
    if args.compare:
        from .comparison import CompareError, load

        try:
            baseline = load(args.compare, "lowbit e2e")
        except CompareError as e:
            print(f"lowbit e2e: --compare {e}", file=sys.stderr)
            return 2
    device = modes_and_device(args, "lowbit e2e", MODES, cuda_only=("graph", "compile-ro"))
    if device is None:
        return 2
    s = SHAPES[args.shape]
    if args.layers is not None:
        s = DecoderShape(**{**asdict(s), "layers": args.layers})
    args.compile_layers = min(args.compile_layers, s.layers)
    from .envinfo import header

    result: dict[str, Any] = {"header": header(), "shape": asdict(s), "settings": {
        "steps": args.steps, "prefill": args.prefill, "compile_layers": args.compile_layers, "modes": args.modes,
        "batch": 1}, "rows": []}
    for config in [c.strip() for c in args.configs.split(",") if c.strip()]:
        t0 = time.perf_counter()
        row = run_config(config, s, args, device)
        row["seconds"] = time.perf_counter() - t0
        result["rows"].append(row)
        ratios(result["rows"])
        print(f"{config}: {json.dumps({k: v for k, v in row.items() if k != 'config'}, default=str)}", flush=True)
        if args.json_path:
            with open(args.json_path, "w") as f:
                json.dump(result, f, indent=1, default=str)
    configs = [r["config"] for r in result["rows"]]
    # eager decode and generate: every config's model built beside the others, timed in interleaved rounds
    rounds = {
        "eager": lambda: eager_rounds(s, configs, args.steps, args.prefill + args.steps + 16, args.prefill, device),
        "generate": lambda: generate_rounds(s, configs, args.steps, device),
    }
    for mode, fn in rounds.items():
        if mode not in args.modes:
            continue
        measured = fn()
        for row in result["rows"]:
            v = measured.get(row["config"])
            if isinstance(v, str):
                row["errors"][mode] = v
            elif v is not None:
                row[mode] = v
        ratios(result["rows"])
        if args.json_path:
            with open(args.json_path, "w") as f:
                json.dump(result, f, indent=1, default=str)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    print(format_table(result), flush=True)
    if baseline is not None:
        print("\n" + compare(result, baseline), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
