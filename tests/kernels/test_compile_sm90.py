"""Every shipped kernel code path compiles for Hopper (sm_90) on this CPU-only machine, with the PTX we expect."""

import importlib
import importlib.util
import itertools
import re

import pytest

triton = pytest.importorskip("triton")
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from lowbit.kernels import KERNEL_MODULES

HOPPER = GPUTarget("cuda", 90, 32)


def _variants():
    for name in KERNEL_MODULES:
        if importlib.util.find_spec(f"lowbit.kernels.{name}") is None:
            continue
        module = importlib.import_module(f"lowbit.kernels.{name}")
        for i, (fn, sig, consts) in enumerate(module.compile_variants()):
            yield pytest.param(fn, sig, consts, id=f"{name}-{fn.__name__}-{i}")


VARIANTS = list(_variants())


def test_every_kernel_module_ships_variants():
    names = {p.id.split("-")[0] for p in VARIANTS}
    present = {n for n in KERNEL_MODULES if importlib.util.find_spec(f"lowbit.kernels.{n}") is not None}
    assert names == present


def compile_for_hopper(fn, signature, constexprs, ints_divisible=False):
    """Compile as a launch with 16-byte-aligned tensors would (the JIT marks such pointers divisible by 16);
    ``ints_divisible``: and with every i32 argument a multiple of 16 (as the JIT marks such values: the usual
    case of M, N, K and strides of model layers, whose code ptxas schedules differently)."""
    sig = dict(signature)
    sig.update({name: "constexpr" for name in constexprs})
    names = list(sig)
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n, t in signature.items()
             if t.startswith("*") or (ints_divisible and t == "i32")}
    if fn.is_gluon():
        from triton.experimental.gluon._runtime import GluonASTSource

        from lowbit.kernels import _fp8_block_ws, _gemm_w4_ws

        if fn.__name__ == "gemm_w4_ws_kernel":
            options = _gemm_w4_ws.launch_options()
        elif fn.__name__ in ("gemm_w4_ra_kernel", "gemm_w4_rf_kernel"):
            options = {"num_warps": 4 * constexprs["WG"]}
        else:
            options = _fp8_block_ws.launch_options(constexprs["CONSUMERS"])
        return triton.compile(GluonASTSource(fn, sig, constexprs, attrs), target=HOPPER, options=options)
    return triton.compile(ASTSource(fn=fn, signature=sig, constexprs=constexprs, attrs=attrs), target=HOPPER)


@pytest.mark.parametrize("fn, signature, constexprs", VARIANTS)
def test_variant_compiles_for_sm90(fn, signature, constexprs):
    ck = compile_for_hopper(fn, signature, constexprs)
    ptx = ck.asm["ptx"]
    assert ".target sm_90" in ptx
    if "wgmma.mma_async" in ptx:
        # the epilogue reads the accumulator only after the final wait (see accumulator_reads_before_final_wait)
        assert not accumulator_reads_before_final_wait(_sass(ck.asm["cubin"]))
    if fn.__name__ == "quantize_blockscaled_kernel":
        # memory-bound: the input must be read with 16-byte vector loads
        assert "ld.global.v4.b32" in ptx
    # bits must match the reference: no approximate fp32 division or reciprocal anywhere
    assert "div.full.f32" not in ptx and "div.approx" not in ptx and "rcp.approx" not in ptx


def _gemv_variants():
    if importlib.util.find_spec("lowbit.kernels.gemv_w4") is None:
        return []
    from lowbit.kernels import gemv_w4

    return [
        pytest.param(fn, sig, consts, id=f"{fn.__name__}-{i}")
        for i, (fn, sig, consts) in enumerate(gemv_w4.compile_variants())
        if consts.get("FMT") in (0, 4) and consts.get("SPLIT", 1) == 1
    ][:4]


@pytest.mark.parametrize("fn, signature, constexprs", _gemv_variants())
def test_gemv_streams_weights_with_16_byte_copies(fn, signature, constexprs):
    """Issue 4 asks for 16-byte weight loads in the decode GEMV. A real launch with K % 128 == 0 and N % 16 == 0
    marks those integer arguments divisible by 16 as well as the pointers; compiled that way, every weight
    cp.async must move 16 bytes (4-byte copies here would mean the layout lost its alignment proof)."""
    sig = dict(signature)
    sig.update({name: "constexpr" for name in constexprs})
    names = list(sig)
    divisible = [n for n, t in signature.items() if t.startswith("*") or n in ("N", "KW", "SK")]
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in divisible}
    ptx = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=constexprs, attrs=attrs), target=HOPPER).asm["ptx"]

    sizes = set(re.findall(r"cp\.async\.c[ag]\.shared\.global(?:\.L2::\w+)? \[[^\]]*\], \[[^\]]*\], (\w+)", ptx))
    assert sizes == {"0x10"}, f"cp.async sizes {sizes}"


def _mma_variants():
    """The first tensor-core GEMV variant of each (format, x dtype)."""
    if importlib.util.find_spec("lowbit.kernels.gemv_w4") is None:
        return []
    from lowbit.kernels import gemv_w4

    seen = {}
    for fn, sig, consts in gemv_w4.compile_variants():
        if fn.__name__ == "gemv_mma_kernel":
            seen.setdefault((consts["FMT"], consts.get("XF16", False)), (fn, sig, consts))
    return [pytest.param(*v, id=f"fmt{f}-{'f16' if h else 'bf16'}") for (f, h), v in seen.items()]


def test_gemv_mma_covers_fp4_int4_and_nf4():
    assert {p.id for p in _mma_variants()} >= {"fmt0-bf16", "fmt1-bf16", "fmt2-bf16", "fmt2-f16", "fmt3-bf16",
                                               "fmt3-f16"}


@pytest.mark.parametrize("fn, signature, constexprs", _mma_variants())
def test_gemv_mma_uses_tensor_cores_and_16_byte_copies(fn, signature, constexprs):
    """The tensor-core GEMV: mma.sync m16n8k16 per 256 weights, 16-byte weight loads into registers with no
    shared memory or barrier in the K loop, and the layout its inline asm relies on
    (each lane holds 4 consecutive words of dim 2: sizePerThread 4, 32 lanes)."""
    ty = "f16" if constexprs.get("XF16") else "bf16"
    sig = dict(signature)
    sig.update({name: "constexpr" for name in constexprs})
    names = list(sig)
    divisible = [n for n, t in signature.items() if t.startswith("*") or n in ("N", "K", "KQ")]
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in divisible}
    ck = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=constexprs, attrs=attrs), target=HOPPER)
    ptx = ck.asm["ptx"]
    assert ptx.count(f"mma.sync.aligned.m16n8k16.row.col.f32.{ty}.{ty}.f32") >= 4
    # the words stream straight into registers with 16-byte loads (no shared-memory staging, no barrier)
    assert "ld.global.v4.b32" in ptx and "cp.async" not in ptx
    loop = ptx[ptx.index("Inner Loop Header"):]
    loop = loop[:re.search(r"\bbra(\.uni)?\s", loop).start()]
    assert loop.count("mma.sync") >= 4 and "bar.sync" not in loop and "ld.shared" not in loop
    layouts = [line for line in ck.asm["ttgir"].splitlines() if line.startswith("#blocked")]
    assert any("sizePerThread = [1, 1, 4], threadsPerWarp = [1, 1, 32]" in line for line in layouts), layouts


def test_fp8_block_tma_kernel_uses_tma_and_wgmma():
    if importlib.util.find_spec("lowbit.kernels.scaled_mm") is None:
        pytest.skip("no scaled_mm kernels")
    from lowbit.kernels import scaled_mm

    variants = [v for v in scaled_mm.compile_variants() if v[0].__name__ == "fp8_block_mm_tma_kernel"]
    assert variants, "the shipped fp8_block configs must include the TMA kernel"
    for fn, sig, consts in variants:
        ptx = compile_for_hopper(fn, sig, consts).asm["ptx"]
        assert "cp.async.bulk.tensor" in ptx, consts
        assert "wgmma.mma_async" in ptx and ".e4m3.e4m3" in ptx, consts


def test_fp8_block_warp_specialized_kernel_ptx():
    """The Gluon kernel: TMA loads into the ring, fp8 wgmma waited per K tile (a wait_group 1 pipeline made
    ptxas serialize every wgmma), register hand-over between the partitions, TMA stores of the output."""
    if importlib.util.find_spec("lowbit.kernels.scaled_mm") is None:
        pytest.skip("no scaled_mm kernels")
    from lowbit.kernels import scaled_mm

    variants = [v for v in scaled_mm.compile_variants() if v[0].__name__ == "fp8_block_mm_ws_kernel"]
    assert len(variants) == 3
    for fn, sig, consts in variants:
        ptx = compile_for_hopper(fn, sig, consts).asm["ptx"]
        assert "cp.async.bulk.tensor.2d.shared::cluster.global" in ptx, consts
        assert "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3" in ptx, consts
        assert "wgmma.wait_group.sync.aligned 0" in ptx and "wgmma.wait_group.sync.aligned 1" not in ptx, consts
        assert "setmaxnreg.dec.sync.aligned.u32" in ptx and "setmaxnreg.inc.sync.aligned.u32" in ptx, consts
        assert ("cp.async.bulk.tensor.2d.global.shared" in ptx) == consts["TMA_STORE"], consts


def test_nvfp4_quantize_ships_both_multiplier_orders():
    """The nvfp4 quantize kernel has a variant per convention (vLLM ``1/(sf * (1/S))``, LightX2V ``S * (1/sf)``),
    with a given and with the default global scale; both compile to exact divisions, the vLLM order with one
    more (its ``1/S``), so neither variant silently computes the other's multiplier."""
    from lowbit.kernels import _blockscaled as k
    from lowbit.kernels import blockscaled

    divs = {}
    for fn, sig, consts in blockscaled.quantize_variants():
        if consts["SCALE_KIND"] != k.SCALE_E4M3 or consts["SWIZZLED"]:
            continue
        key = (consts["E4M3_ORDER"], consts["HAS_GSCALE"], consts.get("GSCALE_FROM_AMAX", False))
        divs[key] = compile_for_hopper(fn, sig, consts).asm["ptx"].count("div.rn.f32")
    for gs in ((True, False), (False, True)):
        vllm, lightx2v = divs[(k.ORDER_VLLM, *gs)], divs[(k.ORDER_LIGHTX2V, *gs)]
        assert lightx2v > 0 and vllm == lightx2v + 1, (gs, vllm, lightx2v)


def test_bnb_fp4_dequantize_runs_a_compiled_nf4_variant():
    """bnb_fp4 ships no kernel of its own: its launcher is the nf4 module's, whose kernel takes the 16-entry table
    as a pointer argument, so the nf4 variants above (same signatures and constexprs) are its variants."""
    from lowbit.formats.registry import REGISTRY
    from lowbit.kernels import nf4

    kernel = REGISTRY["bnb_fp4"].dequantize_kernel
    assert (kernel.module, kernel.launcher) == ("nf4", "dequantize_bnb_fp4")
    assert any(fn is nf4.k.dequantize_nf4_kernel and "lut_ptr" in sig for fn, sig, _ in nf4.compile_variants())


def test_w4a16_warp_specialized_kernel_ptx():
    """The Gluon W4A16 kernel: TMA loads of x and the packed weight, bf16/fp16 wgmma from shared memory with one
    in flight, the decoded tile stored to shared memory and fenced for the tensor cores, register hand-over."""
    from lowbit.kernels import gemm_w4

    variants = [v for v in gemm_w4.compile_variants() if v[0].__name__ == "gemm_w4_ws_kernel"]
    assert len(variants) == 6
    for fn, sig, consts in variants:
        ptx = compile_for_hopper(fn, sig, consts).asm["ptx"]
        dt = "bf16" if "bf16" in sig["out_ptr"] else "f16"
        assert "cp.async.bulk.tensor.2d.shared::cluster.global" in ptx, consts
        assert f"wgmma.mma_async.sync.aligned.m64n128k16.f32.{dt}.{dt}" in ptx, consts
        assert "wgmma.wait_group.sync.aligned 1" in ptx, consts
        assert "fence.proxy.async.shared::cta" in ptx, consts
        assert "st.shared.v4.b32" in ptx, consts
        assert "setmaxnreg.dec.sync.aligned.u32" in ptx and "setmaxnreg.inc.sync.aligned.u32" in ptx, consts


def test_dequant_epilogue_rounds_each_step_and_streams_16_bytes():
    """The dequant route's epilogue as it is launched (fused multiply-adds off): every multiply and the bias add
    are separately rounded fp32 operations (the bits of the torch ops it replaces), and with the sizes a launch
    marks divisible by 16 the fp32 partial product is read with 16-byte loads."""
    if importlib.util.find_spec("lowbit.kernels.scaled_mm") is None:
        pytest.skip("no scaled_mm kernels")
    from lowbit.kernels import _scaled_mm, scaled_mm

    variants = [v for v in scaled_mm.compile_variants() if v[0] is _scaled_mm.dequant_epilogue_kernel]
    assert len(variants) == 4  # three epilogues of the dequant route, the DeepGEMM routes' bias pass
    for fn, signature, constexprs in variants:
        sig = dict(signature)
        sig.update({name: "constexpr" for name in constexprs})
        names = list(sig)
        divisible = [n for n, t in signature.items() if t.startswith("*") or n in ("C", "stride_out")]
        attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in divisible}
        ptx = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=constexprs, attrs=attrs), target=HOPPER,
                             options={"enable_fp_fusion": False}).asm["ptx"]
        scaled = constexprs["HAS_A"] or constexprs["HAS_B"] or constexprs["HAS_ALPHA"]
        assert "fma.rn.f32" not in ptx and ("mul.rn.f32" in ptx) == scaled, constexprs
        if constexprs["HAS_BIAS"] and signature["acc_ptr"] == "*bf16":
            # bf16 + bf16 in fp32 rounded to bf16 is the correctly rounded bf16 sum (fp32 holds 2 x 8 + 2 bits):
            # LLVM shortens it to the bf16 add
            assert "add.rn.bf16" in ptx or "add.rn.f32" in ptx
        elif constexprs["HAS_BIAS"]:
            assert "add.rn.f32" in ptx
        assert "ld.global.v4.b32" in ptx


def _sass(cubin: bytes) -> list[tuple[int, str]]:
    """(address, instruction) of a cubin's SASS, through the cuobjdump that ships with Triton."""
    import os
    import subprocess
    import tempfile

    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    if not os.path.exists(tool):
        pytest.skip("no cuobjdump in this Triton")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run([tool, "-sass", f.name], capture_output=True, text=True, check=True).stdout
    out = []
    for line in text.splitlines():
        m = re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;", line)
        if m:
            out.append((int(m.group(1), 16), m.group(2)))
    return out


_NO_DEST = ("HGMMA", "ST", "BRA", "BAR", "SYNCS", "WARPGROUP", "RED", "ATOM", "EXIT", "UTMA", "MEMBAR", "FENCE",
            "ISETP", "FSETP", "UISETP", "RET", "CALL", "NOP", "DEPBAR", "ELECT", "UBLKCP", "ULDC", "UMOV", "UIADD3",
            "USHF", "ULOP3", "UIMAD", "USEL", "ULEA", "UPRMT", "R2UR", "PLOP3", "VOTEU", "PRMT.U")


def _written(instr: str) -> set[int]:
    """The general registers an instruction writes (its first operand; vector and wide forms write several)."""
    t = re.sub(r"^@!?U?P\w+\s+", "", instr)
    op, _, rest = t.partition(" ")
    if op.startswith(_NO_DEST) or not rest:
        return set()
    m = re.match(r"R(\d+)\b", rest.split(",")[0].strip())
    if not m:
        return set()
    n = 4 if (".128" in op or "M88.4" in op) else 2 if (".64" in op or ".WIDE" in op or "M88.2" in op) else 1
    return set(range(int(m.group(1)), int(m.group(1)) + n))


def register_operand_hazards(sass: list[tuple[int, str]]) -> tuple[int, list[str]]:
    """(number of register-operand wgmma groups checked, instructions that write a group's A registers while it
    may still run). A group (HGMMAs ending at the one that commits, gsb0) runs until the second
    ``WARPGROUP.DEPBAR.LE gsb0, 0x1`` or the first ``WARPGROUP.DEPBAR.LE gsb0, 0x0`` after it, on every path:
    a backward branch (the K loop's) taken and not taken, forward branches followed through."""
    hg = [i for i, (_, t) in enumerate(sass) if t.startswith("HGMMA")]
    groups, cur = [], []
    for i in hg:
        m = re.match(r"HGMMA\.\S+ R\d+, R(\d+), gdesc", sass[i][1])
        cur.append((i, int(m.group(1)) if m else None))
        if "gsb0" in sass[i][1]:
            groups.append(cur)
            cur = []
    index = {a: i for i, (a, _) in enumerate(sass)}

    def back_target(i):
        m = re.match(r"(@!?P\d+ )?BRA 0x([0-9a-f]+)", sass[i][1])
        if m and int(m.group(2), 16) < sass[i][0]:
            return index[int(m.group(2), 16)]
        return None

    checked, bad = 0, []
    for g in groups:
        if any(r is None for _, r in g):
            continue  # shared-memory A operand
        checked += 1
        regs = set().union(*(set(range(r, r + 4)) for _, r in g))
        seen, stack, window = set(), [(g[-1][0] + 1, 0)], set()
        while stack:
            i, waits = stack.pop()
            while i < len(sass) and (i, waits) not in seen:
                seen.add((i, waits))
                t = sass[i][1]
                window.add(i)
                if t.startswith("WARPGROUP.DEPBAR.LE gsb0, 0x0"):
                    break
                if t.startswith("WARPGROUP.DEPBAR.LE gsb0, 0x1"):
                    waits += 1
                    if waits == 2:
                        break
                target = back_target(i)
                if target is not None:
                    stack.append((target, waits))
                    if not t.startswith("@"):
                        break
                i += 1
        bad += [f"{sass[i][0]:#x} {sass[i][1]}" for i in sorted(window) if _written(sass[i][1]) & regs]
    return checked, bad


def accumulator_reads_before_final_wait(sass: list[tuple[int, str]]) -> list[str]:
    """Instructions that name a wgmma accumulator register between the last HGMMA before a
    ``WARPGROUP.DEPBAR.LE gsb0, 0x0`` and that wait, in program order: the accumulator is still being written
    there. (ptxas scheduled the epilogue's conversions of the accumulator above the final wait of the
    register-fragment kernel when the wait followed the K loop: the last K step partly lost.)"""
    bad = []
    for d, (_, t) in enumerate(sass):
        if not t.startswith("WARPGROUP.DEPBAR.LE gsb0, 0x0"):
            continue
        h = max((i for i in range(d) if sass[i][1].startswith("HGMMA")), default=None)
        if h is None:
            continue  # a wait before any wgmma in program order (a loop's head)
        m = re.match(r"HGMMA\.64x(\d+)x\d+\.\S+ R(\d+)", sass[h][1])
        acc = set(range(int(m.group(2)), int(m.group(2)) + int(m.group(1)) // 2))
        bad += [f"{sass[i][0]:#x} {sass[i][1]}" for i in range(h + 1, d)
                if {int(r) for r in re.findall(r"\bR(\d+)\b", sass[i][1])} & acc]
    return bad


@pytest.mark.parametrize("fragments", [False, True])
def test_w4a16_register_operand_kernel_keeps_its_a_registers_until_retired(fragments):
    """The Gluon W4A16 kernels with the decoded weight in registers (``fragments``: read as register fragments):
    register-A wgmmas with one K step in flight, two A register sets, and no instruction writes a set's registers
    before the wait that retires its wgmma (the hazard of Triton 3.6's pipelined register-A wgmma); nothing
    touches the accumulator before the final wait. Compiled as launched with i32 arguments that are multiples
    of 16 and without, each variant. The fragment kernel moves nothing through shared memory but x: no
    shared-memory loads or stores (without split K) and one 16-byte weight load per K step and thread."""
    from lowbit.kernels import gemm_w4

    variants = list(gemm_w4.ra_compile_variants(fragments))
    assert len(variants) == 9
    for (fn, sig, consts), divisible in itertools.product(variants, (False, True)):
        ck = compile_for_hopper(fn, sig, consts, ints_divisible=divisible)
        ptx = ck.asm["ptx"]
        dt = "bf16" if "bf16" in sig["out_ptr"] else "f16"
        assert f"wgmma.mma_async.sync.aligned.m64n{consts['BM']}k16.f32.{dt}.{dt}" in ptx, consts
        # the fragment kernel's last pair of K steps is peeled off the loop, with the final wait
        assert ptx.count("wgmma.wait_group.sync.aligned 1;") == (3 if fragments else 2), consts
        assert ptx.count("wgmma.wait_group.sync.aligned 0;") == 1, consts
        assert "cp.async.bulk.tensor.2d.shared::cluster.global" in ptx, consts
        sass = _sass(ck.asm["cubin"])
        groups, bad = register_operand_hazards(sass)
        assert groups == (4 if fragments else 2), consts
        assert not bad, (consts, bad[:5])
        assert not accumulator_reads_before_final_wait(sass), (consts, divisible)
        if fragments:
            ops = [re.sub(r"^@!?U?P\w+\s+", "", x).split()[0] for _, x in sass]
            if consts["SPLIT"] == 1:
                assert not [o for o in ops if o.startswith(("STS", "LDS"))], consts
            # two words' loads in the prologue (four, loading four steps ahead), two per pair in the loop (the
            # peeled pair's, past the end, unused)
            assert ops.count("LDG.E.128") == (6 if consts["DEEP"] else 4), consts
