"""The plugin: registered through the ``colibri`` entry point, probed without importing
mlx, listed with the device it computes on."""

import json
import subprocess
import sys

import pytest

from colibri_core.plugins.discovery import create_backend, get_registry, reset_manager
from colibri_mlx import plugin


@pytest.fixture(autouse=True)
def fresh_plugins():
    reset_manager()
    yield
    reset_manager()


def colibri(*args):
    return subprocess.run([sys.executable, "-m", "colibri_core", *args], capture_output=True, text=True, timeout=120)


def test_registered_through_the_entry_point():
    entry = get_registry().get("backend", "mlx")
    assert entry.plugin == "colibri-mlx"
    assert entry.spec.unavailable_reason() is None
    assert entry.spec.device_kind() == plugin.device()
    from colibri_mlx.backend import MlxBackend

    backend = create_backend(get_registry(), "mlx")
    assert isinstance(backend, MlxBackend) and backend.name == "mlx"


def test_device_follows_metal(monkeypatch):
    monkeypatch.setattr(plugin.platform, "system", lambda: "Darwin")
    monkeypatch.setattr(plugin.platform, "machine", lambda: "arm64")
    assert plugin.device() == "gpu"
    monkeypatch.setattr(plugin.platform, "system", lambda: "Linux")
    monkeypatch.setattr(plugin.platform, "machine", lambda: "x86_64")
    assert plugin.device() == "cpu"


def test_probe_reasons(monkeypatch):
    real_find_spec = plugin.importlib.util.find_spec
    monkeypatch.setattr(plugin.platform, "system", lambda: "Linux")
    monkeypatch.setattr(plugin.importlib.util, "find_spec", lambda name: None if name == "mlx" else real_find_spec(name))
    assert plugin.unavailable_reason() == "mlx is not installed: pip install colibri-mlx[cpu]"
    monkeypatch.setattr(plugin.importlib.util, "find_spec", real_find_spec)
    monkeypatch.setattr(plugin, "_installed", lambda distribution: False)
    assert plugin.unavailable_reason() == "mlx is installed without a compute library: pip install colibri-mlx[cpu]"
    monkeypatch.setattr(plugin.platform, "system", lambda: "Darwin")  # the macOS wheel carries Metal's library
    assert plugin.unavailable_reason() is None


def test_probe_imports_neither_mlx_nor_numpy():
    code = ("import sys, colibri_mlx.plugin as p; r = p.unavailable_reason(); d = p.device(); "
            "print(r, d, sorted(m for m in ('mlx', 'mlx.core', 'numpy') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["None", plugin.device(), "[]"]


def test_list_backends_shows_the_device():
    table = colibri("list-backends")
    assert table.returncode == 0, table.stderr
    lines = {line.split("│")[1].strip(): line for line in table.stdout.splitlines() if line.count("│") > 2}
    assert f"available ({plugin.device()})" in lines["mlx"]
    assert "available (cpu)" in lines["cpu"]
    rows = {row["backend"]: row for row in json.loads(colibri("list-backends", "--json").stdout)}
    assert rows["mlx"]["available"] and rows["mlx"]["device"] == plugin.device()
    assert rows["cpu"]["device"] == "cpu"


def test_unknown_device_is_refused():
    from colibri_mlx.backend import MlxBackend

    with pytest.raises(ValueError, match="device 'tpu'"):
        MlxBackend("tpu")
