"""Assertions for tests and benchmarks (no pytest import): bit-exact comparison with a useful report."""

from __future__ import annotations

import torch

_INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def assert_bitexact(got: torch.Tensor, want: torch.Tensor, what: str = "tensor", any_nan: bool = False) -> None:
    """Raise AssertionError unless ``got`` and ``want`` have the same shape, dtype and bytes.

    With ``any_nan``, NaNs only have to sit in the same places (their bits may differ): torch's bf16 cast
    writes NaN as 0xFFFF in vectorised loops and 0x7FC0 in scalar tails, whose length depends on the host ISA.
    The message counts the differing elements and shows the first few with their values and bits.
    """
    if got.shape != want.shape or got.dtype != want.dtype:
        raise AssertionError(f"{what}: got {got.dtype}{tuple(got.shape)}, want {want.dtype}{tuple(want.shape)}")
    g = got.detach().cpu().contiguous()
    w = want.detach().cpu().contiguous()
    iv = _INT_VIEW[g.element_size()]
    gb, wb = g.view(iv), w.view(iv)
    diff = gb != wb
    if any_nan and g.is_floating_point():
        diff &= ~(g.isnan() & w.isnan())
    if not diff.any():
        return
    idx = diff.nonzero()[:6].tolist()
    lines = []
    for i in idx:
        t = tuple(i)
        lines.append(f"  at {t}: got {g[t].item()!r} (0x{gb[t].item() & 0xFFFFFFFF:x}) want {w[t].item()!r} "
                     f"(0x{wb[t].item() & 0xFFFFFFFF:x})")
    raise AssertionError(f"{what}: {int(diff.sum())} of {diff.numel()} elements differ\n" + "\n".join(lines))


def linear_oracle(x: torch.Tensor, w, bias: torch.Tensor | None = None, activation: str | None = None) -> torch.Tensor:
    """fp32 ``act(x @ dequant(w).T + bias)`` with the product and the bias add in float64: the oracle of the
    W4A16 kernel tests, one rounding away from exact (``lowbit.ops.linear_reference`` multiplies in fp32)."""
    from .api import dequantize
    from .ops.linear import _act

    y = x.double() @ dequantize(w, torch.float32).double().T
    if bias is not None:
        y = y + bias.double()
    return _act(y.float(), activation)
