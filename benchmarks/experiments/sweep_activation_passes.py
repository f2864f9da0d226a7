"""Tiles of the two passes over a W4A4 activation before the dequant route's GEMM: the finite absmax and the
one-pass nvfp4 quantize-and-decode (``blockscaled.quantize_nvfp4_decoded``).

    PYTHONPATH=src python benchmarks/experiments/sweep_activation_passes.py [--shapes 8190x5120,32760x13824]

Every variant's output is checked bit for bit against the shipped configuration's before it is timed.
Times are ``do_bench`` medians (L2 flushed); GB/s counts bytes read + written. JSON to
``$OUT/sweep_activation_passes.json``.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

from lowbit.kernels import blockscaled

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # this folder (_common)
from _common import bench, header, write_json  # noqa: E402


def _absmax_variant(x: torch.Tensor, chunk: int, chunks: int, warps: int):
    from lowbit.kernels import _blockscaled as k
    from lowbit.kernels import cdiv

    flat = x.view(-1)
    out = torch.zeros(1, dtype=torch.int32, device=x.device)
    n = flat.numel()

    def run():
        out.zero_()
        k.finite_absmax_kernel[(cdiv(n, chunk * chunks),)](flat, out, n, CHUNK=chunk, CHUNKS=chunks, num_warps=warps)
        return out

    return run


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="8190x5120,32760x5120,32760x13824")
    ap.add_argument("--rep", type=int, default=100)
    args = ap.parse_args()
    rows = []
    for spec in args.shapes.split(","):
        m, kdim = (int(v) for v in spec.split("x"))
        x = torch.randn(m, kdim, device="cuda", dtype=torch.bfloat16) * 3
        nbytes = x.numel() * 2
        want = blockscaled._finite_absmax_bits(x).clone()
        for chunk in (1024, 2048, 4096):
            for chunks in (4, 8, 16):
                for warps in (4, 8):
                    run = _absmax_variant(x, chunk, chunks, warps)
                    ok = torch.equal(run(), want)
                    ms = bench(run, args.rep) if ok else float("nan")
                    rows.append({"pass": "absmax", "shape": spec, "chunk": chunk, "chunks": chunks, "warps": warps,
                                 "ok": ok, "us": ms * 1e3, "gbps": nbytes / ms / 1e6})
                    print(f"absmax {spec} chunk {chunk} x{chunks} w{warps}: {ms * 1e3:.1f} us "
                          f"{nbytes / ms / 1e6:.0f} GB/s {'ok' if ok else 'MISMATCH'}", flush=True)
        shipped = dict(blockscaled.TILE)
        want_v, want_s = blockscaled.quantize_nvfp4_decoded(x)
        want_v = want_v.clone()
        try:
            for elems in (2048, 4096, 8192, 16384):
                for warps in (4, 8):
                    blockscaled.TILE.update(elems=elems, warps=warps)
                    blockscaled._QUANTIZE_LAUNCHES.clear()
                    v, _ = blockscaled.quantize_nvfp4_decoded(x)
                    ok = torch.equal(v.view(torch.int16), want_v.view(torch.int16))
                    ms = bench(lambda: blockscaled.quantize_nvfp4_decoded(x, want_s), args.rep) if ok else float("nan")
                    rows.append({"pass": "quantize_decoded", "shape": spec, "elems": elems, "warps": warps, "ok": ok,
                                 "us": ms * 1e3, "gbps": 2 * nbytes / ms / 1e6})
                    print(f"decoded {spec} elems {elems} w{warps}: {ms * 1e3:.1f} us {2 * nbytes / ms / 1e6:.0f} GB/s "
                          f"{'ok' if ok else 'MISMATCH'}", flush=True)
        finally:
            blockscaled.TILE.update(shipped)
            blockscaled._QUANTIZE_LAUNCHES.clear()
    out = os.environ.get("OUT")
    if out:
        write_json(os.path.join(out, "sweep_activation_passes.json"), {"header": header(), "rows": rows})


if __name__ == "__main__":
    main()
