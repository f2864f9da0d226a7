"""Block offload and lazy loading on CPU stand-ins: same outputs, the order of loads/evictions, at most
prefetch+1 blocks resident, stream waits in the right order (a recording fake of the CUDA streams), lazy
per-block reads, and the benchmark's plumbing at tiny shapes."""

from __future__ import annotations

import copy

import pytest
import torch

import lowbit
from lowbit.bench.offload import WanStack, bench_block_offload
from lowbit.nn import QuantLinear
from lowbit.nn.lazy_load import lazy_load_quantized
from lowbit.nn.offload import enable_block_offload


def _stack(seed=0, n=5):
    torch.manual_seed(seed)
    return WanStack(dim=64, ffn_dim=128, heads=4, n_blocks=n).to(torch.bfloat16).eval()


def _inputs():
    g = torch.Generator().manual_seed(1)
    return (torch.randn(1, 8, 64, generator=g).bfloat16(), torch.randn(1, 4, 64, generator=g).bfloat16(),
            torch.randn(1, 64, generator=g).bfloat16())  # fmt: skip


@pytest.mark.parametrize("prefetch", [1, 2])
def test_offload_cpu_same_output_and_schedule(prefetch):
    model = lowbit.quantize_model(_stack(), "w4a16-nvfp4", skip=("time_proj", "proj_out"))
    ref = model(*_inputs())
    log = []
    off = enable_block_offload(model, "blocks", "cpu", prefetch=prefetch, _log=log.append)
    for _ in range(2):  # two denoising steps: the second starts from the prefetched block 0
        assert torch.equal(model(*_inputs()), ref)
    assert off.max_resident <= prefetch + 1
    runs = [e for e in log if e[0] == "run"]
    assert [b for _, b, _ in runs] == [0, 1, 2, 3, 4] * 2
    loads = [(b, s) for k, b, s in log if k == "load"]
    # 10 runs, plus the next step's first blocks prefetched by the last ones
    assert len(loads) == 10 + prefetch and {s for _, s in loads} == set(range(prefetch + 1))
    # every block is loaded before it runs and, but for the very first, prefetched while another block runs
    # (right after a "run" entry), never loaded on demand (right after an eviction)
    first_run = log.index(runs[0])
    for i, e in enumerate(log):
        if e[0] == "run":
            last_load = max(j for j, f in enumerate(log[:i]) if f[0] == "load" and f[1] == e[1])
            assert last_load < i
            if i != first_run:
                assert log[last_load - 1][0] in ("run", "load"), log[last_load - 1 : i + 1]
    # a slot is reloaded only after the block that used it was evicted
    for i, (k, b, s) in enumerate(log):
        if k == "load":
            users = [j for j, f in enumerate(log[:i]) if f[0] == "run" and f[2] == s]
            if users:
                prev = log[users[-1]][1]
                assert ("evict", prev, s) in log[users[-1]:i], (log[users[-1]:i], b, s)
    off.remove()
    assert torch.equal(model(*_inputs()), ref)


class _FakeStreams:
    """Records stream operations: the CUDA path's ordering without a GPU."""

    side = "side"

    def __init__(self):
        self.ops = []
        self.n = 0
        self.current = "compute"

    def compute(self):
        return "compute"

    def on_side(self):
        fake = self

        class _Ctx:
            def __enter__(self):
                fake.current = "side"
                fake.ops.append(("enter_side",))

            def __exit__(self, *a):
                fake.current = "compute"

        return _Ctx()

    def record(self, stream):
        self.n += 1
        self.ops.append(("record", stream, self.n))
        return self.n

    def wait(self, stream, event):
        self.ops.append(("wait", stream, event))


def test_offload_stream_protocol():
    """Copies into a slot wait for the event recorded after the slot's previous block; each block's compute
    waits for the event recorded after its copy."""
    model = _stack(n=4)
    fake = _FakeStreams()
    enable_block_offload(model, model.blocks, "cpu", prefetch=1, _streams=fake)
    model(*_inputs())
    model(*_inputs())
    ops = fake.ops
    copy_done = [o[2] for i, o in enumerate(ops) if o[0] == "record" and o[1] == "side"]
    compute_waits = [o[2] for o in ops if o[0] == "wait" and o[1] == "compute" and o[2] is not None]
    assert compute_waits and set(compute_waits) <= set(copy_done)
    freed = [o[2] for o in ops if o[0] == "record" and o[1] == "compute"]
    side_waits = [o[2] for o in ops if o[0] == "wait" and o[1] == "side" and o[2] is not None]
    assert side_waits and set(side_waits) <= set(freed)
    # each side wait comes before the copy it guards (the next enter_side)
    for i, o in enumerate(ops):
        if o[0] == "wait" and o[1] == "side":
            assert ops[i + 1] == ("enter_side",)


def test_offload_errors():
    model = _stack(n=3)
    with pytest.raises(ValueError, match="prefetch must be an int >= 1"):
        enable_block_offload(model, "blocks", "cpu", prefetch=0)
    with pytest.raises(ValueError, match="blocks: model has no submodule 'layers'"):
        enable_block_offload(model, "layers", "cpu")
    odd = _stack(n=3)
    odd.blocks[2].ffn.net[2] = torch.nn.Linear(128, 64, bias=False).bfloat16()
    with pytest.raises(ValueError, match="block 2 differs from block 0"):
        enable_block_offload(odd, "blocks", "cpu")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA is not available"):
            enable_block_offload(_stack(n=2), "blocks", "cuda")


@pytest.mark.parametrize("offload", [False, True])
def test_lazy_load_reads_blocks_on_first_use(tmp_path, monkeypatch, offload):
    model = lowbit.quantize_model(_stack(), "w4a16-mxfp4", skip=("time_proj", "proj_out"))
    ref = model(*_inputs())
    out = lowbit.save_quantized(model, tmp_path / "ckpt")
    from lowbit.io import files as io_files

    reads = []
    real = io_files.TensorSource.get
    monkeypatch.setattr(io_files.TensorSource, "get", lambda self, k: (reads.append(k), real(self, k))[1])
    with torch.device("meta"):
        target = _stack(seed=5)
    off = lazy_load_quantized(out, target, "blocks", device="cpu", offload=offload)
    assert reads and not any(k.startswith("blocks.") for k in reads)  # blocks stay on disk until used
    y = target(*_inputs())
    assert torch.equal(y, ref)
    assert any(k.startswith("blocks.4.") for k in reads)
    assert all(isinstance(target.blocks[i].attn1.to_q, QuantLinear) for i in range(5))
    n = len(reads)
    assert torch.equal(target(*_inputs()), ref) and len(reads) == n  # read once
    if offload:
        assert off is not None and off.max_resident <= 2


def test_bench_plumbing_cpu():
    res = bench_block_offload(dim=64, ffn_dim=128, heads=4, n_blocks=3, tokens=16, ctx=4, device="cpu", iters=1)
    assert res["offload"]["max_resident_blocks"] == 2 and res["block_bytes"] > 0
    assert res["meets_targets"] is None and res["time_ratio"] > 0
    # two slots, each one buffer: the block's bytes plus each tensor's padding to a 512-byte offset
    assert 2 * res["block_bytes"] <= res["offload"]["slot_bytes"] < 2 * res["block_bytes"] + 2 * 512 * 64
    assert copy.deepcopy(res)["shapes"]["n_blocks"] == 3


@pytest.mark.parametrize("scheme", [None, "w4a16-nvfp4"])
def test_each_slot_is_one_aligned_buffer(scheme):
    """A slot is one allocation holding every tensor of a block at 512-byte-aligned offsets (per-tensor slots
    paid the caching allocator's unsplit segment remainders, up to 1 MiB per large weight), and the stack
    computes what it computed all on the device."""
    from lowbit.nn.offload import SLOT_ALIGN

    model = _stack(n=3)
    if scheme:
        for b in model.blocks:
            lowbit.quantize_model(b, scheme, skip=())
    want = model(*_inputs())
    off = enable_block_offload(model, model.blocks, "cpu", prefetch=1)
    got = model(*_inputs())
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    block_tensors = [*model.blocks[0].parameters(), *model.blocks[0].buffers()]
    block_bytes = sum(t.numel() * t.element_size() for t in block_tensors)
    for slot in off._slots:
        assert slot is not None
        bases = {t.untyped_storage().data_ptr() for t in slot}
        assert len(bases) == 1
        base = next(iter(bases))
        assert all((t.data_ptr() - base) % SLOT_ALIGN == 0 for t in slot)
    assert block_bytes * 2 <= off.slot_bytes < 2 * (block_bytes + SLOT_ALIGN * len(block_tensors))


def test_non_contiguous_tensors_keep_slots_of_their_own():
    from lowbit.nn.offload import _slot_views

    host = [torch.randn(4, 6).t(), torch.randn(5)]
    views = _slot_views(host, torch.device("cpu"))
    assert [v.stride() for v in views] == [h.stride() for h in host]
    assert len({v.untyped_storage().data_ptr() for v in views}) == 2
    flat = _slot_views([torch.randn(4, 6), torch.randn(5).bfloat16()], torch.device("cpu"))
    assert [v.shape for v in flat] == [(4, 6), (5,)] and flat[1].dtype == torch.bfloat16
    assert len({v.untyped_storage().data_ptr() for v in flat}) == 1


def test_lazy_load_keeps_its_old_import_path():
    from lowbit.nn import lazy_load, offload

    assert offload.lazy_load_quantized is lazy_load.lazy_load_quantized
    with pytest.raises(AttributeError):
        offload.no_such_name  # noqa: B018
