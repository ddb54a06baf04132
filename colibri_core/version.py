"""colibri-core's version, in a module of its own so low layers (the plugin registry's
fallback) can read it without importing the package facade."""

__version__ = "0.1.0"
