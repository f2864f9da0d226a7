"""Block offload benchmark: peak device memory and time of a Wan-shaped block stack, offloaded vs all on the GPU.

:class:`WanBlock` has the tensors of diffusers' ``WanTransformerBlock`` under the same names (``attn1.to_q``,
``attn2.to_k``, ``ffn.net.0.proj``, ``norm2``, ``scale_shift_table``, ...) and its computation in outline
(modulated self-attention, cross-attention to a text context, GELU-tanh FFN); Wan2.1-14B is ``dim=5120``,
``ffn_dim=13824``, 40 heads, 40 blocks, and a 480p 81-frame video is 32760 tokens.

:func:`bench_block_offload` runs the stack twice with the same weights: all on the device, then through
:func:`lowbit.nn.offload.enable_block_offload`, and reports per run the median forward time and the peak
device memory (``torch.cuda.max_memory_allocated``), with the targets: offload peak at most the non-block
weights + 2 blocks' weights + the all-on-GPU run's activation peak (``prefetch=1``), and time at most 1.1x.
On CPU (``device="cpu"``) it runs the same code with synchronous copies (a plumbing check; times mean little).

GPU run (``lowbit bench offload`` is ``python -m lowbit.bench offload``)::

    lowbit bench offload --json offload.json                       # bf16 weights, Wan2.1-14B shapes
    lowbit bench offload --scheme w4a16-nvfp4 --json offload_nvfp4.json
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
import sys
import time
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

WAN_14B = {"dim": 5120, "ffn_dim": 13824, "heads": 40, "n_blocks": 40, "tokens": 32760, "ctx": 512}


class _Attention(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.to_q = nn.Linear(dim, dim)
        self.to_k = nn.Linear(dim, dim)
        self.to_v = nn.Linear(dim, dim)
        self.to_out = nn.ModuleList([nn.Linear(dim, dim)])
        self.norm_q = nn.RMSNorm(dim, eps=1e-6)
        self.norm_k = nn.RMSNorm(dim, eps=1e-6)

    def forward(self, x: torch.Tensor, ctx: torch.Tensor) -> torch.Tensor:
        b, n, d = x.shape
        q = self.norm_q(self.to_q(x)).view(b, n, self.heads, -1).transpose(1, 2)
        k = self.norm_k(self.to_k(ctx)).view(b, ctx.shape[1], self.heads, -1).transpose(1, 2)
        v = self.to_v(ctx).view(b, ctx.shape[1], self.heads, -1).transpose(1, 2)
        o = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, n, d)
        return self.to_out[0](o)


class _FeedForward(nn.Module):
    def __init__(self, dim: int, ffn_dim: int) -> None:
        super().__init__()
        proj = nn.Module()
        proj.proj = nn.Linear(dim, ffn_dim)
        self.net = nn.ModuleList([proj, nn.Identity(), nn.Linear(ffn_dim, dim)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net[2](F.gelu(self.net[0].proj(x), approximate="tanh"))


class WanBlock(nn.Module):
    """One Wan transformer block with diffusers' tensor names (see the module docstring)."""

    def __init__(self, dim: int, ffn_dim: int, heads: int) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, eps=1e-6, elementwise_affine=False)
        self.attn1 = _Attention(dim, heads)
        self.norm2 = nn.LayerNorm(dim, eps=1e-6)
        self.attn2 = _Attention(dim, heads)
        self.norm3 = nn.LayerNorm(dim, eps=1e-6, elementwise_affine=False)
        self.ffn = _FeedForward(dim, ffn_dim)
        self.scale_shift_table = nn.Parameter(torch.randn(1, 6, dim) / dim**0.5)

    def forward(self, x: torch.Tensor, ctx: torch.Tensor, temb: torch.Tensor) -> torch.Tensor:
        shift, scale, gate, c_shift, c_scale, c_gate = (self.scale_shift_table + temb).chunk(6, dim=1)
        h = self.norm1(x) * (1 + scale) + shift
        x = x + gate * self.attn1(h, h)
        x = x + self.attn2(self.norm2(x), ctx)
        h = self.norm3(x) * (1 + c_scale) + c_shift
        return x + c_gate * self.ffn(h)


class WanStack(nn.Module):
    """``n_blocks`` :class:`WanBlock` s with a time projection and an output projection around them."""

    def __init__(self, dim: int, ffn_dim: int, heads: int, n_blocks: int, out_dim: int = 64) -> None:
        super().__init__()
        self.time_proj = nn.Linear(dim, 6 * dim)
        self.blocks = nn.ModuleList([WanBlock(dim, ffn_dim, heads) for _ in range(n_blocks)])
        self.norm_out = nn.LayerNorm(dim, eps=1e-6, elementwise_affine=False)
        self.proj_out = nn.Linear(dim, out_dim)

    def forward(self, x: torch.Tensor, ctx: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        temb = self.time_proj(F.silu(t)).unflatten(1, (6, -1))
        for block in self.blocks:
            x = block(x, ctx, temb)
        return self.proj_out(self.norm_out(x))


def build_stack(
    dim: int, ffn_dim: int, heads: int, n_blocks: int, *, device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.bfloat16, scheme: str | None = None, seed: int = 0,
) -> WanStack:
    """A :class:`WanStack` with random weights made on ``device`` (no host-side init of a 14B model), its
    block Linear layers quantized with ``scheme`` when given (:func:`lowbit.quantize_model`)."""
    with torch.device("meta"):
        model = WanStack(dim, ffn_dim, heads, n_blocks)
    model = model.to_empty(device=device).to(dtype)
    g = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("weight") and p.dim() == 2:
                p.normal_(0.0, p.shape[1] ** -0.5, generator=g)
            elif "norm" in name and name.endswith("weight"):
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02, generator=g)
    if scheme is not None:
        from ..nn.quantize import quantize_model

        for block in model.blocks:
            quantize_model(block, scheme, skip=())
    return model.eval()


def _bytes(module: nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in (*module.parameters(), *module.buffers()))


def _run(model, inputs, iters: int, device: torch.device) -> tuple[list[float], int | None, int | None]:
    cuda = device.type == "cuda"
    times = []
    with torch.inference_mode():
        model(*inputs)  # warm-up: kernels, prepared layouts, the first loads
        if cuda:
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
        for _ in range(iters):
            t0 = time.perf_counter()
            model(*inputs)
            if cuda:
                torch.cuda.synchronize(device)
            times.append(time.perf_counter() - t0)
    peak = torch.cuda.max_memory_allocated(device) if cuda else None
    # what stays allocated between steps (weights, slots, library workspaces), next to the peak
    steady = torch.cuda.memory_allocated(device) if cuda else None
    return times, peak, steady


def _live_allocations(device: torch.device) -> collections.Counter | None:
    """(requested bytes, stream) of every live allocation of the caching allocator on ``device`` (None on
    CPU): what stays allocated between steps, by size and the stream it belongs to."""
    if device.type != "cuda":
        return None
    live: collections.Counter = collections.Counter()
    for seg in torch.cuda.memory_snapshot():
        if seg.get("device", device.index or 0) != (device.index or 0):
            continue
        for blk in seg["blocks"]:
            if blk["state"] == "active_allocated":
                live[(blk.get("requested_size", blk["size"]), seg["stream"])] += 1
    return live


def _only_in(a: collections.Counter | None, b: collections.Counter | None, skip: set[int]) -> list | None:
    """Allocations live in ``a`` and not in ``b`` (sizes in ``skip``, the blocks' own tensors, left out):
    ``[[bytes, stream, count], ...]``, largest first."""
    if a is None or b is None:
        return None
    extra = a - b
    return sorted(([size, stream, n] for (size, stream), n in extra.items() if size not in skip), reverse=True)


def bench_block_offload(
    *, dim: int = WAN_14B["dim"], ffn_dim: int = WAN_14B["ffn_dim"], heads: int = WAN_14B["heads"],
    n_blocks: int = WAN_14B["n_blocks"], tokens: int = WAN_14B["tokens"], ctx: int = WAN_14B["ctx"],
    scheme: str | None = None, prefetch: int = 1, iters: int = 3, device: str = "cuda",
    dtype: torch.dtype = torch.bfloat16,
) -> dict[str, Any]:
    """Time and peak memory of the stack all on ``device`` and with block offload (see the module docstring).

    Returns a JSON-able dict: the shapes, ``block_bytes``, ``nonblock_bytes``, per run ``times_s``,
    ``median_s`` and ``peak_bytes`` (None on CPU), ``activation_peak_bytes`` (all-on-GPU peak minus its
    weights), ``time_ratio``, ``peak_target_bytes`` and ``meets_targets`` (None on CPU).
    """
    from ..nn.offload import enable_block_offload

    dev = torch.device(device)
    model = build_stack(dim, ffn_dim, heads, n_blocks, device=dev, dtype=dtype, scheme=scheme)
    g = torch.Generator(device=dev).manual_seed(1)
    inputs = (
        torch.randn(1, tokens, dim, device=dev, dtype=dtype, generator=g),
        torch.randn(1, ctx, dim, device=dev, dtype=dtype, generator=g),
        torch.randn(1, dim, device=dev, dtype=dtype, generator=g),
    )
    block_bytes = _bytes(model.blocks[0])
    weights = _bytes(model)
    nonblock = weights - sum(_bytes(b) for b in model.blocks)
    on_times, on_peak, on_steady = _run(model, inputs, iters, dev)
    on_live = _live_allocations(dev)
    # the slots hold blocks: tensors of a block's sizes, or one buffer of a whole block (added below)
    block_sizes = {t.numel() * t.element_size() for t in (*model.blocks[0].parameters(), *model.blocks[0].buffers())}
    block_sizes.add(block_bytes)

    offloader = enable_block_offload(model, model.blocks, dev, prefetch)
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    off_times, off_peak, off_steady = _run(model, inputs, iters, dev)
    off_live = _live_allocations(dev)
    slot_bytes = offloader.slot_bytes
    block_sizes.add(slot_bytes // offloader.n_slots)  # a slot's one buffer (the block, aligned per tensor)
    offloader.remove()

    act = on_peak - weights if on_peak is not None else None
    target = nonblock + (prefetch + 1) * block_bytes + act if act is not None else None
    ratio = statistics.median(off_times) / statistics.median(on_times)
    return {
        "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
        "shapes": {"dim": dim, "ffn_dim": ffn_dim, "heads": heads, "n_blocks": n_blocks, "tokens": tokens,
                   "ctx": ctx, "dtype": str(dtype).removeprefix("torch."), "scheme": scheme or "none"},
        "prefetch": prefetch,
        "block_bytes": block_bytes,
        "nonblock_bytes": nonblock,
        "weights_bytes": weights,
        "all_on_device": {"times_s": on_times, "median_s": statistics.median(on_times), "peak_bytes": on_peak,
                          "steady_bytes": on_steady},
        "offload": {"times_s": off_times, "median_s": statistics.median(off_times), "peak_bytes": off_peak,
                    "steady_bytes": off_steady,
                    "max_resident_blocks": offloader.max_resident, "slot_bytes": slot_bytes},
        "activation_peak_bytes": act,
        "time_ratio": ratio,
        "peak_target_bytes": target,
        "meets_targets": None if target is None else bool(off_peak <= target and ratio <= 1.1),
        # what the offload run keeps allocated that the all-on-device run does not (besides block-sized
        # tensors, i.e. the slots): the owner of any steady excess over the bound
        "offload_only_allocations": _only_in(off_live, on_live, block_sizes),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="lowbit bench offload", description=__doc__.split("\n\n")[0])
    for k, v in WAN_14B.items():
        p.add_argument(f"--{k.replace('_', '-')}", type=int, default=v)
    p.add_argument("--scheme", default=None, help="quantize the block Linear layers (default: bf16 weights)")
    p.add_argument("--prefetch", type=int, default=1)
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--device", default="cuda")
    p.add_argument("--json", default=None, metavar="PATH")
    a = p.parse_args(argv)
    res = bench_block_offload(
        dim=a.dim, ffn_dim=a.ffn_dim, heads=a.heads, n_blocks=a.n_blocks, tokens=a.tokens, ctx=a.ctx,
        scheme=a.scheme, prefetch=a.prefetch, iters=a.iters, device=a.device,
    )
    from .envinfo import header

    res = {"header": header(), **res}
    text = json.dumps(res, indent=1)
    print(text)
    if a.json:
        with open(a.json, "w") as f:
            f.write(text + "\n")
    return 0 if res["meets_targets"] in (True, None) else 1


if __name__ == "__main__":
    sys.exit(main())
