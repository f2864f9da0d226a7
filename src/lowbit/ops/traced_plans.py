"""What a prepared layer's call under ``torch.compile`` reads besides its tensors, kept once per distinct value.

Every Python value a traced call reads from a layer becomes a guard, which the compiled code checks on every
call: a dozen facts per layer (shape, format codes, the tensor-core GEMV's M range, the device, the
activation) made the guards of a 32-layer decode step cost several times those of the bf16 model. A plan
holds those values in one tuple; layers with equal plans (the same projections in every decoder layer) share
one entry of :data:`PLANS`, and a layer keeps the entry's key. The compiled step then checks each distinct plan
once and one integer per layer.
"""

from __future__ import annotations

from typing import NamedTuple

import torch


class GemvPlan(NamedTuple):
    """The ``lowbit::w4a16_gemv`` call of a prepared W4A16 weight (see ``PreparedWeight.traced_call``)."""

    k: int
    n_out: int
    device: torch.device
    gated: bool
    traced_index: int                  # the device's shared scratch (``lowbit.kernels.scratch.traced_shared``)
    mma_rule: tuple                    # ``lowbit.kernels.gemv_runners.mma_rule``: (x dtypes, min M, max M, M = 1)
    op_args: tuple                     # the op's trailing constants (format facts and activation code)


class Fp8DecodePlan(NamedTuple):
    """The ``lowbit::fp8_block_decode`` call of a prepared fp8_block weight."""

    k: int
    n: int
    device: torch.device
    traced_index: int
    activation: str | None
    op_args: tuple                     # (ue8m0 scales, weight rows per scale, planning rows)


PLANS: dict[int, tuple] = {}
"""key -> plan; read by traced calls as ``PLANS[layer key]``, one source per distinct plan."""
_KEYS: dict[tuple, int] = {}


def plan_key(plan: tuple) -> int:
    """The key of ``plan`` in :data:`PLANS` (added on first sight; equal plans share a key). Entries are a few
    constants each, one per distinct layer shape and format, and are never removed: a compiled graph may
    still read them."""
    ident = (type(plan), plan)
    key = _KEYS.get(ident)
    if key is None:
        key = _KEYS[ident] = len(_KEYS)
        PLANS[key] = plan
    return key


__all__ = ["PLANS", "Fp8DecodePlan", "GemvPlan", "plan_key"]
