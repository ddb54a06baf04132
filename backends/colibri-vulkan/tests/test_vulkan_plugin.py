"""The plugin: registered through the ``colibri`` entry point, probed through the Vulkan
loader alone (neither the binding nor numpy imported), listed with the physical device it
would use; the device choice never puts a CPU implementation in place of a GPU."""

import json
import subprocess
import sys

import pytest

from colibri_core.plugins.discovery import create_backend, get_registry, reset_manager
from colibri_vulkan import probe
from colibri_vulkan.probe import PhysicalDevice, VulkanUnavailable, choose

REASON = probe.unavailable_reason()
needs_vulkan = pytest.mark.skipif(REASON is not None, reason=f"no Vulkan here: {REASON}")

GIB = 2**30
LAVAPIPE = PhysicalDevice(0, "llvmpipe (LLVM 15.0.6, 256 bits)", "cpu", ((2 * GIB, True),))
IGPU = PhysicalDevice(1, "Intel(R) UHD Graphics 770", "integrated", ((16 * GIB, True),))
DGPU = PhysicalDevice(2, "AMD Radeon RX 580", "discrete", ((8 * GIB, True), (32 * GIB, False)))


@pytest.fixture(autouse=True)
def fresh_plugins(monkeypatch):
    monkeypatch.delenv(probe.ENV_DEVICE, raising=False)
    reset_manager()
    yield
    reset_manager()


def colibri(*args, env=None):
    return subprocess.run([sys.executable, "-m", "colibri_core", *args], capture_output=True, text=True, timeout=120,
                          env=env)


def test_choice_prefers_a_gpu_and_takes_lavapipe_only_when_alone_or_asked(monkeypatch):
    assert choose((LAVAPIPE, IGPU, DGPU)) is DGPU
    assert choose((LAVAPIPE, IGPU)) is IGPU
    assert choose((LAVAPIPE,)) is LAVAPIPE
    assert choose((LAVAPIPE, IGPU, DGPU), 0) is LAVAPIPE
    monkeypatch.setenv(probe.ENV_DEVICE, "1")
    assert choose((LAVAPIPE, IGPU, DGPU)) is IGPU
    assert choose((LAVAPIPE, IGPU, DGPU), 2) is DGPU  # the argument wins over the environment


def test_choice_refusals(monkeypatch):
    with pytest.raises(VulkanUnavailable, match="no Vulkan device"):
        choose(())
    with pytest.raises(VulkanUnavailable, match=r"Vulkan device 3 does not exist \(devices: 0: llvmpipe"):
        choose((LAVAPIPE,), 3)
    monkeypatch.setenv(probe.ENV_DEVICE, "gpu")
    with pytest.raises(VulkanUnavailable, match="COLIBRI_VULKAN_DEVICE='gpu' is not a device index"):
        choose((LAVAPIPE,))


def test_description_names_the_device_type_and_heaps():
    assert DGPU.describe() == "gpu: Vulkan device 2 AMD Radeon RX 580 (discrete; heaps 8.0 GiB device-local + 32.0 GiB)"
    assert LAVAPIPE.describe().startswith("cpu: Vulkan device 0 llvmpipe")
    assert DGPU.device_local_bytes == 8 * GIB


def test_probe_reasons(monkeypatch):
    real_find_spec = probe.importlib.util.find_spec
    monkeypatch.setattr(probe.importlib.util, "find_spec", lambda name: None if name == "vulkan" else real_find_spec(name))
    assert probe.unavailable_reason() == "the vulkan Python binding is not installed: pip install colibri-vulkan"
    monkeypatch.setattr(probe.importlib.util, "find_spec", real_find_spec)
    probe.physical_devices.cache_clear()
    monkeypatch.setattr(probe, "LOADER_NAMES", ("libvulkan-absent.so.9",))
    monkeypatch.setattr(probe.ctypes.util, "find_library", lambda name: None)
    try:
        assert probe.unavailable_reason().startswith("no Vulkan loader (libvulkan)")
        assert probe.device() is None
    finally:
        probe.physical_devices.cache_clear()


def test_probe_imports_neither_the_binding_nor_numpy():
    code = ("import sys, colibri_vulkan.plugin, colibri_vulkan.probe as p; r = p.unavailable_reason(); p.device(); "
            "print(sorted(m for m in ('vulkan', 'cffi', 'numpy') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["[]"]


def test_no_driver_is_unavailable_with_the_reason(tmp_path):
    import os

    env = {**os.environ, "VK_ICD_FILENAMES": str(tmp_path / "none.json"), "VK_DRIVER_FILES": str(tmp_path / "none.json")}
    rows = {row["backend"]: row for row in json.loads(colibri("list-backends", "--json", env=env).stdout)}
    assert not rows["vulkan"]["available"] and "found no driver" in rows["vulkan"]["reason"], rows["vulkan"]
    assert rows["cpu"]["available"]


@needs_vulkan
def test_registered_through_the_entry_point():
    entry = get_registry().get("backend", "vulkan")
    assert entry.plugin == "colibri-vulkan"
    assert entry.spec.unavailable_reason() is None
    assert entry.spec.device_kind() == probe.chosen_device().describe()
    from colibri_vulkan.backend import VulkanBackend

    backend = create_backend(get_registry(), "vulkan")
    assert isinstance(backend, VulkanBackend) and backend.name == "vulkan"
    assert backend.device == probe.chosen_device()
    assert backend.device_memory() == backend.device.device_local_bytes > 0


@needs_vulkan
def test_list_backends_shows_the_device():
    chosen = probe.chosen_device()
    table = colibri("list-backends")
    assert table.returncode == 0, table.stderr
    rows = [line.split("│") for line in table.stdout.splitlines() if line.count("│") > 2]
    status = next(cells[2].strip() for cells in rows if cells[1].strip() == "vulkan")  # a long cell wraps: its start
    assert status.startswith(f"available ({chosen.kind}:"), table.stdout
    rows = {row["backend"]: row for row in json.loads(colibri("list-backends", "--json").stdout)}
    assert rows["vulkan"]["available"] and rows["vulkan"]["device"] == chosen.describe()


@needs_vulkan
def test_environment_picks_the_device(monkeypatch):
    from colibri_vulkan.backend import VulkanBackend

    count = len(probe.physical_devices())
    monkeypatch.setenv(probe.ENV_DEVICE, str(count))
    with pytest.raises(VulkanUnavailable, match=f"Vulkan device {count} does not exist"):
        VulkanBackend()
    monkeypatch.setenv(probe.ENV_DEVICE, str(count - 1))
    assert VulkanBackend().device.index == count - 1
