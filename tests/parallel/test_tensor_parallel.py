"""Tensor parallelism on CPU processes (gloo): every scheme column- and row-parallel, placements, plans,
errors, a transformers Llama with its own plan, and a compiled forward. The same checks run with NCCL on two
GPUs in tests/parallel/test_tensor_parallel_gpu.py."""

import pytest
import torch

from tp_workers import (MLP_SCHEMES, compiled_checks, layout_checks, llama_checks, mlp_checks, spawn_ranks,
                        stack_checks)

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed is not built")


@pytest.mark.parametrize("world, rows", [(2, (1, 16)), (4, (3,))])
def test_every_scheme_colwise_bit_exact_rowwise_close(world, rows, tmp_path):
    res = spawn_ranks(mlp_checks, world, "cpu", tmp_path, rows=rows)
    assert set(res) == set(MLP_SCHEMES)
    for scheme, r in res.items():
        assert r["colwise_bits_equal"], scheme
        assert r["ranks_agree"], scheme
        # bf16 partial sums added across ranks: a few bf16 roundings of the output
        assert r["rel_err"] < 2e-2, (scheme, r["rel_err"])


def test_placements_plans_and_errors(tmp_path):
    res = spawn_ranks(layout_checks, 2, "cpu", tmp_path)
    assert res["gathered_equal"] and res["dtensor_in_equal"] and res["dtensor_out"]
    assert res["sequence_parallel_equal"]
    assert res["replicated_in_rel"] < 2e-2 and res["dtensor_out_rel"] < 2e-2
    errors = res["errors"]
    assert "match no module" in errors["{'up': 'colwise', 'nope': 'rowwise'}"]
    assert "unknown tensor-parallel style 'diagonal'" in errors["{'up': 'diagonal'}"]
    assert "matches both" in errors["{'up': 'colwise', 'u*': 'rowwise'}"]
    assert "down" in errors["odd"] and "multiple of 16" in errors["odd"]
    assert "tensor-parallel shards" in errors["save"]
    assert res["untouched"]


def test_transformers_llama_with_its_own_plan(tmp_path):
    pytest.importorskip("transformers")
    res = spawn_ranks(llama_checks, 2, "cpu", tmp_path)
    assert res["sharded"] == 2 * 7
    assert res["rel_err"] < 3e-2


def test_compiled_fullgraph(tmp_path):
    res = spawn_ranks(compiled_checks, 2, "cpu", tmp_path)
    assert res["equal"], res


def test_benchmark_stack_plan(tmp_path):
    """``lowbit bench tp``'s stack and plan on CPU ranks: every projection sharded, the outputs agree."""
    res = spawn_ranks(stack_checks, 2, "cpu", tmp_path)
    for config, r in res.items():
        assert r["rel_err"] < 3e-2, (config, r)
        assert r["sharded"] == (0 if config == "bf16" else 2 * 7), (config, r)
