"""Which backends the test suites run on.

``FamilyOracleSuite`` and ``BackendConformanceSuite`` run once per backend: every
installed one (``colibri list-backends``), a backend that cannot run here skipped with
its reason. Installing a backend plugin (colibri-mlx, ...) adds its runs automatically.

Environment:
  COLIBRI_TEST_BACKENDS=cpu,mlx   run on these backends only (others are left out; a name
                                  that is not installed is a visible skip)
"""

from __future__ import annotations

import os

ENV_BACKENDS = "COLIBRI_TEST_BACKENDS"


def wanted_backends() -> set[str] | None:
    """The names COLIBRI_TEST_BACKENDS allows, or None when it is unset (all)."""
    value = os.environ.get(ENV_BACKENDS)
    if value is None:
        return None
    return {part.strip() for part in value.split(",") if part.strip()}


def matrix_beyond_cpu(params: list) -> list:
    """The parameters with every backend but ``cpu`` marked ``matrix``: the everyday lane
    (``-m "not slow and not matrix"``) runs the families and the kit on the CPU, CI on
    every backend."""
    import pytest

    return [p if p.id == "cpu" else pytest.param(*p.values, id=p.id, marks=[*p.marks, pytest.mark.matrix])
            for p in params]


def backend_params(names: tuple[str, ...] | None = None) -> list:
    """pytest parameters, one per backend, id'd by name: ``names`` (backends the caller
    registers itself, e.g. in-process test backends), or every installed backend. Those
    COLIBRI_TEST_BACKENDS leaves out are dropped; one that cannot run here is a skip that
    says why."""
    import pytest

    from colibri_core.plugins.discovery import get_registry

    wanted = wanted_backends()
    params = []
    if names is not None:
        for name in names:
            if wanted is None or name in wanted:
                params.append(pytest.param(name, id=name))
        return params
    table = get_registry().entries["backend"]
    for name in sorted(table):
        if wanted is not None and name not in wanted:
            continue
        reason = table[name].spec.unavailable_reason()
        marks = [pytest.mark.skip(reason=f"backend {name!r} is not available here: {reason}")] if reason else []
        params.append(pytest.param(name, id=name, marks=marks))
    for name in sorted((wanted or set()) - set(table)):
        installed = ", ".join(sorted(table)) or "none"
        params.append(pytest.param(name, id=name, marks=[pytest.mark.skip(
            reason=f"{ENV_BACKENDS} names backend {name!r}, which is not installed (installed: {installed})")]))
    return params
