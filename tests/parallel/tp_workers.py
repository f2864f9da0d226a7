"""Tensor-parallel checks run on every rank of a process group (gloo on CPU, NCCL on GPUs).

``spawn_ranks(fn, world, device, tmp_path, **kw)`` starts ``world`` processes, each running ``fn(rank, world,
device, out_dir, **kw)`` after joining the group and building a 1-D mesh; rank 0's JSON result comes back.
Imported by the CPU tests (gloo) and by the GPU tests (NCCL, one GPU per rank).
"""

from __future__ import annotations

import copy
import json
import os
import socket
import sys
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

import lowbit
from lowbit.nn.modules import QuantLinear

MLP_SCHEMES = ("w4a16-nvfp4", "w4a16-mxfp4", "w4a16-int4", "w4a16-nf4", "w4a16-bnb-fp4", "w4a16-fp4b32",
               "w8a8-fp8-block", "w4a4-nvfp4", "w4a4-mxfp4", "w4a8-mxfp4", "w8a8-mxfp8")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, fn, world: int, device: str, out_dir: str, port: int, kwargs: dict) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    backend = "nccl" if device == "cuda" else "gloo"
    if device == "cuda":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, rank=rank, world_size=world)
    try:
        result = fn(rank, world, device, **kwargs)
        if rank == 0:
            Path(out_dir, "result.json").write_text(json.dumps(result))
        # every rank done with its collectives before any tears the group down (a rank leaving early could
        # reset a peer's gloo connection mid-collective); on the failure path a barrier could wait forever
        dist.barrier()
    except BaseException:
        Path(out_dir, f"error{rank}.txt").write_text(traceback.format_exc())
        raise
    finally:
        dist.destroy_process_group()
    # a clean run leaves without the interpreter's shutdown: there a c10d/gloo background thread that is still
    # joinable now and then ends the process with "terminate called without an active exception" (SIGABRT),
    # which failed whole modules of these tests on 2-core machines
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def spawn_ranks(fn, world: int, device: str, out_dir, **kwargs) -> dict:
    """Run ``fn`` on ``world`` ranks; rank 0's returned dict. A rank's exception fails with its traceback."""
    out_dir = str(out_dir)
    try:
        mp.spawn(_entry, args=(fn, world, device, out_dir, _free_port(), kwargs), nprocs=world, join=True)
    except Exception as e:
        errors = sorted(Path(out_dir).glob("error*.txt"))
        detail = "\n".join(p.read_text() for p in errors) or str(e)
        raise AssertionError(f"a rank failed:\n{detail}") from None
    return json.loads(Path(out_dir, "result.json").read_text())


def _mesh(world: int, device: str):
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(device, (world,))


class MLP(nn.Module):
    def __init__(self, hidden: int, inter: int, activation_after_down: bool = False) -> None:
        super().__init__()
        self.up = nn.Linear(hidden, inter, bias=True)
        self.gate = nn.Linear(hidden, inter, bias=False)
        self.down = nn.Linear(inter, hidden, bias=True)

    def forward(self, x):
        return self.down(torch.nn.functional.silu(self.gate(x)) * self.up(x))


def _gather_last(y: torch.Tensor, world: int) -> torch.Tensor:
    parts = [torch.empty_like(y) for _ in range(world)]
    dist.all_gather(parts, y.contiguous())
    return torch.cat(parts, dim=-1)


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a.view(torch.int16), b.view(torch.int16))


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def mlp_checks(rank: int, world: int, device: str, schemes=MLP_SCHEMES, hidden: int = 256, inter: int = 1024,
               rows=(1, 5, 16, 64), all_reduce: str = "nccl", exact: bool = False) -> dict:
    """Per scheme: the column-parallel outputs gathered against the one-process layer's (bit for bit; the row
    counts where they differ and the largest difference are recorded), the whole MLP (colwise gate/up, rowwise
    down with a fused GELU) within the all-reduce's rounding, and every rank's output the same tensor."""
    from lowbit.parallel import parallelize

    mesh = _mesh(world, device)
    out: dict = {}
    for scheme in schemes:
        torch.manual_seed(0)
        ref = MLP(hidden, inter).to(device)
        lowbit.quantize_model(ref, scheme)
        ref.down.activation = "gelu"     # fused in one process; after the reduction when row-parallel
        tp = copy.deepcopy(ref)
        parallelize(tp, mesh, {"up": "colwise", "gate": "colwise", "down": "rowwise"}, all_reduce=all_reduce,
                    exact=exact)
        assert type(tp.up).__name__ == "ColwiseQuantLinear" and tp.up.out_features == inter // world
        assert type(tp.down).__name__ == "RowwiseQuantLinear" and tp.down.in_features == inter // world
        res = {"colwise_bits_equal": True, "colwise_inexact_rows": [], "colwise_max_diff": 0.0, "rel_err": 0.0,
               "ranks_agree": True}
        for m in rows:
            gen = torch.Generator().manual_seed(100 + m)
            x = (torch.randn(2, m, hidden, generator=gen) * 3).to(torch.bfloat16).to(device)
            with torch.inference_mode():
                want_up = ref.up(x)
                got_up = _gather_last(tp.up(x), world)
                want = ref(x)
                got = tp(x)
            if not _bits_equal(got_up, want_up):
                res["colwise_bits_equal"] = False
                res["colwise_inexact_rows"].append(m)
                res["colwise_max_diff"] = max(res["colwise_max_diff"],
                                              float((got_up.float() - want_up.float()).abs().max()))
            res["rel_err"] = max(res["rel_err"], _rel(got, want))
            first = got.clone()
            dist.broadcast(first, 0)
            res["ranks_agree"] &= torch.equal(first, got)
        out[scheme] = res
    return out


def graph_checks(rank: int, world: int, device: str, all_reduce: str = "nccl", scheme: str = "w4a16-nvfp4"):
    """A tensor-parallel MLP captured in a CUDA graph (its all-reduces in the graph): replays give the eager
    result for new inputs copied into the captured input."""
    from lowbit.parallel import parallelize

    mesh = _mesh(world, device)
    torch.manual_seed(5)
    m = MLP(1024, 4096).to(device)
    lowbit.quantize_model(m, scheme)
    parallelize(m, mesh, {"up": "colwise", "gate": "colwise", "down": "rowwise"}, all_reduce=all_reduce)
    x = torch.randn(1, 1, 1024, dtype=torch.bfloat16, device=device)
    equal = True
    from lowbit.bench.timing import capture_graph

    out = []
    with torch.inference_mode():
        g = capture_graph(lambda: out.append(m(x)), warm=lambda: m(x))
        (y,) = out
        for i in range(3):
            x.copy_(torch.randn(1, 1, 1024, generator=torch.Generator().manual_seed(i)).to(device, torch.bfloat16))
            g.replay()
            torch.cuda.synchronize()
            equal &= torch.equal(y, m(x))
    return {"replay_equal_eager": bool(equal)}


def layout_checks(rank: int, world: int, device: str) -> dict:
    """Non-default placements: a column-parallel layer with a gathered output, a row-parallel layer given the
    whole input (input_layouts=Replicate), DTensor inputs; torch's own styles in the plan; the errors."""
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel as TorchColwise
    from torch.distributed.tensor.parallel import RowwiseParallel as TorchRowwise

    from lowbit.parallel import ColwiseParallel, RowwiseParallel, parallelize

    mesh = _mesh(world, device)
    torch.manual_seed(1)
    ref = MLP(128, 512).to(device)
    lowbit.quantize_model(ref, "w4a16-nvfp4")
    x = torch.randn(3, 128, dtype=torch.bfloat16, device=device)
    res = {}
    with torch.inference_mode():
        want_up, want_down_in = ref.up(x), ref.gate(x)
        want = ref.down(want_down_in)
    tp = copy.deepcopy(ref)
    parallelize(tp, mesh, {"up": ColwiseParallel(output_layouts=Replicate()),
                           "down": TorchRowwise(input_layouts=Replicate()), "gate": TorchColwise()})
    with torch.inference_mode():
        res["gathered_equal"] = _bits_equal(tp.up(x), want_up)
        res["replicated_in_rel"] = _rel(tp.down(want_down_in), want)
        xd = DTensor.from_local(x, mesh, [Replicate()], run_check=False)
        res["dtensor_in_equal"] = _bits_equal(_gather_last(tp.gate(xd), world), want_down_in)
    tp2 = copy.deepcopy(ref)
    parallelize(tp2, mesh, {"down": RowwiseParallel(use_local_output=False)})
    k0 = rank * (512 // world)
    with torch.inference_mode():
        y = tp2.down(want_down_in[:, k0 : k0 + 512 // world])
    res["dtensor_out"] = isinstance(y, DTensor) and tuple(y.placements) == (Replicate(),)
    res["dtensor_out_rel"] = _rel(y.to_local(), want)
    # errors leave the model untouched
    bad = copy.deepcopy(ref)
    before = {k: v.clone() for k, v in bad.state_dict().items()}
    errors = {}
    for plan in ({"up": "colwise", "nope": "rowwise"}, {"up": "diagonal"}, {"up": "colwise", "u*": "rowwise"}):
        try:
            parallelize(bad, mesh, plan)
            errors[str(plan)] = None
        except (ValueError, TypeError) as e:
            errors[str(plan)] = str(e)
    odd = MLP(128, 48 * world + 16).to(device)   # N / world is not a whole number of nvfp4 blocks for K
    lowbit.quantize_model(odd, "w4a16-nvfp4")
    try:
        parallelize(odd, mesh, {"down": "rowwise"})
        errors["odd"] = None
    except ValueError as e:
        errors["odd"] = str(e)
    import tempfile

    try:
        lowbit.save_quantized(tp, tempfile.mkdtemp(prefix=f"lowbit-tp{rank}-") + "/out")
        errors["save"] = None
    except ValueError as e:
        errors["save"] = str(e)
    res["errors"] = errors
    res["untouched"] = all(torch.equal(before[k], v) for k, v in bad.state_dict().items()) and all(
        type(m) is QuantLinear for m in (bad.up, bad.gate, bad.down)) and type(odd.down) is QuantLinear
    # the shard of a sequence-parallel input: Shard(0) rows gathered before a column-parallel layer
    sp = copy.deepcopy(ref)
    parallelize(sp, mesh, {"up": ColwiseParallel(input_layouts=Shard(0))})
    rows = x.shape[0] * world
    xs = torch.randn(rows, 128, dtype=torch.bfloat16, device=device, generator=None)
    dist.broadcast(xs, 0)
    with torch.inference_mode():
        got = _gather_last(sp.up(xs.chunk(world)[rank]), world)
        res["sequence_parallel_equal"] = _bits_equal(got, ref.up(xs))
    return res


def llama_checks(rank: int, world: int, device: str, scheme: str = "w4a16-nvfp4") -> dict:
    """A tiny transformers Llama, quantized, then parallelized with its own plan (``plan=None``): logits agree
    with the one-process model, and a compiled forward (``fullgraph``) gives the eager result."""
    import transformers

    from lowbit.parallel import parallelize

    mesh = _mesh(world, device)
    cfg = transformers.LlamaConfig(hidden_size=256, intermediate_size=512, num_attention_heads=4,
                                   num_key_value_heads=world, num_hidden_layers=2, vocab_size=128,
                                   max_position_embeddings=64, head_dim=64)
    torch.manual_seed(2)
    ref = transformers.LlamaForCausalLM(cfg).to(device=device, dtype=torch.bfloat16).eval()
    lowbit.quantize_model(ref, scheme)
    tp = copy.deepcopy(ref)
    parallelize(tp, mesh)
    ids = torch.randint(0, 128, (1, 12), generator=torch.Generator().manual_seed(3)).to(device)
    with torch.inference_mode():
        want = ref(ids).logits
        got = tp(ids).logits
    res = {"rel_err": _rel(got, want), "sharded": sum(type(m).__name__.endswith("wiseQuantLinear")
                                                        for m in tp.modules())}
    return res


def compiled_checks(rank: int, world: int, device: str, scheme: str = "w4a16-nvfp4", backend: str = "aot_eager"):
    """``torch.compile(fullgraph=True)`` of a tensor-parallel MLP: the collectives trace (functional
    all-reduce) and the result equals the eager one."""
    from lowbit.parallel import parallelize

    mesh = _mesh(world, device)
    torch.manual_seed(4)
    m = MLP(256, 512).to(device)
    lowbit.quantize_model(m, scheme)
    parallelize(m, mesh, {"up": "colwise", "gate": "colwise", "down": "rowwise"})
    x = torch.randn(1, 1, 256, dtype=torch.bfloat16, device=device)
    with torch.no_grad():
        eager = m(x)
        compiled = torch.compile(m, fullgraph=True, backend=backend)
        got = compiled(x)
    return {"equal": bool(torch.equal(eager, got)), "rel": _rel(got, eager),
            "act_quantized": not lowbit.SCHEMES[scheme].weight_only}


def stack_checks(rank: int, world: int, device: str, configs=("bf16", "lowbit:w4a16-nvfp4", "lowbit:w8a8-fp8-block")):
    """``lowbit bench tp``'s layer stack: its plan shards every projection, and the parallel stack's output
    agrees with the one-rank stack's (built from the same seeds)."""
    from lowbit.bench.tp import SHAPES, build_stack, probe_output

    mesh = _mesh(world, device)
    s = SHAPES["tiny"]
    out = {}
    for config in configs:
        one = probe_output(build_stack(s, 2, 16, config, 1, None, device))
        par = build_stack(s, 2, 16, config, world, mesh, device)
        sharded = sum(type(m).__name__ in ("ColwiseQuantLinear", "RowwiseQuantLinear") for m in par.modules())
        got = probe_output(par)
        # the decode step as `lowbit bench tp --compile` compiles it: the whole parallel stack in one graph
        h, pos = got[:, :1].to(device, torch.bfloat16).contiguous(), torch.tensor([3], device=device)
        with torch.inference_mode():
            eager = par(h, pos)
            compiled = torch.compile(par, fullgraph=True, backend="aot_eager")(h, pos)
        out[config] = {"rel_err": _rel(got, one), "sharded": sharded,
                       "compiled_equal": bool(torch.equal(eager, compiled))}
    return out


def fused_checks(rank: int, world: int, device: str, scheme: str = "w4a16-nvfp4") -> dict:
    """``fuse_projections`` after ``parallelize``: each rank's q/k/v and gate/up shards run as one
    column-parallel GEMM, the stack computes what the unfused parallel stack computes, and unfusing gives back
    the shards (class, placement, weights) they were."""
    from lowbit.bench.tp import SHAPES, build_stack, probe_output
    from lowbit.nn import FusedProjection, unfuse_projections
    from lowbit.parallel import ColwiseQuantLinear

    mesh = _mesh(world, device)
    s = SHAPES["tiny"]
    plain = build_stack(s, 2, 16, f"lowbit:{scheme}", world, mesh, device)
    fused = build_stack(s, 2, 16, f"lowbit:{scheme}+fused", world, mesh, device)
    want, got = probe_output(plain), probe_output(fused)
    layer = fused.layers[0]
    gemms = {id(m._group[0]): m._group[0] for m in fused.modules() if isinstance(m, FusedProjection)}
    qkv = layer.q_proj._group[0]
    # the decode step compiled whole (functional all-reduce, the fused members in one graph)
    h, pos = got[:, :1].to(device, torch.bfloat16).contiguous(), torch.tensor([3], device=device)
    with torch.inference_mode():
        eager_step = fused(h, pos)
        compiled_step = torch.compile(fused, fullgraph=True, backend="aot_eager" if device == "cpu" else "inductor")(h, pos)
    out = {"compiled_rel": _rel(compiled_step.float().cpu(), eager_step.float().cpu()),
           "compiled_equal": bool(torch.equal(compiled_step, eager_step)),
           "equal": bool(torch.equal(want, got)), "rel": _rel(got, want), "fused_layers": len(gemms),
           "fused_class": type(qkv).__name__, "fused_full_out": qkv.tp.full_out, "fused_local_out": qkv.out_features,
           "local_q": layer.q_proj.out_features}
    unfuse_projections(fused)
    a, b = plain.state_dict(), fused.state_dict()
    out["unfused_same_state"] = a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    out["unfused_colwise"] = all(isinstance(lay.get_submodule(n), ColwiseQuantLinear)
                                 and lay.get_submodule(n).tp.world == world for lay in fused.layers
                                 for n in ("q_proj", "k_proj", "v_proj", "mlp.gate_proj", "mlp.up_proj"))
    out["unfused_equal"] = bool(torch.equal(probe_output(fused), want))
    # a plan's exact shards and row-parallel layers stay unfused (each group left as it was)
    from lowbit.nn import fuse_projections

    exact = build_stack(s, 1, 16, f"lowbit:{scheme}", world, mesh, device, exact=True)
    out["exact_fused_groups"] = len(fuse_projections(exact))
    return out


def all_checks(rank: int, world: int, device: str, rows=(1, 5, 16, 64, 300, 2048), hidden: int = 1024,
               inter: int = 4096) -> dict:
    """Every check above in one process group (the kernels compile once per rank): the MLP of every scheme with
    exact and own-size planning, placements, a transformers Llama, CUDA-graph capture with each all-reduce
    (symmetric memory on CUDA only), and a compiled forward (Inductor on CUDA, aot_eager on CPU)."""
    out: dict = {}

    def attempt(name, fn, **kw):
        try:
            out[name] = fn(rank, world, device, **kw)
        except Exception:  # noqa: BLE001 (each check reports its own failure; the others still run)
            out[name] = {"error": traceback.format_exc()[-3000:]}

    attempt("mlp_exact", mlp_checks, rows=rows, hidden=hidden, inter=inter, exact=True)
    if device == "cuda":  # on CPU the reference runs: no launch plans to differ
        attempt("mlp_own", mlp_checks, rows=rows, hidden=hidden, inter=inter, exact=False)
    attempt("layouts", layout_checks)
    attempt("llama", llama_checks)
    if device == "cuda":
        for reduce in ("nccl", "symm_mem"):
            attempt(f"graph_{reduce}", graph_checks, all_reduce=reduce)
    else:
        attempt("stack", stack_checks)
    attempt("fused", fused_checks)
    backend = "inductor" if device == "cuda" else "aot_eager"
    for scheme in ("w4a16-nvfp4", "w8a8-fp8-block"):
        attempt(f"compiled_{scheme}", compiled_checks, scheme=scheme, backend=backend)
    return out
