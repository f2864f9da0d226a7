"""The register-fragment W4A16 GEMM per format and config against the fp32 reference and the register-operand
kernel (the same decode: bit-equal without split K), call after call, with its CUDA-graph time: the probe run
after each change to the kernel's pipeline or epilogue (the x ring's refills, the final wait)."""

import argparse

import torch

import lowbit
from lowbit.bench.timing import graph_ms
from lowbit.kernels import gemm_w4 as g


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="28672x8192,4096x14336,6144x4096")
    ap.add_argument("--ms", default="256,1024")
    ap.add_argument("--formats", default="nvfp4,mxfp4,int4_awq")
    ap.add_argument("--configs", default="WG=2,BM=256;WG=1,BM=256;WG=2,BM=128;WG=1,BM=128;WG=2,BM=256,SPLIT=2")
    args = ap.parse_args()
    configs = [{kv.split("=")[0]: int(kv.split("=")[1]) for kv in c.split(",")} for c in args.configs.split(";")]
    torch.manual_seed(0)
    for shape in args.shapes.split(","):
        n, k = (int(v) for v in shape.split("x"))
        w = torch.randn(n, k, device="cuda") * 0.05
        for fmt in args.formats.split(","):
            q = lowbit.quantize(w.half() if fmt == "int4_awq" else w, fmt)
            for m in (int(v) for v in args.ms.split(",")):
                x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
                ref = lowbit.ops.linear_reference(x, q, out_dtype=torch.float32)
                parts = []
                for cfg in configs:
                    outs = [g.gemm_w4_rf(x, q, config=cfg) for _ in range(4)]
                    fro = ((outs[0].float() - ref).norm() / ref.norm()).item()
                    same = all(torch.equal(o, outs[0]) for o in outs)
                    eq_ra = torch.equal(outs[0], g.gemm_w4_ra(x, q, config=cfg)) if cfg.get("SPLIT", 1) == 1 else "-"
                    us = graph_ms(lambda x=x, q=q, cfg=cfg: g.gemm_w4_rf(x, q, config=cfg), repeats=10, calls=5) * 1e3
                    label = ",".join(f"{a}={b}" for a, b in cfg.items())
                    parts.append(f"[{label}] {us:7.1f} us fro {fro:.1e} repeat {int(same)} =ra {eq_ra}")
                print(f"{fmt:8s} {n}x{k} M={m:5d}: " + " | ".join(parts), flush=True)


if __name__ == "__main__":
    main()
