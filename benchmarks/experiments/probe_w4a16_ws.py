"""Where the warp-specialized W4A16 GEMM's time goes, and whether its output is deterministic.

    PYTHONPATH=src python benchmarks/experiments/probe_w4a16_ws.py

For one weight and a few M: the kernel as shipped, with the decode replaced by a bit copy (DEBUG 1), without the
scale loads (2), without the packed-weight loads and decode (4), and with one program per tile (no persistent
loop). Prints microseconds per call (CUDA-graph replays), the error against the fp32 reference, and how many
output elements differ between repeated calls (a race shows up there).
"""

import torch

import lowbit
from lowbit.bench.timing import graph_ms
from lowbit.kernels import gemm_w4 as g


def main() -> None:
    torch.manual_seed(0)
    for fmt, n, k in (("nvfp4", 4096, 4096), ("int4_awq", 4096, 4096)):
        w = torch.randn(n, k, device="cuda") * 0.02
        q = lowbit.quantize(w.half() if fmt == "int4_awq" else w, fmt, **({"group_size": 128} if fmt == "int4_awq" else {}))
        wf = lowbit.dequantize(q, torch.float32)
        for m in (64, 1024, 4096):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            ref = x.float() @ wf.T
            cub = wf.to(torch.bfloat16)
            t_cub = graph_ms(lambda x=x, cub=cub: torch.nn.functional.linear(x, cub), repeats=20, calls=5) * 1e3
            tiles = -(-m // 128) * -(-n // 128)
            line = [f"{fmt} {n}x{k} M={m} cuBLAS {t_cub:.1f}us"]
            for label, cfg in (("ws", {}), ("nodecode", {"DEBUG": 1}), ("noscale", {"DEBUG": 2}),
                               ("noweight", {"DEBUG": 4}), ("persistent", {"PROGRAMS": min(tiles, 132)}), ("release-now", {"DEBUG": 5})):
                out = g.gemm_w4_ws(x, q, config=cfg)
                t = graph_ms(lambda c=cfg, x=x, q=q: g.gemm_w4_ws(x, q, config=c), repeats=20, calls=5) * 1e3
                text = f"{label} {t:.1f}us ({t_cub / t:.2f}x)"
                if cfg.get("DEBUG", 0) in (0, 5):
                    err = ((out.float() - ref).norm() / ref.norm()).item()
                    diff = sum(int((g.gemm_w4_ws(x, q, config=cfg) != out).sum()) for _ in range(5))
                    text += f" err {err:.1e} nondet {diff}"
                line.append(text)
            print(" | ".join(line), flush=True)


if __name__ == "__main__":
    main()
