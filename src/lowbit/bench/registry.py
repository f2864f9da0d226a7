"""The registry of ``lowbit bench``: ops (a named ``setup(shape, ctx) -> Case`` plus the shapes it runs at,
all timed by the runner) and suites (the model-level benchmarks with their own command line: e2e, dit,
offload).

Nothing here touches a GPU or imports triton; ``setup`` allocates on ``ctx.device`` only when called, and a
suite's module is imported only when it runs.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

Shape = tuple[int, ...]
# a baseline is a zero-argument callable to time, or a string saying why it cannot run here
Baseline = Callable[[], Any] | str


class Skip(Exception):
    """Raised by ``setup`` when the op cannot run here (no kernel yet, a missing package); not a failure."""


@dataclass(frozen=True)
class Context:
    """Where and how a case is set up.

    Attributes:
        device: ``"cuda"`` for timing; tests use ``"cpu"``.
        backend: lowbit backend the timed function uses (``"triton"`` on the GPU, ``"torch"`` in CPU tests).
        baselines: build the case's baselines (they may call ``torch.compile``; the runner asks for them
            at one shape per op unless told otherwise).
        check: build the case's correctness check (the gate: a case whose check fails reports no numbers).
    """

    device: str = "cuda"
    backend: str = "triton"
    baselines: bool = True
    check: bool = True


@dataclass
class Case:
    """One op at one shape, ready to time.

    Attributes:
        fn: zero-argument callable that runs the op once (outputs may be discarded).
        bytes: bytes the op must move: every input read once plus every output written once.
        flops: floating-point operations (0 for quantize/dequantize).
        baselines: name -> callable timed the same way, or a string saying why it is skipped. Their
            speedup is ``baseline_ms / fn_ms`` (above 1: lowbit is faster), on the same bytes.
        check: raises AssertionError when ``fn``'s result differs from the reference; None: no check. It may
            return a string saying what it checked (``"rel_fro 2.1e-03 <= 1e-02, ..."``: a tolerance check);
            returning None means bit for bit.
        graph: also time under a CUDA graph (tiny launches); None lets the runner decide by size.
        note: free text carried into the row.
        check_numel: elements the check computes (the runner skips checks above its limit); None: the
            product of the shape (right for elementwise ops, far too many for a matmul's M x N x K).
    """

    fn: Callable[[], Any]
    bytes: int
    flops: int = 0
    baselines: dict[str, Baseline] = field(default_factory=dict)
    check: Callable[[], None] | None = None
    graph: bool | None = None
    note: str = ""
    check_numel: int | None = None


@dataclass(frozen=True)
class Op:
    """A registered benchmark op.

    Attributes:
        name: dotted name, ``<kind>.<format>[.<variant>]`` (``quantize.nvfp4.swizzled``).
        setup: ``setup(shape, ctx) -> Case``; may raise :class:`Skip`.
        shapes: default shapes.
        quick_shapes: shapes for ``--quick`` (default: the first of ``shapes``).
        baseline_shape: the shape at which baselines run by default (default: the middle of ``shapes``).
        nbytes: ``nbytes(shape) -> int`` computed without allocating; the runner checks ``Case.bytes``
            against it, and the tests check it against hand-computed numbers.
        unavailable: ``unavailable(ctx) -> str | None``: a cheap reason to skip before any allocation.
        doc: one line for ``lowbit bench --list``.
        baselines_everywhere: the baselines are cheap (nothing to compile: cuBLAS, a peer's kernel), so
            ``--baselines one`` times them at every shape, as the speedups are the point of the op.
    """

    name: str
    setup: Callable[[Shape, Context], Case]
    shapes: tuple[Shape, ...]
    quick_shapes: tuple[Shape, ...] = ()
    baseline_shape: Shape | None = None
    nbytes: Callable[[Shape], int] | None = None
    unavailable: Callable[[Context], str | None] | None = None
    doc: str = ""
    baselines_everywhere: bool = False

    def __post_init__(self) -> None:
        if not self.shapes:
            raise ValueError(f"op {self.name!r} has no shapes")
        object.__setattr__(self, "shapes", tuple(tuple(int(d) for d in s) for s in self.shapes))
        object.__setattr__(
            self,
            "quick_shapes",
            tuple(tuple(int(d) for d in s) for s in self.quick_shapes) or self.shapes[:1],
        )
        if self.baseline_shape is None:
            object.__setattr__(self, "baseline_shape", self.shapes[len(self.shapes) // 2])


REGISTRY: dict[str, Op] = {}


def register(op: Op, *, replace: bool = False) -> Op:
    """Add ``op`` to :data:`REGISTRY`; a second op of the same name is an error unless ``replace``."""
    if op.name in REGISTRY and not replace:
        raise ValueError(f"op {op.name!r} is already registered")
    REGISTRY[op.name] = op
    return op


def matches(name: str, pattern: str) -> bool:
    """``pattern`` is a glob (``quantize.mx*``) or a dotted part of the name (``nvfp4``, ``quantize``)."""
    return fnmatch.fnmatchcase(name, pattern) or pattern in name.split(".") or name.startswith(pattern + ".")


def select(patterns: list[str] | None = None) -> list[Op]:
    """Registered ops matching any of ``patterns`` (all when None or empty), in registration order.

    A pattern that matches nothing is a ValueError (a typo should not silently benchmark nothing).
    """
    if not patterns:
        return list(REGISTRY.values())
    for p in patterns:
        if not any(matches(n, p) for n in REGISTRY):
            raise ValueError(f"--ops pattern {p!r} matches no registered op; known: {sorted(REGISTRY)}")
    return [op for n, op in REGISTRY.items() if any(matches(n, p) for p in patterns)]


def parse_shapes(text: str) -> list[Shape]:
    """``"4096x4096,1x7168,8192"`` -> ``[(4096, 4096), (1, 7168), (8192, 8192)]`` (a lone N is NxN)."""
    shapes: list[Shape] = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        try:
            dims = tuple(int(d) for d in part.lower().split("x"))
        except ValueError:
            raise ValueError(f"bad shape {part!r}: use e.g. 4096x4096 or 1x7168") from None
        if any(d <= 0 for d in dims):
            raise ValueError(f"bad shape {part!r}: dims must be positive")
        shapes.append(dims * 2 if len(dims) == 1 else dims)
    if not shapes:
        raise ValueError(f"no shapes in {text!r}")
    return shapes


def shape_str(shape: Shape) -> str:
    return "x".join(str(d) for d in shape)


@dataclass(frozen=True)
class Suite:
    """A model-level benchmark with its own command line (``lowbit bench <name> [its options]``).

    Attributes:
        name: the subcommand (``e2e``).
        module: the module whose ``main(argv) -> int`` runs it (imported only then).
        doc: one line for ``lowbit bench --list``.
    """

    name: str
    module: str
    doc: str = ""

    def main(self, argv: list[str]) -> int:
        import importlib

        return importlib.import_module(self.module).main(list(argv))


SUITES: dict[str, Suite] = {}
RESERVED = ("compare",)
"""``lowbit bench`` subcommands that are not suites (``lowbit bench compare NEW.json BASELINE.json``)."""


def register_suite(suite: Suite, *, replace: bool = False) -> Suite:
    """Add ``suite`` to :data:`SUITES`; its name must not collide with another suite or a subcommand."""
    if suite.name in SUITES and not replace:
        raise ValueError(f"suite {suite.name!r} is already registered")
    if suite.name.startswith("-") or suite.name in RESERVED:
        raise ValueError(f"suite name {suite.name!r} is reserved")
    SUITES[suite.name] = suite
    return suite
