"""Options plugins add to the commands that load a model.

A plugin registers ``LoadOptionsSpec(name, "module:Class")`` through the
``colibri_register_load_options`` hook; the class (a ``LoadOptions`` subclass) lists its
click options, which ``run``, ``serve``, ``chat``, ``bench``, ``plan`` and ``doctor`` all
get, and turns their values into ``load()`` keyword arguments (``compute`` /
``compute_options`` for a compute tier) and, for ``plan`` and ``doctor``, into rows and
checks of its own. Its module is imported
when the command line is built: it imports click and the standard library only.
"""

from __future__ import annotations

from typing import Any


class LoadOptions:
    """One plugin's options. ``options()`` returns click option decorators
    (``click.option(...)``), fresh on every call (each command gets its own); their
    destinations must not clash with the core's options or another plugin's."""

    def options(self) -> list:
        return []

    def load_kwargs(self, values: dict[str, Any]) -> dict[str, Any]:
        """``load()`` keyword arguments for these option values (their destinations as
        keys); {} when the options are not used. A bad value is a UsageError naming it."""
        return {}

    def plan(self, blueprint, report: dict, values: dict[str, Any]) -> list[tuple[str, str]]:
        """Extra rows (label, text) of ``colibri plan`` for these values, adding what they
        show to ``report`` (printed by ``plan --json``); [] when the options are not used."""
        return []


    def doctor(self, model_dir, values: dict[str, Any]) -> list[tuple[str, str, str, str]]:
        """Extra checks of ``colibri doctor`` for these values: (name, "pass" | "warn" |
        "fail", detail, fix hint) each; [] when the options are not used."""
        return []


_cached: list[tuple[LoadOptions, list[str]]] | None = None


def plugin_options() -> list[tuple[LoadOptions, list[str]]]:
    """(options object, its options' destinations) of every plugin, built once per
    process. A class that fails marks its plugin failed, as a failing hook does."""
    global _cached
    if _cached is not None:
        return _cached
    from colibri_core.plugins.discovery import get_manager

    manager = get_manager()
    found = []
    for entry in manager.registry.all("options"):
        try:
            obj = entry.spec.load()()
            probe = _decorate(lambda: None, obj.options())
            found.append((obj, [p.name for p in getattr(probe, "__click_params__", [])]))
        except Exception as exc:
            info = manager.plugins.get(entry.plugin)
            if info is not None:
                info.status, info.error = "failed", f"load options {entry.spec.name!r}: {type(exc).__name__}: {exc}"
    _cached = found
    return found


def _decorate(f, decorators):
    for option in reversed(decorators):  # decorators apply bottom-up; keep --help in their order
        f = option(f)
    return f


def add_plugin_options(f):
    """Decorate a click command function with every plugin's options."""
    for obj, _ in plugin_options():
        f = _decorate(f, obj.options())
    return f


def split_plugin_values(values: dict[str, Any]) -> tuple[dict[str, Any], list[tuple[LoadOptions, dict]]]:
    """The core's option values, and each plugin's own (by its options' destinations)."""
    rest = dict(values)
    mine = [(obj, {name: rest.pop(name) for name in names if name in rest}) for obj, names in plugin_options()]
    return rest, mine


def plugin_load_kwargs(values: list[tuple[LoadOptions, dict]]) -> dict[str, Any]:
    """The ``load()`` keyword arguments all plugins' option values ask for; two plugins
    asking for the same one is a UsageError."""
    from colibri_core.errors import UsageError

    out: dict[str, Any] = {}
    for obj, vals in values:
        for key, value in obj.load_kwargs(vals).items():
            if key in out:
                raise UsageError(f"two plugins' options both set load()'s {key!r}: give the options of one of them")
            out[key] = value
    return out


def plugin_plan_rows(blueprint, report: dict, values: list[tuple[LoadOptions, dict]]) -> list[tuple[str, str]]:
    rows = []
    for obj, vals in values:
        rows += obj.plan(blueprint, report, vals)
    return rows


def plugin_doctor_checks(model_dir, values: list[tuple[LoadOptions, dict]]) -> list[tuple[str, str, str, str]]:
    checks = []
    for obj, vals in values:
        checks += obj.doctor(model_dir, vals)
    return checks
