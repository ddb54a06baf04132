"""Registers the CUDA backend. Cheap on purpose: ``colibri list-backends`` calls the
probe, which looks for CuPy without importing it and asks the CUDA driver (through
ctypes) whether there is a device."""

from __future__ import annotations

import ctypes
import importlib.util
import sys

from colibri_core import hookimpl
from colibri_core.plugins.registry import BackendSpec, LoadOptionsSpec

# what colibri-cuda depends on, for an environment that lost it (or installed with --no-deps)
INSTALL_HINT = "pip install 'cupy-cuda12x[ctk]>=14' (CUDA 12 and 13 drivers)"
DRIVER_LIBRARIES = ("nvcuda.dll",) if sys.platform == "win32" else ("libcuda.so.1", "libcuda.so")
CUDA_ERROR_NO_DEVICE = 100


def _driver():
    for name in DRIVER_LIBRARIES:
        try:
            return ctypes.CDLL(name)
        except OSError:
            continue
    return None


def driver_reason() -> str | None:
    """None when the CUDA driver loads and sees at least one device, else why not."""
    driver = _driver()
    if driver is None:
        return f"no CUDA driver ({DRIVER_LIBRARIES[0]} not found)"
    try:
        status = driver.cuInit(0)
        if status == CUDA_ERROR_NO_DEVICE:
            return "no CUDA device"
        if status != 0:
            return f"the CUDA driver does not start (cuInit error {status})"
        count = ctypes.c_int(0)
        status = driver.cuDeviceGetCount(ctypes.byref(count))
    except AttributeError:  # not a CUDA driver after all
        return f"no CUDA driver ({DRIVER_LIBRARIES[0]} has no cuInit)"
    if status != 0 or count.value < 1:
        return "no CUDA device"
    return None


def unavailable_reason() -> str | None:
    if importlib.util.find_spec("cupy") is None:
        return f"cupy is not installed: {INSTALL_HINT}"
    return driver_reason()


@hookimpl
def colibri_register_backends(register):
    register(
        BackendSpec(
            "cuda",
            "colibri_cuda.backend:CudaBackend",
            probe="colibri_cuda.plugin:unavailable_reason",
            device="gpu",
            description="CUDA on CuPy, float32: cuBLAS products, kernels on packed weights, experts in VRAM",
        )
    )


@hookimpl
def colibri_register_load_options(register):
    register(LoadOptionsSpec("cuda", "colibri_cuda.environment:CudaEnvironment",
                             "colibri doctor's CUDA check: the driver and the CUDA runtime found"))
