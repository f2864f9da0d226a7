"""``quantize_model(algorithm=...)``: which algorithms run, in which order, and the checks on the argument.

An algorithm is a name or an options object:

=================  ===========================================  ============================================
name               options                                      what it does
=================  ===========================================  ============================================
``"rtn"``          -                                            round-to-nearest (the default)
``"gptq"``         :class:`lowbit.algorithms.GPTQ`              Hessian error compensation of the weights
``"awq"``          -                                            ``w4a16-int4``: AWQ scale search (``awq=True``)
``"smoothquant"``  :class:`lowbit.algorithms.SmoothQuant`       move activation outliers into the weights
``"rotate"``       :class:`lowbit.algorithms.Rotate`            random Hadamard rotation of layer inputs
=================  ===========================================  ============================================

Several combine as a tuple or list (``("smoothquant", "gptq")``, ``(SmoothQuant(alpha=0.6), Rotate())``) or a
string joined by ``+`` (``"smoothquant+gptq"``). They always run in the order smoothing, rotation, weight
rounding (GPTQ or round-to-nearest), whatever order they are given in: smoothing's statistics are those of the
original inputs, and GPTQ's Hessians those of the transformed inputs the quantized layers will see.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .gptq import GPTQ
from .rotation import Rotate
from .smoothing import SmoothQuant

NAMES = ("rtn", "gptq", "awq", "smoothquant", "rotate")
"""Algorithm names ``quantize_model`` accepts."""
_OBJECTS = {GPTQ: "gptq", SmoothQuant: "smoothquant", Rotate: "rotate"}


@dataclass(frozen=True)
class Plan:
    """The resolved ``algorithm`` argument: options of each algorithm that runs (None: it does not)."""

    smooth: SmoothQuant | None = None
    rotate: Rotate | None = None
    gptq: GPTQ | None = None
    awq: bool | None = None

    @property
    def transforms(self) -> bool:
        """Smoothing or rotation: the algorithms that need a scheme quantizing activations."""
        return self.smooth is not None or self.rotate is not None

    @property
    def name(self) -> str:
        """``"smoothquant+gptq"``, ``"rtn"``, ...: the algorithms in the order they run."""
        parts = [n for n, v in (("smoothquant", self.smooth), ("rotate", self.rotate)) if v is not None]
        if self.gptq is not None:
            parts.append("gptq")
        elif self.awq:
            parts.append("awq")
        return "+".join(parts) if parts else "rtn"

    def check_scheme(self, scheme: Any) -> None:
        """ValueError if smoothing or rotation is asked for a weight-only scheme."""
        if self.transforms and scheme.act_format is None:
            which = "+".join(n for n, v in (("smoothquant", self.smooth), ("rotate", self.rotate)) if v is not None)
            raise ValueError(
                f"algorithm {which!r} needs a scheme that quantizes activations (w8a8-*, w4a8-*, w4a4-*); "
                f"{scheme.name} is weight-only: its activations stay 16-bit, there are no activation outliers "
                "to move (use algorithm='gptq' or 'awq' for weight-only schemes)"
            )


def _items(algorithm: Any) -> list[Any]:
    if isinstance(algorithm, str):
        parts = [p.strip() for p in algorithm.replace(",", "+").split("+")]
        if any(not p for p in parts):
            raise ValueError(f"algorithm must name algorithms joined by '+' (one of {NAMES}), got {algorithm!r}")
        return parts
    if isinstance(algorithm, tuple(_OBJECTS)):
        return [algorithm]
    if isinstance(algorithm, (tuple, list)):
        items = list(algorithm)
        if not items:
            raise ValueError(f"algorithm must not be empty; give one or more of {NAMES}")
        for a in items:
            if not isinstance(a, (str, *_OBJECTS)):
                raise TypeError(
                    f"algorithm entries must be names ({', '.join(NAMES)}) or GPTQ/SmoothQuant/Rotate options, "
                    f"got {type(a).__name__}"
                )
        return [p for a in items for p in (_items(a) if isinstance(a, str) else [a])]
    raise TypeError(
        f"algorithm must be a name ({', '.join(NAMES)}), an options object (GPTQ, SmoothQuant, Rotate) or a "
        f"tuple of them, got {type(algorithm).__name__}"
    )


def resolve(algorithm: Any, awq: bool | None, calibration: Any) -> Plan:
    """``quantize_model``'s ``algorithm`` and ``awq`` arguments -> a :class:`Plan`.

    Raises:
        TypeError: ``algorithm`` (or an entry) is neither a name nor an options object.
        ValueError: an unknown or repeated name, ``"rtn"`` with ``"gptq"``, ``"awq"`` with ``awq=False`` or
            with GPTQ, or smoothing/GPTQ without calibration data.
    """
    found: dict[str, Any] = {}
    for item in _items(algorithm):
        if isinstance(item, str):
            if item not in NAMES:
                raise ValueError(
                    f"algorithm: unknown name {item!r}; known: {', '.join(NAMES)} (or GPTQ/SmoothQuant/Rotate "
                    "options)"
                )
            key, value = item, None
        else:
            key, value = _OBJECTS[type(item)], item
        if key in found:
            raise ValueError(f"algorithm: {key!r} is given twice")
        found[key] = value
    if "rtn" in found and "gptq" in found:
        raise ValueError("algorithm: 'rtn' and 'gptq' are two ways of rounding the weights; give one")
    if "awq" in found:
        if awq is False:
            raise ValueError("algorithm='awq' contradicts awq=False")
        if "gptq" in found:
            raise ValueError("algorithm: 'awq' and 'gptq' together are not supported; give one (or "
                             "algorithm='gptq' with awq=True)")
        awq = True
    gptq = None
    if "gptq" in found:
        gptq = found["gptq"] or GPTQ()
        if calibration is None:
            raise ValueError("algorithm='gptq' needs calibration data (calibration=...)")
        awq = False if awq is None else awq
    smooth = None
    if "smoothquant" in found:
        smooth = found["smoothquant"] or SmoothQuant()
        if calibration is None:
            raise ValueError(
                "algorithm='smoothquant' needs calibration data (calibration=...): the smoothing factors come "
                "from the layers' input ranges"
            )
    rotate = None
    if "rotate" in found:
        rotate = found["rotate"] or Rotate()
    return Plan(smooth=smooth, rotate=rotate, gptq=gptq, awq=awq)


def names_of(algorithm: Any) -> list[str]:
    """The algorithm names in ``algorithm`` (no calibration check); TypeError/ValueError as :func:`resolve`."""
    out = []
    for item in _items(algorithm):
        key = item if isinstance(item, str) else _OBJECTS[type(item)]
        if key not in NAMES:
            raise ValueError(f"algorithm: unknown name {key!r}; known: {', '.join(NAMES)}")
        out.append(key)
    return out


def without_transforms(algorithm: Any) -> Any:
    """``algorithm`` less smoothing and rotation (what a weight-only scheme can run): a tuple, or ``"rtn"``."""
    items = [a for a in _items(algorithm)
             if (a if isinstance(a, str) else _OBJECTS[type(a)]) not in ("smoothquant", "rotate")]
    return tuple(items) if items else "rtn"


def describe(algorithm: Any) -> str:
    """A short label: names joined by ``+``, options that differ from the defaults in parentheses."""
    parts = []
    for item in _items(algorithm):
        if isinstance(item, str):
            parts.append(item)
            continue
        name = _OBJECTS[type(item)]
        default = type(item)()
        changed = [f"{k}={getattr(item, k)!r}" for k in item.__dataclass_fields__
                   if getattr(item, k) != getattr(default, k)]
        parts.append(f"{name}({', '.join(changed)})" if changed else name)
    return "+".join(parts)


def label(algorithm: Any) -> str:
    """A compact label for tables: ``"sq-online+gptq"``, ``"rot16"``, ``"sq@0.4+gptq-act"``, ``"gptq-act-clip"``
    (act-order, scale search), ``"gptq-act-clip-cd4"`` (and 4 refinement sweeps), ``"gptq-act-clip-cd4-refit2"``
    (and 2 scale refits), ``"gptq-act-clip-cd4-asym"`` (and the asymmetric objective), ``"rtn"``."""
    parts = []
    for item in _items(algorithm):
        if isinstance(item, str):
            parts.append({"smoothquant": "sq", "rotate": "rot"}.get(item, item))
        elif isinstance(item, SmoothQuant):
            parts.append("sq" + (f"@{item.alpha:g}" if item.alpha != 0.5 and not item.alphas else "")
                         + ("-search" if item.alphas else "") + ("-online" if item.online else ""))
        elif isinstance(item, Rotate):
            parts.append("rot" + (str(item.block_size) if item.block_size else ""))
        else:
            parts.append("gptq" + ("-act" if item.act_order else "") + ("-clip" if item.scale_search else "")
                         + (f"-cd{item.refine_sweeps}" if item.refine_sweeps else "")
                         + (f"-refit{item.scale_refits}" if item.scale_refits else "")
                         + ("-asym" if item.asymmetric else ""))
    return "+".join(parts)


def as_tuple(algorithm: Any) -> tuple:
    """``algorithm`` as a tuple of names and options objects."""
    return tuple(_items(algorithm))


__all__ = ["NAMES", "Plan", "as_tuple", "describe", "label", "names_of", "resolve", "without_transforms"]
