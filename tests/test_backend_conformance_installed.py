"""The backend conformance kit on every installed backend: installing a backend plugin
(colibri-mlx, ...) adds its run here; one that cannot run on this machine is skipped with
its reason; ``COLIBRI_TEST_BACKENDS=cpu,mlx`` restricts the list
(``colibri_core.testing.backends``)."""

import pytest

from colibri_core.plugins.discovery import create_backend, get_registry
from colibri_core.testing.backend_kit import BackendConformanceSuite
from colibri_core.testing.backends import ENV_BACKENDS, backend_params, matrix_beyond_cpu


class TestInstalledBackend(BackendConformanceSuite):
    @pytest.fixture(params=matrix_beyond_cpu(backend_params()))
    def backend(self, request):
        return create_backend(get_registry(), request.param)


def test_a_backend_that_cannot_run_here_is_skipped_with_its_reason(monkeypatch):
    from colibri_core import hookimpl
    from colibri_core.plugins.registry import BackendSpec
    from colibri_core.testing import registered_plugin

    class FarAway:
        @hookimpl
        def colibri_register_backends(self, register):
            register(BackendSpec("faraway", "boxed_backend:BoxedBackend", probe=lambda: "needs a TPU"))

    monkeypatch.delenv(ENV_BACKENDS, raising=False)
    with registered_plugin(FarAway(), "faraway-plugin"):
        params = {p.id: p for p in backend_params()}
    assert not params["cpu"].marks
    (mark,) = params["faraway"].marks
    assert mark.name == "skip" and "'faraway' is not available here: needs a TPU" in mark.kwargs["reason"]


def test_colibri_test_backends_restricts_the_list(monkeypatch):
    monkeypatch.setenv(ENV_BACKENDS, "cpu, nowhere")
    params = {p.id: p for p in backend_params()}
    assert set(params) == {"cpu", "nowhere"}
    assert not params["cpu"].marks
    assert "names backend 'nowhere', which is not installed" in params["nowhere"].marks[0].kwargs["reason"]
    assert [p.id for p in backend_params(("boxed", "cpu"))] == ["cpu"]  # a suite's own list too
    monkeypatch.delenv(ENV_BACKENDS)
    assert [p.id for p in backend_params(("boxed", "cpu"))] == ["boxed", "cpu"]
