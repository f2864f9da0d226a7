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
    from .ops.linear import apply_activation

    y = x.double() @ dequantize(w, torch.float32).double().T
    if bias is not None:
        y = y + bias.double()
    return apply_activation(y.float(), activation)


def nvfp4_order_ties() -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 ``x [R, 16]`` and a global scale ``S`` where NVFP4's two multiplier orders give different codes.

    vLLM computes the element multiplier as ``1/(sf * (1/S))``, LightX2V as ``S * (1/sf)``; for ``S = 3`` and
    block scales ``sf = 3.75 * 2^k`` the two differ in the last bit. Each row is one block whose absmax
    ``7.5 * 2^k`` makes ``S * (absmax * fp32(1/6)) = sf`` exactly (no E4M3 rounding: the Triton interpreter,
    whose fp8 casts are not trusted, can check these blocks too); its other 15 elements sit on and one ulp
    either side of ``t / m`` for every E2M1 tie ``t`` and both multipliers ``m``, with alternating signs.
    """
    s = torch.tensor(3.0)
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    rows = []
    for k in range(-6, 3):
        sf = torch.tensor(3.75 * 2.0**k)
        cands = []
        for m in (1.0 / (sf * (1.0 / s)), s * (1.0 / sf)):
            base = ties / m
            cands += [base, torch.nextafter(base, torch.full_like(base, float("inf"))),
                      torch.nextafter(base, torch.zeros_like(base))]
        c = torch.cat(cands)
        c = c * torch.tensor([1.0, -1.0]).repeat(c.numel() // 2 + 1)[: c.numel()]
        c = torch.cat([c, c[: -c.numel() % 15]]) if c.numel() % 15 else c
        blocks = c.reshape(-1, 15)
        amax = torch.full((blocks.shape[0], 1), 7.5 * 2.0**k)
        rows.append(torch.cat([amax, blocks], 1))
    return torch.cat(rows), s
