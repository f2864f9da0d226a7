"""How the end-to-end benchmark times a decoder: decode steps replayed from a manually captured CUDA graph or
``torch.compile``d (default mode and reduce-overhead), eager and compiled (default mode) decode with every
config's model built together and timed in interleaved rounds (:func:`interleaved_rounds`, which transformers'
``generate()`` uses too), the prefill time, and the host time of one call."""

from __future__ import annotations

import gc
import math
import time
from collections.abc import Callable
from typing import Any

import torch

from .common import short_error
from .decoder import Decoder, DecoderShape, bf16_model_bytes, build_decoder
from .e2e_configs import apply_config
from .timing import capture_graph, replay_seconds, sync

REPEATS = 3
"""Timed windows per decode mode; the best is reported (the lent machines' host CPUs are shared and noisy)."""



def decode_graph(model: Decoder, steps: int, start: int) -> float:
    """Tokens/s of replays of one decode step captured in a CUDA graph (token and position updated in place)."""
    tok = torch.zeros(1, 1, dtype=torch.long, device="cuda")
    pos = torch.tensor([start], device="cuda")
    def step():
        nxt = model(tok, pos).argmax(-1, keepdim=True)
        tok.copy_(nxt)
        pos.add_(1)

    with torch.inference_mode():
        g = capture_graph(step, warm=lambda: model(tok, pos))
        return 1.0 / replay_seconds(g, steps, warm_replays=2)



def decode_compiled(model: Decoder, steps: int, start: int, mode: str | None, n_layers: int, device) -> dict:
    """Tokens/s of a ``torch.compile``d decode step over the first ``n_layers`` layers, and compile seconds."""
    import torch._dynamo

    torch._dynamo.reset()
    fn = _compiled_step(model, n_layers, mode)
    t0 = time.perf_counter()
    _decode_window(fn, 3, start, device, mode)
    compile_s = time.perf_counter() - t0
    best = max(_decode_window(fn, steps, start, device, mode) for _ in range(REPEATS))
    return {"tok_s": best, "compile_s": compile_s, "layers": n_layers}


def _decode_window(step: Callable, steps: int, start: int, device, mode: str | None = None) -> float:
    """Tokens/s of ``steps`` greedy decode steps ``tok = step(tok, pos)`` from position ``start`` (batch 1),
    synchronized before and after; under reduce-overhead each step is marked as a new CUDA-graph-tree step."""
    tok = torch.zeros(1, 1, dtype=torch.long, device=device)
    pos = torch.tensor([start], device=device)
    with torch.inference_mode():
        sync(device)
        t0 = time.perf_counter()
        for _ in range(steps):
            if mode == "reduce-overhead":
                torch.compiler.cudagraph_mark_step_begin()
            tok = step(tok, pos)
            pos += 1
        sync(device)
    return steps / (time.perf_counter() - t0)


def prefill_ms(model: Decoder, tokens: int, device, repeats: int = 3) -> float:
    ids = torch.randint(0, model.s.vocab, (1, tokens), device=device)
    pos = torch.arange(tokens, device=device)
    with torch.inference_mode():
        model(ids, pos)
        sync(device)
        best = math.inf
        for _ in range(repeats):
            t0 = time.perf_counter()
            model(ids, pos)
            sync(device)
            best = min(best, time.perf_counter() - t0)
    return best * 1e3



def host_us_per_call(fn: Callable[[], Any], device, calls: int = 200) -> float:
    """CPU microseconds per call of ``fn``, issued back to back without synchronizing (the GPU queue absorbs
    the kernels: at M = 1 they take less time than the host)."""
    with torch.inference_mode():
        for _ in range(10):
            fn()
        sync(device)
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        t = time.perf_counter() - t0
        sync(device)
    return t / calls * 1e6



def interleaved_rounds(configs: list[str], build: Callable[[str], Any], warm: Callable[[Any], None],
                       measure: Callable[[Any], Any], need_bytes: int, device, rounds: int = 3
                       ) -> dict[str, list | str]:
    """Measure every config in interleaved rounds: the configs' models are built together, as many as the
    device holds beside ``need_bytes`` free for the next build (bf16's stays for every group), warmed up, then
    each round runs ``measure(model)`` for each model in turn, so a drifting host CPU weighs on all of them
    alike. Returns config -> the list of its measurements (one per round), or the error that stopped it."""
    out: dict[str, list | str] = {}
    models: dict = {}
    cuda = torch.device(device).type == "cuda"

    def run_group() -> None:
        for config, model in list(models.items()):
            if config in out:
                continue
            try:
                warm(model)
                out[config] = []
            except Exception as e:  # noqa: BLE001 - reported per config, the others still run
                out[config] = short_error(e)
                del models[config]
        for _ in range(rounds):
            for config, model in models.items():
                out[config].append(measure(model))
        for config in [c for c in models if c != "bf16"]:
            del models[config]
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()

    for config in configs:
        if cuda and len(models) > ("bf16" in models):
            free, _total = torch.cuda.mem_get_info(device)
            if free < need_bytes:  # the next build would not fit beside this group: measure it, then free it
                run_group()
        try:
            models[config] = build(config)
        except Exception as e:  # noqa: BLE001
            out[config] = short_error(e)
            gc.collect()
            if cuda:
                torch.cuda.empty_cache()
    run_group()
    models.clear()
    gc.collect()
    return out



def _compiled_step(model: Decoder, n_layers: int, mode: str | None):
    """``torch.compile`` of a decode step over ``model``'s first ``n_layers`` layers (its output cloned: a
    CUDA-graph tree reuses its output memory), on a code object of its own: steps of several models on one
    shared code object would be cache entries of one Dynamo cache, whose guards run in turn on every call, so
    the models checked later would pay the others' guards."""
    import types

    def step(tok, pos):
        return model(tok, pos, n_layers).argmax(-1, keepdim=True)

    step = types.FunctionType(step.__code__.replace(co_name=f"decode_step_{id(model):x}"), step.__globals__,
                              step.__name__, None, step.__closure__)
    fn = torch.compile(step, mode=mode, fullgraph=True)

    def run(tok, pos):
        return fn(tok, pos).clone()

    run.compiled = fn
    return run


def compiled_rounds(s: DecoderShape, configs: list[str], steps: int, max_len: int, start: int, n_layers: int,
                    device, rounds: int = 5) -> dict[str, dict | str]:
    """``torch.compile`` (default mode) decode tokens/s per config in :func:`interleaved_rounds`: each config's
    step compiled and warmed, then timed one window of ``steps`` in turn with the others, the best kept. The
    default mode is host-bound (the GPU waits on the launches), so a host that slows for a while would
    otherwise decide the ratio of whichever config it was timing (two configs with the same launches measured
    0.88 and 1.59 ms per 4-layer step one after the other on a lent machine)."""
    import torch._dynamo

    torch._dynamo.reset()

    def build(config: str) -> dict:
        model = apply_config(build_decoder(s, max_len, device), config)
        return {"model": model, "fn": _compiled_step(model, n_layers, None)}

    def warm(built: dict) -> None:
        t0 = time.perf_counter()
        _decode_window(built["fn"], 3, start, device)
        built["compile_s"] = time.perf_counter() - t0

    raw = interleaved_rounds(configs, build, warm, lambda built: (_decode_window(built["fn"], steps, start, device),
                                                                  built["compile_s"]),
                             int(bf16_model_bytes(s) * 1.15) + (2 << 30), device, rounds)
    torch._dynamo.reset()
    return {c: v if isinstance(v, str) else {"tok_s": max(t for t, _ in v), "compile_s": v[0][1],
                                            "layers": n_layers, "rounds": [t for t, _ in v]}
            for c, v in raw.items()}


def eager_rounds(s: DecoderShape, configs: list[str], steps: int, max_len: int, start: int, device,
                 rounds: int = 3) -> dict[str, float | str]:
    """Eager decode tokens/s of the decoder per config in :func:`interleaved_rounds` (one window of ``steps``
    steps per round and config, the best kept): the eager ratios of separate builds moved by a third between
    lent machines, so the configs share the machine state instead."""

    def window(model) -> float:
        return _decode_window(lambda tok, pos: model(tok, pos).argmax(-1, keepdim=True), steps, start, device)

    def warm(model) -> None:
        tok = torch.zeros(1, 1, dtype=torch.long, device=device)
        pos = torch.tensor([start], device=device)
        with torch.inference_mode():
            for _ in range(2):
                model(tok, pos)
        sync(device)

    raw = interleaved_rounds(configs, lambda c: apply_config(build_decoder(s, max_len, device), c), warm, window,
                             int(bf16_model_bytes(s) * 1.15) + (2 << 30), device, rounds)
    return {c: v if isinstance(v, str) else max(v) for c, v in raw.items()}


__all__ = [
    "REPEATS", "compiled_rounds", "decode_compiled", "decode_graph", "eager_rounds", "host_us_per_call",
    "interleaved_rounds", "prefill_ms",
]
