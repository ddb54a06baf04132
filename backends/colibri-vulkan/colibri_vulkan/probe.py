"""Which Vulkan devices this machine has, and which one colibri uses: through ctypes and the
Vulkan loader alone, so listing backends imports neither the binding nor numpy.

Choice: ``COLIBRI_VULKAN_DEVICE=N`` (or ``VulkanBackend(device_index=N)``) picks device N;
otherwise the first discrete GPU, else integrated, else virtual, else any other, and a CPU
implementation (lavapipe) only when it is the only device, never in place of a GPU.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import importlib.util
import os
from dataclasses import dataclass

ENV_DEVICE = "COLIBRI_VULKAN_DEVICE"
LOADER_NAMES = ("libvulkan.so.1", "libvulkan.so", "vulkan-1.dll", "libvulkan.1.dylib", "libvulkan.dylib")
TYPES = {0: "other", 1: "integrated", 2: "discrete", 3: "virtual", 4: "cpu"}
PREFERENCE = ("discrete", "integrated", "virtual", "other", "cpu")
DEVICE_LOCAL = 1  # VK_MEMORY_HEAP_DEVICE_LOCAL_BIT
RESULTS = {-1: "VK_ERROR_OUT_OF_HOST_MEMORY", -2: "VK_ERROR_OUT_OF_DEVICE_MEMORY", -3: "VK_ERROR_INITIALIZATION_FAILED",
           -7: "VK_ERROR_EXTENSION_NOT_PRESENT", -9: "VK_ERROR_INCOMPATIBLE_DRIVER"}


class VulkanUnavailable(RuntimeError):
    """No usable Vulkan here; the message says why in one line."""


@dataclass(frozen=True)
class PhysicalDevice:
    index: int
    name: str
    type: str  # discrete / integrated / virtual / cpu / other
    heaps: tuple[tuple[int, bool], ...]  # (bytes, device-local)

    @property
    def kind(self) -> str:
        """What colibri's listings call it: "cpu" for a CPU implementation, else "gpu"."""
        return "cpu" if self.type == "cpu" else "gpu"

    @property
    def device_local_bytes(self) -> int:
        return sum(size for size, local in self.heaps if local)

    def describe(self) -> str:
        heaps = " + ".join(f"{size / 2**30:.1f} GiB{' device-local' if local else ''}" for size, local in self.heaps)
        return f"{self.kind}: Vulkan device {self.index} {self.name} ({self.type}; heaps {heaps})"


class _InstanceCreateInfo(ctypes.Structure):
    _fields_ = [("sType", ctypes.c_uint32), ("pNext", ctypes.c_void_p), ("flags", ctypes.c_uint32),
                ("pApplicationInfo", ctypes.c_void_p), ("enabledLayerCount", ctypes.c_uint32),
                ("ppEnabledLayerNames", ctypes.c_void_p), ("enabledExtensionCount", ctypes.c_uint32),
                ("ppEnabledExtensionNames", ctypes.c_void_p)]


def _load_loader():
    for name in LOADER_NAMES:
        try:
            return ctypes.CDLL(name)
        except OSError:
            continue
    found = ctypes.util.find_library("vulkan")
    if found:
        try:
            return ctypes.CDLL(found)
        except OSError:
            pass
    raise VulkanUnavailable("no Vulkan loader (libvulkan): install one (Debian: apt-get install libvulkan1 "
                            "mesa-vulkan-drivers)")


@functools.lru_cache(maxsize=1)
def physical_devices() -> tuple[PhysicalDevice, ...]:
    """Every Vulkan physical device, in the loader's order. Raises VulkanUnavailable."""
    lib = _load_loader()
    lib.vkCreateInstance.restype = ctypes.c_int32
    lib.vkEnumeratePhysicalDevices.restype = ctypes.c_int32
    instance = ctypes.c_void_p()
    info = _InstanceCreateInfo(sType=1)  # VK_STRUCTURE_TYPE_INSTANCE_CREATE_INFO
    result = lib.vkCreateInstance(ctypes.byref(info), None, ctypes.byref(instance))
    if result != 0:
        raise VulkanUnavailable(f"the Vulkan loader found no driver (vkCreateInstance: {RESULTS.get(result, result)}): "
                                "install one (Debian: mesa-vulkan-drivers for lavapipe on the CPU)")
    try:
        count = ctypes.c_uint32()
        lib.vkEnumeratePhysicalDevices(instance, ctypes.byref(count), None)
        handles = (ctypes.c_void_p * count.value)()
        if count.value:
            lib.vkEnumeratePhysicalDevices(instance, ctypes.byref(count), handles)
        devices = []
        for index in range(count.value):
            props = ctypes.create_string_buffer(2048)  # VkPhysicalDeviceProperties (about 824 bytes)
            lib.vkGetPhysicalDeviceProperties(ctypes.c_void_p(handles[index]), props)
            device_type = int.from_bytes(props.raw[16:20], "little")
            name = props.raw[20:276].split(b"\0", 1)[0].decode("utf-8", "replace")
            memory = ctypes.create_string_buffer(1024)  # VkPhysicalDeviceMemoryProperties (520 bytes)
            lib.vkGetPhysicalDeviceMemoryProperties(ctypes.c_void_p(handles[index]), memory)
            heap_count = int.from_bytes(memory.raw[260:264], "little")
            heaps = tuple((int.from_bytes(memory.raw[264 + 16 * i:272 + 16 * i], "little"),
                           bool(int.from_bytes(memory.raw[272 + 16 * i:276 + 16 * i], "little") & DEVICE_LOCAL))
                          for i in range(heap_count))
            devices.append(PhysicalDevice(index, name, TYPES.get(device_type, "other"), heaps))
        return tuple(devices)
    finally:
        lib.vkDestroyInstance(instance, None)


def requested_index(device_index: int | None = None) -> int | None:
    """The index asked for: the argument, else COLIBRI_VULKAN_DEVICE, else None."""
    if device_index is not None:
        return device_index
    value = os.environ.get(ENV_DEVICE, "").strip()
    if not value:
        return None
    try:
        return int(value)
    except ValueError:
        raise VulkanUnavailable(f"{ENV_DEVICE}={value!r} is not a device index (0, 1, ...)") from None


def choose(devices: tuple[PhysicalDevice, ...], device_index: int | None = None) -> PhysicalDevice:
    """The device colibri uses (see the module docstring). Raises VulkanUnavailable."""
    if not devices:
        raise VulkanUnavailable("no Vulkan device: install a driver (Debian: mesa-vulkan-drivers for lavapipe on the CPU)")
    wanted = requested_index(device_index)
    if wanted is not None:
        if not 0 <= wanted < len(devices):
            names = ", ".join(f"{d.index}: {d.name}" for d in devices)
            raise VulkanUnavailable(f"Vulkan device {wanted} does not exist (devices: {names})")
        return devices[wanted]
    return min(devices, key=lambda d: (PREFERENCE.index(d.type), d.index))


def chosen_device(device_index: int | None = None) -> PhysicalDevice:
    return choose(physical_devices(), device_index)


def unavailable_reason() -> str | None:
    """The plugin's probe: None when the backend can run here, else one line saying why."""
    if importlib.util.find_spec("vulkan") is None:
        return "the vulkan Python binding is not installed: pip install colibri-vulkan"
    try:
        chosen_device()
    except VulkanUnavailable as exc:
        return str(exc)
    return None


def device() -> str | None:
    """The listing's device column: the physical device the backend would use."""
    try:
        return chosen_device().describe()
    except VulkanUnavailable:
        return None
