"""End-to-end decoder benchmark: a Llama-3-8B-shaped model, quantized as a user would, in every run mode.

``lowbit e2e`` (or ``python -m lowbit.bench.e2e``) builds a decoder with random weights (no downloads) for each
configuration (bf16, lowbit schemes, torchao int4 / fp8-rowwise, bitsandbytes nf4 when installed), and
measures in one run, on one GPU:

- decode tokens/s at batch 1 with a static KV cache: eager and ``torch.compile`` default mode (every config's
  model built, then timed in interleaved rounds: both are host-bound), ``torch.compile(mode="reduce-overhead")``
  (CUDA-graph trees) and a manually captured CUDA graph;
- prefill time of ``--prefill`` tokens, eager;
- transformers' ``LlamaForCausalLM.generate()`` decode tokens/s on the same shapes, eager (every config's model
  built, then timed in interleaved rounds);
- weight bytes, and host time of one linear call at M = 1 (the config's q_proj against ``F.linear`` on the
  same shape: CPU time per call with no synchronization, which is what an eager model pays per layer).

Every number is also given as a ratio to bf16 measured in the same run. Results go to a JSON file and a table.
A mode that fails records its error (type and message) in place of a number; the run goes on.

The model: ``hidden`` 4096, 32 heads of 128 (8 KV heads), MLP 14336, vocabulary 128256, RMSNorm, RoPE,
SDPA over a static cache with a position mask; every ``nn.Linear`` but ``lm_head`` is quantized.

This module runs the benchmark (one row per config, the interleaved modes, the JSON and the command line). The
parts live beside it: the model (:mod:`lowbit.bench.decoder`), the configs (:mod:`lowbit.bench.e2e_configs`),
the timing modes (:mod:`lowbit.bench.e2e_timing`), ``generate()`` (:mod:`lowbit.bench.e2e_generate`) and the
ratios, table and comparison (:mod:`lowbit.bench.e2e_report`).
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

import torch
import torch.nn.functional as F

from .common import modes_and_device, short_error
from .decoder import SHAPES, Decoder, DecoderBlock, DecoderShape, build_decoder, register_decode_buffers
from .e2e_configs import DEFAULT_CONFIGS, LOWBIT_SCHEMES, PEERS, apply_config, weight_bytes
from .e2e_generate import generate_rounds
from .e2e_report import compare, format_table, ratios
from .e2e_timing import (
    REPEATS,
    compiled_rounds,
    decode_compiled,
    decode_graph,
    eager_rounds,
    host_us_per_call,
    interleaved_rounds,
    prefill_ms,
)

MODES = ("eager", "graph", "compile", "compile-ro", "prefill", "generate", "host")


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
    # eager and compiled decode and generate: every config's model built beside the others, timed in
    # interleaved rounds
    rounds = {
        "eager": lambda: eager_rounds(s, configs, args.steps, args.prefill + args.steps + 16, args.prefill, device),
        "compile": lambda: compiled_rounds(s, configs, args.steps, args.prefill + args.steps + 16, args.prefill,
                                           args.compile_layers, device),
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


__all__ = [
    "DEFAULT_CONFIGS",
    "LOWBIT_SCHEMES",
    "MODES",
    "PEERS",
    "REPEATS",
    "SHAPES",
    "Decoder",
    "DecoderBlock",
    "DecoderShape",
    "apply_config",
    "build_decoder",
    "build_parser",
    "compare",
    "decode_compiled",
    "decode_graph",
    "eager_rounds",
    "format_table",
    "generate_rounds",
    "host_us_per_call",
    "interleaved_rounds",
    "main",
    "prefill_ms",
    "ratios",
    "register_decode_buffers",
    "run_config",
    "weight_bytes",
]


if __name__ == "__main__":
    sys.exit(main())
