"""``colibri doctor``'s CUDA check says which driver and which CUDA runtime it found, or
that none was found: with stand-in drivers for every case here, with the CuPy that
colibri-cuda depends on for the runtime, and through the command line."""

import ctypes
import json

import pytest

from colibri_core.cli.demo import DemoSpec, build_demo_model
from colibri_core.testing.cli import run_colibri
from colibri_cuda import environment, plugin


class FakeDriver:
    def __init__(self, version=13000, names=("Fake GPU",), init=0):
        self.version, self.names, self.init = version, names, init

    def cuInit(self, flags):
        return self.init

    def cuDriverGetVersion(self, pointer):
        ctypes.cast(pointer, ctypes.POINTER(ctypes.c_int))[0] = self.version
        return 0

    def cuDeviceGetCount(self, pointer):
        ctypes.cast(pointer, ctypes.POINTER(ctypes.c_int))[0] = len(self.names)
        return 0

    def cuDeviceGet(self, pointer, ordinal):
        ctypes.cast(pointer, ctypes.POINTER(ctypes.c_int))[0] = ordinal
        return 0

    def cuDeviceGetName(self, buffer, size, device):
        ctypes.memmove(buffer, self.names[device.value].encode() + b"\0", len(self.names[device.value]) + 1)
        return 0


RUNTIME_12_9 = (12090, "CUDA runtime 12.9 (CuPy 14.2.0, cupy-cuda12x 14.2.0), NVRTC 12.9")


@pytest.mark.parametrize("driver, runtime, status, said", [
    (None, RUNTIME_12_9, "warn", "no CUDA driver (libcuda.so.1 not found); CUDA runtime 12.9"),
    (FakeDriver(), RUNTIME_12_9, "pass", "driver for CUDA 13.0, 1 device: Fake GPU; CUDA runtime 12.9 (CuPy 14.2.0"),
    (FakeDriver(12020, ("A", "B")), RUNTIME_12_9, "pass", "driver for CUDA 12.2, 2 devices: A, B; CUDA runtime 12.9"),
    (FakeDriver(11080), RUNTIME_12_9, "warn", "driver for CUDA 11.8, 1 device"),
    (FakeDriver(init=100), RUNTIME_12_9, "warn", "driver for CUDA 13.0, no CUDA device"),
    (FakeDriver(), (None, "no CUDA runtime: cupy is not installed"), "warn", "1 device: Fake GPU; no CUDA runtime"),
], ids=["no-driver", "driver-13", "two-devices", "old-driver", "no-device", "no-cupy"])
def test_the_check_names_the_driver_and_runtime_found(monkeypatch, driver, runtime, status, said):
    monkeypatch.setattr(plugin, "_driver", lambda: driver)
    monkeypatch.setattr(environment, "runtime_summary", lambda: runtime)
    name, got_status, detail, hint = environment.cuda_check()
    assert (name, got_status) == ("CUDA", status), detail
    assert said in detail
    assert bool(hint) == (status != "pass")


def test_the_runtime_is_cupys_cuda_12_build_with_its_nvrtc():
    """colibri-cuda's dependency: CuPy's CUDA 12 build, whose NVRTC (compiling the
    kernels) comes from NVIDIA's wheels, found without a CUDA toolkit or a driver."""
    runtime, text = environment.runtime_summary()
    assert runtime is not None and runtime // 1000 == 12, text
    assert "cupy-cuda12x" in text and "NVRTC 12." in text, text
    assert environment.cupy_distributions() == [b for b in environment.cupy_distributions() if b.startswith("cupy-cuda12x")]


def test_colibri_doctor_reports_cuda(tmp_path):
    model = tmp_path / "tiny"
    build_demo_model(model, DemoSpec(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_experts=4,
                                     num_experts_per_tok=2, intermediate_size=16, tokenizer_vocab=300))
    out = run_colibri("doctor", "--model", model, "--json")
    assert out.returncode == 0, out.stdout + out.stderr
    checks = {c["name"]: c for c in json.loads(out.stdout)["checks"]}
    cuda = checks["CUDA"]
    assert "CUDA runtime 12." in cuda["detail"], cuda
    assert "driver for CUDA" in cuda["detail"] or "no CUDA driver" in cuda["detail"], cuda
    assert cuda["status"] == ("pass" if plugin.unavailable_reason() is None else "warn"), cuda
