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


@pytest.fixture(scope="module")
def trained_olmoe():
    """colibri-trained's OLMoE-geometry model, or a skip saying why it is absent."""
    trained = pytest.importorskip("colibri_trained", reason="colibri-trained is not installed")
    try:
        return trained.path("olmoe")
    except LookupError as exc:
        pytest.skip(f"the trained OLMoE model is absent: {exc}")
