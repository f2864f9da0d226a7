"""Tensor-parallel benchmark: a Llama-3-70B-shaped stack of decoder layers on 1 and on N GPUs.

``lowbit bench tp --tp 2`` builds, in one process per GPU (NCCL), the same stack of ``--layers`` decoder layers
(hidden 8192, 64 heads of 128, 8 KV heads, MLP 28672, RMSNorm, RoPE, SDPA over a static KV cache), quantized
per config (``bf16``, ``lowbit:<scheme>``), split with :func:`lowbit.parallel.parallelize` (q/k/v and gate/up
column-parallel, o and down row-parallel) on N ranks (``lowbit:<scheme>+fused``: then q/k/v and gate/up of
each rank fused into one column-parallel GEMM each, :func:`lowbit.nn.fuse_projections`), and measures:

- decode step time at batch 1 replayed from a CUDA graph (the all-reduces captured in it), the number the
  targets use; also eager, and the graph of the projections alone (norms, the seven quantized projections with
  their all-reduces, residual adds: the part of the step lowbit makes, without attention and RoPE), and with
  ``--compile`` the step compiled by ``torch.compile(fullgraph=True)`` before its capture;
- prefill time of ``--prefill`` tokens, eager (GPU-bound at that size);
- the agreement of the N-rank output with the one-rank output on the same input.

Every rank times the same replays after a barrier; the slowest rank's time is reported. The ratio N-rank /
1-rank time is given per config and mode, with the targets (decode <= 0.6, prefill <= 0.55). Weights are
random, seeded per layer, identical on every rank and world size. One JSON + a table.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import socket
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

from .common import fuse_or_fail, lowbit_config
from .decoder import DecoderBlock, DecoderShape, clear_cache, layer_cache, register_decode_buffers
from .timing import capture_graph

SHAPES = {
    "llama3-70b": DecoderShape(8192, 28672, 64, 8, 128, 128256, 80),
    "tiny": DecoderShape(512, 1024, 8, 4, 64, 512, 2),
}
DEFAULT_CONFIGS = ("bf16", "lowbit:w4a16-nvfp4", "lowbit:w4a16-nvfp4+fused", "lowbit:w8a8-fp8-block")
TARGETS = {"decode_graph": 0.6, "compiled_graph": 0.6, "prefill": 0.55}
PLAN = {"layers.*.q_proj": "colwise", "layers.*.k_proj": "colwise", "layers.*.v_proj": "colwise",
        "layers.*.o_proj": "rowwise", "layers.*.mlp.gate_proj": "colwise",
        "layers.*.mlp.up_proj": "colwise", "layers.*.mlp.down_proj": "rowwise"}


class Stack(torch.nn.Module):
    """``layers`` decoder layers over a static KV cache holding this rank's ``kv_heads / world`` heads."""

    def __init__(self, s: DecoderShape, layers: int, max_len: int, world: int, device) -> None:
        super().__init__()
        self.s = s
        self.layers = torch.nn.ModuleList()
        register_decode_buffers(self, s, layers, 1, s.kv_heads // world, max_len, torch.bfloat16, device)

    projections_only = False
    """Run only each layer's norms, seven projections (with their all-reduces) and residual adds: the part of a
    decode step lowbit's kernels and the tensor-parallel sums make (attention, RoPE and the KV cache left out;
    the attention output is replaced by the query projection, which has its shape)."""
    n_layers: int | None = None

    def forward(self, h: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        layers = self.layers[: self.n_layers or len(self.layers)]
        if self.projections_only:
            for layer in layers:
                x = layer.attn_norm(h)
                q = layer.q_proj(x)
                layer.k_proj(x)
                layer.v_proj(x)
                h = h + layer.o_proj(q)
                x = layer.mlp_norm(h)
                h = h + layer.mlp(x)
            return h
        cos, sin = self.cos[pos], self.sin[pos]
        mask = self.key_pos[None, :] <= pos[:, None]
        for i, layer in enumerate(layers):
            h = layer(h, cos, sin, pos, mask, *layer_cache(self, i))
        return h


def build_stack(s: DecoderShape, layers: int, max_len: int, config: str, world: int, mesh, device,
                all_reduce: str = "nccl", exact: bool = False) -> Stack:
    """The stack for ``config``: each layer made in bf16 from its own seed, quantized, then (``world`` > 1)
    sharded, one layer at a time (the bf16 layer is freed before the next); ``+fused``: q/k/v and gate/up
    fused last (after the sharding: each rank fuses its shards)."""
    import lowbit

    scheme, fused = (None, "") if config == "bf16" else lowbit_config(
        config, ("fused",), "bf16, lowbit:<scheme>, lowbit:<scheme>+fused")
    stack = Stack(s, layers, max_len, world, device)
    for i in range(layers):
        torch.manual_seed(1000 + i)
        with torch.no_grad():
            block = DecoderBlock(s, torch.bfloat16, device)
            for p in block.parameters():
                if p.dim() >= 2:
                    p.normal_(0.0, 0.02)
        if scheme is not None:
            lowbit.quantize_model(block, scheme)
        stack.layers.append(block)
    if world > 1:
        if scheme is None:
            from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

            torch_plan = {k: ColwiseParallel() if v == "colwise" else RowwiseParallel() for k, v in PLAN.items()}
            parallelize_module(stack, mesh, torch_plan)
        else:
            from ..parallel import parallelize

            parallelize(stack, mesh, PLAN, all_reduce=all_reduce, exact=exact)
    if fused:
        fuse_or_fail(stack, config)
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()
    return stack.eval()


def _barrier(world: int) -> None:
    if world > 1:
        import torch.distributed as dist

        dist.barrier()
    torch.cuda.synchronize()


def _slowest(value: float, world: int) -> float:
    if world == 1:
        return value
    import torch.distributed as dist

    t = torch.tensor([value], dtype=torch.float64, device="cuda")
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def decode_graph_ms(stack: Stack, world: int, start: int, steps: int, compiled: bool = False) -> float:
    """Milliseconds per decode step replayed from a CUDA graph (slowest rank); ``compiled``: the step is
    ``torch.compile(fullgraph=True)``'s (Inductor fuses the elementwise ops around the projections), compiled
    before the capture."""
    h = torch.randn(1, 1, stack.s.hidden, dtype=torch.bfloat16, device="cuda", generator=None)
    pos = torch.tensor([start], device="cuda")
    forward = torch.compile(stack, fullgraph=True) if compiled else stack

    def step():
        h.copy_(forward(h, pos) * 0.5)   # the next step's input, kept at the same scale

    with torch.inference_mode():
        g = capture_graph(step, warm=lambda: forward(h, pos), before_capture=lambda: _barrier(world))
        for _ in range(3):
            g.replay()
        best = math.inf
        for _ in range(3):
            _barrier(world)
            t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            t0.record()
            for _ in range(steps):
                g.replay()
            t1.record()
            t1.synchronize()
            best = min(best, t0.elapsed_time(t1) / steps)
        del g
    return _slowest(best, world)


def decode_eager_ms(stack: Stack, world: int, start: int, steps: int) -> float:
    h = torch.randn(1, 1, stack.s.hidden, dtype=torch.bfloat16, device="cuda")
    pos = torch.tensor([start], device="cuda")
    with torch.inference_mode():
        for _ in range(3):
            stack(h, pos)
        best = math.inf
        for _ in range(3):
            _barrier(world)
            t0 = time.perf_counter()
            for _ in range(steps):
                stack(h, pos)
            torch.cuda.synchronize()
            best = min(best, (time.perf_counter() - t0) * 1e3 / steps)
    return _slowest(best, world)


def prefill_ms(stack: Stack, world: int, tokens: int) -> float:
    gen = torch.Generator(device="cuda").manual_seed(5)
    h = torch.randn(1, tokens, stack.s.hidden, dtype=torch.bfloat16, device="cuda", generator=gen)
    pos = torch.arange(tokens, device="cuda")
    with torch.inference_mode():
        stack(h, pos)
        best = math.inf
        for _ in range(3):
            _barrier(world)
            t0 = time.perf_counter()
            stack(h, pos)
            torch.cuda.synchronize()
            best = min(best, (time.perf_counter() - t0) * 1e3)
    return _slowest(best, world)


def probe_output(stack: Stack, tokens: int = 8, n_layers: int | None = None) -> torch.Tensor:
    """The output of the stack's first ``n_layers`` layers (default all) on a fixed input (positions
    0..tokens-1), for comparing world sizes. Random layers amplify any rounding difference layer after layer
    (and an activation quantizer turns some into code flips), so the first layer is the one to compare."""
    device = stack.cos.device
    gen = torch.Generator(device=device).manual_seed(9)
    h = torch.randn(1, tokens, stack.s.hidden, dtype=torch.bfloat16, device=device, generator=gen)
    with torch.inference_mode():
        clear_cache(stack)
        stack.n_layers = n_layers
        try:
            return stack(h, torch.arange(tokens, device=device)).float().cpu()
        finally:
            stack.n_layers = None


def _err(e: BaseException) -> str:
    return f"{type(e).__name__}: {str(e)[:400]}"


def rank_main(rank: int, world: int, args: dict, out_dir: str, port: int) -> None:
    """One rank: every config built, measured, freed; rank 0 writes ``rows_<world>.json``."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(rank)
    mesh = None
    if world > 1:
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh

        from ..io.distributed import import_before_group

        import_before_group()  # so that destroy_process_group below ends the group's threads
        dist.init_process_group("nccl", rank=rank, world_size=world, device_id=torch.device("cuda", rank))
        mesh = init_device_mesh("cuda", (world,))
    s = SHAPES[args["shape"]]
    rows = []
    try:
        for config in args["configs"]:
            variants = args["variants"] if (world > 1 and config != "bf16") else [("nccl", False)]
            if config.endswith("+fused"):   # exact column shards do not fuse (lowbit.nn.fuse_projections)
                variants = [v for v in variants if not v[1]] or [("nccl", False)]
            for reduce, exact in variants:
                row: dict = {"config": config, "world": world, "all_reduce": reduce if world > 1 else None,
                             "exact": exact if world > 1 else None}
                try:
                    t0 = time.perf_counter()
                    stack = build_stack(s, args["layers"], args["prefill"] + 64, config, world, mesh, "cuda",
                                        reduce, exact)
                    row["build_s"] = time.perf_counter() - t0
                    row["weight_gb_per_rank"] = sum(
                        t.numel() * t.element_size() for t in stack.state_dict().values()
                        if isinstance(t, torch.Tensor)) / 1e9
                    for tag, n in (("layer0", 1), ("stack", None)):
                        out = probe_output(stack, n_layers=n)
                        ref = Path(out_dir, f"probe_{tag}_{config.replace(':', '_')}.pt")
                        if world == 1 and rank == 0:
                            torch.save(out, ref)
                        elif ref.exists():
                            want = torch.load(ref)
                            row[f"rel_err_vs_1gpu_{tag}"] = float((out - want).norm() / want.norm())

                    def projections_graph():
                        stack.projections_only = True
                        try:
                            return decode_graph_ms(stack, world, 100, args["steps"])
                        finally:
                            stack.projections_only = False

                    modes = [("decode_graph", lambda: decode_graph_ms(stack, world, 100, args["steps"])),
                             ("projections_graph", projections_graph)]
                    if args.get("compile"):
                        modes.append(("compiled_graph",
                                      lambda: decode_graph_ms(stack, world, 100, args["steps"], compiled=True)))
                    for mode, fn in (*modes,
                                     ("decode_eager", lambda: decode_eager_ms(stack, world, 100, 20)),
                                     ("prefill", lambda: prefill_ms(stack, world, args["prefill"]))):
                        try:
                            row[f"{mode}_ms"] = fn()
                        except Exception as e:  # noqa: BLE001 (a mode that fails is recorded, the run goes on)
                            row[f"{mode}_error"] = _err(e)
                    row["peak_gb"] = torch.cuda.max_memory_allocated() / 1e9
                    stack = None  # freed before the next config is built
                except Exception as e:  # noqa: BLE001
                    row["error"] = _err(e)
                    traceback.print_exc()
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats()
                rows.append(row)
                if rank == 0:
                    print(json.dumps(row), flush=True)
                    Path(out_dir, f"rows_{world}.json").write_text(json.dumps(rows))
    finally:
        if world > 1:
            import torch.distributed as dist

            dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_world(world: int, args: dict, out_dir: str) -> list[dict]:
    import torch.multiprocessing as mp

    mp.spawn(rank_main, args=(world, args, out_dir, _free_port()), nprocs=world, join=True)
    path = Path(out_dir, f"rows_{world}.json")
    return json.loads(path.read_text()) if path.exists() else []


def ratios(rows: list[dict], tp: int) -> list[dict]:
    """Per config and all-reduce: N-rank / 1-rank time per mode, with the targets met or not."""
    one = {r["config"]: r for r in rows if r["world"] == 1}
    out = []
    for r in rows:
        if r["world"] != tp or r["config"] not in one:
            continue
        base = one[r["config"]]
        entry = {"config": r["config"], "all_reduce": r["all_reduce"], "exact": r.get("exact")}
        for mode in ("decode_graph", "projections_graph", "compiled_graph", "decode_eager", "prefill"):
            a, b = r.get(f"{mode}_ms"), base.get(f"{mode}_ms")
            if a is not None and b:
                entry[mode] = a / b
                if mode in TARGETS:
                    entry[f"{mode}_meets"] = a / b <= TARGETS[mode]
        out.append(entry)
    return out


def format_table(result: dict) -> str:
    lines = [f"{'config':24} {'ranks':>5} {'reduce':>8} {'exact':>5} {'decode graph ms':>15} {'proj. ms':>8} "
             f"{'eager ms':>9} {'prefill ms':>10} {'GB/rank':>7} {'err L0':>8} {'err all':>8}"]
    for r in result["rows"]:
        def cell(k, fmt="{:.3f}"):
            v = r.get(k)
            return "err" if v is None and (f"{k[:-3]}_error" in r or "error" in r) else "-" if v is None else fmt.format(v)

        ex = "-" if r.get("exact") is None else "yes" if r["exact"] else "no"
        lines.append(f"{r['config']:24} {r['world']:>5} {str(r.get('all_reduce') or '-'):>8} {ex:>5} "
                     f"{cell('decode_graph_ms'):>15} {cell('projections_graph_ms'):>8} "
                     f"{cell('decode_eager_ms', '{:.2f}'):>9} {cell('prefill_ms', '{:.1f}'):>10} "
                     f"{cell('weight_gb_per_rank', '{:.2f}'):>7} {cell('rel_err_vs_1gpu_layer0', '{:.1e}'):>8} "
                     f"{cell('rel_err_vs_1gpu_stack', '{:.1e}'):>8}")
    lines.append("")
    lines.append(f"ratios {result['tp']} ranks / 1 rank (targets: decode graph <= {TARGETS['decode_graph']}, "
                 f"prefill <= {TARGETS['prefill']}):")
    for e in result["ratios"]:
        parts = [f"{m} {e[m]:.3f}" + (" (met)" if e.get(f"{m}_meets") else " (missed)" if m in TARGETS else "")
                 for m in ("decode_graph", "projections_graph", "compiled_graph", "decode_eager", "prefill")
                 if m in e]
        ex = " exact" if e.get("exact") else ""
        lines.append(f"  {e['config']:24} {str(e['all_reduce'] or '-'):>8}{ex}: " + ", ".join(parts))
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="lowbit bench tp", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tp", type=int, default=2, help="ranks (GPUs) of the parallel run, against 1 (default 2)")
    p.add_argument("--shape", choices=sorted(SHAPES), default="llama3-70b")
    p.add_argument("--layers", type=int, default=8, help="decoder layers in the stack (default 8)")
    p.add_argument("--configs", default=",".join(DEFAULT_CONFIGS),
                   help="comma-separated: bf16, lowbit:<scheme>, lowbit:<scheme>+fused (default: %(default)s)")
    p.add_argument("--variants", default="nccl,symm_mem,nccl+exact",
                   help="N-rank variants of each quantized config: the row-parallel sum (nccl, symm_mem), '+exact' "
                   "for column shards planned as the whole layer (default: %(default)s)")
    p.add_argument("--prefill", type=int, default=2048, help="prefill tokens (default 2048)")
    p.add_argument("--compile", action="store_true",
                   help="also time the decode step compiled (torch.compile fullgraph, then the CUDA graph)")
    p.add_argument("--steps", type=int, default=100, help="graph replays per timed window (default 100)")
    p.add_argument("--json", default=None, metavar="PATH", help="write the result here")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if not torch.cuda.is_available():
        print("lowbit bench tp: needs CUDA GPUs", file=sys.stderr)
        return 2
    if args.tp < 2 or args.tp > torch.cuda.device_count():
        print(f"lowbit bench tp: --tp must be in [2, {torch.cuda.device_count()}] (the GPUs here), got {args.tp}",
              file=sys.stderr)
        return 2
    from ..parallel.collectives import ALL_REDUCES

    variants = []
    for v in (v for v in args.variants.split(",") if v):
        reduce, _, flag = v.partition("+")
        if reduce not in ALL_REDUCES or flag not in ("", "exact"):
            print(f"lowbit bench tp: --variants takes {ALL_REDUCES} each with an optional '+exact', got {v!r}",
                  file=sys.stderr)
            return 2
        variants.append((reduce, flag == "exact"))
    if not variants:
        print("lowbit bench tp: --variants is empty", file=sys.stderr)
        return 2
    conf = {"shape": args.shape, "layers": args.layers, "configs": [c for c in args.configs.split(",") if c],
            "prefill": args.prefill, "steps": args.steps, "variants": variants, "compile": args.compile}
    from .envinfo import header

    result: dict = {"suite": "tp", "header": header(), "tp": args.tp, "args": conf, "rows": [], "ratios": []}
    with tempfile.TemporaryDirectory(prefix="lowbit-tp-") as tmp:
        for world in (1, args.tp):
            result["rows"] += run_world(world, conf, tmp)
            result["ratios"] = ratios(result["rows"], args.tp)
            if args.json:
                Path(args.json).write_text(json.dumps(result, indent=1))
    print(format_table(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
