"""Typed specs of the four extension points, and the registry that holds them.

Specs name their implementation lazily ("package.module:Attribute"), so listing what is
installed imports nothing heavy. ``load()`` imports the implementation when it is used.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any, Callable

from colibri_core.errors import PluginError, UnsupportedModelError
from colibri_core.plugins.hookspecs import hookimpl
from colibri_core.plugins.known import install_hint


def import_object(ref: str) -> Any:
    """Import "package.module:attr.sub" and return the attribute."""
    module_name, _, attr_path = ref.partition(":")
    if not module_name or not attr_path:
        raise PluginError(f"bad implementation reference {ref!r}: expected 'module:attribute'")
    obj = importlib.import_module(module_name)
    for part in attr_path.split("."):
        obj = getattr(obj, part)
    return obj


@dataclass(frozen=True)
class FamilySpec:
    """A model family: the Hugging Face ``model_type`` strings (and architectures) it runs.

    ``impl`` names a ``colibri_core.model.family.Family`` subclass, whose
    ``build(config, weights)`` returns a ``colibri_core.nn.CausalLM``.
    """

    name: str
    model_types: tuple[str, ...]
    impl: str
    architectures: tuple[str, ...] = ()
    description: str = ""

    def load(self) -> Any:
        return import_object(self.impl)


def family_hook(*specs: FamilySpec) -> Callable:
    """A family plugin's whole registration, as its module's hook::

        colibri_register_families = family_hook(
            FamilySpec(name="olmoe", model_types=("olmoe",), impl="colibri_olmoe.model:Olmoe", ...))

    The plugin's module imports only colibri_core's light modules (this one): the
    architecture loads through the ``impl`` string when a model runs."""

    @hookimpl
    def colibri_register_families(register):
        for spec in specs:
            register(spec)

    return colibri_register_families


@dataclass(frozen=True)
class QuantSpec:
    """A weight storage format: how raw tensor bytes decode into numbers."""

    name: str
    impl: str
    description: str = ""
    dtypes: tuple[str, ...] = ()  # safetensors dtypes this format reads directly
    storage: str = ""  # how a claimed tensor is stored, for listings (formats claimed by evidence)

    def load(self) -> Any:
        return import_object(self.impl)


TIER_ROLES = ("disk", "ram", "device", "compute")


@dataclass(frozen=True)
class TierSpec:
    """A storage tier experts can be served from. ``role`` says which part of the expert
    store it plays ("disk", "ram" or "device"; default: its name); the store finds its
    tiers by role, so a plugin can supply its own implementation of one. A "compute" tier
    computes the routed experts instead of the backend (on other machines, say); it is
    never found by role, only chosen by name (``load(compute=NAME)``)."""

    name: str
    impl: str
    description: str = ""
    role: str = ""

    def __post_init__(self):
        object.__setattr__(self, "role", self.role or self.name)
        if self.role not in TIER_ROLES:
            raise PluginError(f"tier {self.name!r} has role {self.role!r}; a tier's role is one of {', '.join(TIER_ROLES)}")

    def load(self) -> Any:
        return import_object(self.impl)


@dataclass(frozen=True)
class BackendSpec:
    """A compute backend. ``probe`` names a cheap function returning None when the
    backend can run here, or a short reason why not; it must not import heavy stacks.
    ``device`` says what the backend computes on here, for listings ("cpu", "gpu"): the
    word itself, or a cheap function returning it (a callable or "module:function")."""

    name: str
    impl: str
    probe: str | Callable[[], str | None] | None = None
    description: str = ""
    device: str | Callable[[], str | None] | None = None

    def load(self) -> Any:
        return import_object(self.impl)

    def unavailable_reason(self) -> str | None:
        if self.probe is None:
            return None
        try:
            return _resolve(self.probe)()
        except Exception as exc:  # a broken probe must not break listing
            return f"probe failed: {type(exc).__name__}: {exc}"

    def device_kind(self) -> str | None:
        """What the backend computes on here, or None when it does not say."""
        if self.device is None or (isinstance(self.device, str) and ":" not in self.device):
            return self.device
        try:
            return _resolve(self.device)()
        except Exception:  # a broken probe must not break listing
            return None


def _resolve(ref: str | Callable) -> Callable:
    return import_object(ref) if isinstance(ref, str) else ref


@dataclass(frozen=True)
class LoadOptionsSpec:
    """Command-line options a plugin adds to the commands that load a model (run, serve,
    chat, bench) and to plan. ``impl`` names a ``colibri_core.cli.extend.LoadOptions``
    subclass; it is imported when the command line is built, so its module imports only
    click and the standard library at import time."""

    name: str
    impl: str
    description: str = ""

    def load(self) -> Any:
        return import_object(self.impl)


@dataclass(frozen=True)
class DraftSpec:
    """A source of drafted tokens for speculative decoding (``--draft NAME``). ``impl``
    names a callable taking the loaded ``Model`` and returning an object with
    ``new_drafter()`` (colibri_core.engine.speculative.DraftSource)."""

    name: str
    impl: str
    description: str = ""

    def load(self) -> Any:
        return import_object(self.impl)


KINDS = {"family": FamilySpec, "quant": QuantSpec, "tier": TierSpec, "backend": BackendSpec, "options": LoadOptionsSpec,
         "draft": DraftSpec}


@dataclass
class Entry:
    kind: str
    spec: Any
    plugin: str  # name of the plugin that registered it


@dataclass
class Conflict:
    kind: str
    key: str
    plugins: tuple[str, str]

    def message(self) -> str:
        a, b = self.plugins
        return (
            f"{self.kind} {self.key!r} is claimed by two plugins, {a!r} and {b!r}; "
            f"disable one with COLIBRI_DISABLE_PLUGINS={b}"
        )


@dataclass
class Registry:
    """What the loaded plugins registered, keyed by kind and name."""

    entries: dict[str, dict[str, Entry]] = field(default_factory=lambda: {k: {} for k in KINDS})
    # model_type / architecture -> family name, so lookups by config are direct
    model_types: dict[str, str] = field(default_factory=dict)
    architectures: dict[str, str] = field(default_factory=dict)
    conflicts: list[Conflict] = field(default_factory=list)
    # why plugins that are installed were not loaded (COLIBRI_PLUGINS and friends), for
    # "no family runs this model" to say instead of "install one"
    not_loaded_note: str | None = None

    def add(self, kind: str, spec: Any, plugin: str) -> None:
        expected = KINDS[kind]
        if not isinstance(spec, expected):
            raise PluginError(f"plugin {plugin!r} registered {spec!r} as a {kind}; expected a {expected.__name__}")
        table = self.entries[kind]
        previous = table.get(spec.name)
        if previous is not None:
            self.conflicts.append(Conflict(kind, spec.name, (previous.plugin, plugin)))
            return
        table[spec.name] = Entry(kind, spec, plugin)
        if kind == "family":
            for key, index in ((spec.model_types, self.model_types), (spec.architectures, self.architectures)):
                for value in key:
                    owner = index.get(value)
                    if owner is not None and owner != spec.name:
                        other = table[owner].plugin
                        self.conflicts.append(Conflict("model_type", value, (other, plugin)))
                    else:
                        index[value] = spec.name

    def conflict_for(self, kind: str, key: str) -> Conflict | None:
        for conflict in self.conflicts:
            if conflict.kind == kind and conflict.key == key:
                return conflict
        return None

    def get(self, kind: str, name: str) -> Entry:
        conflict = self.conflict_for(kind, name)
        if conflict:
            raise PluginError(conflict.message())
        try:
            return self.entries[kind][name]
        except KeyError:
            known = ", ".join(sorted(self.entries[kind])) or "none"
            raise UnsupportedModelError(f"no {kind} named {name!r} is installed (installed: {known})") from None

    def tier(self, role: str, core: str = "colibri-core") -> Entry:
        """The tier playing ``role``: a plugin's tier replaces the core's own (``core``
        names the core's plugin); two plugins' tiers for one role are a conflict."""
        if role == "compute":
            raise PluginError("a compute tier is chosen by name (load(compute=NAME)), never by role")
        entries = [e for e in self.all("tier") if e.spec.role == role]
        plugins = [e for e in entries if e.plugin != core] or entries
        if not plugins:
            raise UnsupportedModelError(f"no tier plays the role {role!r} (installed tiers: "
                                        f"{', '.join(e.spec.name for e in self.all('tier')) or 'none'})")
        if len(plugins) > 1:
            names = " and ".join(f"{e.spec.name!r} (plugin {e.plugin!r})" for e in plugins)
            raise PluginError(f"tiers {names} both play the role {role!r}; disable one plugin with COLIBRI_DISABLE_PLUGINS")
        return plugins[0]

    def all(self, kind: str) -> list[Entry]:
        return sorted(self.entries[kind].values(), key=lambda e: e.spec.name)

    def family_for(self, model_type: str | None, architectures: list[str] | None) -> Entry:
        """The family that runs a config: by ``model_type``; by ``architectures`` only when
        the config has no model_type (an unknown model_type is never second-guessed)."""
        if model_type:
            candidates = [("model_type", model_type, self.model_types.get(model_type))]
        else:
            candidates = [("model_type", arch, self.architectures.get(arch)) for arch in architectures or []]
        for kind, key, family in candidates:
            conflict = self.conflict_for(kind, key)
            if conflict:
                raise PluginError(conflict.message())
            if family is not None:
                return self.get("family", family)
        known = ", ".join(sorted(self.model_types)) or "none"
        raise UnsupportedModelError(
            f"no installed family runs model_type {model_type!r}"
            + (f" (architectures {architectures})" if architectures else "")
            + f"; installed model types: {known}. "
            + _sentence(self.not_loaded_note or install_hint(model_type))
        )


def _sentence(text: str) -> str:
    return text[:1].upper() + text[1:]
