"""A column shard that carries ``params['plan_rows']`` is planned as its whole weight: the same GEMV kernel
variant and the same split of K (so its outputs equal the whole layer's bit for bit on the GPU), where a shard
planned for its own size may split K more ways. Plans are pure Python: checked here without a GPU."""

from dataclasses import replace

import pytest
import torch

import lowbit
from lowbit.formats.shards import PLAN_ROWS, plan_rows, shard

pytest.importorskip("triton")


@pytest.fixture
def h100_sms(monkeypatch):
    from lowbit.kernels import gemv_w4

    monkeypatch.setattr(gemv_w4, "_num_sms", lambda device_index: 132)


def _facts(q):
    from lowbit.kernels import gemv_prepack, gemv_runners

    p = gemv_prepack._prepare(q)  # layout only, no cache
    lay_fmt = gemv_prepack.FMT_CODES["nvfp4"] if q.fmt == "nvfp4" else -1
    return gemv_runners.GemvFacts(p.fmt, p.fmt_code, p.n, p.k, p.sk, p.words_per_block, p.post, p.gs_kind, lay_fmt,
                                  1, p.plan_n)


@pytest.mark.parametrize("m", [1, 4, 16])
def test_gemv_shard_planned_as_the_whole_weight(m, h100_sms):
    from lowbit.kernels import gemv_runners

    w = lowbit.quantize(torch.randn(8192, 8192), "nvfp4")
    half = shard(w, 0, 0, 2)
    exact = replace(half, params={**half.params, PLAN_ROWS: 8192})
    assert plan_rows(w) == 8192 and plan_rows(half) == 4096 and plan_rows(exact) == 8192
    full_mma, full = gemv_runners._default_plan(_facts(w), m, torch.bfloat16, False, 0, 0)
    own_mma, own = gemv_runners._default_plan(_facts(half), m, torch.bfloat16, False, 0, 0)
    ex_mma, ex = gemv_runners._default_plan(_facts(exact), m, torch.bfloat16, False, 0, 0)
    assert (ex_mma, ex.split, ex.consts) == (full_mma, full.split, full.consts)
    assert ex.ints[1] == 4096 and ex.grid[0] * 2 == full.grid[0]   # the shard's own rows, half the tiles
    assert own.split > full.split   # planned for its own size, K would be split more ways


def test_gemm_split_k_follows_plan_rows():
    from lowbit.kernels import gemm_w4

    cpu = torch.device("cpu")  # 132 SMs assumed off the GPU
    whole = gemm_w4.choose_config(32, 4096, 8192, "nvfp4", 0, cpu)
    own = gemm_w4.choose_config(32, 2048, 8192, "nvfp4", 0, cpu)
    planned = gemm_w4.choose_config(32, 2048, 8192, "nvfp4", 0, cpu, plan_n=4096)
    assert planned["SPLIT_K"] == whole["SPLIT_K"]
    assert own["SPLIT_K"] > whole["SPLIT_K"]
