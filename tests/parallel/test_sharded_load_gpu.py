"""Sharded loading on two GPUs (NCCL): load_quantized(device_mesh=, tp_plan=) onto CUDA equals parallelize after
a whole load onto CUDA, for a layout of each kind of read (row slices, packed columns, swizzled tiles, the nf4
fallback), and the loaded model runs."""

import pytest
import torch

from test_sharded_load import _differences, _plan_of, _write
from tp_workers import spawn_ranks

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")]

GPU_CASES = ("ct-nvfp4-dense-o", "awq", "lightx2v-nvfp4", "bnb-nf4-double", "fp8", "ct-w4a4-static")


def _gpu_checks(rank: int, world: int, device: str, root: str, cases=GPU_CASES) -> dict:
    from pathlib import Path

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import lowbit
    from lowbit.parallel import parallelize

    from test_sharded_load import CASES

    cases = [c for c in cases if c in CASES]
    for i, name in enumerate(cases):
        if i % world == rank:
            _write(Path(root), name)
    dist.barrier()
    mesh = init_device_mesh("cuda", (world,))
    dev = f"cuda:{rank}"
    ids = (torch.arange(16).reshape(1, 16) % 96).to(dev)
    out = {}
    for case in cases:
        path, plan = str(Path(root, case)), _plan_of(case)
        got = lowbit.load_quantized(path, device=dev, device_mesh=mesh, tp_plan=plan)
        want = parallelize(lowbit.load_quantized(path, device=dev), mesh, plan)
        with torch.inference_mode():
            a, b = got(ids).logits, want(ids).logits
        out[case] = {"differences": _differences(got, want)[:8], "logits_equal": bool(torch.equal(a, b)),
                     "on_cuda": all(t.device.type == "cuda" for t in got.state_dict().values()
                                    if isinstance(t, torch.Tensor) and not hasattr(t, "placements"))}
    return out


def test_sharded_load_on_gpus(tmp_path):
    res = spawn_ranks(_gpu_checks, 2, "cuda", tmp_path, root=str(tmp_path))
    print(res)
    assert res, "no case ran"
    for case, r in res.items():
        assert r["differences"] == [], (case, r["differences"])
        assert r["logits_equal"] and r["on_cuda"], (case, r)
