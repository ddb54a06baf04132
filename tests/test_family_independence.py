"""No family distribution depends on another: each requires only colibri-core (plus
third-party packages) and no module of one imports another family's package, so a family
installs and runs alone. Shared code belongs in the core (``colibri_core.nn``)."""

import ast
import re
import tomllib
from pathlib import Path

import pytest

FAMILIES = sorted(p.parent for p in (Path(__file__).resolve().parents[1] / "families").glob("*/pyproject.toml"))


def packages(family: Path) -> set[str]:
    return {p.parent.name for p in family.glob("*/__init__.py")}


def project(family: Path) -> dict:
    return tomllib.loads((family / "pyproject.toml").read_text())["project"]


ALL_PACKAGES = {name for family in FAMILIES for name in packages(family)}


def imported_roots(source: Path) -> set[str]:
    """The top-level package of every import in ``source``, wherever it is (functions included)."""
    roots = set()
    for node in ast.walk(ast.parse(source.read_text(), str(source))):
        if isinstance(node, ast.Import):
            roots |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            roots.add(node.module.split(".")[0])
    return roots


def test_every_family_is_found():
    assert {f.name for f in FAMILIES} >= {"colibri-olmoe", "colibri-qwen", "colibri-deepseek", "colibri-kimi", "colibri-glm",
                                          "colibri-inkling", "colibri-mistral", "colibri-ibm", "colibri-baidu"}
    assert all(packages(f) for f in FAMILIES)


@pytest.mark.parametrize("family", FAMILIES, ids=lambda f: f.name)
def test_family_requires_no_other_family(family):
    required = {re.match(r"[A-Za-z0-9_.\-]+", r).group(0).lower().replace("_", "-")
                for r in project(family).get("dependencies", [])}
    assert "colibri-core" in required
    others = {project(f)["name"] for f in FAMILIES} - {project(family)["name"]}
    assert not required & others, f"{family.name} requires {sorted(required & others)}"


@pytest.mark.parametrize("family", FAMILIES, ids=lambda f: f.name)
def test_family_sources_import_no_other_family(family):
    own = packages(family)
    offenders = {}
    for source in sorted(family.rglob("*.py")):  # the packages and their tests
        foreign = {m for m in imported_roots(source) if m in ALL_PACKAGES and m not in own}
        if foreign:
            offenders[str(source.relative_to(family))] = sorted(foreign)
    assert not offenders, f"{family.name} imports other families: {offenders}"
