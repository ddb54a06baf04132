"""The layout keeps its promises: packages import only the layers under them (compute ->
nn -> model -> engine -> cli, late imports included), no import cycles inside
colibri_core, interfaces import no implementation, and only the registry entry names the
built-in CPU backend."""

from __future__ import annotations

import ast
from pathlib import Path

import colibri_core

ROOT = Path(colibri_core.__file__).parent


def _module_name(path: Path, root: Path = ROOT) -> str:
    rel = path.relative_to(root.parent).with_suffix("")
    parts = list(rel.parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, *, top_level_only: bool, root: Path = ROOT) -> set[str]:
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
            for alias in node.names:  # "from colibri_core.x import module" names the module, not the package
                submodule = f"{node.module}.{alias.name}"
                found.add(submodule if _is_module(submodule, root) else node.module)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("colibri_core"))
    return found


def _is_module(name: str, root: Path) -> bool:
    path = root.parent.joinpath(*name.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def _graph(top_level_only: bool, root: Path = ROOT) -> dict[str, set[str]]:
    modules = {_module_name(p, root): p for p in root.rglob("*.py")}
    return {name: {m for m in _imports(path, top_level_only=top_level_only, root=root) if m in modules and m != name}
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
        if name.startswith("colibri_core.compute.cpu"):
            continue
        if any(m.startswith("colibri_core.compute.cpu") for m in _imports(path, top_level_only=False)):
            offenders.append(name)
    assert not offenders


def test_interfaces_import_no_implementation():
    """The contract modules (families, formats, backends, tiers) stand alone."""
    interfaces = {"colibri_core.compute.backend": ROOT / "compute/backend.py", "colibri_core.model.family": ROOT / "model/family.py",
                  "colibri_core.formats.base": ROOT / "formats/base.py"}
    for name, path in interfaces.items():
        imported = _imports(path, top_level_only=False)
        assert not {m for m in imported if m.startswith(("colibri_core.compute.cpu", "colibri_core.compute.reference",
                                                           "colibri_core.cli", "colibri_core.experts"))}, name


# The layers, lowest first: a module may import its own layer and those under it, never
# one above, not even inside a function. The package facade (``colibri_core``: ``load``)
# stands with the engine; the root's small modules (errors, units, ...) under everything.
LAYERS = (
    ("base", ("colibri_core.errors", "colibri_core.units", "colibri_core.warn", "colibri_core.interrupts",
              "colibri_core.version")),
    ("io", ("colibri_core.io",)),
    ("formats", ("colibri_core.formats",)),
    ("plugins", ("colibri_core.plugins",)),
    ("compute", ("colibri_core.compute",)),
    ("nn", ("colibri_core.nn",)),
    ("model", ("colibri_core.model",)),
    ("experts", ("colibri_core.experts",)),
    ("engine", ("colibri_core.engine", "colibri_core")),
    ("cli", ("colibri_core.cli", "colibri_core.__main__")),
    ("testing", ("colibri_core.testing",)),
)


def _layer(module: str) -> int:
    for rank, (_, prefixes) in enumerate(LAYERS):
        if any(module == p or (p != "colibri_core" and module.startswith(p + ".")) for p in prefixes):
            return rank
    raise AssertionError(f"{module} belongs to no layer: add it to LAYERS")


def test_every_module_has_a_layer():
    for name in _graph(top_level_only=False):
        _layer(name)


def test_packages_import_only_the_layers_under_them():
    upward = sorted(f"{name} ({LAYERS[_layer(name)][0]}) imports {dep} ({LAYERS[_layer(dep)][0]})"
                    for name, deps in _graph(top_level_only=False).items() for dep in deps
                    if _layer(dep) > _layer(name))
    assert not upward, "upward imports:\n" + "\n".join(upward)


def test_the_layering_check_sees_a_late_upward_import(tmp_path):
    """The check above can fail: a function-level import of the engine from nn is caught."""
    fake = tmp_path / "colibri_core"
    (fake / "nn").mkdir(parents=True)
    (fake / "engine").mkdir()
    for path in (fake / "__init__.py", fake / "nn" / "__init__.py", fake / "engine" / "__init__.py",
                 fake / "engine" / "api.py"):
        path.write_text("")
    (fake / "nn" / "layers.py").write_text("def f():\n    from colibri_core.engine import api\n")
    graph = _graph(top_level_only=False, root=fake)
    assert graph["colibri_core.nn.layers"] == {"colibri_core.engine.api"}
    assert _layer("colibri_core.engine.api") > _layer("colibri_core.nn.layers")
