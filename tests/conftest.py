"""Fixtures of the core tests. Helpers are imported from ``colibri_core.testing`` (see
``colibri_core.testing.cli`` for why not from here)."""

import pytest

from colibri_core.plugins.discovery import reset_manager


@pytest.fixture(autouse=True)
def fresh_plugin_manager():
    """Each test sees plugins loaded anew (in-process registrations do not leak)."""
    reset_manager()
    yield
    reset_manager()
