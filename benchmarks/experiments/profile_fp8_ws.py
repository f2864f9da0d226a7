"""One fp8_block x fp8_block GEMM of a shape through a chosen kernel, for ncu (the warp-specialized Gluon kernel,
the one-partition TMA kernel or torch._scaled_mm per-tensor FP8), after one warm-up call.

    ncu --clock-control none -k regex:'fp8_block|gemm|xmma' --launch-skip 1 --launch-count 1 \\
        python benchmarks/experiments/profile_fp8_ws.py ws 4096 7168 16384
"""

import sys

import torch

import lowbit
from lowbit.kernels import scaled_mm as ks

WS = {"BM": 128, "BN": 128, "BK": 128, "GROUP_M": 8, "num_warps": 4, "num_stages": 4, "tma": True, "ws": True}


def main() -> None:
    which = sys.argv[1]
    m, n, k = (int(v) for v in sys.argv[2:5])
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.05
    a = lowbit.quantize(x, "fp8_block")
    b = lowbit.quantize(w, "fp8_block", block=(128, 128))
    x8, w8 = x.to(torch.float8_e4m3fn), w.to(torch.float8_e4m3fn)
    one = torch.ones((), device="cuda")
    torch.cuda.synchronize()
    for _ in range(2):
        if which == "ws":
            ks.scaled_mm(a, b, None, None, torch.bfloat16, config=WS)
        elif which == "tma":
            ks.scaled_mm(a, b, None, None, torch.bfloat16, config=ks.ONE_PARTITION_CONFIG)
        else:
            torch._scaled_mm(x8, w8.T, scale_a=one, scale_b=one, out_dtype=torch.bfloat16)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
