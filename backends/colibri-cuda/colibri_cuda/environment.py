"""``colibri doctor``'s CUDA check: which driver and which CUDA runtime this machine has,
or that none was found. The driver is asked through ctypes, as the probe asks it; the
runtime is the one CuPy brings (its CUDA build, and the NVRTC it loads, which compiles
the kernels). Registered as load options without options of their own, for their doctor
hook; CuPy is imported only when doctor runs the check."""

from __future__ import annotations

import ctypes
import importlib.util
from importlib import metadata

from colibri_core.cli.extend import LoadOptions
from colibri_cuda import plugin

CHECK = "CUDA"


def _version(number: int) -> str:
    """CUDA's version numbers: 12090 is 12.9."""
    return f"{number // 1000}.{number % 1000 // 10}"


def driver_version() -> int | None:
    """The CUDA version the driver supports (12090 for 12.9), or None without a driver."""
    driver = plugin._driver()
    if driver is None:
        return None
    version = ctypes.c_int(0)
    try:
        status = driver.cuDriverGetVersion(ctypes.byref(version))
    except AttributeError:  # not a CUDA driver after all
        return None
    return version.value if status == 0 else None


def _device_names(driver) -> list[str]:
    count = ctypes.c_int(0)
    if driver.cuDeviceGetCount(ctypes.byref(count)) != 0:
        return []
    names = []
    for ordinal in range(count.value):
        device, name = ctypes.c_int(0), ctypes.create_string_buffer(256)
        if driver.cuDeviceGet(ctypes.byref(device), ordinal) == 0 and driver.cuDeviceGetName(name, 256, device) == 0:
            names.append(name.value.decode(errors="replace"))
    return names


def driver_summary() -> tuple[int | None, str]:
    """(the driver's CUDA version or None, what was found)."""
    version = driver_version()
    if version is None:
        return None, plugin.driver_reason() or "no CUDA driver (its version is unknown)"
    found = f"driver for CUDA {_version(version)}"
    reason = plugin.driver_reason()
    if reason is not None:
        return version, f"{found}, {reason}"
    names = _device_names(plugin._driver())
    return version, f"{found}, {len(names)} device{'s' * (len(names) != 1)}: {', '.join(names) or '?'}"


def cupy_distributions() -> list[str]:
    """The installed distributions that provide the ``cupy`` module (cupy-cuda12x, ...)."""
    found = set()
    for dist in metadata.distributions():
        name = (dist.metadata["Name"] or "").lower()
        if name == "cupy" or name.startswith(("cupy-cuda", "cupy-rocm")):
            found.add(f"{name} {dist.version}")
    return sorted(found)


def runtime_summary() -> tuple[int | None, str]:
    """(CuPy's CUDA runtime version or None, what was found)."""
    if importlib.util.find_spec("cupy") is None:
        return None, f"no CUDA runtime: cupy is not installed ({plugin.INSTALL_HINT})"
    builds = cupy_distributions()
    if len(builds) > 1:  # each overwrites the other's files: neither works reliably
        return None, f"several CuPy builds installed over each other ({', '.join(builds)}): uninstall all, install one"
    try:
        import cupy

        runtime = cupy.cuda.runtime.runtimeGetVersion()
    except Exception as exc:  # a broken install: say what CuPy says
        return None, f"CuPy does not load: {type(exc).__name__}: {exc}"
    found = f"CUDA runtime {_version(runtime)} (CuPy {cupy.__version__}{', ' + builds[0] if builds else ''})"
    try:
        major, minor = cupy.cuda.nvrtc.getVersion()
    except Exception as exc:
        return None, f"{found}; NVRTC, which compiles colibri's kernels, is not found: {exc}"
    return runtime, f"{found}, NVRTC {major}.{minor}"


def cuda_check() -> tuple[str, str, str, str]:
    """(name, status, detail, hint) of doctor's CUDA check."""
    driver, driver_text = driver_summary()
    runtime, runtime_text = runtime_summary()
    detail = f"{driver_text}; {runtime_text}"
    if runtime is None:
        return CHECK, "warn", detail, "pip install colibri-cuda brings CuPy and the CUDA libraries; --backend cuda needs them"
    if driver is None or plugin.driver_reason() is not None:
        return CHECK, "warn", detail, "--backend cuda needs an NVIDIA GPU and its driver; the other backends are unaffected"
    if driver // 1000 < runtime // 1000:
        return CHECK, "warn", detail, (f"the driver is older than CUDA {_version(runtime)}: update it, or install a CuPy "
                                       "build for its CUDA version")
    return CHECK, "pass", detail, ""


class CudaEnvironment(LoadOptions):
    """No options: only ``colibri doctor``'s CUDA check."""

    def doctor(self, model_dir, values):
        return [cuda_check()]
