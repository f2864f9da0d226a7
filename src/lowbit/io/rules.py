"""Which tensors of a checkpoint to quantize when no model class says which are Linear weights.

A diffusers folder (``config.json`` with ``_class_name``, no ``model_type``) or a bare folder of safetensors
files cannot be built as a transformers model, so :func:`lowbit.convert_checkpoint` decides from tensor names
and header shapes alone (nothing is read but the headers):

1. the key ends in ``.weight``, the tensor is 2-D and floating point (``[out_features, in_features]``, the
   shape of an ``nn.Linear`` weight; conv kernels are 3-D or more, biases, norms and gains 1-D, modulation
   tables such as ``scale_shift_table`` 3-D);
2. the module name (the key without ``.weight``) matches an ``include`` pattern when ``include`` is given,
   else matches none of :data:`DEFAULT_EXCLUDE` (embeddings, norms, modulation and time projections, the final
   output projection: 2-D tensors that are not the transformer's Linear layers or that models keep in high
   precision);
3. it matches no ``exclude`` pattern;
4. the scheme takes its shape (``in_features`` divisible by the format's block, ...); a weight that fails only
   this rule is reported as left unquantized, with the reason.

Patterns are ``fnmatch`` globs on the module name (``blocks.*.attn1.to_q``), or regular expressions after a
``re:`` prefix (``re:blocks\\.\\d+\\.ffn``), searched anywhere in the name (anchor with ``^``/``$``), as
compressed-tensors marks its regex targets.
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Iterable, Mapping

import torch

DEFAULT_EXCLUDE = (
    "*embed*",
    "*norm*",
    "*modulation*",
    "*scale_shift*",
    "*time_proj*",
    "*pos_emb*",
    "*lm_head*",
    "proj_out",
    "head",
    "head.*",
)
"""Module-name globs left in full precision by the name rules (unless ``include`` names them)."""

_FLOAT_DTYPES = {"F64", "F32", "F16", "BF16", torch.float64, torch.float32, torch.float16, torch.bfloat16}


def check_patterns(patterns: str | Iterable[str] | None, name: str) -> tuple[str, ...]:
    """Patterns as a tuple; TypeError/ValueError naming the argument for non-strings or a bad ``re:``."""
    if patterns is None:
        return ()
    if isinstance(patterns, str):
        patterns = (patterns,)
    elif not isinstance(patterns, Iterable):
        raise TypeError(f"{name} must be None, a pattern (str) or an iterable of patterns, got {type(patterns).__name__}")
    out = tuple(patterns)
    for p in out:
        if not isinstance(p, str):
            raise TypeError(f"{name} must hold module-name patterns (str), got {type(p).__name__} {p!r:.40}")
        if not p:
            raise ValueError(f"{name}: an empty pattern matches nothing; remove it")
        if p.startswith("re:"):
            try:
                re.compile(p[3:])
            except re.error as e:
                raise ValueError(f"{name}: {p!r} is not a valid regular expression ({e})") from None
    return out


def matches(name: str, patterns: Iterable[str]) -> bool:
    """True if ``name`` matches a glob, or a ``re:`` regular expression anywhere in it."""
    for p in patterns:
        if p.startswith("re:"):
            if re.search(p[3:], name):
                return True
        elif fnmatch.fnmatchcase(name, p):
            return True
    return False


def select_linear_weights(
    shapes: Mapping[str, tuple[list[int], object]],
    unsupported,
    include: tuple[str, ...] = (),
    exclude: tuple[str, ...] = (),
) -> tuple[dict[str, tuple[str, int, int]], dict[str, str]]:
    """Apply the rules of this module.

    Args:
        shapes: ``{key: (shape, dtype)}`` from the safetensors headers (dtype a torch dtype or header string).
        unsupported: ``(out_features, in_features) -> reason or None`` (the scheme's shape rule).
        include, exclude: checked patterns (:func:`check_patterns`).

    Returns:
        ``({module name: (key, out_features, in_features)}`` to quantize, ``{module name: reason}`` of the
        Linear-like weights left in full precision because of their shape).
    """
    targets: dict[str, tuple[str, int, int]] = {}
    misfit: dict[str, str] = {}
    for key, (shape, dtype) in shapes.items():
        if not key.endswith(".weight") or len(shape) != 2 or dtype not in _FLOAT_DTYPES:
            continue
        name = key[: -len(".weight")]
        if include:
            if not matches(name, include):
                continue
        elif matches(name, DEFAULT_EXCLUDE):
            continue
        if matches(name, exclude):
            continue
        out_f, in_f = shape
        why = unsupported(out_f, in_f)
        if why is not None:
            misfit[name] = why
            continue
        targets[name] = (key, out_f, in_f)
    return targets, misfit


__all__ = ["DEFAULT_EXCLUDE", "check_patterns", "matches", "select_linear_weights"]
