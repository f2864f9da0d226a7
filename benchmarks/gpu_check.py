"""One device call: GPU tests, then kernel bandwidth vs the measured copy bandwidth. Results under $OUT."""

import datetime
import json
import os
import subprocess
import sys

import torch
import triton
from triton.testing import do_bench

import lowbit

out_dir = os.environ.get("OUT", "benchmarks/results/tmp")
os.makedirs(out_dir, exist_ok=True)
what = sys.argv[1:] or ["tests", "bench"]

if "tests" in what:
    rc = subprocess.call([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "gpu", "--maxfail=8",
                          "tests/kernels", f"--junitxml={out_dir}/gpu_tests.xml"])
    print("gpu tests exit code", rc, flush=True)

if "bench" in what:
    def sha():
        try:
            return subprocess.check_output(["git", "rev-parse", "--short", "HEAD"], text=True).strip()
        except Exception:
            return os.environ.get("GIT_SHA", "unknown")

    header = {
        "date": datetime.date.today().isoformat(), "gpu": torch.cuda.get_device_name(),
        "driver": subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                 capture_output=True, text=True).stdout.strip(),
        "cuda": torch.version.cuda,
        "torch": torch.__version__, "triton": triton.__version__, "lowbit": lowbit.__version__,
        "git_sha": os.environ.get("GIT_SHA") or sha(),
    }
    big = torch.empty(1 << 29, dtype=torch.bfloat16, device="cuda").normal_()
    dst = torch.empty_like(big)
    t = do_bench(lambda: dst.copy_(big), return_mode="median", warmup=50, rep=300)
    copy_gbs = 2 * big.numel() * 2 / t / 1e6
    del big, dst
    rows = []
    for n in (4096, 8192, 16384):
        x = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
        for fmt, opts in [("nvfp4", {}), ("nvfp4", {"global_scale": torch.tensor(1.0)}), ("mxfp4", {}),
                          ("mxfp6_e3m2", {}), ("mxfp8_e4m3", {}), ("fp4_b32", {}), ("nvfp4", {"scale_layout": "swizzled"})]:
            q = lowbit.quantize(x, fmt, backend="triton", **opts)
            in_b = x.numel() * 2
            q_b = q.data.numel() * q.data.element_size() + q.scale.numel() * q.scale.element_size()
            tq = do_bench(lambda: lowbit.quantize(x, fmt, backend="triton", **opts), return_mode="median")
            td = do_bench(lambda: lowbit.dequantize(q, torch.bfloat16, backend="triton"), return_mode="median")
            label = fmt + ("" if not opts else "(" + ",".join(k for k in opts) + ")")
            for op, tt in (("quantize", tq), ("dequantize", td)):
                gbs = (in_b + q_b) / tt / 1e6
                rows.append({"op": op, "fmt": label, "shape": [n, n], "ms": tt, "GB/s": gbs,
                             "pct_copy": 100 * gbs / copy_gbs})
        del x
    res = {"header": header, "copy_GBps": copy_gbs, "rows": rows}
    name = f"{out_dir}/quant_kernels_{header['date']}.json"
    with open(name, "w") as f:
        json.dump(res, f, indent=1)
    print(json.dumps(header))
    print(f"copy bandwidth {copy_gbs:.0f} GB/s")
    print(f"{'op':10} {'fmt':32} {'shape':12} {'us':>9} {'GB/s':>7} {'%copy':>6}")
    for r in rows:
        print(f"{r['op']:10} {r['fmt']:32} {str(r['shape'][0]):12} {r['ms']*1e3:9.1f} {r['GB/s']:7.0f} {r['pct_copy']:6.1f}")
