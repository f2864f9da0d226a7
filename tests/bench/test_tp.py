"""``lowbit bench tp`` plumbing on CPU: ratios and targets, the table, argument errors (the GPU run is
benchmarks/gpu_check.py's tp step; the stack and its plan run on CPU ranks in tests/parallel)."""

import torch

from lowbit.bench import SUITES
from lowbit.bench.tp import TARGETS, format_table, main, ratios


def _rows():
    return [
        {"config": "lowbit:w4a16-nvfp4", "world": 1, "all_reduce": None, "decode_graph_ms": 2.0, "prefill_ms": 100.0,
         "decode_eager_ms": 5.0},
        {"config": "lowbit:w4a16-nvfp4", "world": 2, "all_reduce": "nccl", "decode_graph_ms": 1.3, "prefill_ms": 54.0,
         "decode_eager_ms": 6.0, "rel_err_vs_1gpu": 3e-3},
        {"config": "lowbit:w4a16-nvfp4", "world": 2, "all_reduce": "symm_mem", "decode_graph_ms": 1.1,
         "prefill_ms": 56.0},
        {"config": "bf16", "world": 1, "error": "RuntimeError: boom"},
    ]


def test_ratios_and_targets():
    out = ratios(_rows(), 2)
    assert [(e["config"], e["all_reduce"]) for e in out] == [("lowbit:w4a16-nvfp4", "nccl"),
                                                            ("lowbit:w4a16-nvfp4", "symm_mem")]
    nccl, symm = out
    assert abs(nccl["decode_graph"] - 0.65) < 1e-9 and nccl["decode_graph_meets"] is False
    assert abs(nccl["prefill"] - 0.54) < 1e-9 and nccl["prefill_meets"] is True
    assert symm["decode_graph_meets"] is True and symm["prefill_meets"] is False
    assert "decode_eager_meets" not in nccl and set(TARGETS) == {"decode_graph", "compiled_graph", "prefill"}


def test_table_shows_errors_and_ratios():
    text = format_table({"tp": 2, "rows": _rows(), "ratios": ratios(_rows(), 2)})
    assert "err" in text.splitlines()[-4] or "err" in text
    assert "decode_graph 0.650 (missed)" in text and "prefill 0.540 (met)" in text


def test_suite_registered_and_needs_gpus(capsys):
    assert "tp" in SUITES
    if not torch.cuda.is_available():
        assert main(["--tp", "2"]) == 2
        assert "needs CUDA" in capsys.readouterr().err


def test_config_names_are_checked():
    import pytest

    from lowbit.bench.tp import SHAPES, build_stack

    for bad in ("bf16+fused", "lowbit:w4a16-nvfp4+fast", "other:w4a16-nvfp4"):
        with pytest.raises(ValueError, match="unknown config"):
            build_stack(SHAPES["tiny"], 1, 8, bad, 1, None, "cpu")
    # a scheme whose weights do not stack (fp8_block) cannot run fused: said, not silently run unfused
    with pytest.raises(ValueError, match="could be fused"):
        build_stack(SHAPES["tiny"], 1, 8, "lowbit:w8a8-fp8-block+fused", 1, None, "cpu")
