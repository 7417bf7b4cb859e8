"""The package's import graph: no cycle, and no module imports a higher layer.

Every module under ``liger_portable/`` is parsed with ``ast`` (nothing is imported). An edge is an
import of another module of the package, absolute (``import liger_portable.x``, ``from
liger_portable.x import y``) or relative (``from . import x``, ``from .x import y``, ``from .. import
x``), at module level or inside a function (a late import is still a dependency); only imports under
``if TYPE_CHECKING:`` are exempt. A package's ``__init__`` is a module of its own (the package's
name); ``from . import x`` inside package ``p`` is an edge to ``p.x`` when that is a module, else to
``p`` (a name ``p/__init__`` defines). ``from .x import y`` is an edge to ``x.y`` when that is a
module, else to ``x``. Importing ``p.x`` runs ``p/__init__`` first, but that implicit edge is not
counted (every sibling import would otherwise look like a cycle through the package).
"""

from __future__ import annotations

import ast
from pathlib import Path

import liger_portable

PKG = Path(liger_portable.__file__).resolve().parent
ROOT = "liger_portable"

# Lowest first. A module belongs to the layer of its first name below liger_portable
# (liger_portable.tuning.hooks is in "tuning"); liger_portable itself (its __init__) sits on top.
LAYERS: list[tuple[str, set[str]]] = [
    ("platform", {"hardware", "_paths", "_checks", "_autograd", "_warn"}),
    ("configs", {"configs", "autotune_cache", "specs", "_tables"}),
    # fallback: the pure-PyTorch twins of the kernels import nothing of the package, and
    # ops.fused_linear_cross_entropy uses fallback.cross_entropy.chunk_rows: a kernels-layer module.
    ("kernels", {"ops", "_dispatch", "fallback"}),
    ("tuning", {"tuning", "_warmup"}),
    ("API", {"functional", "nn", "chunked_loss", "_dtensor"}),
    ("patching", {"transformers"}),
    ("CLI", {"cli", "_arguments", "commands", "demo", "warmup", "__main__", "compile_matrix"}),
]
TOP = "package root"

# Edges that break the layer order today and cannot be fixed here (the modules are owned
# elsewhere), as (importer, imported). Keep this empty when possible.
KNOWN_LAYER_EXCEPTIONS: set[tuple[str, str]] = set()


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PKG).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join([ROOT, *parts])


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PKG.rglob("*.py"))}


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(tree: ast.AST):
    """Every Import/ImportFrom node, outside ``if TYPE_CHECKING:`` bodies (their else runs)."""
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            stack.extend(node.orelse)
            continue
        stack.extend(ast.iter_child_nodes(node))


def _resolve(name: str, known: set[str]) -> str | None:
    """The longest prefix of ``name`` that is a module of the package."""
    parts = name.split(".")
    while parts:
        candidate = ".".join(parts)
        if candidate in known:
            return candidate
        parts.pop()
    return None


def import_graph() -> dict[str, set[str]]:
    mods = modules()
    known = set(mods)
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for mod, path in mods.items():
        is_pkg = path.name == "__init__.py"
        package = mod if is_pkg else mod.rpartition(".")[0]
        targets: list[str] = []
        for node in _imports(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets += [a.name for a in node.names if a.name == ROOT or a.name.startswith(ROOT + ".")]
                continue
            if node.level:
                base_parts = package.split(".")
                base_parts = base_parts[: len(base_parts) - (node.level - 1)]
                assert base_parts and base_parts[0] == ROOT, f"{path}: relative import above the package"
                base = ".".join(base_parts)
            elif node.module and (node.module == ROOT or node.module.startswith(ROOT + ".")):
                base = ""
            else:
                continue
            source = ".".join(p for p in (base, node.module) if p)
            for alias in node.names:
                sub = f"{source}.{alias.name}"
                targets.append(sub if sub in known else source)
        for t in targets:
            target = _resolve(t, known)
            assert target is not None, f"{path}: imports {t}, which is no module of the package"
            if target != mod:
                graph[mod].add(target)
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of the graph as [a, b, ..., a], or None."""
    state: dict[str, int] = {}  # 1: on the stack, 2: done
    stack: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        stack.append(m)
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                return stack[stack.index(n):] + [n]
            if n not in state:
                found = visit(n)
                if found:
                    return found
        stack.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state:
            found = visit(m)
            if found:
                return found
    return None


def layer_of(mod: str) -> int:
    if mod == ROOT:
        return len(LAYERS)
    first = mod.split(".")[1]
    for i, (_, names) in enumerate(LAYERS):
        if first in names:
            return i
    raise AssertionError(f"{mod} is in no layer of LAYERS: add it to the list in {__file__}")


def layer_name(i: int) -> str:
    return LAYERS[i][0] if i < len(LAYERS) else TOP


def test_the_graph_sees_imports():
    """The parser finds the imports it must (a broken parser would pass the tests below)."""
    graph = import_graph()
    assert "liger_portable.configs" in graph["liger_portable.tuning.search"]
    assert "liger_portable.tuning.hooks" in graph["liger_portable.warmup"]  # a late import
    assert "liger_portable.ops._problem" in graph["liger_portable.tuning.hooks"]  # from ..ops._problem import
    assert "liger_portable.ops.rms_norm" in graph["liger_portable.functional"]  # from .ops import rms_norm
    assert "liger_portable.tuning" in graph["liger_portable.functional"]  # from . import tuning
    assert "liger_portable.tuning.runtime" in graph["liger_portable.tuning"]


def test_no_import_cycle():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_every_module_has_a_layer():
    for mod in modules():
        layer_of(mod)


def test_no_module_imports_a_higher_layer():
    bad = []
    for mod, targets in import_graph().items():
        for t in sorted(targets):
            if layer_of(t) > layer_of(mod) and (mod, t) not in KNOWN_LAYER_EXCEPTIONS:
                bad.append(f"{mod} ({layer_name(layer_of(mod))}) imports {t} ({layer_name(layer_of(t))})")
    assert bad == [], "imports of a higher layer:\n" + "\n".join(bad)


def test_known_exceptions_are_still_needed():
    graph = import_graph()
    stale = [e for e in KNOWN_LAYER_EXCEPTIONS if e[1] not in graph.get(e[0], set())]
    assert stale == [], f"remove these from KNOWN_LAYER_EXCEPTIONS, the imports are gone: {stale}"


def test_config_lookup_never_reaches_the_tuner():
    """resolve() is a pure lookup: nothing the configs layer imports, directly or not, is tuning."""
    graph = import_graph()
    seen, todo = set(), ["liger_portable.configs"]
    while todo:
        m = todo.pop()
        if m not in seen:
            seen.add(m)
            todo.extend(graph[m])
    assert not {m for m in seen if layer_of(m) >= layer_of("liger_portable.tuning")}, sorted(seen)
