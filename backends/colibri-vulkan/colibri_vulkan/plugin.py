"""Registers the Vulkan backend. Cheap on purpose: ``colibri list-backends`` calls the probe,
which asks the Vulkan loader through ctypes (colibri_vulkan.probe), importing neither the
binding nor numpy."""

from __future__ import annotations

from colibri_core import hookimpl
from colibri_core.plugins.registry import BackendSpec


@hookimpl
def colibri_register_backends(register):
    register(
        BackendSpec(
            "vulkan",
            "colibri_vulkan.backend:VulkanBackend",
            probe="colibri_vulkan.probe:unavailable_reason",
            device="colibri_vulkan.probe:device",
            description="Vulkan compute shaders, float32, on any Vulkan device (COLIBRI_VULKAN_DEVICE=N picks one); "
                        "products on every packed kind",
        )
    )
