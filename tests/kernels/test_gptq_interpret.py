"""GPTQ's fused refinement kernel (``lowbit.kernels.gptq.refine_block``) under ``TRITON_INTERPRET=1`` on tiny
CPU tensors, bit-exact against the torch column loop of ``lowbit.algorithms.gptq_refine``.

The interpreter runs the kernel's indexing, masking (row tiles, a partial block, columns with ``H_jj <= 0``),
the first-minimum choice among the 16 levels and the per-column arithmetic with numpy fp32, whose product,
IEEE division and separate multiply and add are what torch's CPU ops do here, so every code and value must
match. On the GPU the rank-1 update of G is one FMA, which torch may round differently: the GPU test
compares there within near-ties. triton 3.6's interpreter takes ``int()`` of 1-element arrays for runtime
loop bounds, which numpy >= 2.4 refuses; the script patches that one attribute.
"""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from interpreter_compat import LOOP_BOUNDS  # this folder's interpreter patch

pytest.importorskip("triton")

SCRIPT = LOOP_BOUNDS + textwrap.dedent(
    """
    import sys

    import torch

    sys.path.insert(0, TESTS)
    from test_gptq import _layer

    from lowbit.algorithms import gptq_refine
    from lowbit.algorithms.grids import grid_for
    from lowbit.kernels.gptq import refine_block

    def rounded(grid, w):
        G = grid.group
        states = [grid.fit(w[:, g * G:(g + 1) * G]) for g in range(w.shape[1] // G)]
        parts = [grid.round(w[:, g * G:(g + 1) * G], st) for g, st in enumerate(states)]
        return states, torch.cat([c for c, _ in parts], 1), torch.cat([v for _, v in parts], 1)

    # the kernel only picks among the levels it is given: one format with uint8 codes, one with int32
    cases = [("nvfp4", {}), ("int4_awq", {"group_size": 32})]
    checked = 0
    for fmt, opts in cases:
        # 40 rows: a full and a partial row tile; 160 columns: a full and a partial block of 128
        w, _, H = _layer(seed=5, out=40, k=160)
        # an evenly spaced row: values on the grid and exactly between two of its levels
        w[3] = torch.linspace(-0.1, 0.1, 160)
        grid = grid_for(w, fmt, **opts)
        states, codes, values = rounded(grid, w)
        Hd = H + 0.03 * H.diagonal().mean() * torch.eye(H.shape[0])
        Hd[7, :] = 0.0
        Hd[:, 7] = 0.0          # a dead input: H_jj = 0, its values must stay
        Hd[150, 150] = -1.0     # and a negative diagonal
        for bs in (128, 48):
            want = gptq_refine.refine(grid, w, values, codes, states, Hd, 2, bs, graphs=False)
            real = gptq_refine._fused_kernel
            gptq_refine._fused_kernel = lambda device, block_size: refine_block
            try:
                got = gptq_refine.refine(grid, w, values, codes, states, Hd, 2, bs)
            finally:
                gptq_refine._fused_kernel = real
            assert torch.equal(got[1], want[1]), (fmt, bs, (got[1] != want[1]).sum())
            assert torch.equal(got[0], want[0]), (fmt, bs)
            assert not torch.equal(got[1], codes), (fmt, bs)   # something moved
            assert torch.equal(got[1][:, 7], codes[:, 7]) and torch.equal(got[1][:, 150], codes[:, 150])
            checked += 1
    print("interpreter checks passed", checked)
    """
)


def test_refine_block_bit_exact_under_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONWARNINGS="ignore")
    tests = str(Path(__file__).resolve().parents[1] / "algorithms")
    proc = subprocess.run([sys.executable, "-c", f"TESTS = {tests!r}\n" + SCRIPT], env=env, capture_output=True,
                          text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    assert "interpreter checks passed 4" in proc.stdout


def test_refine_block_rejects_what_it_cannot_take():
    import torch

    from lowbit.kernels.gptq import refine_block

    rows, cols = 8, 32
    f = torch.zeros(cols, rows)
    args = {"Wt": f, "Qt": f.clone(), "Ct": torch.zeros(cols, rows, dtype=torch.uint8), "Et": f.clone(),
            "Gt": f.clone(), "H": torch.zeros(cols, cols), "diag": torch.zeros(cols),
            "levels": torch.zeros(2, rows, 16), "dE": torch.zeros(16, rows), "b1": 0, "ncols": 16, "group": 16}
    with pytest.raises(TypeError, match="Ct"):
        refine_block(**dict(args, Ct=args["Ct"].to(torch.int16)))
    with pytest.raises(TypeError, match="H must be float32"):
        refine_block(**dict(args, H=args["H"].double()))
    with pytest.raises(ValueError, match="levels must have shape"):
        refine_block(**dict(args, levels=torch.zeros(3, rows, 16)))
    with pytest.raises(ValueError, match="block"):
        refine_block(**dict(args, b1=24))
    with pytest.raises(ValueError, match="dE"):
        refine_block(**dict(args, ncols=32))
    with pytest.raises(ValueError, match="contiguous"):
        refine_block(**dict(args, Qt=torch.zeros(rows, cols).t()))


def test_the_fused_refinement_is_chosen_only_where_it_runs():
    """CUDA with Triton and a block the kernel takes: the fused kernel; the CPU, a block wider than its G tile
    or the switch off: the torch loop (graphs or eager)."""
    import torch

    from lowbit.algorithms import gptq_refine
    from lowbit.kernels.gptq import MAX_BLOCK, refine_block

    cuda = torch.device("cuda")
    assert gptq_refine._fused_kernel(torch.device("cpu"), 128) is None
    if torch.cuda.is_available():  # on a GPU machine a capture check runs first; the rest is the same
        assert gptq_refine._fused_kernel(cuda, 128) is refine_block
    else:
        original = torch.cuda.is_current_stream_capturing
        torch.cuda.is_current_stream_capturing = lambda: False
        try:
            assert gptq_refine._fused_kernel(cuda, 128) is refine_block
            assert gptq_refine._fused_kernel(cuda, MAX_BLOCK) is refine_block
            assert gptq_refine._fused_kernel(cuda, MAX_BLOCK + 1) is None
            gptq_refine.USE_FUSED_KERNEL = False
            assert gptq_refine._fused_kernel(cuda, 128) is None
        finally:
            gptq_refine.USE_FUSED_KERNEL = True
            torch.cuda.is_current_stream_capturing = original
