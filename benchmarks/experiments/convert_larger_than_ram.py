"""Peak memory of ``lowbit.convert_checkpoint`` on a checkpoint larger than this machine's RAM.

Writes a synthetic Llama-3-70B-shaped transformers checkpoint (hidden 8192, intermediate 28672, a small
vocabulary; ``--layers`` layers, one safetensors shard per layer) of about ``--factor`` times MemTotal into
``--workdir`` (one tensor generated at a time, fsynced), then converts it in a child process on the CPU and samples
the child's resident memory every 50 ms: anonymous (RssAnon: what the process allocates: tensors, buffers) and
file-backed (RssFile: pages of the memory-mapped safetensors it reads, which the kernel reclaims under memory
pressure like any page cache, so they bound nothing). Prints and writes (``--json``) the checkpoint size,
MemTotal, the peaks, the bound the converter states (``max_shard_size`` buffered per file being written, plus the
one pending write, plus twice the largest source tensor, plus the CPU reference quantizer's working copies: up to
three fp32 copies of that tensor) over the anonymous memory of the child right after its imports, and the time. The files are removed at the end.

    python benchmarks/experiments/convert_larger_than_ram.py --scheme w8a8-fp8-block --max-shard-size 1GB

A CPU-only measurement (the conversion's memory does not depend on the device it quantizes on, except for the
device's own copy of one tensor). Linux only (/proc).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
HIDDEN, INTER, HEADS, KV_HEADS, HEAD_DIM, VOCAB = 8192, 28672, 64, 8, 128, 1024


def mem_total() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemTotal:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no MemTotal in /proc/meminfo")


def _status_kb(pid: int, field: str) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except OSError:
        return None
    return None


def layer_tensors(i: int) -> dict[str, tuple[int, int]]:
    p = f"model.layers.{i}."
    return {
        p + "self_attn.q_proj.weight": (HEADS * HEAD_DIM, HIDDEN),
        p + "self_attn.k_proj.weight": (KV_HEADS * HEAD_DIM, HIDDEN),
        p + "self_attn.v_proj.weight": (KV_HEADS * HEAD_DIM, HIDDEN),
        p + "self_attn.o_proj.weight": (HIDDEN, HEADS * HEAD_DIM),
        p + "mlp.gate_proj.weight": (INTER, HIDDEN),
        p + "mlp.up_proj.weight": (INTER, HIDDEN),
        p + "mlp.down_proj.weight": (HIDDEN, INTER),
        p + "input_layernorm.weight": (HIDDEN,),
        p + "post_attention_layernorm.weight": (HIDDEN,),
    }


def write_checkpoint(path: Path, layers: int) -> int:
    """One shard per layer (plus one for the embeddings and norm); returns the bytes written."""
    import torch
    from safetensors.torch import save_file

    path.mkdir(parents=True)
    cfg = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": HIDDEN,
           "intermediate_size": INTER, "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS,
           "head_dim": HEAD_DIM, "num_hidden_layers": layers, "vocab_size": VOCAB, "torch_dtype": "bfloat16",
           "tie_word_embeddings": False}
    (path / "config.json").write_text(json.dumps(cfg))
    gen = torch.Generator().manual_seed(0)
    shards = [({"model.embed_tokens.weight": (VOCAB, HIDDEN), "model.norm.weight": (HIDDEN,),
                "lm_head.weight": (VOCAB, HIDDEN)}, "model-00000.safetensors")]
    shards += [(layer_tensors(i), f"model-{i + 1:05d}.safetensors") for i in range(layers)]
    weight_map, total = {}, 0
    for tensors, name in shards:
        data = {}
        for key, shape in tensors.items():
            data[key] = (torch.randn(shape, generator=gen) * 0.02).to(torch.bfloat16)
            weight_map[key] = name
            total += data[key].numel() * 2
        save_file(data, path / name)
        with open(path / name, "rb+") as f:
            os.fsync(f.fileno())
        del data
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    return total


CHILD = """
import os, sys, time, json
import lowbit
from pathlib import Path
anon = int([l for l in Path('/proc/self/status').read_text().splitlines() if l.startswith('RssAnon:')][0].split()[1])
print(json.dumps({"baseline_kb": anon}), flush=True)
t = time.perf_counter()
lowbit.convert_checkpoint(sys.argv[1], sys.argv[2], sys.argv[3], device="cpu", progress=False,
                          max_shard_size=sys.argv[4])
print(json.dumps({"convert_s": time.perf_counter() - t}), flush=True)
"""


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workdir", default=None, help="where the checkpoints go (default: a temp dir)")
    ap.add_argument("--factor", type=float, default=1.1, help="checkpoint size over MemTotal (default 1.1)")
    ap.add_argument("--scheme", default="w8a8-fp8-block")
    ap.add_argument("--max-shard-size", default="1GB")
    ap.add_argument("--json", default=None)
    ap.add_argument("--keep", action="store_true", help="keep the synthetic checkpoint and the output")
    ap.add_argument("--reuse", action="store_true", help="convert the checkpoint a --keep run left in --workdir")
    args = ap.parse_args(argv)
    total_mem = mem_total()
    per_layer = sum(2 * math.prod(shape) for shape in layer_tensors(0).values())
    layers = max(1, int(args.factor * total_mem / per_layer) + 1)
    work = Path(args.workdir or tempfile.mkdtemp(prefix="lowbit-ltr-"))
    src, out = work / "src", work / "out"
    try:
        t0 = time.perf_counter()
        if args.reuse and (src / "model.safetensors.index.json").exists():
            size = sum(f.stat().st_size for f in src.glob("*.safetensors"))
        else:
            size = write_checkpoint(src, layers)
        write_s = time.perf_counter() - t0
        print(f"checkpoint: {size / 1e9:.1f} GB in {layers + 1} shards ({write_s:.0f} s); MemTotal "
              f"{total_mem / 1e9:.1f} GB", flush=True)
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]))
        child = subprocess.Popen([sys.executable, "-c", CHILD, str(src), str(out), args.scheme,
                                  args.max_shard_size], stdout=subprocess.PIPE, text=True, env=env)
        peak = {"RssAnon": 0, "RssFile": 0, "VmRSS": 0, "VmHWM": 0}
        while child.poll() is None:
            for field in peak:
                peak[field] = max(peak[field], _status_kb(child.pid, field) or 0)
            time.sleep(0.05)
        lines = [json.loads(line) for line in child.stdout.read().splitlines() if line.startswith("{")]
        facts = {k: v for d in lines for k, v in d.items()}
        if child.returncode != 0:
            print(f"conversion failed (exit {child.returncode})", file=sys.stderr)
            return 1
        from lowbit.io.files import parse_size

        limit = parse_size(args.max_shard_size)
        largest = INTER * HIDDEN * 2
        baseline = facts["baseline_kb"] * 1024
        # the CPU reference quantizers hold up to three fp32 copies of the tensor they quantize
        working = 3 * INTER * HIDDEN * 4
        bound = baseline + 2 * limit + 2 * largest + working
        result = {
            "checkpoint_bytes": size, "mem_total_bytes": total_mem, "layers": layers, "scheme": args.scheme,
            "max_shard_size": limit, "largest_tensor_bytes": largest, "baseline_rss_bytes": baseline,
            "quantizer_working_bytes": working,
            "peak_anon_bytes": peak["RssAnon"] * 1024, "peak_file_backed_bytes": peak["RssFile"] * 1024,
            "peak_rss_bytes": max(peak["VmRSS"], peak["VmHWM"]) * 1024,
            "stated_bound_bytes": bound, "within_bound": peak["RssAnon"] * 1024 <= bound,
            "convert_s": facts.get("convert_s"), "write_s": write_s,
        }
        print(json.dumps(result, indent=1))
        if args.json:
            Path(args.json).write_text(json.dumps(result, indent=1))
        return 0
    finally:
        shutil.rmtree(out, ignore_errors=True)
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
