"""Tensor parallelism on CPU processes (gloo): every scheme column- and row-parallel, placements, plans, errors, a
transformers Llama with its own plan, a compiled forward and ``lowbit bench tp``'s stack, in one process group of
2 ranks (each rank pays its imports once), and the schemes again on 4 ranks. The same checks run with NCCL on two
GPUs in tests/parallel/test_tensor_parallel_gpu.py."""

import pytest
import torch

from tp_workers import MLP_SCHEMES, all_checks, mlp_checks, spawn_ranks

from lowbit.bench.tp import SHAPES

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed is not built")


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return spawn_ranks(all_checks, 2, "cpu", tmp_path_factory.mktemp("tp"), rows=(1, 16), hidden=256, inter=1024)


def _ok(part):
    assert "error" not in part, part.get("error")
    return part


def _check_schemes(res):
    assert set(res) == set(MLP_SCHEMES)
    for scheme, r in res.items():
        assert r["colwise_bits_equal"], scheme
        assert r["ranks_agree"], scheme
        # bf16 partial sums added across ranks: a few bf16 roundings of the output
        assert r["rel_err"] < 2e-2, (scheme, r["rel_err"])


def test_every_scheme_colwise_bit_exact_rowwise_close(results):
    _check_schemes(_ok(results["mlp_exact"]))


def test_every_scheme_on_four_ranks(tmp_path):
    _check_schemes(spawn_ranks(mlp_checks, 4, "cpu", tmp_path, rows=(3,)))


def test_placements_plans_and_errors(results):
    res = _ok(results["layouts"])
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


def test_transformers_llama_with_its_own_plan(results):
    pytest.importorskip("transformers")
    res = _ok(results["llama"])
    assert res["sharded"] == 2 * 7
    assert res["rel_err"] < 3e-2


@pytest.mark.parametrize("scheme", ["w4a16-nvfp4", "w8a8-fp8-block"])
def test_compiled_fullgraph(results, scheme):
    """aot_eager on CPU: the graph traces whole (functional all-reduce, the ops) and computes the eager bits."""
    res = _ok(results[f"compiled_{scheme}"])
    assert res["equal"], res


def test_benchmark_stack_plan(results):
    """``lowbit bench tp``'s stack and plan on CPU ranks: every projection sharded, the outputs agree."""
    for config, r in _ok(results["stack"]).items():
        assert r["rel_err"] < 3e-2, (config, r)
        assert r["sharded"] == (0 if config == "bf16" else 2 * 7), (config, r)
        if config != "bf16":  # torch's DTensor layers are not what this checks
            assert r["compiled_equal"], (config, r)


def test_fused_column_shards(results):
    """q/k/v and gate/up shards of each rank fused into one column-parallel GEMM each (as vLLM's merged
    column-parallel layers): same output as the unfused parallel stack, unfused back to the same shards."""
    r = _ok(results["fused"])
    assert r["fused_layers"] == 2 * 2, r               # two groups in each of the two layers
    assert r["fused_class"] == "ColwiseQuantLinear", r
    s = SHAPES["tiny"]
    assert r["local_q"] == s.heads * s.head_dim // 2, r
    assert r["fused_local_out"] == (s.heads + 2 * s.kv_heads) * s.head_dim // 2, r
    assert r["fused_full_out"] == 2 * r["fused_local_out"], r
    assert r["equal"] or r["rel"] < 1e-5, r
    assert r["unfused_same_state"] and r["unfused_colwise"] and r["unfused_equal"], r
    assert r["exact_fused_groups"] == 0, r
    assert r["compiled_equal"], r   # aot_eager: the traced graph computes the eager bits


def test_rowwise_refuses_an_online_input_transform():
    """A row shard sees part of K; an online transform (scale vector, Hadamard blocks) spans all of it: refused
    before any mesh is touched."""
    import copy
    import sys
    from pathlib import Path

    import pytest

    import lowbit
    from lowbit.parallel.layers import parallelize_quant_linear

    sys.path.insert(0, str(Path(__file__).parents[1] / "algorithms"))
    from outlier_layer import outlier_layer

    m, _, _ = outlier_layer()
    q = lowbit.quantize_model(copy.deepcopy(m), "w4a4-nvfp4", skip=(), algorithm="rotate")
    with pytest.raises(ValueError, match="row-parallel QuantLinear cannot transform its input online"):
        parallelize_quant_linear(q.fc, None, "rowwise")
