"""Does a plugin use only colibri-core's public API? ``private_imports(package_dir)`` parses
every ``.py`` file under it (``ast``; nothing is imported) and lists each import of a
colibri_core module or name outside ``colibri_core.plugins.public.PUBLIC_API``. Imports
of anything else (the standard library, numpy, the plugin itself) are the plugin's own
business."""

from __future__ import annotations

import ast
from pathlib import Path

from colibri_core.plugins.public import PUBLIC_API, public_names


def _is_core(module: str) -> bool:
    return module == "colibri_core" or module.startswith("colibri_core.")


def private_imports(package_dir: str | Path) -> list[str]:
    """``"file:line: what"`` for every non-public colibri_core import under ``package_dir``."""
    found = []
    for path in sorted(Path(package_dir).rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        for node in ast.walk(tree):
            where = f"{path}:{getattr(node, 'lineno', 0)}"
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if _is_core(alias.name) and alias.name not in PUBLIC_API:
                        found.append(f"{where}: import {alias.name} (not a public module)")
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module and _is_core(node.module):
                names = public_names(node.module)
                if names is None:
                    found.append(f"{where}: from {node.module} import ... (not a public module)")
                    continue
                for alias in node.names:
                    submodule = f"{node.module}.{alias.name}"
                    if alias.name not in names and submodule not in PUBLIC_API:
                        found.append(f"{where}: from {node.module} import {alias.name} (not public)")
    return found
