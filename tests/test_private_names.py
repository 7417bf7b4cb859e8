"""No module, script or test reads another module's private names.

The project rule: what users and scripts call is public API without underscores, and nothing reads
a name with a leading underscore from another module. Every ``.py`` file under ``liger_portable/``,
``scripts/`` and ``tests/`` is parsed with ``ast`` (nothing is imported) and these are flagged:

(a) ``from liger_portable.x import _y`` / ``from .x import _y`` / ``from benchlib import _y``: an
    imported name with a leading underscore (dunders are fine; so is a private *module*:
    ``from liger_portable import _dispatch`` names a module);
(b) ``m._y`` where ``m`` is bound to a module of the package (or a local script/test helper module)
    by an import anywhere in the file: ``import liger_portable.a.b as m``, ``from liger_portable.a
    import b as m``, ``from . import b``, ``import liger_portable`` (then ``liger_portable.a.b._y``,
    the chain followed through modules), ``m = importlib.import_module("liger_portable.a.b")``;
(c) the same through strings: ``getattr/setattr/hasattr/delattr(m, "_y")``,
    ``monkeypatch.setattr(m, "_y", ...)``, ``mock.patch.object(m, "_y", ...)``,
    ``monkeypatch.setattr("liger_portable.a._y", ...)``, ``mock.patch("liger_portable.a._y")``;
    ``m = importlib.import_module(f"liger_portable.ops.{name}")`` binds ``m`` to any module of
    ``liger_portable.ops`` (reported as ``liger_portable.ops.*``).

A module's own names are fine; there are no exceptions.
"""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
ROOT = "liger_portable"
PKG = REPO / ROOT
FOLDERS = [REPO / "liger_portable", REPO / "scripts", REPO / "tests"]

def is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def python_files() -> list[Path]:
    return sorted(p for folder in FOLDERS for p in folder.rglob("*.py"))


def module_name(path: Path) -> str:
    """The dotted name a file is imported by: ``liger_portable.a.b`` for the package's files, the
    bare file name for scripts and tests (they import each other as top-level modules)."""
    if PKG in path.parents:
        parts = list(path.relative_to(REPO).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        return ".".join(parts)
    return path.stem


def known_modules() -> set[str]:
    return {module_name(p) for p in python_files()}


KNOWN = known_modules()
LOCAL = {m for m in KNOWN if not m.startswith(ROOT)}  # scripts/ and tests/ helper modules


def _tracked(mod: str) -> bool:
    return mod in KNOWN and (mod == ROOT or mod.startswith(ROOT + ".") or mod in LOCAL)


def _dotted(node: ast.expr) -> list[str] | None:
    """``a.b.c`` as ["a", "b", "c"], or None if it is not a plain chain of names."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    return [node.id, *reversed(parts)]


class Finder:
    """The private reads of one file, as (line, module read, private name)."""

    def __init__(self, path: Path):
        self.path = path
        self.own = module_name(path)
        self.package = self.own if path.name == "__init__.py" else self.own.rpartition(".")[0]
        self.tree = ast.parse(path.read_text(), str(path))
        self.bound: dict[str, str] = {}  # local name -> module it is bound to (anywhere in the file)
        self.found: list[tuple[int, str, str]] = []

    def flag(self, node: ast.AST, mod: str, name: str) -> None:
        if mod != self.own:
            self.found.append((node.lineno, mod, name))

    def _from_base(self, node: ast.ImportFrom) -> str | None:
        if node.level:
            if not self.own.startswith(ROOT):
                return None
            parts = self.package.split(".")
            parts = parts[: len(parts) - (node.level - 1)]
            return ".".join(p for p in (".".join(parts), node.module) if p)
        return node.module

    def bind(self) -> None:
        for node in ast.walk(self.tree):
            if isinstance(node, ast.Import):
                for a in node.names:
                    if a.asname:
                        if _tracked(a.name):
                            self.bound[a.asname] = a.name
                    else:
                        top = a.name.split(".")[0]
                        if _tracked(top):
                            self.bound[top] = top
            elif isinstance(node, ast.ImportFrom):
                base = self._from_base(node)
                if base is None or not _tracked(base):
                    continue
                for a in node.names:
                    sub = f"{base}.{a.name}"
                    if sub in KNOWN:
                        self.bound[a.asname or a.name] = sub
                    elif is_private(a.name):
                        self.flag(node, base, a.name)  # (a)
            elif (
                isinstance(node, ast.Assign)
                and len(node.targets) == 1
                and isinstance(node.targets[0], ast.Name)
                and isinstance(node.value, ast.Call)
                and (_dotted(node.value.func) or [""])[-1] == "import_module"
                and node.value.args
            ):
                arg = node.value.args[0]
                if isinstance(arg, ast.Constant) and isinstance(arg.value, str) and _tracked(arg.value):
                    self.bound[node.targets[0].id] = arg.value
                elif (  # import_module(f"liger_portable.ops.{name}"): any module of that package
                    isinstance(arg, ast.JoinedStr)
                    and isinstance(arg.values[0], ast.Constant)
                    and arg.values[0].value.endswith(".")
                    and _tracked(arg.values[0].value[:-1])
                ):
                    self.bound[node.targets[0].id] = arg.values[0].value + "*"

    def module_of(self, node: ast.expr) -> str | None:
        """The module an expression names (``m``, ``liger_portable.ops``), or None."""
        parts = _dotted(node)
        if parts is None or parts[0] not in self.bound:
            return None
        mod = self.bound[parts[0]]
        if mod.endswith(".*"):
            return mod if len(parts) == 1 else None
        for p in parts[1:]:
            if f"{mod}.{p}" not in KNOWN:
                return None
            mod = f"{mod}.{p}"
        return mod

    def check_string_target(self, node: ast.AST, target: str) -> None:
        """``monkeypatch.setattr("liger_portable.a.b._y", ...)``."""
        parts = target.split(".")
        if not _tracked(parts[0]):
            return
        mod = parts[0]
        for p in parts[1:]:
            if f"{mod}.{p}" in KNOWN:
                mod = f"{mod}.{p}"
            else:
                if is_private(p):
                    self.flag(node, mod, p)
                return

    def run(self) -> list[tuple[int, str, str]]:
        self.bind()
        for node in ast.walk(self.tree):
            if isinstance(node, ast.Attribute) and is_private(node.attr):  # (b)
                mod = self.module_of(node.value)
                if mod is not None and f"{mod}.{node.attr}" not in KNOWN:
                    self.flag(node, mod, node.attr)
            elif isinstance(node, ast.Call) and node.args:  # (c)
                func = _dotted(node.func) or [""]
                first = node.args[0]
                by_name = func[-1] in ("getattr", "setattr", "hasattr", "delattr") or func[-2:] == ["patch", "object"]
                if by_name and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant):
                    mod = self.module_of(first)
                    if mod is not None and isinstance(node.args[1].value, str) and is_private(node.args[1].value):
                        self.flag(node, mod, node.args[1].value)
                by_path = func[-1] in ("setattr", "delattr", "patch")
                if by_path and isinstance(first, ast.Constant) and isinstance(first.value, str):
                    self.check_string_target(node, first.value)
        return sorted(set(self.found))


def private_reads() -> dict[tuple[str, str, str], list[int]]:
    """Every private read, as (file relative to the repository, module, name) -> lines."""
    reads: dict[tuple[str, str, str], list[int]] = {}
    for path in python_files():
        for line, mod, name in Finder(path).run():
            reads.setdefault((str(path.relative_to(REPO)), mod, name), []).append(line)
    return reads


def _check(source: str, path: str = "tests/test_x.py") -> list[tuple[str, str]]:
    f = Finder.__new__(Finder)
    f.path = REPO / path
    f.own = module_name(f.path)
    f.package = f.own if f.path.name == "__init__.py" else f.own.rpartition(".")[0]
    f.tree = ast.parse(source)
    f.bound, f.found = {}, []
    return [(mod, name) for _, mod, name in f.run()]


def test_the_finder_sees_private_reads():
    """The finder flags what it must (a broken finder would pass the test below)."""
    assert _check("from liger_portable.configs import _memo, resolve") == [("liger_portable.configs", "_memo")]
    assert _check("from liger_portable import configs\nconfigs._memo.clear()") == [("liger_portable.configs", "_memo")]
    assert _check("import liger_portable.configs as c\nc._memo") == [("liger_portable.configs", "_memo")]
    assert _check("import liger_portable.ops.mlp\nliger_portable.ops.mlp._x") == [("liger_portable.ops.mlp", "_x")]
    assert _check("from liger_portable.ops import rms_norm as ops\nops._k") == [("liger_portable.ops.rms_norm", "_k")]
    assert _check("import importlib\nm = importlib.import_module('liger_portable.ops.rope')\nm._k") == [
        ("liger_portable.ops.rope", "_k")
    ]
    assert _check("def t(monkeypatch):\n from liger_portable import autotune_cache\n monkeypatch.setattr(autotune_cache, '_x', 1)") == [
        ("liger_portable.autotune_cache", "_x")
    ]
    assert _check("def t(monkeypatch):\n monkeypatch.setattr('liger_portable.autotune_cache._x', 1)") == [
        ("liger_portable.autotune_cache", "_x")
    ]
    assert _check("from unittest import mock\nfrom liger_portable import configs\nmock.patch.object(configs, '_c', 1)") == [
        ("liger_portable.configs", "_c")
    ]
    assert _check("from unittest import mock\nmock.patch('liger_portable.ops.mlp._c', 1)") == [("liger_portable.ops.mlp", "_c")]
    src = "import importlib\nfor n in ('a', 'b'):\n m = importlib.import_module(f'liger_portable.ops.{n}')\n m._e = 1"
    assert _check(src) == [("liger_portable.ops.*", "_e")]
    assert _check("from benchlib import _helper") == [("benchlib", "_helper")]
    src = "from ..configs import _check_config\nfrom . import hooks\nhooks._y"
    assert _check(src, "liger_portable/tuning/search.py") == [
        ("liger_portable.configs", "_check_config"),
        ("liger_portable.tuning.hooks", "_y"),
    ]
    # fine: a private module, dunders, public names, a module's own names, other packages' names
    assert _check("from liger_portable import _dispatch\n_dispatch.simulate\nliger_portable.__version__") == []
    assert _check("import liger_portable\nliger_portable.configs.resolve\nliger_portable.__file__") == []
    assert _check("from liger_portable.configs import _memo", "liger_portable/configs.py") == []
    assert _check("import torch\ntorch._dynamo\nx = object()\nx._y") == []


def test_no_private_reads_across_modules():
    reads = private_reads()
    bad = [f"{f}:{lines[0]} reads {mod}.{name}" for (f, mod, name), lines in sorted(reads.items())]
    assert bad == [], "private names read from another module (make them public):\n" + "\n".join(bad)
