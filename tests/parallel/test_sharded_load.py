"""Tensor-parallel loading, ``load_quantized(path, device_mesh=, tp_plan=)``, on 2 CPU processes (gloo).

A tiny transformers Llama is saved in every layout lowbit writes (compressed-tensors nvfp4 / w4a4 / mxfp4 / mxfp8 /
int4 / fp8, bitsandbytes nf4 with double quantization and fp4, AutoAWQ, GPTQ, DeepSeek FP8, ModelOpt, lowbit
native with mixed formats and swizzled scales, LightX2V nvfp4 and mxfp6). On each rank the sharded load must equal
``parallelize(load_quantized(path), mesh, plan)``: every module's tensors (QuantLinear buffers, dense DTensor
shards) and QuantLinear metadata bit-equal, logits equal. Every read of the sharded load is recorded
(``TensorSource.get`` / ``read_slice``): no rank reads more of a quantized tensor than its shard, except the
documented bounds (partial 128-row tiles of swizzled scales, covering nested absmax blocks) and fallbacks
(row-parallel nf4 / bnb_fp4, read whole). Errors: unshardable layers (before any weight is read), 2-D meshes,
bad plans. One spawn runs every check (starting ranks dominates the time).
"""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

import lowbit
from lowbit.io import files as io_files
from lowbit.nn import QuantLinear
from tp_workers import spawn_ranks

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed is not built")

WORLD = 2
# q [256, 256], k/v [128, 256] (64 rows a rank: partial swizzle tiles), o [256, 256], gate/up [512, 256], down
BASE = {"hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 64}
FP8 = {**BASE, "num_attention_heads": 2, "head_dim": 128}  # every shard a multiple of 128 rows and columns
# q [384, 256], k/v [192, 256], o [256, 384]: rank 1's rows of k are absmax blocks 384:768, starting inside a
# nested block of 256 (decoded to fp32); those of q (768:1536) and gate/up start on one (kept)
NESTED = {**BASE, "head_dim": 96}
# gate/up [480, 256]: 240 rows a rank; down [256, 480]: 15 scale columns a rank (not whole 4-column groups)
ODD = {**BASE, "intermediate_size": 480}

# name: (scheme, save format, Llama config, setup)
CASES = {
    "ct-nvfp4-dense-o": ("w4a16-nvfp4", "auto", BASE, "dense_o"),
    "ct-w4a4-static": ("w4a4-nvfp4", "auto", BASE, "static"),
    "ct-mxfp4-own-plan": ("w4a16-mxfp4", "auto", BASE, None),
    "ct-mxfp8": ("w8a8-mxfp8", "auto", BASE, None),
    "ct-int4": ("w4a16-int4", "auto", BASE, None),
    "ct-fp8": ("w8a8-fp8-block", "compressed-tensors", FP8, None),
    "bnb-nf4-double": ("w4a16-nf4", "auto", NESTED, "double_quant"),
    "bnb-fp4": ("w4a16-bnb-fp4", "auto", BASE, None),
    "awq": ("w4a16-int4", "awq", BASE, None),
    "gptq": ("w4a16-int4", "gptq", BASE, None),
    "fp8": ("w8a8-fp8-block", "auto", FP8, None),
    "modelopt": ("w4a4-nvfp4", "modelopt", BASE, "static"),
    "lowbit-mixed": ("w4a16-nvfp4", "lowbit", NESTED, "mixed"),
    "lightx2v-nvfp4": ("w4a4-nvfp4", "lightx2v", ODD, "static"),
    "lightx2v-mxfp6": ("w6a8-mxfp6", "lightx2v", BASE, None),
}
# layers every rank reads whole (lowbit.io.sharded): row-parallel nf4 / bnb_fp4 weights are stored flattened
FALLBACK = {
    "bnb-nf4-double": {"o_proj", "down_proj"},
    "bnb-fp4": {"o_proj", "down_proj"},
    "lowbit-mixed": {"down_proj"},
}
# module-local names of the stored tensors that hold the weight (the rest is metadata, read whole)
UNSHARDABLE = "fp8-unshardable"
WEIGHT_TENSORS = {"weight", "weight_packed", "weight_scale", "weight_zero_point", "qweight", "qzeros", "scales",
                  "weight_scale_inv", "weight.absmax", "weight.nested_absmax", "weight_data", "weight_zeros",
                  "weight_nested_scale"}


def _llama(cfg: dict, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(vocab_size=96, num_hidden_layers=1, max_position_embeddings=64,
                                      tie_word_embeddings=False, **cfg)
    return transformers.LlamaForCausalLM._from_config(config, dtype=torch.bfloat16).eval()


def _scheme(name: str):
    if name == "w6a8-mxfp6":
        from lowbit.io.lightx2v import LIGHTX2V_SCHEMES

        return LIGHTX2V_SCHEMES["mxfp6-mxfp8"]
    return name


def _mixed(model) -> None:
    """lowbit native with one format per layer: swizzled nvfp4 and mxfp8 (column- and row-parallel), nf4 with
    double quantization (a row shard inside a nested block), int4, fp4_b32 and nf4 row-parallel (a fallback)."""
    attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    plan = {attn.q_proj: ("w4a16-nvfp4", {"scale_layout": "swizzled"}),
            attn.k_proj: ("w4a16-nf4", {"double_quant": True}),
            attn.v_proj: ("w8a8-mxfp8", {"scale_layout": "swizzled"}),
            attn.o_proj: ("w4a16-nvfp4", {"scale_layout": "swizzled"}), mlp.gate_proj: ("w4a16-int4", {}),
            mlp.up_proj: ("w4a16-fp4b32", {}), mlp.down_proj: ("w4a16-nf4", {"double_quant": True})}
    for parent in (attn, mlp):
        for child, lin in list(parent.named_children()):
            if lin not in plan:
                continue
            scheme, extra = plan[lin]
            q = QuantLinear.from_linear(lin, scheme)
            if extra:
                w = lowbit.quantize(lin.weight.detach(), q.scheme.weight_format,
                                    **{**q.scheme.weight_quantize_options(lin.in_features), **extra})
                q.set_weight(w)
            setattr(parent, child, q)


def _write(tmp, name: str):
    if name == UNSHARDABLE:
        model = _llama(BASE)  # fp8 k/v: 64 rows a rank, not whole 128x128 blocks
        lowbit.quantize_model(model, "w8a8-fp8-block")
        return lowbit.save_quantized(model, tmp / name)
    scheme, fmt, cfg, setup = CASES[name]
    model = _llama(cfg)
    if setup == "mixed":
        _mixed(model)
    else:
        skip = ("lm_head", "*.o_proj") if setup == "dense_o" else ("lm_head",)
        lowbit.quantize_model(model, _scheme(scheme), skip=skip)
    for m in model.modules():
        if isinstance(m, QuantLinear):
            if setup == "double_quant":
                w = lowbit.quantize(m.dequantize_weight(torch.bfloat16), "nf4", double_quant=True)
                m.set_weight(w)
            if setup == "static":  # a calibrated NVFP4 activation scale, stored by the layout
                m.input_global_scale = torch.tensor([1024.0])
    return lowbit.save_quantized(model, tmp / name, format=fmt)


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> list[dict]:
    """Every rank's results (rank 0's first)."""
    tmp = tmp_path_factory.mktemp("sharded")
    return spawn_ranks(_checks, WORLD, "cpu", tmp, root=str(tmp))["ranks"]


# ---------------------------------------------------------------------------------------------- on each rank


class _ReadLog:
    """Records the bytes every TensorSource read returns, per checkpoint key, while ``on``."""

    def __init__(self) -> None:
        self.on = False
        self.bytes: dict[str, int] = {}
        self.lock = threading.Lock()
        get, read_slice = io_files.TensorSource.get, io_files.TensorSource.read_slice

        def logged(fn):
            def wrapper(source, key, *args):
                t = fn(source, key, *args)
                if self.on:
                    with self.lock:
                        self.bytes[key] = self.bytes.get(key, 0) + t.numel() * t.element_size()
                return t
            return wrapper

        io_files.TensorSource.get = logged(get)
        io_files.TensorSource.read_slice = logged(read_slice)

    def __enter__(self):
        self.bytes, self.on = {}, True
        return self

    def __exit__(self, *exc):
        self.on = False


def _bits(t: torch.Tensor) -> torch.Tensor:
    t = t.detach().contiguous()
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def _local(t):
    from torch.distributed.tensor import DTensor

    return (t.to_local(), tuple(t.placements)) if isinstance(t, DTensor) else (t, None)


def _differences(a, b) -> list[str]:
    """Everything that differs between two parallel models (tensors bit for bit, QuantLinear metadata)."""
    out = []
    mods_a, mods_b = dict(a.named_modules()), dict(b.named_modules())
    if mods_a.keys() != mods_b.keys():
        return [f"modules differ: {sorted(mods_a.keys() ^ mods_b.keys())}"]
    for name, ma in mods_a.items():
        mb = mods_b[name]
        if type(ma) is not type(mb):
            out.append(f"{name}: {type(ma).__name__} vs {type(mb).__name__}")
            continue
        if isinstance(ma, QuantLinear):
            for attr in ("in_features", "out_features", "scheme", "activation", "output_activation"):
                if getattr(ma, attr, None) != getattr(mb, attr, None):
                    out.append(f"{name}.{attr}")
            wa, wb = ma.weight_qtensor, mb.weight_qtensor
            if (wa.dtype, wa.scale_layout, wa.params.keys()) != (wb.dtype, wb.scale_layout, wb.params.keys()) or any(
                    not (torch.equal(v, wb.params[k]) if isinstance(v, torch.Tensor) else v == wb.params[k])
                    for k, v in wa.params.items()):
                out.append(f"{name}: weight metadata {wa.dtype, wa.scale_layout, wa.params} vs "
                           f"{wb.dtype, wb.scale_layout, wb.params}")
            ta, tb = getattr(ma, "tp", None), getattr(mb, "tp", None)
            if (ta is None) != (tb is None):
                out.append(f"{name}: tensor-parallel on one side only")
            for attr in ("style", "rank", "world", "full_in", "full_out", "input_layout", "output_layout",
                         "use_local_output", "default_io", "exact", "reduce"):
                if ta is not None and tb is not None and getattr(ta, attr) != getattr(tb, attr):
                    out.append(f"{name}.tp.{attr}: {getattr(ta, attr)} vs {getattr(tb, attr)}")
            for buf, t in ma._buffers.items():
                u = mb._buffers.get(buf)
                if (t is None) != (u is None):
                    out.append(f"{name}.{buf}: None vs a tensor")
                elif t is not None and (t.dtype != u.dtype or t.shape != u.shape
                                        or not torch.equal(_bits(t), _bits(u))):
                    out.append(f"{name}.{buf}: {t.dtype} {tuple(t.shape)} vs {u.dtype} {tuple(u.shape)}")
    sa, sb = a.state_dict(), b.state_dict()
    if sa.keys() != sb.keys():
        out.append(f"state_dict keys differ: {sorted(sa.keys() ^ sb.keys())}")
    for k in sa.keys() & sb.keys():
        (x, px), (y, py) = _local(sa[k]), _local(sb[k])
        if px != py or x.dtype != y.dtype or x.shape != y.shape or not torch.equal(_bits(x), _bits(y)):
            out.append(f"{k}: {x.dtype} {tuple(x.shape)} {px} vs {y.dtype} {tuple(y.shape)} {py}")
    return out


def _read_violations(path: str, model, plan, reads: dict[str, int], rank: int, world: int) -> tuple[list, list]:
    """(reads beyond the bounds, planned quantized layers read whole) of one sharded load; ``model`` is the
    parallelize-after-load reference, which says each layer's format, style and whole shape."""
    from lowbit.formats.shards import shard_range
    from lowbit.formats.spec import FORMATS
    from lowbit.parallel import resolve_plan

    source = io_files.TensorSource(path)
    bad, whole = [], []
    for name, module, _ in resolve_plan(model, plan):
        if not isinstance(module, QuantLinear):
            continue  # dense layers are read whole and given to torch's styles
        tp, q = module.tp, module.weight_qtensor
        a, b = shard_range(tp.full_out if tp.style == "colwise" else tp.full_in, rank, world)
        keys = {k[len(name) + 1 :]: k for k in source.keys() if k.startswith(name + ".")}
        for local, key in keys.items():
            if local not in WEIGHT_TENSORS:
                continue
            meta = source.meta(key)
            nbytes = meta.numel() * meta.element_size()
            got = reads.get(key, 0)
            allowed = nbytes // world
            if local == "weight_scale" and q.scale_layout == "swizzled":
                prow, pcol = meta.shape
                if tp.style == "colwise":  # the 128-row tiles holding the rank's rows
                    allowed = (-(-b // 128) - a // 128) * 128 * pcol
                else:  # per tile: the 4-column groups of its scale columns, and the stored rows the run starts/ends in
                    block = FORMATS[q.fmt].block
                    groups = -(-(b // block) // 4) - (a // block) // 4
                    allowed = prow // 128 * (groups * 512 + 2 * pcol)
            if local in ("weight.nested_absmax", "weight_nested_scale"):
                allowed += 2 * meta.element_size()  # the nested blocks covering both ends
            if got == 0:
                bad.append(f"{key}: never read (the read log misses it)")
            elif got == nbytes and nbytes > allowed:
                whole.append(name.rpartition(".")[2])
            elif got > allowed:
                bad.append(f"{key}: read {got} of {nbytes} bytes, bound {allowed}")
    source.close()
    return bad, sorted(set(whole))


def _plan_of(case: str):
    if case == "ct-mxfp4-own-plan":
        from torch.distributed.tensor import Replicate

        from lowbit.parallel import ColwiseParallel, RowwiseParallel

        # the whole input given to a row-parallel layer; a column-parallel layer with a gathered output; the
        # dense lm_head column-parallel with a gathered output
        return {"model.layers.*.mlp.down_proj": RowwiseParallel(input_layouts=Replicate()),
                "model.layers.*.mlp.up_proj": ColwiseParallel(output_layouts=Replicate()),
                "lm_head": "colwise_gather_output"}
    return None


def _error(fn) -> str | None:
    try:
        fn()
    except (ValueError, TypeError) as e:
        return str(e)
    return None


def _checks(rank: int, world: int, device: str, root: str) -> dict:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from torch.distributed.tensor import Replicate

    from lowbit.parallel import parallelize

    names = [*CASES, UNSHARDABLE]
    for i, name in enumerate(names):  # the ranks write the checkpoints in turn
        if i % world == rank:
            _write(Path(root), name)
    dist.barrier()
    paths = {name: str(Path(root, name)) for name in names}
    mesh = init_device_mesh(device, (world,))
    log = _ReadLog()
    ids = torch.arange(16).reshape(1, 16) % 96
    out: dict = {"cases": {}}
    for case in CASES:
        plan = _plan_of(case)
        with log:
            got = lowbit.load_quantized(paths[case], device_mesh=mesh, tp_plan=plan)
        want = parallelize(lowbit.load_quantized(paths[case]), mesh, plan)
        with torch.inference_mode():
            logits_equal = torch.equal(got(ids).logits, want(ids).logits)
        bad, whole = _read_violations(paths[case], want, plan, log.bytes, rank, world)
        out["cases"][case] = {
            "differences": _differences(got, want)[:8],
            "logits_equal": logits_equal,
            "over_reads": bad,
            "read_whole": whole,
            "sharded": sorted({n.rpartition(".")[2] for n, m in got.named_modules()
                               if type(m).__name__.endswith("wiseQuantLinear")}),
            "dense_parallel": sorted(n for n, p in got.named_parameters() if hasattr(p, "placements")),
            # nf4 double quantization kept (a shard that starts a nested block) or decoded to fp32 absmax
            "nested": {n.rpartition(".")[2]: m.weight_nested_scale is not None for n, m in got.named_modules()
                       if isinstance(m, QuantLinear) and m.scheme.weight_format == "nf4"},
        }
    # exact column shards plan their launches for the whole layer's rows
    from lowbit.formats.shards import PLAN_ROWS
    from lowbit.parallel import ColwiseParallel

    exact = lowbit.load_quantized(paths["ct-int4"], device_mesh=mesh,
                                  tp_plan={"model.layers.*.mlp.up_proj": ColwiseParallel(exact=True,
                                                                                          output_layouts=Replicate())})
    up = exact.model.layers[0].mlp.up_proj
    out["exact_plan_rows"] = [up.tp.exact, up.weight_qtensor.params.get(PLAN_ROWS), up.tp.full_out]
    errors = {}
    odd = paths[UNSHARDABLE]
    with log:
        errors["unshardable"] = _error(lambda: lowbit.load_quantized(odd, device_mesh=mesh))
    errors["unshardable_read"] = sorted(k for k in log.bytes if k.rpartition(".")[2] in WEIGHT_TENSORS)
    mesh2 = init_device_mesh(device, (1, world), mesh_dim_names=("dp", "tp"))
    nvfp4 = paths["ct-nvfp4-dense-o"]
    errors["mesh_2d"] = _error(lambda: lowbit.load_quantized(nvfp4, device_mesh=mesh2))
    errors["mesh_tp_slice_loads"] = _error(lambda: lowbit.load_quantized(nvfp4, device_mesh=mesh2["tp"]))
    errors["no_match"] = _error(lambda: lowbit.load_quantized(nvfp4, device_mesh=mesh,
                                                              tp_plan={"model.layers.*.mlp.nope": "colwise"}))
    errors["unknown_style"] = _error(lambda: lowbit.load_quantized(nvfp4, device_mesh=mesh,
                                                                   tp_plan={"model.layers.*.mlp.up_proj": "diagonal"}))
    from torch.distributed.tensor.parallel import SequenceParallel

    errors["not_a_quant_style"] = _error(lambda: lowbit.load_quantized(
        nvfp4, device_mesh=mesh, tp_plan={"model.layers.*.mlp.up_proj": SequenceParallel()}))
    # a native checkpoint whose planned layer transforms its input online (a rotation: no tensor needed)
    import json
    import shutil

    online = Path(root, f"online-{rank}")
    shutil.copytree(paths["lowbit-mixed"], online)
    cfg = json.loads((online / "config.json").read_text())
    cfg["quantization_config"]["modules"]["model.layers.0.mlp.down_proj"]["input_transform"] = {
        "scale": False, "hadamard_block": 16}
    (online / "config.json").write_text(json.dumps(cfg))
    errors["online_transform"] = _error(lambda: lowbit.load_quantized(str(online), device_mesh=mesh))
    out["errors"] = errors
    ranks = [None] * world
    dist.all_gather_object(ranks, out)
    return {"ranks": ranks}


# ---------------------------------------------------------------------------------------------- the tests


@pytest.mark.parametrize("case", list(CASES))
def test_sharded_load_equals_parallelize_after_load(results, case):
    planned = {"down_proj", "up_proj"} if case == "ct-mxfp4-own-plan" else {
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    if case == "ct-nvfp4-dense-o":
        planned.discard("o_proj")  # left dense: torch's RowwiseParallel, a DTensor weight
    for rank, res in enumerate(results):
        r = res["cases"][case]
        assert r["differences"] == [], (rank, r["differences"])
        assert r["logits_equal"], rank
        assert set(r["sharded"]) == planned, rank
        if case == "ct-nvfp4-dense-o":
            assert r["dense_parallel"] == ["model.layers.0.self_attn.o_proj.weight"], rank
        if case == "ct-mxfp4-own-plan":
            assert r["dense_parallel"] == ["lm_head.weight"], rank


@pytest.mark.parametrize("case", list(CASES))
def test_no_rank_reads_more_than_its_shard(results, case):
    for rank, res in enumerate(results):
        r = res["cases"][case]
        assert r["over_reads"] == [], (rank, r["over_reads"])
        assert set(r["read_whole"]) == FALLBACK.get(case, set()), rank


def test_nf4_double_quant_kept_on_whole_nested_blocks(results):
    for case in ("bnb-nf4-double", "lowbit-mixed"):
        # rank 0 starts at block 0; rank 1 at block 384
        assert results[0]["cases"][case]["nested"]["k_proj"], case
        assert not results[1]["cases"][case]["nested"]["k_proj"], case
        # the row-parallel fallback cuts columns: every nested block is cut, decoded on both ranks
        assert not any(res["cases"][case]["nested"]["down_proj"] for res in results), case
    nested = results[1]["cases"]["bnb-nf4-double"]["nested"]
    assert nested["q_proj"] and nested["gate_proj"] and nested["up_proj"]


def test_exact_column_shards_plan_for_the_whole_layer(results):
    for res in results:
        assert res["exact_plan_rows"] == [True, 512, 512]


def test_errors(results):
    for res in results:
        e = res["errors"]
        # named with the rule it breaks, before any weight is read
        assert "2 layer(s) cannot be sharded" in e["unshardable"]
        assert "k_proj" in e["unshardable"] and "v_proj" in e["unshardable"] and "multiple of 128" in e["unshardable"]
        assert e["unshardable_read"] == []
        assert "device_mesh must be 1-D" in e["mesh_2d"]
        assert e["mesh_tp_slice_loads"] is None
        assert "match no module" in e["no_match"]
        assert "unknown tensor-parallel style 'diagonal'" in e["unknown_style"]
        assert "SequenceParallel does not shard a QuantLinear" in e["not_a_quant_style"]
        assert "'model.layers.0.mlp.down_proj' transforms its input online" in e["online_transform"]


def test_plan_without_mesh(tmp_path):
    with pytest.raises(ValueError, match="pass device_mesh too"):
        lowbit.load_quantized(tmp_path, tp_plan={"x": "colwise"})
