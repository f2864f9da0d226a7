"""Peer W4A16 kernels a user would pick instead of lowbit, built on the same bf16 weights: bitsandbytes
``matmul_4bit`` (NF4, blocksize 64) and gemlite's Triton GEMV/GEMM (INT4 asymmetric, group 128, and MXFP4).

Each builder returns one callable ``f(x) -> y`` per weight copy, or None with the reason printed when the
peer is not installed or fails on this GPU: peers are optional baselines, never a reason to stop a run.
"""

from __future__ import annotations

import torch


def _unavailable(name: str, e: BaseException) -> None:
    print(f"  {name} baseline unavailable: {type(e).__name__}: {str(e)[:200]}", flush=True)


def bnb_nf4(weights: list[torch.Tensor]):
    try:
        import bitsandbytes as bnb
        import bitsandbytes.functional as F

        packed = [F.quantize_4bit(w, blocksize=64, quant_type="nf4") for w in weights]
        return [lambda x, p=p: bnb.matmul_4bit(x, p[0].t(), quant_state=p[1]) for p in packed]
    except Exception as e:  # noqa: BLE001 - optional baseline
        _unavailable("bitsandbytes", e)
        return None


def _int4_minmax(w: torch.Tensor, group: int):
    """Asymmetric min/max INT4 of ``w`` per ``group`` columns: (codes uint8 [N, K], scales, zeros [N, K/group])
    with ``w ~ (codes - zeros) * scales``, the layout gemlite's ``A16Wn.from_weights`` takes."""
    n, k = w.shape
    g = w.float().view(n, k // group, group)
    lo, hi = g.amin(-1), g.amax(-1)
    scale = ((hi - lo) / 15).clamp_min(1e-8)
    zero = (-lo / scale).round()
    codes = (g / scale[..., None] + zero[..., None]).round().clamp(0, 15).to(torch.uint8).view(n, k)
    return codes, scale, zero


def gemlite(weights: list[torch.Tensor], kind: str):
    """gemlite layers for ``kind`` in {"int4", "mxfp4"} (bf16 in/out), or None."""
    try:
        import gemlite  # noqa: F401 - loads the shipped per-GPU kernel configs
        from gemlite.helper import A16W4_MXFP, A16Wn

        layers = []
        for w in weights:
            if kind == "int4":
                codes, scale, zero = _int4_minmax(w, 128)
                layer = A16Wn(device=str(w.device), dtype=torch.bfloat16).from_weights(
                    codes, scale.to(torch.bfloat16), zero.to(torch.bfloat16), 4, 128
                )
            elif kind == "mxfp4":
                lin = torch.nn.Linear(w.shape[1], w.shape[0], bias=False, device=w.device, dtype=w.dtype)
                lin.weight.data.copy_(w)
                layer = A16W4_MXFP(device=str(w.device), dtype=torch.bfloat16).from_linear(lin)
            else:
                raise ValueError(f"kind must be 'int4' or 'mxfp4', got {kind!r}")
            layers.append(layer)
        return [lambda x, layer=layer: layer(x) for layer in layers]
    except Exception as e:  # noqa: BLE001 - optional baseline
        _unavailable(f"gemlite {kind}", e)
        return None


def write_json(path: str, payload: dict) -> None:
    """Write ``payload`` to ``path`` atomically. Benchmarks call it after every shape, so a run cut short by a
    time limit still leaves the rows it measured (marked ``"complete": False`` until the last write)."""
    import json
    import os

    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(payload, f, indent=1, default=str)
    os.replace(tmp, path)


def rel_error(y: torch.Tensor, ref: torch.Tensor) -> float:
    return ((y.float() - ref.float()).norm() / ref.float().norm()).item()
