"""No module of src/lowbit reaches into another module's private names. CPU only, reads the sources (AST).

The rule:

* a name with one leading underscore (``_name``; dunders such as ``__version__`` excepted) defined in module A
  may be used only inside A: ``from A import _name``, ``import A._name`` and ``A._name`` (A bound to a module by
  an import) anywhere else are violations. A helper more than one module needs gets a public name (where it
  lives says who may use it), or moves to the module that uses it;
* a module whose own name starts with an underscore (``lowbit.kernels._launch``) is internal to its package:
  only modules of that package (``lowbit.kernels`` and its subpackages) may import it or reach it as an
  attribute; anything outside goes through a public module.

Only lowbit's own modules are checked (``torch._scaled_mm`` is torch's business); attributes of objects that
are not modules (``t._version``, ``self._cache``) are not names of a module and are out of scope.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"
PKG = "lowbit"


def _is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _module_name(path: Path, src: Path) -> str:
    parts = list(path.relative_to(src).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _package_of(module: str, is_package: bool) -> str:
    return module if is_package else module.rpartition(".")[0]


def _resolve(node: ast.ImportFrom, module: str, is_package: bool) -> str:
    if not node.level:
        return node.module or ""
    base = _package_of(module, is_package).split(".")
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _private_module_owner(dotted: str) -> tuple[str, str] | None:
    """(private module, package allowed to use it) for the first underscore-named part of ``dotted``."""
    parts = dotted.split(".")
    for i, part in enumerate(parts):
        if i and _is_private(part):
            return ".".join(parts[: i + 1]), ".".join(parts[:i])
    return None


def _inside(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def violations(files: dict[str, tuple[str, bool]]) -> list[str]:
    """``files``: module name -> (source, is_package). One 'module:line: what' per violation."""
    modules = set(files)
    found: list[str] = []

    def check_module_use(where: str, line: int, target: str, user: str) -> None:
        """``user`` imports or reaches module (or module attribute) ``target``."""
        if not _inside(target, PKG):
            return
        owner = _private_module_owner(target)
        if owner and not _inside(user, owner[1]):
            found.append(f"{where}:{line}: {owner[0]} (private module of {owner[1]})")

    for mod, (source, is_package) in sorted(files.items()):
        tree = ast.parse(source)
        where = mod.replace(".", "/") + ("/__init__.py" if is_package else ".py")
        bound: dict[str, str] = {}  # local name -> lowbit module it is bound to
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    check_module_use(where, node.lineno, alias.name, mod)
                    if alias.asname:
                        bound[alias.asname] = alias.name
                    else:
                        bound[alias.name.split(".")[0]] = alias.name.split(".")[0]
            elif isinstance(node, ast.ImportFrom):
                src_mod = _resolve(node, mod, is_package)
                if not _inside(src_mod, PKG):
                    continue
                check_module_use(where, node.lineno, src_mod, mod)
                for alias in node.names:
                    full = f"{src_mod}.{alias.name}"
                    if full in modules:  # a submodule
                        check_module_use(where, node.lineno, full, mod)
                        bound[alias.asname or alias.name] = full
                    elif _is_private(alias.name) and src_mod != mod:
                        found.append(f"{where}:{node.lineno}: {full}")
        # module attributes: m._name, pkg.sub._name, pkg._private_module
        for node in ast.walk(tree):
            if not isinstance(node, ast.Attribute):
                continue
            chain, base = [node.attr], node.value
            while isinstance(base, ast.Attribute):
                chain.append(base.attr)
                base = base.value
            if not isinstance(base, ast.Name) or base.id not in bound:
                continue
            dotted = bound[base.id]
            for attr in reversed(chain):
                target = f"{dotted}.{attr}"
                if target in modules:
                    check_module_use(where, node.lineno, target, mod)
                    dotted = target
                    continue
                if _is_private(attr) and dotted != mod and dotted in modules:
                    found.append(f"{where}:{node.lineno}: {target}")
                break
    # ast.walk visits every link of an attribute chain: report each (line, name) once
    return sorted(set(found))


def _tree() -> dict[str, tuple[str, bool]]:
    files = {}
    for path in sorted((SRC / PKG).rglob("*.py")):
        files[_module_name(path, SRC)] = (path.read_text(encoding="utf-8"), path.name == "__init__.py")
    return files


@pytest.mark.parametrize(
    ("files", "expect"),
    [
        ({"lowbit.a": ("def _f(): pass\n", False), "lowbit.b": ("from .a import _f\n", False)},
         ["lowbit/b.py:1: lowbit.a._f"]),
        ({"lowbit.a": ("def _f(): pass\n", False), "lowbit.b": ("from lowbit import a\na._f()\n", False)},
         ["lowbit/b.py:2: lowbit.a._f"]),
        ({"lowbit.a": ("def _f(): pass\n", False), "lowbit.b": ("import lowbit.a as m\nm._f()\n", False)},
         ["lowbit/b.py:2: lowbit.a._f"]),
        ({"lowbit.k": ("", True), "lowbit.k._x": ("y = 1\n", False), "lowbit.o": ("", True),
          "lowbit.o.u": ("from ..k._x import y\n", False)},
         ["lowbit/o/u.py:1: lowbit.k._x (private module of lowbit.k)"]),
        ({"lowbit.k": ("", True), "lowbit.k._x": ("y = 1\n", False), "lowbit.u": ("", False),
          "lowbit.u2": ("import lowbit.k._x\nlowbit.k._x.y\n", False)},
         ["lowbit/u2.py:1: lowbit.k._x (private module of lowbit.k)",
          "lowbit/u2.py:2: lowbit.k._x (private module of lowbit.k)"]),
        ({"lowbit.k": ("", True), "lowbit.k._x": ("y = 1\n", False), "lowbit.u": ("from .k import _x\n", False)},
         ["lowbit/u.py:1: lowbit.k._x (private module of lowbit.k)"]),
        ({"lowbit.k": ("", True), "lowbit.k._x": ("y = 1\n", False),
          "lowbit.u": ("from lowbit import k\nk._x.y\n", False)},
         ["lowbit/u.py:2: lowbit.k._x (private module of lowbit.k)"]),
    ],
)
def test_detector_catches(files, expect):
    assert violations(files) == expect


@pytest.mark.parametrize(
    "files",
    [
        {"lowbit.a": ("def _f(): pass\n_f()\nfrom .a import _f\n", False)},
        {"lowbit.k": ("", True), "lowbit.k._x": ("def f(): pass\n", False),
         "lowbit.k.y": ("from ._x import f\nfrom . import _x\n_x.f()\n", False)},
        {"lowbit.a": ("import torch\ntorch._scaled_mm\nt._version\nself._c\n__all__ = []\n", False)},
        {"lowbit.a": ("__version__ = '1'\n", False), "lowbit.b": ("from .a import __version__\n", False)},
    ],
)
def test_detector_passes(files):
    assert violations(files) == []


def test_src_has_no_private_cross_module_imports():
    files = _tree()
    assert len(files) > 50, f"found only {len(files)} modules under {SRC / PKG}"
    bad = violations(files)
    assert not bad, "private names used outside their module (see this test's docstring):\n" + "\n".join(bad)
