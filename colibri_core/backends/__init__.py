"""Compute backends that ship with colibri-core."""
