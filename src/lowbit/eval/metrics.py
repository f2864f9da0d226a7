"""Quality metrics of a quantized model against its fp32 original.

- :func:`cosine_stats`: cosine similarity of each sentence's embedding to the fp32 one (mean, min).
- :func:`retrieval_agreement`: nearest-neighbour search among the evaluation sentences (cosine, the query
  itself excluded): the fraction of sentences whose top-1 neighbour is the fp32 top-1, and the mean overlap of
  the top-k neighbour sets.
- :func:`topic_accuracy`: how often a sentence's nearest neighbour has the same topic label (fp32 and
  quantized alike; an absolute measure of the embeddings, not a comparison).
- :class:`LayerErrors`: per-layer SQNR in dB, ``10 log10(sum(y_ref^2) / sum((y - y_ref)^2))`` over the real
  (non-padding) tokens, for each quantized Linear:
  ``sqnr_db`` (in network): the quantized model's layer output against the fp32 model's, errors of the
  earlier layers included; ``isolated_sqnr_db``: the quantized layer fed the fp32 layer's input (its own error
  only, activation quantization included); ``weight_sqnr_db``: the dequantized weight against the fp32 weight.
"""

from __future__ import annotations

import math
from contextlib import contextmanager

import torch
from torch import nn


def cosine_stats(ref: torch.Tensor, q: torch.Tensor) -> dict[str, float]:
    cos = torch.nn.functional.cosine_similarity(ref.double(), q.double(), dim=1)
    return {"mean": cos.mean().item(), "min": cos.min().item()}


def _neighbours(emb: torch.Tensor, k: int) -> torch.Tensor:
    e = torch.nn.functional.normalize(emb.double(), dim=1)
    sim = e @ e.T
    sim.fill_diagonal_(-math.inf)
    return sim.topk(k, dim=1).indices


def retrieval_agreement(ref: torch.Tensor, q: torch.Tensor, k: int = 5) -> dict[str, float]:
    """``top1``: fraction of queries with the same nearest neighbour; ``topk``: mean |ref top-k ∩ q top-k| / k."""
    nr, nq = _neighbours(ref, k), _neighbours(q, k)
    top1 = (nr[:, 0] == nq[:, 0]).double().mean().item()
    overlap = sum(len(set(a) & set(b)) for a, b in zip(nr.tolist(), nq.tolist())) / (k * len(nr))
    return {"top1": top1, f"top{k}": overlap}


def topic_accuracy(emb: torch.Tensor, topics: list[str] | tuple[str, ...]) -> float:
    nn1 = _neighbours(emb, 1)[:, 0].tolist()
    return sum(topics[i] == topics[j] for i, j in enumerate(nn1)) / len(topics)


def sqnr_db(signal: float, noise: float) -> float:
    """``10 log10(signal / noise)``; ``inf`` when the noise is 0."""
    if noise == 0:
        return math.inf
    if signal == 0:
        return -math.inf
    return 10.0 * math.log10(signal / noise)


class _Acc:
    """Running ``sum(ref^2)`` and ``sum((y - ref)^2)`` over the rows selected by a token mask."""

    __slots__ = ("noise", "signal")

    def __init__(self) -> None:
        self.signal = 0.0
        self.noise = 0.0

    def add(self, ref: torch.Tensor, y: torch.Tensor, mask: torch.Tensor | None = None) -> None:
        ref = ref.float()
        err = y.float() - ref
        if mask is not None and ref.dim() == 3 and tuple(ref.shape[:2]) == tuple(mask.shape):
            m = mask.to(ref.dtype)
            self.signal += float((ref.square().sum(-1) * m).sum(dtype=torch.float64))
            self.noise += float((err.square().sum(-1) * m).sum(dtype=torch.float64))
        else:
            self.signal += float(ref.square().sum(dtype=torch.float64))
            self.noise += float(err.square().sum(dtype=torch.float64))

    @property
    def db(self) -> float:
        return sqnr_db(self.signal, self.noise)


@contextmanager
def capture(modules: dict[str, nn.Module], *, inputs: bool = False):
    """Records each module's output (and first input) of the next forward: ``yield (outputs, inputs)``."""
    outs: dict[str, torch.Tensor] = {}
    ins: dict[str, torch.Tensor] = {}

    def hook(name):
        def fn(module, args, out):
            outs[name] = out.detach()

        return fn

    def pre(name):
        def fn(module, args):
            ins[name] = args[0].detach()

        return fn

    handles = [m.register_forward_hook(hook(n)) for n, m in modules.items()]
    if inputs:
        # first of the pre-hooks: the input as the layer receives it, before an online input transform
        # (lowbit.algorithms) changes it; the quantized layer fed this input applies its own
        handles += [m.register_forward_pre_hook(pre(n), prepend=True) for n, m in modules.items()]
    try:
        yield outs, ins
    finally:
        for h in handles:
            h.remove()


class LayerErrors:
    """Accumulates per-layer SQNR over batches; pairs ``ref`` Linear layers with the ``quant`` modules of the
    same name that replaced them (layers left as ``nn.Linear`` in the quantized model are not quantized)."""

    def __init__(self, ref: nn.Module, quant: nn.Module):
        ref_mods = dict(ref.named_modules())
        q_mods = dict(quant.named_modules())
        self.names = [
            n
            for n, m in ref_mods.items()
            if isinstance(m, nn.Linear) and n in q_mods and not isinstance(q_mods[n], nn.Linear)
        ]
        self.ref = {n: ref_mods[n] for n in self.names}
        self.quant = {n: q_mods[n] for n in self.names}
        self.net = {n: _Acc() for n in self.names}
        self.iso = {n: _Acc() for n in self.names}

    @torch.inference_mode()
    def run(self, ref: nn.Module, quant: nn.Module, enc: dict[str, torch.Tensor], *, isolated: bool = True):
        """One batch through both models (and, with ``isolated``, each quantized layer on the fp32 layer's
        input); returns ``(ref_output, quant_output)``."""
        mask = enc.get("attention_mask")
        with capture(self.ref, inputs=isolated) as (r_out, r_in):
            ref_out = ref(**enc)
        with capture(self.quant) as (q_out, _):
            q_out_model = quant(**enc)
        for n in self.names:
            if n not in r_out or n not in q_out:
                continue
            r = r_out[n]
            self.net[n].add(r, q_out[n], mask)
            if isolated:
                self.iso[n].add(r, self.quant[n](r_in[n]), mask)
        return ref_out, q_out_model

    def weight_sqnr(self, name: str) -> float | None:
        q = self.quant[name]
        deq = getattr(q, "dequantize_weight", None)
        if deq is None:
            return None
        w = self.ref[name].weight.detach()
        acc = _Acc()
        acc.add(w, deq(torch.float32).to(w.device))
        return acc.db

    def results(self) -> list[dict]:
        return [
            {
                "name": n,
                "shape": [self.ref[n].out_features, self.ref[n].in_features],
                "sqnr_db": self.net[n].db,
                "isolated_sqnr_db": self.iso[n].db if self.iso[n].signal else None,
                "weight_sqnr_db": self.weight_sqnr(n),
            }
            for n in self.names
        ]
