"""GPTQ benchmark: the time to GPTQ one Llama-3-8B-shaped decoder layer, and what it buys over round-to-nearest.

``lowbit bench gptq`` builds one decoder layer (hidden 4096, 32 heads of 128, 8 KV heads, MLP 14336, RMSNorm,
causal SDPA; random bf16 weights, seeded) inside a one-layer stack, and quantizes it per scheme with
``lowbit.quantize_model(stack, scheme, algorithm=GPTQ(...), calibration=...)`` on ``--calib`` random
sequences of ``--seq`` tokens (the layer's input hidden states, with a few strong channels as real
activations have). Per scheme and mode it reports:

- ``total_s``: the whole ``quantize_model`` call (the calibration pass accumulating the seven Hessians, then
  the GPTQ of the seven projections), synchronised, after one warm-up run of the same scheme on a small
  layer (kernel loading and first-use costs excluded); ``forward_s``: the float layer's plain forward over the
  calibration set, timed apart (what the calibration pass costs before its Hessian hooks);
- ``rtn_s``: round-to-nearest ``quantize_model`` of the same layer;
- the layer's relative output error on held-out sequences, GPTQ against round-to-nearest.

Modes: ``graphs`` (the default GPU path: each lazy block's column loop replayed from CUDA graphs) and
``eager`` (the same loop launched op by op, ``lowbit.algorithms.gptq_graphs.USE_CUDA_GRAPHS = False``). Target: a
layer in at most 10 s on an H100. One JSON + a table.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from .decoder import SHAPES, DecoderBlock, DecoderShape

DEFAULT_SCHEMES = ("w4a16-nvfp4", "w4a16-int4", "w4a16-mxfp4", "w4a16-nf4")
TARGET_S = 10.0


class Layer(DecoderBlock):
    """A Llama decoder layer (the benchmark decoder's projections and norms) over a whole sequence: causal
    attention, no cache, no RoPE, since the projections' inputs are what GPTQ needs."""

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        q, k, v = self.attention_inputs(h)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.attention_output_and_mlp(h, a)


class Stack(nn.Module):
    """One layer under ``layers.0``: GPTQ's stage is the layer, calibrated in one pass."""

    def __init__(self, s: DecoderShape, dtype: torch.dtype, device) -> None:
        super().__init__()
        self.layers = nn.ModuleList([Layer(s, dtype, device)])

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.layers[0](h)


def build(s: DecoderShape, device, seed: int = 0) -> Stack:
    torch.manual_seed(seed)
    m = Stack(s, torch.float32, device)
    with torch.no_grad():
        for lin in (x for x in m.modules() if isinstance(x, nn.Linear)):
            lin.weight.normal_(0, lin.in_features ** -0.5)
    return m.to(torch.bfloat16)


def hidden_states(s: DecoderShape, n: int, seq: int, device, seed: int) -> list[torch.Tensor]:
    g = torch.Generator(device=device).manual_seed(seed)
    out = []
    for _ in range(n):
        h = torch.randn(1, seq, s.hidden, generator=g, device=device)
        h[..., :16] *= 12  # a few outlier channels
        out.append(h.to(torch.bfloat16))
    return out


def _sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def _rel_err(ref: Stack, model: nn.Module, held: list[torch.Tensor]) -> float:
    num = den = 0.0
    with torch.no_grad():
        for h in held:
            a, b = ref(h).float() - h.float(), model(h).float() - h.float()  # the layer's contribution
            num += float(((a - b) ** 2).sum())
            den += float((a ** 2).sum())
    return (num / den) ** 0.5 if den else float("nan")


def run_scheme(scheme: str, s: DecoderShape, calib, held, device, mode: str, config) -> dict:
    import lowbit
    from ..algorithms import gptq_graphs as gptq_module

    ref = build(s, device)
    row: dict = {"scheme": scheme, "mode": mode}
    old = gptq_module.USE_CUDA_GRAPHS
    gptq_module.USE_CUDA_GRAPHS = mode == "graphs"
    try:
        # warm-up on a small layer: kernel loading, cuBLAS/cuSOLVER handles, first-use allocations
        small = build(SHAPES["tiny"], device)
        lowbit.quantize_model(small, scheme, algorithm=config,
                              calibration=hidden_states(SHAPES["tiny"], 2, 64, device, 9))
        _sync(device)
        m = build(s, device)
        t0 = time.perf_counter()
        with torch.no_grad():
            for h in calib:
                m(h)
        _sync(device)
        row["forward_s"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        lowbit.quantize_model(m, scheme, algorithm=config, calibration=calib)
        _sync(device)
        row["total_s"] = time.perf_counter() - t0
    finally:
        gptq_module.USE_CUDA_GRAPHS = old
    row["gptq_rel_err"] = _rel_err(ref, m, held)
    del m
    r = build(s, device)
    t0 = time.perf_counter()
    lowbit.quantize_model(r, scheme)
    _sync(device)
    row["rtn_s"] = time.perf_counter() - t0
    row["rtn_rel_err"] = _rel_err(ref, r, held)
    row["meets_target"] = row["total_s"] <= TARGET_S
    return row


def format_table(result: dict) -> str:
    a = result["args"]
    lines = [f"GPTQ of one {a['shape']} decoder layer, {a['calib']} x {a['seq']} calibration tokens "
             f"({result['header'].get('gpu', '?')}); target <= {TARGET_S:g} s",
             "| scheme | mode | GPTQ s (quantize_model) | forward s (calibration set) | RTN s | rel err GPTQ | rel err RTN |",
             "|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        if "error" in r:
            lines.append(f"| {r['scheme']} | {r['mode']} | error: {r['error']} | | | | |")
            continue
        lines.append(f"| {r['scheme']} | {r['mode']} | {r['total_s']:.2f} | {r['forward_s']:.2f} | "
                     f"{r['rtn_s']:.2f} | {r['gptq_rel_err']:.4f} | {r['rtn_rel_err']:.4f} |")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="lowbit bench gptq", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="llama3-8b", choices=sorted(SHAPES))
    p.add_argument("--schemes", default=",".join(DEFAULT_SCHEMES))
    p.add_argument("--modes", default="graphs,eager", help="graphs, eager (default: both)")
    p.add_argument("--calib", type=int, default=128, help="calibration sequences (default 128)")
    p.add_argument("--seq", type=int, default=2048, help="tokens per sequence (default 2048)")
    p.add_argument("--held", type=int, default=2, help="held-out sequences for the error (default 2)")
    p.add_argument("--act-order", action="store_true", help="GPTQ(act_order=True)")
    p.add_argument("--cli-defaults", action="store_true",
                   help="the settings `lowbit quantize --algorithm gptq` runs (act-order, scale search, refinement "
                        "sweeps, the asymmetric objective) instead of GPTQ()'s plain defaults")
    p.add_argument("--set", default="", metavar="KEY=VALUE,...",
                   help="GPTQ fields over those, e.g. 'refine_sweeps=0,asymmetric=0' (ints, floats, 0/1 for flags), "
                        "to time the parts of a configuration one at a time")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--json", default=None, metavar="PATH")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from ..algorithms import GPTQ
    from ..nn import SCHEMES
    from .envinfo import header

    schemes = [x for x in args.schemes.split(",") if x]
    modes = [x for x in args.modes.split(",") if x]
    bad = [x for x in schemes if x not in SCHEMES] + [x for x in modes if x not in ("graphs", "eager")]
    if bad or not schemes or not modes:
        print(f"lowbit bench gptq: unknown or empty --schemes/--modes: {bad}", file=sys.stderr)
        return 2
    s = SHAPES[args.shape]
    fields: dict = {"act_order": args.act_order}
    if args.cli_defaults:
        from ..cli.algorithm_flags import GPTQ_DEFAULTS

        fields = dict(GPTQ_DEFAULTS)
    for item in filter(None, args.set.split(",")):
        key, _, value = item.partition("=")
        try:
            fields[key.strip()] = float(value) if "." in value or "e" in value else int(value)
        except ValueError:
            print(f"lowbit bench gptq: --set {item!r}: not KEY=<number>", file=sys.stderr)
            return 2
    for key in ("act_order", "asymmetric"):
        if key in fields:
            fields[key] = bool(fields[key])
    try:
        config = GPTQ(**fields)
    except (TypeError, ValueError) as e:
        print(f"lowbit bench gptq: {e}", file=sys.stderr)
        return 2
    calib = hidden_states(s, args.calib, args.seq, args.device, 1)
    held = hidden_states(s, args.held, args.seq, args.device, 2)
    result: dict = {"suite": "gptq", "header": header(), "args": {
        "shape": args.shape, "calib": args.calib, "seq": args.seq, "act_order": args.act_order,
        "cli_defaults": args.cli_defaults, "set": args.set,
        "device": args.device}, "rows": []}
    for scheme in schemes:
        for mode in modes:
            if mode == "graphs" and torch.device(args.device).type != "cuda":
                continue
            try:
                row = run_scheme(scheme, s, calib, held, args.device, mode, config)
            except Exception as e:  # a failing scheme is a row, the others still run
                row = {"scheme": scheme, "mode": mode, "error": f"{type(e).__name__}: {e}"[:300]}
            result["rows"].append(row)
            print(json.dumps(row), flush=True)
            if args.json:
                Path(args.json).write_text(json.dumps(result, indent=1))
    print(format_table(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
