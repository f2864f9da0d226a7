"""The NF4 (and bnb_fp4, the same kernel with bitsandbytes' FP4 table) and INT4-AWQ kernels under ``TRITON_INTERPRET=1`` on tiny CPU tensors, bit-exact against the reference.

The interpreter runs the kernels' indexing, masking, tail programs, nibble orders, group/tile mapping,
double-quant decode and NaN bookkeeping with numpy on this x86 host. It cannot run inline asm or
reproduce GPU conversions, so the launchers pass ``ON_GPU=False`` there: table gathers become
``tl.load`` and bf16 rounding is done on the bits (its fp32 -> bf16 cast truncates). The GPU paths
are covered by ``test_nf4_int4_gpu.py`` and the sm_90 compile test.
"""

import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("triton")

SCRIPT = textwrap.dedent(
    """
    import torch
    from dataclasses import replace
    from lowbit.formats import bnb_fp4 as ref_fp4, int4_awq as ref_awq, nf4 as ref_nf4
    from lowbit.formats.qtensor import QTensor
    from lowbit.kernels import int4_awq as k_awq, nf4 as k_nf4
    from lowbit.testing import assert_bitexact

    OUTS = (torch.float32, torch.bfloat16, torch.float16)
    g = torch.Generator().manual_seed(0)

    def nf4(q, what):
        for dt in OUTS:
            assert_bitexact(k_nf4.dequantize_nf4(q, dt), ref_nf4.dequantize_nf4(q, dt), f"nf4 {what} {dt}")

    def fp4(q, what):
        for dt in OUTS:
            assert_bitexact(k_nf4.dequantize_bnb_fp4(q, dt), ref_fp4.dequantize_bnb_fp4(q, dt), f"bnb_fp4 {what} {dt}")

    # tiles of a few hundred elements: several programs, full and tail ones
    for n, bs in ((1, 32), (2, 64), (255, 32), (256, 64), (1000, 64), (1537, 128), (3000, 1024), (700, 4096),
                  (3 * 256 * 32 + 5, 32)):
        k_nf4.TILE.update(elems=256 if n < 5000 else 2048)
        x = torch.randn(n, generator=g) * 4
        if n >= 1000:
            x[:128] = 0.0
            x[200] = float("nan")
            x[333] = float("inf")
            x[400] = -float("inf")
            x[500:532] = 1e-40
        for dq in (False, True):
            nf4(ref_nf4.quantize_nf4(x, bs, dq), f"n={n} bs={bs} dq={dq}")
            fp4(ref_fp4.quantize_bnb_fp4(x, bs, dq), f"n={n} bs={bs} dq={dq}")

    # every byte value; NaN payloads, +-inf, -0, subnormal and negative absmax
    data = torch.arange(256, dtype=torch.uint8).repeat(4)
    scale = torch.linspace(-2, 2, 32)
    scale.view(torch.int32)[:8] = torch.tensor([0x7F812345, -0x005FFFFF, 0x7F800000, -0x00800000,
                                                -0x80000000, 1, 0x7F7FFFFF, 0x7FFFFFFF], dtype=torch.int32)
    nf4(QTensor(data=data, scale=scale, fmt="nf4", shape=torch.Size([2048]),
                params={"blocksize": 64, "double_quant": False}), "every byte")
    fp4(QTensor(data=data, scale=scale, fmt="bnb_fp4", shape=torch.Size([2048]),
                params={"blocksize": 64, "double_quant": False}), "every byte")
    # the table reaches the kernel: an fp4 QTensor never decodes with NF4's levels
    assert not torch.equal(k_nf4.dequantize_bnb_fp4(QTensor(data=data, scale=scale.abs(), fmt="bnb_fp4",
        shape=torch.Size([2048]), params={"blocksize": 64, "double_quant": False})), k_nf4.dequantize_nf4(QTensor(
        data=data, scale=scale.abs(), fmt="nf4", shape=torch.Size([2048]), params={"blocksize": 64,
        "double_quant": False})))

    # double quantization: every dynamic-map code, NaN / inf nested absmax and offset
    k_nf4.TILE.update(elems=1024)
    q = ref_nf4.quantize_nf4(torch.randn(32 * 300 + 3, generator=g), 32, True)
    codes = q.scale.clone()
    codes[:256] = torch.arange(256, dtype=torch.uint8)
    for nested in ((1.0, 0.5), (float("inf"), 0.5), (float("nan"), 2.0)):
        for off in (0.01, float("inf"), -float("inf"), float("nan")):
            nf4(replace(q, scale=codes, nested_scale=torch.tensor(nested), nested_offset=torch.tensor(off)),
                f"dq nested={nested} off={off}")
            fp4(replace(q, fmt="bnb_fp4", scale=codes, nested_scale=torch.tensor(nested),
                        nested_offset=torch.tensor(off)), f"dq nested={nested} off={off}")

    # NaN payloads of the reference's fp16 multiply are the vectorized ATen kernels' (AVX2/AVX-512: payload kept);
    # torch's scalar fallback (no AVX2, ATEN_CPU_CAPABILITY=default, aarch64) writes 0x7E00: positions only there
    vector_nans = torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")

    def awq(q, what):
        for dt in OUTS:
            assert_bitexact(k_awq.dequantize_int4_awq(q, dt), ref_awq.dequantize_int4_awq(q, dt), f"awq {what} {dt}",
                            any_nan=not vector_nans)

    k_awq.TILE.update(elems=512, cols=32)
    for out_f, in_f, gs in ((64, 128, 32), (48, 96, 32), (24, 96, 96), (16, 12, 3), (136, 64, 64), (8, 8, 8),
                            (40, 48, 6), (8, 16, 1), (16, 128, 128)):
        w = torch.randn(out_f, in_f, generator=g)
        awq(ref_awq.quantize_int4_awq(w, gs), f"{out_f}x{in_f} g{gs}")
        ng = in_f // gs
        words = lambda r, c: torch.randint(-(1 << 31), 1 << 31, (r, c), generator=g, dtype=torch.int64).to(torch.int32)
        scales = (torch.randn(ng, out_f, generator=g) * 100).to(torch.float16)
        sv = scales.view(torch.int16).view(-1)
        specials = [0x7C00, -0x0400, 0x7D23, -1, 0x7E01, 0x7BFF, 1, -0x8000, 0x03FF]
        for j, t in enumerate(torch.randperm(sv.numel(), generator=g)[: len(specials)].tolist()):
            sv[t] = specials[j]
        qr = QTensor(data=words(in_f, out_f // 8), scale=scales, fmt="int4_awq", shape=torch.Size((out_f, in_f)),
                     zeros=words(ng, out_f // 8), params={"group_size": gs})
        awq(qr, f"random words {out_f}x{in_f} g{gs}")
    print("interpreter checks passed")
    """
)


def test_kernels_bit_exact_under_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONWARNINGS="ignore")
    proc = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=120,
                          check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    assert "interpreter checks passed" in proc.stdout
