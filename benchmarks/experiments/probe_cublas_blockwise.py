"""Does cuBLASLt's block-scaled FP8 GEMM (torch.nn.functional.scaled_mm, BlockWise1x128 x BlockWise128x128, SM90,
CUDA >= 12.9) run DeepSeek-V3 fp8_block operands, how close is it to the reference, and how fast against
torch._scaled_mm per-tensor FP8 and lowbit's own kernels? JSON to $OUT.

    PYTHONPATH=src python benchmarks/experiments/probe_cublas_blockwise.py
"""

from __future__ import annotations

import json
import os
import platform
import time

import torch
import torch.nn.functional as F
import triton
from triton.testing import do_bench

import lowbit
from lowbit.ops import scaled_mm_reference

SHAPES = [(7168, 2048), (24576, 1536), (2112, 7168), (7168, 16384), (4096, 7168), (8192, 8192)]
MS = [4096, 1024, 256, 64, 16, 1, 4095, 8192]


def cublas_blockwise(a, b, out_dtype=torch.bfloat16, bias=None):
    k = a.shape[1]
    kb = triton.cdiv(k, 128)
    sa = a.scale.t().contiguous().t()  # [M, K/128], M-major (stride (1, M))
    sb = b.scale
    if kb % 4:
        sb = F.pad(sb, (0, 4 - kb % 4))
    return F.scaled_mm(a.data, b.data.t(), sa, F.ScalingType.BlockWise1x128, sb.t(), F.ScalingType.BlockWise128x128,
                       bias=bias, output_dtype=out_dtype)


def main() -> None:
    out_dir = os.environ.get("OUT", "benchmarks/results/tmp")
    os.makedirs(out_dir, exist_ok=True)
    meta = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "cuda": torch.version.cuda,
            "cublaslt": getattr(torch._C, "_cuda_getCompiledVersion", lambda: None)(), "triton": triton.__version__,
            "git": os.environ.get("GIT_SHA", "unknown"), "host": platform.node(), "date": time.strftime("%Y-%m-%d")}
    print(meta, flush=True)
    rows = []
    path = os.path.join(out_dir, "probe_cublas_blockwise.json")
    torch.manual_seed(0)
    for n, k in SHAPES:
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
        wq = lowbit.quantize(w, "fp8_block", block=(128, 128))
        one = torch.ones((), device="cuda")
        for m in MS:
            if m == 8192 and (n, k) != (8192, 8192):
                continue
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            row = {"M": m, "N": n, "K": k}
            for fmt in (None, "ue8m0"):
                aq = lowbit.quantize(x, "fp8_block", scale_fmt=fmt) if fmt else lowbit.quantize(x, "fp8_block")
                ref = scaled_mm_reference(aq, wq, None, None, torch.float32)
                tag = "" if fmt is None else "_ue8m0"
                try:
                    y = cublas_blockwise(aq, wq)
                    row["cublas_rel" + tag] = ((y.float() - ref).norm() / ref.norm()).item()
                    if fmt is None:
                        row["cublas_ms"] = do_bench(lambda: cublas_blockwise(aq, wq), rep=40, return_mode="median")
                except Exception as e:  # noqa: BLE001 - the probe records what cuBLAS refuses
                    row["cublas_error" + tag] = f"{type(e).__name__}: {str(e)[:300]}"
                if fmt is None:
                    y2 = lowbit.scaled_mm(aq, wq)
                    row["lowbit_rel"] = ((y2.float() - ref).norm() / ref.norm()).item()
                    row["lowbit_ms"] = do_bench(lambda: lowbit.scaled_mm(aq, wq), rep=40, return_mode="median")
            xa = x.to(torch.float8_e4m3fn)
            wt = w.to(torch.float8_e4m3fn).t()
            row["scaled_mm_fp8_ms"] = do_bench(lambda: torch._scaled_mm(xa, wt, one, one, out_dtype=torch.bfloat16),
                                               rep=40, return_mode="median")
            wb = w.t()
            row["cublas_bf16_ms"] = do_bench(lambda: x @ wb, rep=40, return_mode="median")
            if "cublas_ms" in row:
                row["cublas_vs_scaled_mm"] = row["scaled_mm_fp8_ms"] / row["cublas_ms"]
            row["lowbit_vs_scaled_mm"] = row["scaled_mm_fp8_ms"] / row["lowbit_ms"]
            print({k_: (round(v, 4) if isinstance(v, float) else v) for k_, v in row.items()}, flush=True)
            rows.append(row)
            with open(path, "w") as f:
                json.dump({**meta, "rows": rows}, f, indent=1)


if __name__ == "__main__" and not os.environ.get("EDGES"):
    main()


def edges() -> None:
    """Which shapes, scale paddings, bias and output dtypes cuBLAS accepts, and the error against the reference."""
    torch.manual_seed(1)
    res = []
    for m, n, k in [(4096, 1024, 1408), (256, 1024, 1408), (4, 256, 256), (8, 4096, 1536), (256, 100, 256),
                    (256, 2112, 1000), (128, 7168, 2048)]:
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        wq = lowbit.quantize(w, "fp8_block", block=(128, 128))
        aq = lowbit.quantize(x, "fp8_block")
        kb = triton.cdiv(k, 128)
        sa = aq.scale.t().contiguous().t()
        sbp = F.pad(wq.scale, (0, -kb % 4))
        for bias_dtype in (None, torch.bfloat16, torch.float16, torch.float32):
            for out_dtype in (torch.bfloat16, torch.float16, torch.float32):
                bias = None if bias_dtype is None else torch.randn(n, device="cuda", dtype=bias_dtype)
                ref = scaled_mm_reference(aq, wq, None, bias, torch.float32)
                for variant, sb in (("sliced", sbp[:, :kb].t()), ("padded", sbp.t())):
                    tag = {"M": m, "N": n, "K": k, "bias": str(bias_dtype), "out": str(out_dtype), "sb": variant}
                    try:
                        y = F.scaled_mm(aq.data, wq.data.t(), sa, F.ScalingType.BlockWise1x128, sb,
                                        F.ScalingType.BlockWise128x128, bias=bias, output_dtype=out_dtype)
                        tag["rel"] = ((y.float() - ref).norm() / ref.norm()).item()
                        tag["out_dtype_got"] = str(y.dtype)
                    except Exception as e:  # noqa: BLE001
                        tag["error"] = f"{type(e).__name__}: {str(e)[:160]}"
                    print(tag, flush=True)
                    res.append(tag)
    out_dir = os.environ.get("OUT", "benchmarks/results/tmp")
    with open(os.path.join(out_dir, "probe_cublas_blockwise_edges.json"), "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__" and os.environ.get("EDGES"):
    edges()
