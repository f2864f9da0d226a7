"""The built-in evaluation sentences (``data/sentences.json``, shipped as package data).

330 everyday English sentences in 33 topics of 10 (the topic is each sentence's label for the retrieval
check) and 379 further sentences, disjoint from them, that are only used for calibration (activation scales,
GPTQ's Hessians, smoothing ranges). The calibration sentences after the first 64 were added for GPTQ, which
fits better on more tokens; each was kept only if its all-MiniLM-L6-v2 embedding has cosine similarity at most
0.60 with every evaluation sentence (the first 64 reach 0.61), so none paraphrases an evaluated sentence.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache
from importlib import resources


@dataclass(frozen=True)
class EvalSet:
    sentences: tuple[str, ...]
    """The evaluation sentences, topic by topic."""
    topics: tuple[str, ...]
    """``topics[i]`` is the topic of ``sentences[i]``."""
    calibration: tuple[str, ...]
    """Calibration sentences (none of them is in :attr:`sentences`)."""

    def calibration_sentences(self, n: int) -> list[str]:
        """The first ``n`` calibration sentences; ValueError if ``n`` is negative or above what there is."""
        if n < 0 or n > len(self.calibration):
            raise ValueError(
                f"--calib takes 0 to {len(self.calibration)} sentences (the built-in set), got {n}"
            )
        return list(self.calibration[:n])


@lru_cache(maxsize=1)
def load_sentences() -> EvalSet:
    """Reads and checks the packaged sentence set."""
    raw = json.loads(resources.files(__package__).joinpath("data/sentences.json").read_text(encoding="utf-8"))
    sentences: list[str] = []
    topics: list[str] = []
    for topic, items in raw["topics"].items():
        sentences.extend(items)
        topics.extend([topic] * len(items))
    calibration = tuple(raw["calibration"])
    if len(set(sentences)) != len(sentences) or set(sentences) & set(calibration):
        raise ValueError(
            "lowbit/eval/data/sentences.json: sentences must be unique and disjoint from calibration"
        )
    return EvalSet(tuple(sentences), tuple(topics), calibration)
