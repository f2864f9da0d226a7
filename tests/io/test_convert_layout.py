"""The output files of a conversion are laid out before anything is quantized: the header and offsets are
safetensors' own (bytes compared with ``save_file``), the planned tensors of every scheme and layout are the
ones the quantizer exports, and the pieces of work cover the keys in order, cut between modules, and split a
Llama-70B-shaped checkpoint evenly over ranks. CPU only."""

from __future__ import annotations

import itertools
import random
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

import lowbit
from lowbit.io import convert_layout as cl
from lowbit.io.checkpoint import choose_layout
from lowbit.io.distributed import assign_runs
from lowbit.io.files import SAFETENSORS_DTYPES
from lowbit.nn.modules import QuantLinear
from lowbit.nn.schemes import get_scheme


def _random_tensor(rng: random.Random, dtype: torch.dtype) -> torch.Tensor:
    shape = rng.choice([(), (0,), (3,), (2, 5), (4, 0, 2), (7, 3)])
    raw = torch.randint(0, 256, (max(1, torch.Size(shape).numel()) * torch.empty((), dtype=dtype).element_size(),),
                        dtype=torch.uint8, generator=torch.Generator().manual_seed(rng.randrange(1 << 30)))
    n = torch.Size(shape).numel()
    return raw.view(dtype)[:n].reshape(shape).clone()


@pytest.mark.parametrize("seed", range(12))
def test_layout_is_safetensors_bytes(tmp_path, seed):
    rng = random.Random(seed)
    dtypes = list(SAFETENSORS_DTYPES.values())
    names = {f"{rng.choice(['a', 'model.layers', 'z', 'blocks'])}.{rng.randrange(100)}."
             f"{rng.choice(['w', 'weight_scale', 'x'])}" for _ in range(rng.randrange(1, 30))}
    if seed == 0:
        names |= {"é.weight", 'quote".key'}  # non-ASCII and an escaped character in a name
    tensors = {n: _random_tensor(rng, rng.choice(dtypes)) for n in sorted(names)}
    path = tmp_path / "ref.safetensors"
    save_file(tensors, str(path), metadata={"format": "pt"})
    specs = [cl.Spec(n, cl.dtype_name(t.dtype), tuple(t.shape), t.numel() * t.element_size())
             for n, t in tensors.items()]
    rng.shuffle(specs)  # the order the outputs come in does not matter
    header, offsets = cl.safetensors_layout(specs)
    ref = path.read_bytes()
    assert ref[: len(header)] == header
    for n, t in tensors.items():
        data = t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
        assert ref[offsets[n]: offsets[n] + len(data)] == data, n
    assert len(ref) == len(header) + sum(s.nbytes for s in specs)


def test_layout_rejects_an_unknown_dtype():
    with pytest.raises(ValueError, match="safetensors has no dtype"):
        cl.dtype_name(torch.complex32)


def _formats():
    for name in lowbit.SCHEMES:
        scheme = get_scheme(name)
        for fmt in ("lowbit", "auto", "lightx2v", "modelopt", "compressed-tensors", "fp8", "bitsandbytes"):
            try:
                layout = choose_layout({"p": QuantLinear(16, 16, False, scheme=scheme)}, fmt)
            except ValueError:
                continue
            yield pytest.param(scheme, layout, id=f"{name}-{layout.name}")


@pytest.mark.parametrize(("scheme", "layout"), list({p.id: p for p in _formats()}.values()))
@pytest.mark.parametrize("shape", [(256, 512), (384, 1024)])
def test_planned_tensors_are_the_exported_ones(scheme, layout, shape):
    if scheme.unsupported(*shape) is not None:
        pytest.skip(scheme.unsupported(*shape))
    shared = scheme.shared_global_scale and layout.name != "lightx2v"
    planned = cl._export_specs(list(shape), torch.bfloat16, scheme, layout, shared)
    w = torch.randn(shape, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    g = torch.tensor(448.0 * 6.0 / 3.0) if shared else None
    m, _ = cl.quantize_target(w, scheme, layout, g)
    real = [(k, cl.dtype_name(v.dtype), tuple(v.shape)) for k, v in layout.export(m).items()]
    assert planned == real


def _llama70b_like(layers: int, shards: int):
    """Header-only stand-in of a Llama-3-70B checkpoint: keys, shapes and dtypes, split into shards."""
    h, i, kv = 8192, 28672, 1024
    shapes = {"model.embed_tokens.weight": [32000, h]}
    for n in range(layers):
        p = f"model.layers.{n}."
        shapes |= {p + "input_layernorm.weight": [h], p + "post_attention_layernorm.weight": [h],
                   p + "mlp.down_proj.weight": [h, i], p + "mlp.gate_proj.weight": [i, h],
                   p + "mlp.up_proj.weight": [i, h], p + "self_attn.k_proj.weight": [kv, h],
                   p + "self_attn.o_proj.weight": [h, h], p + "self_attn.q_proj.weight": [h, h],
                   p + "self_attn.v_proj.weight": [kv, h]}
    shapes |= {"model.norm.weight": [h], "lm_head.weight": [32000, h]}
    keys = list(shapes)
    per = -(-len(keys) // shards)
    shard_keys = {Path(f"model-{s:05d}-of-{shards:05d}.safetensors"): sorted(keys[s * per:(s + 1) * per])
                  for s in range(shards)}
    targets = {k: (k.removesuffix(".weight"), k[: -len("weight")]) for k in keys
               if k.endswith("proj.weight")}
    return shard_keys, shapes, targets


def test_pieces_cover_the_keys_cut_between_modules_and_split_evenly():
    shard_keys, shapes, targets = _llama70b_like(12, 6)
    scheme = get_scheme("w4a16-nvfp4")
    layout = choose_layout({"p": QuantLinear(16, 16, False, scheme=scheme)}, "lowbit")
    plan = cl.plan_outputs(shard_keys, shapes.__getitem__, lambda k: "BF16", targets, lambda n: True, scheme,
                           layout, 5 << 30, False)
    # every key once, in shard order, pieces within one shard
    assert [k for p in plan.pieces for k in p.keys] == [k for keys in shard_keys.values() for k in keys]
    for p in plan.pieces:
        assert len({f.name for f in shard_keys if p.source == f.name}) == 1
        assert set(p.files) <= set(plan.files)
    # a fused group (q/k/v of one layer, gate/up) never spans two pieces of one shard
    piece_of = {k: p.id for p in plan.pieces for k in p.keys}
    shard_of = {k: f for f, keys in shard_keys.items() for k in keys}
    checked = 0
    for n in range(12):
        for group in ([f"model.layers.{n}.self_attn.{x}_proj.weight" for x in "qkv"],
                      [f"model.layers.{n}.mlp.{x}_proj.weight" for x in ("gate", "up")]):
            if len({shard_of[k] for k in group}) == 1:
                assert len({piece_of[k] for k in group}) == 1, group
                checked += 1
    assert checked >= 20
    # shares in contiguous runs, each rank's pieces in file order (two ranks share at most the file where a run
    # ends): no rank above an equal share plus one piece (a piece here is up to a gate/up pair, 0.9 GB, against
    # 2.7 GB a rank at 8 ranks: 16 % above the mean at worst; whole shards were 6 units for up to 8 ranks), and
    # within 5 % of the mean for 2 ranks
    sizes = [(p.id, p.nbytes) for p in plan.pieces]
    biggest = max(n for _, n in sizes)
    for world in range(2, 9):
        owner = assign_runs(sizes, world)
        loads = [sum(n for u, n in sizes if owner[u] == rank) for rank in range(world)]
        assert max(loads) <= sum(loads) / world + biggest, (world, loads)
        assert world > 2 or max(loads) <= 1.05 * sum(loads) / world, (world, loads)
        files_of = [{f for p in plan.pieces if owner[p.id] == rank for f in p.files} for rank in range(world)]
        shared = [f for f in plan.files if sum(f in fs for fs in files_of) > 1]
        assert len(shared) <= world - 1, (world, shared)
    # the files: the shard's outputs, data right after the header, offsets in order without gaps
    for f in plan.files.values():
        assert f.size == len(f.header) + f.tensor_bytes
        ends = sorted((plan.where[k][1], plan.where[k][1] + next(
            s.nbytes for specs in plan.specs.values() for s in specs if s.name == k)) for k in f.keys)
        assert ends[0][0] == len(f.header) and ends[-1][1] == f.size
        assert all(a[1] == b[0] for a, b in itertools.pairwise(ends))


def test_parts_are_cut_before_a_tensor_would_pass_the_limit():
    shard_keys, shapes, targets = _llama70b_like(2, 1)
    scheme = get_scheme("w8a8-fp8-block")
    layout = choose_layout({"p": QuantLinear(16, 16, False, scheme=scheme)}, "lowbit")
    limit = 600 << 20
    plan = cl.plan_outputs(shard_keys, shapes.__getitem__, lambda k: "BF16", targets, lambda n: False, scheme,
                           layout, limit, False)
    files = list(plan.files.values())
    assert len(files) > 2 and all("-part" in f.name for f in files)
    assert all(f.tensor_bytes <= limit for f in files)
    # each part but the last would have passed the limit with the next key's outputs
    keys = next(iter(shard_keys.values()))
    for a, b in itertools.pairwise(files):
        nxt = keys[keys.index(next(k for k in keys if plan.where[plan.specs[k][0].name][0] == b.tmp_name))]
        assert a.tensor_bytes + sum(s.nbytes for s in plan.specs[nxt]) > limit


def test_conversion_passes_through_every_safetensors_dtype(tmp_path):
    """Tensors that are not Linear weights keep their dtype and bytes, whatever it is (the files are laid out
    for them from the source header)."""
    g = torch.Generator().manual_seed(1)
    src = tmp_path / "src"
    src.mkdir()
    dtypes = [torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int16,
              torch.int8, torch.uint8, torch.bool, torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e8m0fnu,
              torch.uint16, torch.uint32, torch.uint64, torch.complex64]
    extra = {f"extra.{i}": _random_tensor(random.Random(i), d) for i, d in enumerate(dtypes)}
    save_file({"blocks.0.ffn.weight": torch.randn(64, 64, generator=g).to(torch.bfloat16), **extra},
              str(src / "model.safetensors"))
    out = lowbit.convert_checkpoint(src, tmp_path / "out", "w8a8-fp8-block", device="cpu", progress=False)
    from safetensors.torch import load_file

    back = load_file(str(out / "model.safetensors"))
    for k, t in extra.items():
        assert back[k].dtype == t.dtype and back[k].shape == t.shape
        assert back[k].reshape(-1).view(torch.uint8).tolist() == t.reshape(-1).view(torch.uint8).tolist(), k
    assert back["blocks.0.ffn.weight"].dtype == torch.float8_e4m3fn  # the Linear weight was quantized
