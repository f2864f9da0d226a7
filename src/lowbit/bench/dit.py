"""Diffusion-transformer block benchmark: one Wan2.1-14B-shaped DiT block, bf16 against every lowbit scheme.

``lowbit dit`` (or ``python -m lowbit.bench.dit``) builds one block with random weights (no downloads) per
configuration and token count and times its forward, the regime of a video DiT's denoising step (thousands of
tokens per call, every Linear a large GEMM):

- ``eager``: the block called from Python, best of ``--repeats`` timed calls after warm-up;
- ``graph``: replays of the forward captured in a CUDA graph (no host overhead);
- ``compile``: ``torch.compile`` (default mode) of the forward (off by default: minutes per configuration).

Each row also gives the weight bytes of the block and the cosine similarity and SQNR of its output to bf16's
on the same input (the smallest token count), so a fast row that computes the wrong thing shows. Every time is
also given as a ratio to bf16 in the same run (``bf16 ms / config ms``: above 1 is faster). A mode that fails
records its error in place of a number; the run goes on. Results go to a JSON file and a table.

The block (Wan2.1 14B: hidden 5120, 40 heads of 128, FFN 13824, text context 512 tokens of 5120), in plain
torch: AdaLN modulation (shift/scale/gate from a timestep embedding), LayerNorm, self-attention with RMSNorm
on q and k and rotary embedding, affine LayerNorm and cross-attention over the text tokens, modulated
LayerNorm and a GELU(tanh) FFN, gated residuals. Its 10 Linear layers (q, k, v, o twice, FFN up and down)
are what ``quantize_model`` quantizes; attention runs ``F.scaled_dot_product_attention`` in bf16 for every
configuration. Default token counts: 8190 and 32760 (a Wan 480p and 720p video's latent tokens).
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .common import lowbit_config, modes_and_device, short_error, weight_bytes
from .timing import sync


@dataclass(frozen=True)
class DiTShape:
    hidden: int
    heads: int
    ffn: int
    text_len: int
    blocks: int = 1

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


SHAPES = {
    "wan2.1-14b": DiTShape(5120, 40, 13824, 512),
    "tiny": DiTShape(128, 4, 256, 16),
}
DEFAULT_TOKENS = (8190, 32760)
MODES = ("eager", "graph", "compile")
DEFAULT_MODES = ("eager", "graph")


def default_configs() -> tuple[str, ...]:
    from ..nn.schemes import SCHEMES

    return ("bf16", *(f"lowbit:{s}" for s in SCHEMES), "lowbit:w4a4-nvfp4+fp8", "lowbit:w4a4-nvfp4+fp8-kept")


# ---------------------------------------------------------------------------------------------- the model


class _Attention(nn.Module):
    def __init__(self, s: DiTShape, dtype, device) -> None:
        super().__init__()
        kw = {"bias": True, "dtype": dtype, "device": device}
        self.to_q = nn.Linear(s.hidden, s.hidden, **kw)
        self.to_k = nn.Linear(s.hidden, s.hidden, **kw)
        self.to_v = nn.Linear(s.hidden, s.hidden, **kw)
        self.to_out = nn.Linear(s.hidden, s.hidden, **kw)
        # Wan's qk norm: RMSNorm over all heads together
        self.norm_q = nn.RMSNorm(s.hidden, eps=1e-6, dtype=dtype, device=device)
        self.norm_k = nn.RMSNorm(s.hidden, eps=1e-6, dtype=dtype, device=device)
        self.heads = s.heads

    def forward(self, x: torch.Tensor, context: torch.Tensor | None = None, rope=None) -> torch.Tensor:
        b, t, _ = x.shape
        src = x if context is None else context
        q = self.norm_q(self.to_q(x)).unflatten(2, (self.heads, -1)).transpose(1, 2)
        k = self.norm_k(self.to_k(src)).unflatten(2, (self.heads, -1)).transpose(1, 2)
        v = self.to_v(src).unflatten(2, (self.heads, -1)).transpose(1, 2)
        if rope is not None:
            q, k = _rope(q, *rope), _rope(k, *rope)
        a = F.scaled_dot_product_attention(q, k, v)
        return self.to_out(a.transpose(1, 2).flatten(2))


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


class DiTBlock(nn.Module):
    """One Wan-style DiT block: modulated self-attention, cross-attention, modulated FFN (module doc)."""

    def __init__(self, s: DiTShape, dtype=torch.bfloat16, device="cuda") -> None:
        super().__init__()
        self.s = s
        self.attn1 = _Attention(s, dtype, device)
        self.attn2 = _Attention(s, dtype, device)
        self.norm2 = nn.LayerNorm(s.hidden, eps=1e-6, dtype=dtype, device=device)
        self.ffn_up = nn.Linear(s.hidden, s.ffn, dtype=dtype, device=device)
        self.ffn_down = nn.Linear(s.ffn, s.hidden, dtype=dtype, device=device)
        self.scale_shift_table = nn.Parameter(torch.randn(1, 6, s.hidden, dtype=dtype, device=device) * 0.5)

    def forward(self, x: torch.Tensor, context: torch.Tensor, temb: torch.Tensor, rope) -> torch.Tensor:
        shift, scale, gate, c_shift, c_scale, c_gate = (self.scale_shift_table + temb).chunk(6, dim=1)
        h = F.layer_norm(x, (self.s.hidden,), eps=1e-6) * (1 + scale) + shift
        x = x + self.attn1(h, rope=rope) * gate
        x = x + self.attn2(self.norm2(x), context)
        h = F.layer_norm(x, (self.s.hidden,), eps=1e-6) * (1 + c_scale) + c_shift
        return x + self.ffn_down(F.gelu(self.ffn_up(h), approximate="tanh")) * c_gate


class DiT(nn.Module):
    """``blocks`` DiT blocks in sequence (the benchmark uses one)."""

    def __init__(self, s: DiTShape, dtype=torch.bfloat16, device="cuda") -> None:
        super().__init__()
        self.s = s
        self.blocks = nn.ModuleList(DiTBlock(s, dtype, device) for _ in range(s.blocks))

    def forward(self, x, context, temb, rope):
        for b in self.blocks:
            x = b(x, context, temb, rope)
        return x


def build_dit(s: DiTShape, device="cuda", seed: int = 0) -> DiT:
    torch.manual_seed(seed)
    with torch.no_grad():
        m = DiT(s, device=device)
        for name, p in m.named_parameters():
            if p.dim() == 2:
                p.normal_(0.0, 1.0 / math.sqrt(p.shape[1]))  # unit-variance outputs at every Linear
            elif name.endswith("bias"):
                p.normal_(0.0, 0.02)
    return m.eval()


def make_inputs(s: DiTShape, tokens: int, device, seed: int = 1) -> tuple:
    """Latent tokens ``[1, tokens, hidden]``, text context ``[1, text_len, hidden]``, the timestep's
    modulation ``[1, 6, hidden]`` and rotary tables ``[tokens, head_dim / 2]`` (cos, sin), all bf16."""
    g = torch.Generator(device=device).manual_seed(seed)
    bf = {"dtype": torch.bfloat16, "device": device}
    x = torch.randn(1, tokens, s.hidden, generator=g, **bf)
    ctx = torch.randn(1, s.text_len, s.hidden, generator=g, **bf)
    temb = torch.randn(1, 6, s.hidden, generator=g, **bf) * 0.1
    half = s.head_dim // 2
    inv = 1.0 / (10000.0 ** (torch.arange(half, device=device, dtype=torch.float32) / half))
    ang = torch.arange(tokens, device=device, dtype=torch.float32)[:, None] * inv[None, :]
    return x, ctx, temb, (ang.cos().to(torch.bfloat16), ang.sin().to(torch.bfloat16))


# ---------------------------------------------------------------------------------------------- configs


def apply_config(model: nn.Module, config: str) -> nn.Module:
    """Quantize ``model`` in place as ``config`` says: ``bf16`` or ``lowbit:<scheme>`` (every Linear);
    ``lowbit:w4a4-nvfp4+fp8``: then the FP8 compute mode (``lowbit.nn.set_compute(model, "fp8_block")``, the
    weight re-encoded on every call); ``+fp8-kept``: with each layer's FP8 weight kept (``keep_weight=True``)."""
    if config == "bf16":
        return model
    import lowbit
    from lowbit.nn import set_compute

    scheme, mode = lowbit_config(config, ("fp8", "fp8-kept"), "bf16, lowbit:<scheme>, lowbit:w4a4-nvfp4+fp8[-kept]")
    model = lowbit.quantize_model(model, scheme, skip=())
    if mode and not set_compute(model, "fp8_block", keep_weight=mode == "fp8-kept"):
        raise ValueError(f"config {config!r}: +fp8 is for w4a4-nvfp4 layers, none in this model")
    return model


# ---------------------------------------------------------------------------------------------- timing


def time_eager(fn: Callable[[], Any], device, repeats: int, warmup: int = 2) -> float:
    """Milliseconds of one call: the best of ``repeats`` synchronized calls after ``warmup``."""
    with torch.inference_mode():
        for _ in range(warmup):
            fn()
        sync(device)
        best = math.inf
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            sync(device)
            best = min(best, time.perf_counter() - t0)
    return best * 1e3


def time_graph(fn: Callable[[], Any], repeats: int) -> float:
    """Milliseconds per replay of ``fn`` captured in a CUDA graph (mean of ``repeats`` replays)."""
    from .timing import graph_ms

    return graph_ms(fn, repeats)


def time_compiled(model: nn.Module, inputs: tuple, device, repeats: int) -> dict:
    """Milliseconds of a ``torch.compile``d forward (best of ``repeats``) and the compile seconds."""
    import torch._dynamo

    torch._dynamo.reset()
    fn = torch.compile(model)
    with torch.inference_mode():
        t0 = time.perf_counter()
        fn(*inputs)
        sync(device)
        compile_s = time.perf_counter() - t0
    return {"ms": time_eager(lambda: fn(*inputs), device, repeats), "compile_s": compile_s}


# ---------------------------------------------------------------------------------------------- the run


def _quality(out: torch.Tensor, ref: torch.Tensor) -> dict:
    r, o = ref.float().flatten(), out.float().flatten()
    err = float((o - r).pow(2).sum())
    return {
        "cosine": float(F.cosine_similarity(o, r, dim=0)),
        "sqnr_db": math.inf if err == 0 else float(10 * math.log10(float(r.pow(2).sum()) / err)),
    }


def run_config(config: str, s: DiTShape, args: argparse.Namespace, device, reference: dict) -> dict:
    """One configuration at every token count. ``reference`` holds bf16's output per token count for the
    quality columns (filled by the bf16 row, which runs first)."""
    row: dict[str, Any] = {"config": config, "errors": {}, "tokens": {}}
    try:
        model = apply_config(build_dit(s, device), config)
    except Exception as e:  # noqa: BLE001 - a config that cannot be built is reported, the run goes on
        row["errors"]["build"] = short_error(e)
        return row
    row["weight_gb"] = weight_bytes(model) / 1e9
    for i, tokens in enumerate(args.tokens):
        cell: dict[str, Any] = {}
        row["tokens"][str(tokens)] = cell
        try:
            inputs = make_inputs(s, tokens, device)
        except Exception as e:  # noqa: BLE001 (out of memory at a large token count)
            row["errors"][f"{tokens}/inputs"] = short_error(e)
            continue

        def attempt(name: str, fn: Callable[[], Any], _tokens=tokens, _cell=cell) -> None:
            if name not in args.modes:
                return
            try:
                _cell[name] = fn()
            except Exception as e:  # noqa: BLE001
                row["errors"][f"{_tokens}/{name}"] = short_error(e)
            gc.collect()

        if i == 0:
            try:
                with torch.inference_mode():
                    out = model(*inputs)
                if config == "bf16":
                    reference[tokens] = out
                elif tokens in reference:
                    row["quality"] = {"tokens": tokens, **_quality(out, reference[tokens])}
                del out
            except Exception as e:  # noqa: BLE001
                row["errors"][f"{tokens}/quality"] = short_error(e)
        attempt("eager", lambda _in=inputs: time_eager(lambda: model(*_in), device, args.repeats))
        attempt("graph", lambda _in=inputs: time_graph(lambda: model(*_in), args.repeats))
        attempt("compile", lambda _in=inputs: time_compiled(model, _in, device, args.repeats))
        inputs = None
        if device.type == "cuda":
            torch.cuda.empty_cache()
    model = None  # frees the weights before the next configuration is built
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return row


def _ms(v: Any) -> float | None:
    if isinstance(v, dict):
        v = v.get("ms")
    return v if isinstance(v, float) else None


def ratios(rows: list[dict]) -> None:
    """Adds ``ratio`` to every row: ``{tokens: {mode: bf16 ms / row ms}}`` (above 1: faster than bf16)."""
    base = next((r for r in rows if r["config"] == "bf16"), None)
    for r in rows:
        rr: dict[str, dict[str, float]] = {}
        if base is not None:
            for tokens, cell in r["tokens"].items():
                bcell = base["tokens"].get(tokens, {})
                for mode, v in cell.items():
                    ms, bms = _ms(v), _ms(bcell.get(mode))
                    if ms and bms:
                        rr.setdefault(tokens, {})[mode] = bms / ms
        r["ratio"] = rr


def format_table(result: dict) -> str:
    rows = result["rows"]
    tokens = [str(t) for t in result["settings"]["tokens"]]
    modes = result["settings"]["modes"]
    head = ["config", "GB", "cos", "SQNR dB"] + [f"{m} ms @{t}" for t in tokens for m in modes]
    lines = [" | ".join(head), " | ".join("---" for _ in head)]
    for r in rows:
        cells = [r["config"], f"{r['weight_gb']:.3f}" if "weight_gb" in r else "-"]
        q = r.get("quality")
        cells += [f"{q['cosine']:.5f}", f"{q['sqnr_db']:.1f}"] if q else ["-", "-"]
        for t in tokens:
            for m in modes:
                if f"{t}/{m}" in r["errors"] or f"{t}/inputs" in r["errors"]:
                    cells.append("error")
                    continue
                ms = _ms(r["tokens"].get(t, {}).get(m))
                if ms is None:
                    cells.append("-")
                    continue
                ratio = r.get("ratio", {}).get(t, {}).get(m)
                show = ratio is not None and r["config"] != "bf16"
                cells.append(f"{ms:.2f}" + (f" ({ratio:.2f}x)" if show else ""))
        lines.append(" | ".join(cells))
    errs = [f"- {r['config']} {k}: {v}" for r in rows for k, v in r["errors"].items()]
    return "\n".join(lines + (["", "errors:", *errs] if errs else []))


def _int_list(text: str, what: str) -> list[int]:
    try:
        vals = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{what} must be comma-separated integers, got {text!r}") from None
    if not vals or any(v < 1 for v in vals):
        raise argparse.ArgumentTypeError(f"{what} must be positive integers, got {text!r}")
    return vals


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="lowbit dit", description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", choices=sorted(SHAPES), default="wan2.1-14b")
    p.add_argument("--blocks", type=int, default=None, help="DiT blocks in sequence (default 1)")
    p.add_argument("--tokens", type=lambda t: _int_list(t, "--tokens"), default=list(DEFAULT_TOKENS),
                   help="comma-separated token counts M (default: 8190,32760)")
    p.add_argument("--configs", default=None,
                   help="comma-separated: bf16, lowbit:<scheme> (default: bf16 and every lowbit scheme)")
    p.add_argument("--modes", default=",".join(DEFAULT_MODES),
                   help=f"comma-separated subset of {','.join(MODES)}")
    p.add_argument("--repeats", type=int, default=5, help="timed calls (or graph replays) per mode")
    p.add_argument("--device", default="cuda")
    p.add_argument("--json", dest="json_path", default=None, help="write the results to this file")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.repeats < 1 or (args.blocks is not None and args.blocks < 1):
        print("lowbit dit: --repeats and --blocks must be >= 1", file=sys.stderr)
        return 2
    device = modes_and_device(args, "lowbit dit", MODES, cuda_only=("graph",))
    if device is None:
        return 2
    s = SHAPES[args.shape]
    if args.blocks is not None:
        s = DiTShape(**{**asdict(s), "blocks": args.blocks})
    configs = [c.strip() for c in (args.configs or ",".join(default_configs())).split(",") if c.strip()]
    if "bf16" in configs:  # bf16 first: its output is the reference of the quality columns
        configs = ["bf16", *(c for c in configs if c != "bf16")]
    from .envinfo import header

    result: dict[str, Any] = {
        "header": header(),
        "shape": {**asdict(s), "head_dim": s.head_dim},
        "settings": {"tokens": args.tokens, "modes": args.modes, "repeats": args.repeats, "batch": 1},
        "rows": [],
    }
    reference: dict[int, torch.Tensor] = {}
    for config in configs:
        t0 = time.perf_counter()
        row = run_config(config, s, args, device, reference)
        row["seconds"] = time.perf_counter() - t0
        result["rows"].append(row)
        ratios(result["rows"])
        line = json.dumps({k: v for k, v in row.items() if k != "config"}, default=str)
        print(f"{config}: {line}", flush=True)
        if args.json_path:
            with open(args.json_path, "w") as f:
                json.dump(result, f, indent=1, default=str)
    print(format_table(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
