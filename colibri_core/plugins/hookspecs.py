"""The extension points of colibri.

A plugin is a module (or object) with functions named like the hooks below, decorated
with ``colibri_core.hookimpl``. It is found through the ``colibri`` entry-point group
(``[project.entry-points.colibri] my-plugin = "my_package"``) or registered in-process
with ``colibri_core.plugins.discovery.register_plugin``. Each hook receives a ``register`` callback
so the core knows which plugin registered what and can refuse a name claimed twice.

Plugin modules must import only the standard library and colibri_core at import time;
the ``impl`` strings of the specs ("module:attribute") are imported only when used.
"""

import pluggy

hookspec = pluggy.HookspecMarker("colibri")
hookimpl = pluggy.HookimplMarker("colibri")


@hookspec
def colibri_register_families(register):
    """Register model families: call ``register(FamilySpec(...))`` once per family."""


@hookspec
def colibri_register_quants(register):
    """Register weight formats: call ``register(QuantSpec(...))`` once per format."""


@hookspec
def colibri_register_tiers(register):
    """Register expert storage tiers: call ``register(TierSpec(...))`` once per tier."""


@hookspec
def colibri_register_backends(register):
    """Register compute backends: call ``register(BackendSpec(...))`` once per backend."""


@hookspec
def colibri_register_load_options(register):
    """Add options to the commands that load or plan a model: call
    ``register(LoadOptionsSpec(...))`` once per group of options."""


@hookspec
def colibri_register_draft_sources(register):
    """Register sources of drafted tokens for speculative decoding: call
    ``register(DraftSpec(...))`` once per source."""


@hookspec
def colibri_register_commands(cli):
    """Add commands to the ``colibri`` command line: ``cli`` is the click group."""
