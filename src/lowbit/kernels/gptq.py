"""Triton launcher for one block of GPTQ's coordinate-descent refinement (the kernel: ``_gptq``).

:func:`refine_block` runs what ``lowbit.algorithms.gptq_refine`` runs column by column over a block, in one
launch: a program per tile of rows, every column of the block in order (the objective is separable over the
rows). On a Llama-3-8B layer the torch loop launches about twenty kernels per column, some 3 million per
refinement of four sweeps, and takes seconds even replayed from CUDA graphs.
"""

from __future__ import annotations

import torch

from . import _gptq as k
from . import cdiv
from . import interpreting as _interpreting

BLOCK_ROWS = 32
"""Rows per program: the block's tile of G (``bs x 32`` fp32) stays in registers."""

MAX_BLOCK = 256
"""The widest block of columns one launch takes (its G tile lives in registers)."""


def refine_block(Wt: torch.Tensor, Qt: torch.Tensor, Ct: torch.Tensor, Et: torch.Tensor, Gt: torch.Tensor,
                 H: torch.Tensor, diag: torch.Tensor, levels: torch.Tensor, dE: torch.Tensor, b1: int, ncols: int,
                 group: int) -> None:
    """One sweep over the columns ``b1 .. b1 + ncols`` of the transposed ``[cols, rows]`` tensors ``Wt``
    (target), ``Qt`` (values), ``Ct`` (codes, uint8 or int32), ``Et`` (``Wt - Qt``) and ``Gt`` (``(E H)^T``),
    updating ``Qt``, ``Ct``, ``Et`` and the block's rows of ``Gt`` in place and writing each column's change of
    E into ``dE[:ncols]``. ``H`` fp32 ``[cols, cols]``, ``diag`` its diagonal (fp32 ``[cols]``), ``levels``
    fp32 ``[cols / group, rows, 16]``: each group's grid per row, the level of code ``c`` at index ``c``.

    Raises:
        ValueError: shapes, devices or layouts that do not fit together.
        TypeError: dtypes other than the ones above.
    """
    cols, rows = Wt.shape
    for name, t in (("Wt", Wt), ("Qt", Qt), ("Et", Et), ("Gt", Gt), ("H", H), ("diag", diag),
                    ("levels", levels), ("dE", dE)):
        if t.dtype != torch.float32:
            raise TypeError(f"{name} must be float32, got {t.dtype}")
    if Ct.dtype not in (torch.uint8, torch.int32):
        raise TypeError(f"Ct must be uint8 or int32 codes, got {Ct.dtype}")
    for name, t, shape in (("Qt", Qt, (cols, rows)), ("Ct", Ct, (cols, rows)), ("Et", Et, (cols, rows)),
                           ("Gt", Gt, (cols, rows)), ("H", H, (cols, cols)), ("diag", diag, (cols,)),
                           ("levels", levels, (cols // group, rows, 16))):
        if tuple(t.shape) != shape:
            raise ValueError(f"{name} must have shape {shape}, got {tuple(t.shape)}")
    if not 0 < ncols <= MAX_BLOCK or b1 < 0 or b1 + ncols > cols:
        raise ValueError(f"the block {b1} .. {b1 + ncols} must lie in 0 .. {cols} and span 1 .. {MAX_BLOCK} columns")
    if dE.dim() != 2 or dE.shape[0] < ncols or dE.shape[1] != rows:
        raise ValueError(f"dE must be [>= {ncols}, {rows}], got {tuple(dE.shape)}")
    if group <= 0 or cols % group:
        raise ValueError(f"group must divide cols={cols}, got {group}")
    tensors = (Wt, Qt, Ct, Et, Gt, H, diag, levels, dE)
    if any(not t.is_contiguous() for t in tensors):
        raise ValueError("refine_block takes contiguous tensors")
    if len({t.device for t in tensors}) != 1:
        raise ValueError("refine_block takes tensors on one device")
    if rows == 0:
        return
    bs = max(16, 1 << (ncols - 1).bit_length())
    k.refine_block_kernel[(cdiv(rows, BLOCK_ROWS),)](
        Wt, Qt, Ct, Et, Gt, H, diag, levels, dE, rows, cols, b1, ncols, group,
        BS=bs, BR=BLOCK_ROWS, ON_GPU=not _interpreting(), num_warps=4,
    )


def compile_variants():
    """(kernel, signature, constexprs): uint8 and int32 codes, the 128-column block and a narrower tail."""
    sig = {"wt_ptr": "*fp32", "qt_ptr": "*fp32", "ct_ptr": "*u8", "et_ptr": "*fp32", "gt_ptr": "*fp32",
           "h_ptr": "*fp32", "diag_ptr": "*fp32", "lv_ptr": "*fp32", "de_ptr": "*fp32",
           "ROWS": "i32", "COLS": "i32", "B1": "i32", "NCOLS": "i32", "GROUP": "i32"}
    for codes, bs in (("*u8", 128), ("*i32", 128), ("*u8", 64)):
        yield k.refine_block_kernel, dict(sig, ct_ptr=codes), {"BS": bs, "BR": BLOCK_ROWS, "ON_GPU": True}
