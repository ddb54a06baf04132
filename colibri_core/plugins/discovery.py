"""Plugin discovery and loading, isolated per plugin.

Plugins come from the ``colibri`` entry-point group and from in-process registration.
Each one is imported and each of its hooks is called separately: a plugin whose import
or hook fails is recorded as failed (or unavailable, when an optional dependency is
missing) with its error, and everything else keeps working.

Environment:
  COLIBRI_PLUGINS=a,b            load only these plugins (the core's built-ins always load)
  COLIBRI_DISABLE_PLUGINS=a,b    never load these plugins
Names match the entry-point name or the distribution name (``colibri-olmoe``).
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass, field
from importlib import metadata
from typing import Any

import pluggy

from colibri_core.plugins import hookspecs
from colibri_core.plugins.registry import Registry

ENTRY_POINT_GROUP = "colibri"
ENV_ONLY = "COLIBRI_PLUGINS"
ENV_DISABLE = "COLIBRI_DISABLE_PLUGINS"
BUILTIN_NAME = "colibri-core"

REGISTER_HOOKS = {
    "colibri_register_families": "family",
    "colibri_register_quants": "quant",
    "colibri_register_tiers": "tier",
    "colibri_register_backends": "backend",
    "colibri_register_load_options": "options",
    "colibri_register_draft_sources": "draft",
}


@dataclass
class PluginInfo:
    name: str
    distribution: str | None = None
    version: str | None = None
    module: str | None = None
    hooks: list[str] = field(default_factory=list)
    status: str = "loaded"  # loaded | failed | unavailable | disabled
    error: str | None = None
    builtin: bool = False

    def as_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "distribution": self.distribution,
            "version": self.version,
            "module": self.module,
            "hooks": self.hooks,
            "status": self.status,
            "error": self.error,
        }


def _names_from_env(var: str) -> set[str] | None:
    value = os.environ.get(var)
    if value is None:
        return None
    return {part.strip() for part in value.split(",") if part.strip()}


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


class PluginManager:
    """Loads plugins once and builds the registry of what they provide."""

    def __init__(self, *, load_entry_points: bool = True):
        self.pm = pluggy.PluginManager("colibri")
        self.pm.add_hookspecs(hookspecs)
        self.plugins: dict[str, PluginInfo] = {}
        self._registry: Registry | None = None
        self._load_entry_points = load_entry_points
        self.unknown_selected: list[str] = []  # names in COLIBRI_PLUGINS / _DISABLE_PLUGINS no plugin has
        self._loaded = False
        self._lock = threading.RLock()

    # -- loading -----------------------------------------------------------------------
    def load(self) -> None:
        with self._lock:
            if self._loaded:
                return
            self._loaded = True
            from colibri_core.plugins import builtins

            self._add(builtins, PluginInfo(BUILTIN_NAME, BUILTIN_NAME, _version(BUILTIN_NAME), builtins.__name__, builtin=True))
            if self._load_entry_points:
                self._load_from_entry_points()

    def _load_from_entry_points(self) -> None:
        only = _names_from_env(ENV_ONLY)
        disabled = _names_from_env(ENV_DISABLE) or set()
        eps = sorted(metadata.entry_points(group=ENTRY_POINT_GROUP), key=lambda e: e.name)
        per_dist: dict[str | None, int] = {}
        for ep in eps:
            per_dist[_dist_name(ep)] = per_dist.get(_dist_name(ep), 0) + 1
        known = {ep.name for ep in eps} | {d for d in per_dist if d}
        for var, names in ((ENV_ONLY, only or set()), (ENV_DISABLE, disabled)):
            unknown = sorted(names - known - {BUILTIN_NAME})
            if unknown:
                named = f"{var} names {', '.join(map(repr, unknown))}, which no installed plugin is"
                self.unknown_selected.append(named)
                from colibri_core.warn import warn

                warn(f"{named} (installed: {', '.join(sorted(d for d in per_dist if d)) or 'none'})")
        for ep in eps:
            dist = _dist_name(ep)
            # a plugin is known by its distribution (what users pip install), or
            # "dist:entry" when one distribution brings several
            name = dist if dist and per_dist[dist] == 1 else f"{dist}:{ep.name}" if dist else ep.name
            info = PluginInfo(name, dist, ep.dist.version if ep.dist is not None else None, ep.value)
            names = {ep.name, dist, name} - {None}
            if name in self.plugins:
                info.name = f"{name} (duplicate entry point)"
                info.status, info.error = "failed", f"plugin name {name!r} is used by two entry points"
                self.plugins[info.name] = info
                continue
            if names & disabled or (only is not None and not names & only):
                info.status = "disabled"
                info.error = f"disabled by {ENV_DISABLE if names & disabled else ENV_ONLY}"
                self.plugins[info.name] = info
                continue
            try:
                obj = ep.load()
            except ImportError as exc:
                missing = getattr(exc, "name", None)
                top = (ep.value.split(":")[0]).split(".")[0]
                # a missing *dependency* makes a plugin unavailable; a broken plugin fails
                info.status = "unavailable" if missing and missing.split(".")[0] != top else "failed"
                info.error = _describe(exc)
                self.plugins[info.name] = info
                continue
            except Exception as exc:
                info.status, info.error = "failed", _describe(exc)
                self.plugins[info.name] = info
                continue
            self._add(obj, info)

    def _add(self, obj: Any, info: PluginInfo) -> None:
        try:
            self.pm.register(obj, name=info.name)
        except Exception as exc:  # e.g. a hook with a misspelt argument
            info.status, info.error = "failed", _describe(exc)
        else:
            info.hooks = sorted(impl.name for impl in self._hookcallers_of(info.name))
        self.plugins[info.name] = info
        self._registry = None

    def _hookcallers_of(self, name: str):
        plugin = self.pm.get_plugin(name)
        if plugin is None:
            return []
        return self.pm.get_hookcallers(plugin) or []

    def register(self, obj: Any, name: str, *, version: str | None = None) -> PluginInfo:
        """Register a plugin object in-process (tests, notebooks, embedding apps)."""
        self.load()
        with self._lock:
            if name in self.plugins:
                from colibri_core.errors import PluginError

                raise PluginError(f"a plugin named {name!r} is already registered")
            info = PluginInfo(name, None, version, getattr(obj, "__name__", type(obj).__name__))
            self._add(obj, info)
            return info

    def unregister(self, name: str) -> None:
        with self._lock:
            if self.pm.get_plugin(name) is not None:
                self.pm.unregister(name=name)
            self.plugins.pop(name, None)
            self._registry = None

    # -- the registry ------------------------------------------------------------------
    @property
    def registry(self) -> Registry:
        self.load()
        with self._lock:
            if self._registry is None:
                self._registry = self._build_registry()
            return self._registry

    def _build_registry(self) -> Registry:
        registry = Registry()
        off = sorted(name for name, info in self.plugins.items() if info.status == "disabled")
        if off:
            why = sorted({info.error.removeprefix("disabled by ") for info in self.plugins.values()
                          if info.status == "disabled" and info.error})
            registry.not_loaded_note = "; ".join(self.unknown_selected + [
                f"installed but disabled by {' and '.join(why)}: {', '.join(off)}. Enable the family's plugin "
                "(colibri plugins lists them)"])
        for hook_name, kind in REGISTER_HOOKS.items():
            caller = getattr(self.pm.hook, hook_name)
            for impl in caller.get_hookimpls():
                info = self.plugins.get(impl.plugin_name)
                if info is None or info.status != "loaded":
                    continue
                collected = []
                try:
                    impl.function(register=collected.append)
                    for spec in collected:
                        registry.add(kind, spec, info.name)
                except Exception as exc:
                    info.status = "failed"
                    info.error = f"{hook_name}: {_describe(exc)}"
        # a plugin that failed in one hook must not leave half its registrations behind
        failed = {name for name, info in self.plugins.items() if info.status == "failed"}
        if failed:
            for table in registry.entries.values():
                for key in [k for k, e in table.items() if e.plugin in failed]:
                    del table[key]
            for index in (registry.model_types, registry.architectures):
                for key in [k for k, fam in index.items() if fam not in registry.entries["family"]]:
                    del index[key]
        return registry

    def add_commands(self, cli) -> None:
        """Let plugins add CLI commands; a failing plugin is recorded, not fatal."""
        self.load()
        for impl in self.pm.hook.colibri_register_commands.get_hookimpls():
            info = self.plugins.get(impl.plugin_name)
            if info is None or info.status != "loaded":
                continue
            before = dict(cli.commands)
            error = None
            try:
                impl.function(cli=cli)
            except Exception as exc:
                error = _describe(exc)
            replaced = [name for name, command in before.items() if cli.commands.get(name) is not command]
            if replaced:  # a plugin may add commands, never take over existing ones
                error = f"command {replaced[0]!r} already exists"
            if error:
                cli.commands.clear()
                cli.commands.update(before)
                info.status, info.error = "failed", f"colibri_register_commands: {error}"

    def conflict_messages(self) -> list[str]:
        return [c.message() for c in self.registry.conflicts]


def _dist_name(ep) -> str | None:
    return ep.dist.name if ep.dist is not None else None


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        from colibri_core.version import __version__

        return __version__


_manager: PluginManager | None = None
_manager_lock = threading.Lock()


def get_manager() -> PluginManager:
    """The process-wide plugin manager, loaded on first use."""
    global _manager
    with _manager_lock:
        if _manager is None:
            _manager = PluginManager()
        manager = _manager
    manager.load()
    return manager


def reset_manager() -> None:
    """Forget loaded plugins (tests, or after installing a plugin in-process)."""
    global _manager
    with _manager_lock:
        _manager = None


def get_registry() -> Registry:
    return get_manager().registry


def register_plugin(obj: Any, name: str, *, version: str | None = None) -> PluginInfo:
    return get_manager().register(obj, name, version=version)


def unregister_plugin(name: str) -> None:
    get_manager().unregister(name)


DEFAULT_BACKEND = "cpu"


def create_backend(registry: Registry, name: str):
    """An instance of the installed backend ``name``. An unknown name or a backend that
    cannot run here is a one-line BackendError naming what is installed."""
    from colibri_core.errors import BackendError

    table = registry.entries["backend"]
    installed = ", ".join(f"{n}{'' if e.spec.unavailable_reason() is None else ' (unavailable)'}"
                          for n, e in sorted(table.items())) or "none"
    if name not in table:
        raise BackendError(f"no backend named {name!r} is installed (installed: {installed})")
    entry = registry.get("backend", name)
    reason = entry.spec.unavailable_reason()
    if reason:
        raise BackendError(f"backend {name!r} is not available here: {reason} (installed: {installed})")
    return entry.spec.load()()
