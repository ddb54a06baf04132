"""The plugin: probed without importing CuPy; the probe's reasons for each thing that can
be missing (CuPy, the driver, a device); registered as backend "cuda" computing on the
GPU, and, where it cannot run, listed with its reason and refused in one line."""

import contextlib
import ctypes
import subprocess
import sys

import pytest

from colibri_core.plugins.discovery import create_backend, get_registry, reset_manager
from colibri_core.testing import registered_plugin
from colibri_cuda import plugin


def cuda_registered():
    """The plugin as installed (its entry point), else registered here for the test."""
    from colibri_core.plugins.discovery import get_manager

    if "colibri-cuda" in get_manager().plugins:
        return contextlib.nullcontext()
    return registered_plugin(plugin, "colibri-cuda")


@pytest.fixture(autouse=True)
def fresh_plugins():
    reset_manager()
    yield
    reset_manager()


class FakeDriver:
    def __init__(self, init=0, count=1, count_status=0):
        self.init, self.count, self.count_status = init, count, count_status

    def cuInit(self, flags):
        return self.init

    def cuDeviceGetCount(self, pointer):
        ctypes.cast(pointer, ctypes.POINTER(ctypes.c_int))[0] = self.count
        return self.count_status


def test_probe_reasons(monkeypatch):
    real_find_spec = plugin.importlib.util.find_spec
    monkeypatch.setattr(plugin.importlib.util, "find_spec", lambda name: None if name == "cupy" else real_find_spec(name))
    assert plugin.unavailable_reason() == "cupy is not installed: " + plugin.INSTALL_HINT
    monkeypatch.setattr(plugin.importlib.util, "find_spec", lambda name: object())  # as if cupy were there
    monkeypatch.setattr(plugin, "_driver", lambda: None)
    assert plugin.unavailable_reason().startswith("no CUDA driver (libcuda.so.1 not found)")
    for driver, reason in ((FakeDriver(init=100), "no CUDA device"), (FakeDriver(count=0), "no CUDA device"),
                           (FakeDriver(init=3), "the CUDA driver does not start (cuInit error 3)"),
                           (FakeDriver(count_status=2), "no CUDA device"), (FakeDriver(), None)):
        monkeypatch.setattr(plugin, "_driver", lambda d=driver: d)
        assert plugin.unavailable_reason() == reason


def test_probe_imports_no_cupy():
    code = ("import sys, colibri_cuda.plugin as p; p.unavailable_reason(); "
            "assert not {'cupy', 'numpy', 'colibri_cuda.backend'} & set(sys.modules), sys.modules.keys()")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr


def test_registered_as_cuda_on_the_gpu():
    with cuda_registered():
        entry = get_registry().get("backend", "cuda")
        assert entry.spec.device_kind() == "gpu"
        assert entry.spec.unavailable_reason() == plugin.unavailable_reason()
        if plugin.unavailable_reason() is None:
            from colibri_cuda.backend import CudaBackend

            assert isinstance(create_backend(get_registry(), "cuda"), CudaBackend)
        else:
            with pytest.raises(Exception, match="backend 'cuda' is not available"):
                create_backend(get_registry(), "cuda")


def test_the_table_shows_the_reason_as_written(monkeypatch):
    """The install hint's extra ([ctk]) is text, not markup."""
    from click.testing import CliRunner

    from colibri_core.cli.main import build_cli

    monkeypatch.setenv("COLUMNS", "400")
    monkeypatch.setattr(plugin, "unavailable_reason", lambda: "cupy is not installed: " + plugin.INSTALL_HINT)
    with cuda_registered():
        result = CliRunner().invoke(build_cli(), ["list-backends"])
    assert result.exit_code == 0, result.output
    assert "unavailable: cupy is not installed: pip install 'cupy-cuda12x[ctk]>=14' (CUDA 12 and 13 drivers)" \
        in result.output
