"""Fixtures of the core tests. Helpers are imported from ``colibri_core.testing`` (see
``colibri_core.testing.cli`` for why not from here)."""

import shutil

import pytest

from colibri_core.cli.demo import build_demo_model
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


@pytest.fixture(scope="module")
def demo_model(request, tmp_path_factory):
    """The demo model (``colibri_core.cli.demo``) of the test module's ``SPEC``, built once
    per module for its tests to read; a test that changes it takes ``model_dir``."""
    path = tmp_path_factory.mktemp(request.module.__name__.removeprefix("test_")) / "model"
    build_demo_model(path, request.module.SPEC)
    return path


@pytest.fixture
def model_dir(demo_model, tmp_path):
    """A copy of ``demo_model`` of the test's own."""
    return shutil.copytree(demo_model, tmp_path / "model")
