"""The layout keeps its promises: no import cycles inside colibri_core, interfaces import
no implementation, and only the registry entry names the built-in CPU backend."""

from __future__ import annotations

import ast
from pathlib import Path

import colibri_core

ROOT = Path(colibri_core.__file__).parent


def _module_name(path: Path) -> str:
    rel = path.relative_to(ROOT.parent).with_suffix("")
    parts = list(rel.parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, *, top_level_only: bool) -> set[str]:
    """colibri_core modules a file imports (module-level statements only, when asked:
    imports inside functions run late and cannot form an import-time cycle)."""
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):  # annotation-only imports never run
        if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING":
            node.body = []
    nodes = tree.body if top_level_only else list(ast.walk(tree))
    found = set()
    for node in nodes:
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0 and node.module.startswith("colibri_core"):
            found.add(node.module)
            for alias in node.names:  # "from colibri_core.x import module"
                found.add(f"{node.module}.{alias.name}")
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("colibri_core"))
    return found


def _graph(top_level_only: bool) -> dict[str, set[str]]:
    modules = {_module_name(p): p for p in ROOT.rglob("*.py")}
    return {name: {m for m in _imports(path, top_level_only=top_level_only) if m in modules and m != name}
            for name, path in modules.items()}


def test_no_relative_imports_so_moves_stay_visible():
    offenders = [str(p) for p in ROOT.rglob("*.py") if any(isinstance(n, ast.ImportFrom) and n.level
                                                           for n in ast.walk(ast.parse(p.read_text())))]
    assert not offenders


def test_no_import_cycles_in_the_core():
    graph = _graph(top_level_only=False)  # late imports too: a cycle through a function is still a tangle
    seen, stack, cycles = set(), [], []

    def visit(node):
        if node in stack:
            cycles.append(stack[stack.index(node):] + [node])
            return
        if node in seen:
            return
        seen.add(node)
        stack.append(node)
        for nxt in sorted(graph[node]):
            if not nxt.endswith("__init__"):
                visit(nxt)
        stack.pop()

    for module in sorted(graph):
        visit(module)
    # a package's __init__ importing its own submodules is not a cycle of the design
    real = [c for c in cycles if not any(c[i + 1].startswith(c[i] + ".") or c[i].startswith(c[i + 1] + ".")
                                         for i in range(len(c) - 1))]
    assert not real, "import cycles: " + "; ".join(" -> ".join(c) for c in real)


def test_only_the_registry_entry_names_the_cpu_backend():
    offenders = []
    for path in ROOT.rglob("*.py"):
        name = _module_name(path)
        if name.startswith("colibri_core.backends.cpu"):
            continue
        if any(m.startswith("colibri_core.backends.cpu") for m in _imports(path, top_level_only=False)):
            offenders.append(name)
    assert not offenders


def test_interfaces_import_no_implementation():
    """The contract modules (families, formats, backends, tiers) stand alone."""
    interfaces = {"colibri_core.engine.backend": ROOT / "engine/backend.py", "colibri_core.model.family": ROOT / "model/family.py",
                  "colibri_core.formats.base": ROOT / "formats/base.py"}
    for name, path in interfaces.items():
        imported = _imports(path, top_level_only=False)
        assert not {m for m in imported if m.startswith(("colibri_core.backends", "colibri_core.engine.reference",
                                                           "colibri_core.cli", "colibri_core.experts"))}, name
