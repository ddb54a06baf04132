"""Registers the MLX backend. Cheap on purpose: ``colibri list-backends`` calls the probes
below, which look for the installed distributions without importing mlx."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import platform

from colibri_core import hookimpl
from colibri_core.plugins.registry import BackendSpec

# MLX's compute libraries on Linux come in separate distributions (mlx[cpu], mlx[cuda])
LINUX_BACKENDS = ("mlx-cpu", "mlx-cuda-12", "mlx-cuda-13")


def has_metal() -> bool:
    """Apple silicon under macOS: MLX runs on Metal."""
    return platform.system() == "Darwin" and platform.machine() == "arm64"


def _installed(distribution: str) -> bool:
    try:
        importlib.metadata.distribution(distribution)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def unavailable_reason() -> str | None:
    if importlib.util.find_spec("mlx") is None:
        return "mlx is not installed: pip install colibri-mlx" + ("" if has_metal() else "[cpu]")
    if platform.system() == "Linux" and not any(_installed(d) for d in LINUX_BACKENDS):
        return "mlx is installed without a compute library: pip install colibri-mlx[cpu]"
    return None


def device() -> str:
    """What the backend computes on here: Metal's GPU on Apple silicon, else the CPU."""
    return "gpu" if has_metal() else "cpu"


@hookimpl
def colibri_register_backends(register):
    register(
        BackendSpec(
            "mlx",
            "colibri_mlx.backend:MlxBackend",
            probe="colibri_mlx.plugin:unavailable_reason",
            device="colibri_mlx.plugin:device",
            description="MLX float32: Metal on Apple silicon, MLX's CPU build elsewhere; native int4 and MXFP4 products",
        )
    )
