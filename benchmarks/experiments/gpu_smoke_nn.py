"""quantize_model on CUDA for every scheme: a small bf16 MLP, the Triton path (backend auto) against the
reference path (backend="torch") on the same quantized layers, and both against the unquantized model.

    PYTHONPATH=src python benchmarks/experiments/gpu_smoke_nn.py
"""

from __future__ import annotations

import copy
import json
import os

import torch

import lowbit


def main() -> None:
    torch.manual_seed(0)
    base = torch.nn.Sequential(torch.nn.Linear(512, 1024), torch.nn.GELU(), torch.nn.Linear(1024, 512)).cuda()
    base = base.to(torch.bfloat16)
    x = torch.randn(3, 37, 512, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        dense = base(x).float()
    rows = []
    for scheme in lowbit.SCHEMES:
        row = {"scheme": scheme}
        try:
            q = lowbit.quantize_model(copy.deepcopy(base), scheme)
            with torch.no_grad():
                y = q(x).float()
                for mod in q.modules():
                    if isinstance(mod, lowbit.nn.QuantLinear):
                        mod.backend = "torch"
                y_ref = q(x).float()
            row["kernel_vs_reference"] = ((y - y_ref).norm() / y_ref.norm()).item()
            row["quantized_vs_dense"] = ((y - dense).norm() / dense.norm()).item()
            row["ok"] = bool(torch.isfinite(y).all()) and row["kernel_vs_reference"] <= 1e-2
        except Exception as e:  # noqa: BLE001 - report every scheme
            row["error"] = f"{type(e).__name__}: {e}"[:300]
            row["ok"] = False
        print(row, flush=True)
        rows.append(row)
    out = os.environ.get("OUT", "benchmarks/results/tmp")
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "gpu_smoke_nn.json"), "w") as f:
        json.dump({"device": torch.cuda.get_device_name(0), "rows": rows}, f, indent=1)
    print(f"{sum(r['ok'] for r in rows)}/{len(rows)} schemes ok")


if __name__ == "__main__":
    main()
