"""The Vulkan machinery under the backend: instance, device and compute queue, memory,
pipelines and command recording, through the ``vulkan`` binding (cffi).

- **Memory.** Arrays and weights are ranges of a few large device-local allocations
  (``Block``, 64 MiB or the size of a larger array), first fit with coalescing; a range
  returns to its block when the last Python reference to it goes. Uploads go through a
  host-visible staging buffer and a recorded copy, downloads through a readback buffer.
- **Commands.** Dispatches, copies and fills are recorded into one command buffer, with a
  memory barrier after each, and submitted only when the host needs data (``download``)
  (more descriptor pools and staging buffers are made when a recording needs them): one
  submit and one host wait per ``to_host``, none other. A dispatch holds references to the ranges it uses until its submit finished.
  Descriptor sets are written once per (program, buffer ranges) and reused across submits
  (``CACHED_SETS`` of them; past that the cache is dropped at the next submit); the commands
  themselves are recorded per call (docs/backends.md, Vulkan: why).
- **Pipelines** are made once per program on first use, from the committed SPIR-V.
- **Device features** (``Features``) are queried when the context is made: the Vulkan version,
  subgroup size and operations in compute shaders, 8/16-bit storage, int8 / float16 arithmetic
  and integer dot products. ``product_program`` picks each weight kind's variant of
  ``linear.comp`` from them (subgroup-reduced, reading packed bytes through 8/16-bit storage
  where the device has it; the plain Vulkan 1.0 shader where not, or when
  ``COLIBRI_VULKAN_PLAIN=1``), and the device is made with exactly the features those use.
- **One context per device and process** (``shared_context``): backends made one after
  another reuse the device, its memory blocks and its compiled pipelines (drivers compile
  SPIR-V on first use, which costs more than a small model's whole run on lavapipe). A lock
  serialises recording: the expert store may prepare weights from its reader threads.
"""

from __future__ import annotations

import bisect
import collections
import logging
import os
import struct
import threading
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import vulkan as vk

from colibri_vulkan.probe import PREFERENCE, TYPES, PhysicalDevice, VulkanUnavailable, choose

ffi, lib = vk.ffi, vk.lib
log = logging.getLogger("colibri_vulkan")
ENV_PLAIN = "COLIBRI_VULKAN_PLAIN"
SPIRV = Path(__file__).resolve().parent / "spirv"
BLOCK_BYTES = 64 << 20
STAGING_BYTES = 16 << 20
PUSH_BYTES = 128  # the least maxPushConstantsSize every device has
DESCRIPTOR_SETS = 256  # per descriptor pool
CACHED_SETS = 4096  # descriptor sets kept for reuse; past it the cache is dropped at the next submit
# storage buffers each program binds
BINDINGS = {"eltwise": 3, "rows": 4, "rope": 4, "attention": 8, "bmm": 3, "gather": 4, "dsa": 4, "delta": 7,
            "linear": 6}  # every variant of linear.comp: linear_<kind>[_subgroup[_8bit|_16bit]]
OUT_OF_POOL = (-1000069000, -12)  # VK_ERROR_OUT_OF_POOL_MEMORY, VK_ERROR_FRAGMENTED_POOL
STAGES = vk.VK_PIPELINE_STAGE_COMPUTE_SHADER_BIT | vk.VK_PIPELINE_STAGE_TRANSFER_BIT
WRITES = vk.VK_ACCESS_SHADER_WRITE_BIT | vk.VK_ACCESS_TRANSFER_WRITE_BIT
READS_WRITES = WRITES | vk.VK_ACCESS_SHADER_READ_BIT | vk.VK_ACCESS_TRANSFER_READ_BIT


class VulkanError(RuntimeError):
    pass


def locked(method):
    """Run a context method under the context's lock (recording is not thread-safe)."""

    def run(self, *args, **kwargs):
        with self.lock:
            return method(self, *args, **kwargs)

    run.__name__, run.__doc__ = method.__name__, method.__doc__
    return run


def check(result: int, what: str) -> None:
    if result != 0:
        raise VulkanError(f"{what} failed: VkResult {result}")


SUBGROUP_OPS = {1: "basic", 2: "vote", 4: "arithmetic", 8: "ballot", 16: "shuffle", 32: "relative shuffle",
                64: "clustered", 128: "quad"}  # VkSubgroupFeatureFlagBits
NARROW = {"bf16": "16bit", "q8": "8bit", "q4": "8bit", "mxfp4": "8bit", "fp8": "8bit"}  # as shaders/build.py
PRODUCT_KINDS = ("f32", "bf16", "q8", "q4", "mxfp4", "fp8")
SUBGROUP_WORKGROUP = 64  # invocations per workgroup of the subgroup products (at least one subgroup)


def plain_requested() -> bool:
    """COLIBRI_VULKAN_PLAIN set (to anything but "" or "0"): only the plain shaders."""
    return os.environ.get(ENV_PLAIN, "").strip() not in ("", "0")


@dataclass(frozen=True)
class Features:
    """What the device offers colibri's shaders (queried once, when a context is made)."""

    api: tuple[int, int] = (1, 0)  # the version used: the lowest of the loader's, the device's and 1.3
    subgroup_size: int = 0
    subgroup_ops: frozenset = frozenset()  # operations in compute shaders (SUBGROUP_OPS' names)
    storage8: bool = False  # storageBuffer8BitAccess
    storage16: bool = False  # storageBuffer16BitAccess
    int8: bool = False  # shaderInt8
    float16: bool = False  # shaderFloat16
    integer_dot: bool = False  # shaderIntegerDotProduct
    integer_dot_accelerated: bool = False  # 4x8-bit packed signed dot products in hardware
    max_workgroup: int = 128  # maxComputeWorkGroupSize[0] and maxComputeWorkGroupInvocations, the lower
    extensions: frozenset = field(default_factory=frozenset, repr=False)  # the device's extensions

    @property
    def subgroups(self) -> bool:
        """Subgroup-reduced products possible: Vulkan 1.1, basic and arithmetic operations in
        compute shaders, and a workgroup that holds a whole subgroup."""
        return (self.api >= (1, 1) and {"basic", "arithmetic"} <= self.subgroup_ops
                and 0 < self.subgroup_size <= self.max_workgroup)

    def narrow(self, width: str) -> bool:
        return self.storage8 if width == "8bit" else self.storage16

    def describe(self) -> str:
        ops = ", ".join(name for bit, name in SUBGROUP_OPS.items() if name in self.subgroup_ops) or "none"
        have = [name for name, on in (("8-bit storage", self.storage8), ("16-bit storage", self.storage16),
                                      ("int8", self.int8), ("float16", self.float16)) if on]
        if self.integer_dot:
            have.append("integer dot products" + ("" if self.integer_dot_accelerated else " (not accelerated)"))
        return (f"Vulkan {self.api[0]}.{self.api[1]}; subgroup size {self.subgroup_size} ({ops} in compute); "
                + (", ".join(have) if have else "no 8/16-bit storage"))


def product_program(kind: str, features: Features, plain: bool = False) -> str:
    """The variant of linear.comp a weight kind's products use on a device with ``features``."""
    if plain or not features.subgroups:
        return f"linear_{kind}"
    width = NARROW.get(kind)
    if width is not None and features.narrow(width):
        return f"linear_{kind}_subgroup_{width}"
    return f"linear_{kind}_subgroup"


def _version(v: int) -> tuple[int, int]:
    return ((v >> 22) & 0x7F, (v >> 12) & 0x3FF)


def instance_version() -> tuple[int, int]:
    """The loader's Vulkan version (1.0 for a loader without vkEnumerateInstanceVersion)."""
    try:
        return _version(int(vk.vkEnumerateInstanceVersion()))
    except Exception:  # a 1.0 loader: the function does not exist
        return (1, 0)


def _struct(ctype: str, stype: int, chain=ffi.NULL):
    return ffi.new(f"{ctype}*", {"sType": stype, "pNext": chain})


def query_features(physical, instance_api: tuple[int, int]) -> Features:
    """The device's features that colibri's shaders may use (Vulkan 1.0 devices: none)."""
    props = vk.vkGetPhysicalDeviceProperties(physical)
    limits = props.limits
    api = min(instance_api, _version(int(props.apiVersion)), (1, 3))
    max_workgroup = min(int(limits.maxComputeWorkGroupSize[0]), int(limits.maxComputeWorkGroupInvocations))
    extensions = frozenset(e.extensionName for e in vk.vkEnumerateDeviceExtensionProperties(physical, None))
    if api < (1, 1):
        return Features(api=api, max_workgroup=max_workgroup, extensions=extensions)
    sub = _struct("VkPhysicalDeviceSubgroupProperties", vk.VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_SUBGROUP_PROPERTIES)
    dot_props = None
    chain = sub
    if api >= (1, 3) or "VK_KHR_shader_integer_dot_product" in extensions:
        dot_props = _struct("VkPhysicalDeviceShaderIntegerDotProductProperties",
                            vk.VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_SHADER_INTEGER_DOT_PRODUCT_PROPERTIES, chain)
        chain = dot_props
    props2 = _struct("VkPhysicalDeviceProperties2", vk.VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_PROPERTIES_2, chain)
    lib.vkGetPhysicalDeviceProperties2(physical, props2)

    s16 = _struct("VkPhysicalDevice16BitStorageFeatures", vk.VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_16BIT_STORAGE_FEATURES)
    chain, s8, f16i8, dot = s16, None, None, None
    if api >= (1, 2) or "VK_KHR_8bit_storage" in extensions:
        s8 = chain = _struct("VkPhysicalDevice8BitStorageFeatures",
                             vk.VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_8BIT_STORAGE_FEATURES, chain)
    if api >= (1, 2) or "VK_KHR_shader_float16_int8" in extensions:
        f16i8 = chain = _struct("VkPhysicalDeviceShaderFloat16Int8Features",
                                vk.VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_SHADER_FLOAT16_INT8_FEATURES, chain)
    if dot_props is not None:
        dot = chain = _struct("VkPhysicalDeviceShaderIntegerDotProductFeatures",
                              vk.VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_SHADER_INTEGER_DOT_PRODUCT_FEATURES, chain)
    features2 = _struct("VkPhysicalDeviceFeatures2", vk.VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_FEATURES_2, chain)
    lib.vkGetPhysicalDeviceFeatures2(physical, features2)

    compute = bool(sub.supportedStages & vk.VK_SHADER_STAGE_COMPUTE_BIT)
    ops = frozenset(name for bit, name in SUBGROUP_OPS.items() if compute and sub.supportedOperations & bit)
    return Features(api=api, subgroup_size=int(sub.subgroupSize), subgroup_ops=ops,
                    storage8=bool(s8 is not None and s8.storageBuffer8BitAccess),
                    storage16=bool(s16.storageBuffer16BitAccess),
                    int8=bool(f16i8 is not None and f16i8.shaderInt8),
                    float16=bool(f16i8 is not None and f16i8.shaderFloat16),
                    integer_dot=bool(dot is not None and dot.shaderIntegerDotProduct),
                    integer_dot_accelerated=bool(dot_props is not None
                                                 and dot_props.integerDotProduct4x8BitPackedSignedAccelerated),
                    max_workgroup=max_workgroup, extensions=extensions)


class Allocation:
    """A range of a block: what an array's data lives in. Returned to the block when the
    last reference goes (pending commands hold one until their submit finished)."""

    __slots__ = ("block", "offset", "size")

    def __init__(self, block: "Block", offset: int, size: int):
        self.block, self.offset, self.size = block, offset, size

    def __del__(self):
        # only queued here: __del__ may run in the middle of an allocation (garbage collection)
        # or on another thread; the next allocation returns the range to its block
        try:
            self.block.ctx.released.append((self.block, self.offset, self.size))
        except Exception:  # interpreter shutdown: the memory goes with the device
            pass


class Block:
    """One device allocation with one buffer over all of it, handed out in ranges."""

    def __init__(self, ctx: "VulkanContext", size: int, usage: int, properties: int, host: bool = False):
        self.ctx, self.size = ctx, size
        self.buffer = vk.vkCreateBuffer(ctx.device, vk.VkBufferCreateInfo(
            size=size, usage=usage, sharingMode=vk.VK_SHARING_MODE_EXCLUSIVE), None)
        req = vk.vkGetBufferMemoryRequirements(ctx.device, self.buffer)
        memory_type = ctx.memory_type(req.memoryTypeBits, properties)
        self.memory = vk.vkAllocateMemory(ctx.device, vk.VkMemoryAllocateInfo(
            allocationSize=req.size, memoryTypeIndex=memory_type), None)
        vk.vkBindBufferMemory(ctx.device, self.buffer, self.memory, 0)
        self.mapped = None
        if host:
            ptr = ffi.new("void**")
            check(lib.vkMapMemory(ctx.device, self.memory, 0, size, 0, ptr), "vkMapMemory")
            self.mapped = ffi.cast("char*", ptr[0])
        self.free: list[tuple[int, int]] = [(0, size)]  # (offset, size), sorted, coalesced

    def take(self, size: int) -> int | None:
        for i, (offset, free) in enumerate(self.free):
            if free >= size:
                if free == size:
                    del self.free[i]
                else:
                    self.free[i] = (offset + size, free - size)
                return offset
        return None

    def release(self, offset: int, size: int) -> None:
        i = bisect.bisect(self.free, (offset, size))
        if i < len(self.free) and offset + size == self.free[i][0]:
            size += self.free.pop(i)[1]
        if i > 0 and self.free[i - 1][0] + self.free[i - 1][1] == offset:
            offset, size = self.free[i - 1][0], self.free[i - 1][1] + size
            i -= 1
            del self.free[i]
        self.free.insert(i, (offset, size))

    def destroy(self) -> None:
        if self.mapped is not None:
            vk.vkUnmapMemory(self.ctx.device, self.memory)
        vk.vkDestroyBuffer(self.ctx.device, self.buffer, None)
        vk.vkFreeMemory(self.ctx.device, self.memory, None)


class Pipeline:
    def __init__(self, ctx: "VulkanContext", name: str):
        device = ctx.device
        code = (SPIRV / f"{name}.spv").read_bytes()
        self.module = vk.vkCreateShaderModule(device, vk.VkShaderModuleCreateInfo(codeSize=len(code), pCode=code), None)
        bindings = [vk.VkDescriptorSetLayoutBinding(binding=i, descriptorType=vk.VK_DESCRIPTOR_TYPE_STORAGE_BUFFER,
                                                    descriptorCount=1, stageFlags=vk.VK_SHADER_STAGE_COMPUTE_BIT)
                    for i in range(BINDINGS[name.split("_")[0]])]
        self.set_layout = vk.vkCreateDescriptorSetLayout(device, vk.VkDescriptorSetLayoutCreateInfo(
            bindingCount=len(bindings), pBindings=bindings), None)
        push = vk.VkPushConstantRange(stageFlags=vk.VK_SHADER_STAGE_COMPUTE_BIT, offset=0, size=PUSH_BYTES)
        self.layout = vk.vkCreatePipelineLayout(device, vk.VkPipelineLayoutCreateInfo(
            setLayoutCount=1, pSetLayouts=[self.set_layout], pushConstantRangeCount=1, pPushConstantRanges=[push]), None)
        entry = "main"  # the binding's known trap: the name must stay referenced while the pipeline is made
        special = ffi.NULL
        if "_subgroup" in name:  # constant 0: the workgroup's size (local_size_x_id = 0)
            size = ffi.new("uint32_t[1]", [ctx.subgroup_workgroup])
            entries = ffi.new("VkSpecializationMapEntry[1]", [{"constantID": 0, "offset": 0, "size": 4}])
            special = ffi.new("VkSpecializationInfo*", {"mapEntryCount": 1, "pMapEntries": entries, "dataSize": 4,
                                                        "pData": size})
        stage = vk.VkPipelineShaderStageCreateInfo(stage=vk.VK_SHADER_STAGE_COMPUTE_BIT, module=self.module, pName=entry,
                                                   pSpecializationInfo=special)
        info = vk.VkComputePipelineCreateInfo(stage=stage, layout=self.layout)
        self.pipeline = vk.vkCreateComputePipelines(device, ctx.pipeline_cache, 1, [info], None)[0]
        self.set_layout_ptr = ffi.new("VkDescriptorSetLayout[1]", [self.set_layout])
        del entry, special

    def destroy(self, device) -> None:
        vk.vkDestroyPipeline(device, self.pipeline, None)
        vk.vkDestroyPipelineLayout(device, self.layout, None)
        vk.vkDestroyDescriptorSetLayout(device, self.set_layout, None)
        vk.vkDestroyShaderModule(device, self.module, None)


def _records(instance) -> tuple[list, tuple[PhysicalDevice, ...]]:
    handles = vk.vkEnumeratePhysicalDevices(instance)
    records = []
    for i, handle in enumerate(handles):
        props = vk.vkGetPhysicalDeviceProperties(handle)
        memory = vk.vkGetPhysicalDeviceMemoryProperties(handle)
        heaps = tuple((int(memory.memoryHeaps[h].size), bool(memory.memoryHeaps[h].flags & vk.VK_MEMORY_HEAP_DEVICE_LOCAL_BIT))
                      for h in range(memory.memoryHeapCount))
        name = props.deviceName if isinstance(props.deviceName, str) else ffi.string(props.deviceName).decode()
        records.append(PhysicalDevice(i, name, TYPES.get(int(props.deviceType), "other"), heaps))
    return handles, tuple(records)


class VulkanContext:
    """One logical device with one compute queue, and everything recorded on it."""

    def __init__(self, device_index: int | None = None, plain: bool | None = None):
        self.plain = plain_requested() if plain is None else bool(plain)
        loader = min(instance_version(), (1, 3))
        app = vk.VkApplicationInfo(pApplicationName="colibri", applicationVersion=1, pEngineName="colibri",
                                   engineVersion=1, apiVersion=vk.VK_MAKE_VERSION(*loader, 0))
        try:
            self.instance = vk.vkCreateInstance(vk.VkInstanceCreateInfo(pApplicationInfo=app), None)
        except vk.VkError as exc:
            raise VulkanUnavailable(f"vkCreateInstance failed ({type(exc).__name__}): no Vulkan driver") from None
        handles, records = _records(self.instance)
        self.info = choose(records, device_index)
        self.physical = handles[self.info.index]
        props = vk.vkGetPhysicalDeviceProperties(self.physical)
        self.limits = props.limits
        self.align = max(256, int(self.limits.minStorageBufferOffsetAlignment))
        self.memory_props = vk.vkGetPhysicalDeviceMemoryProperties(self.physical)
        families = vk.vkGetPhysicalDeviceQueueFamilyProperties(self.physical)
        self.family = next(i for i, f in enumerate(families) if f.queueFlags & vk.VK_QUEUE_COMPUTE_BIT)
        self.features = query_features(self.physical, loader)
        # each weight kind's product shader, and the features (and extensions) they need
        self.product_programs = {kind: product_program(kind, self.features, self.plain) for kind in PRODUCT_KINDS}
        used = set(self.product_programs.values())
        self.subgroup_workgroup = max(SUBGROUP_WORKGROUP, self.features.subgroup_size)
        self.rows_per_group = max(1, self.subgroup_workgroup // max(1, self.features.subgroup_size))
        need8 = any(p.endswith("_8bit") for p in used)
        need16 = any(p.endswith("_16bit") for p in used)
        queue_info = vk.VkDeviceQueueCreateInfo(queueFamilyIndex=self.family, queueCount=1, pQueuePriorities=[1.0])
        chain, extensions = ffi.NULL, []
        if need16:
            self._storage16 = chain = _struct("VkPhysicalDevice16BitStorageFeatures",
                                              vk.VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_16BIT_STORAGE_FEATURES, chain)
            chain.storageBuffer16BitAccess = 1
        if need8:
            self._storage8 = chain = _struct("VkPhysicalDevice8BitStorageFeatures",
                                             vk.VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_8BIT_STORAGE_FEATURES, chain)
            chain.storageBuffer8BitAccess = 1
            if self.features.api < (1, 2):  # an extension before Vulkan 1.2
                extensions += ["VK_KHR_8bit_storage", "VK_KHR_storage_buffer_storage_class"]
        extra = {}
        if chain != ffi.NULL:  # the features in a VkPhysicalDeviceFeatures2 chain (kept referenced)
            self._features2 = extra["pNext"] = _struct("VkPhysicalDeviceFeatures2",
                                                       vk.VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_FEATURES_2, chain)
        if extensions:
            extra.update(enabledExtensionCount=len(extensions), ppEnabledExtensionNames=extensions)
        self.device = vk.vkCreateDevice(self.physical, vk.VkDeviceCreateInfo(
            queueCreateInfoCount=1, pQueueCreateInfos=[queue_info], **extra), None)
        log.debug("Vulkan device %s: %s; products: %s", self.info.describe(), self.features.describe(),
                  self.describe_products())
        self.queue = vk.vkGetDeviceQueue(self.device, self.family, 0)
        self.pipeline_cache = vk.vkCreatePipelineCache(self.device, vk.VkPipelineCacheCreateInfo(), None)
        self.command_pool = vk.vkCreateCommandPool(self.device, vk.VkCommandPoolCreateInfo(
            queueFamilyIndex=self.family, flags=vk.VK_COMMAND_POOL_CREATE_RESET_COMMAND_BUFFER_BIT), None)
        self.cmd = vk.vkAllocateCommandBuffers(self.device, vk.VkCommandBufferAllocateInfo(
            commandPool=self.command_pool, level=vk.VK_COMMAND_BUFFER_LEVEL_PRIMARY, commandBufferCount=1))[0]
        self.fence = vk.vkCreateFence(self.device, vk.VkFenceCreateInfo(), None)
        self.descriptor_pools = [self._descriptor_pool()]  # more are made while recording, kept for reuse
        self.pool_in_use = 0
        # descriptor sets written once per (program, buffer ranges), kept across submits
        self.kept_pools = [self._descriptor_pool()]
        self.kept_pool_in_use = 0
        self.sets: dict[tuple, object] = {}
        self.set_hits = 0
        self.drop_sets = False
        self.lock = threading.RLock()
        self.released: collections.deque = collections.deque()  # ranges whose arrays are gone
        self.blocks: list[Block] = []
        self.pipelines: dict[str, Pipeline] = {}
        self.recording = False
        self.held: list = []  # what pending commands use
        self.submits = 0
        self.stagings = [self._host_block(STAGING_BYTES)]  # more are made while recording, kept for reuse
        self.staging_in_use = 0
        self.staged = 0
        self.readback = self._host_block(STAGING_BYTES)
        self.barrier = ffi.new("VkMemoryBarrier*", {"sType": vk.VK_STRUCTURE_TYPE_MEMORY_BARRIER,
                                                    "srcAccessMask": WRITES, "dstAccessMask": READS_WRITES})

    def describe_products(self) -> str:
        """Which shader each weight kind's products use, e.g. "q4 linear_q4_subgroup_8bit, ..."."""
        why = " (COLIBRI_VULKAN_PLAIN)" if self.plain else ""
        return ", ".join(f"{kind} {program}" for kind, program in self.product_programs.items()) + why

    # -- memory ------------------------------------------------------------------------
    def memory_type(self, bits: int, properties: int) -> int:
        for i in range(self.memory_props.memoryTypeCount):
            if bits & (1 << i) and (self.memory_props.memoryTypes[i].propertyFlags & properties) == properties:
                return i
        raise VulkanError(f"no memory type with properties {properties:#x}")

    def _descriptor_pool(self):
        sizes = [vk.VkDescriptorPoolSize(type=vk.VK_DESCRIPTOR_TYPE_STORAGE_BUFFER,
                                         descriptorCount=DESCRIPTOR_SETS * max(BINDINGS.values()))]
        return vk.vkCreateDescriptorPool(self.device, vk.VkDescriptorPoolCreateInfo(
            maxSets=DESCRIPTOR_SETS, poolSizeCount=1, pPoolSizes=sizes), None)

    def _host_block(self, size: int) -> Block:
        usage = vk.VK_BUFFER_USAGE_TRANSFER_SRC_BIT | vk.VK_BUFFER_USAGE_TRANSFER_DST_BIT
        return Block(self, size, usage, vk.VK_MEMORY_PROPERTY_HOST_VISIBLE_BIT | vk.VK_MEMORY_PROPERTY_HOST_COHERENT_BIT,
                     host=True)

    @locked
    def allocate(self, nbytes: int) -> Allocation:
        self._return_released()
        size = max(self.align, -(-nbytes // self.align) * self.align)
        for block in self.blocks:
            offset = block.take(size)
            if offset is not None:
                return Allocation(block, offset, size)
        usage = (vk.VK_BUFFER_USAGE_STORAGE_BUFFER_BIT | vk.VK_BUFFER_USAGE_TRANSFER_SRC_BIT
                 | vk.VK_BUFFER_USAGE_TRANSFER_DST_BIT)
        block = Block(self, max(BLOCK_BYTES, size), usage, vk.VK_MEMORY_PROPERTY_DEVICE_LOCAL_BIT)
        self.blocks.append(block)
        return Allocation(block, block.take(size), size)

    def _return_released(self) -> None:
        while self.released:
            block, offset, size = self.released.popleft()
            block.release(offset, size)

    @locked
    def allocated_bytes(self) -> int:
        self._return_released()
        return sum(b.size - sum(s for _, s in b.free) for b in self.blocks)

    # -- recording ---------------------------------------------------------------------
    def _begin(self) -> None:
        if not self.recording:
            info = ffi.new("VkCommandBufferBeginInfo*", {"sType": vk.VK_STRUCTURE_TYPE_COMMAND_BUFFER_BEGIN_INFO,
                                                         "flags": vk.VK_COMMAND_BUFFER_USAGE_ONE_TIME_SUBMIT_BIT})
            check(lib.vkBeginCommandBuffer(self.cmd, info), "vkBeginCommandBuffer")
            self.recording = True

    def _barrier(self) -> None:
        lib.vkCmdPipelineBarrier(self.cmd, STAGES, STAGES, 0, 1, self.barrier, 0, ffi.NULL, 0, ffi.NULL)

    def _allocate_set(self, pipe: Pipeline, kept: bool):
        """A descriptor set for ``pipe``: from the kept pools (reset only when the cache of
        sets is dropped) or from this recording's pools (reset at its submit)."""
        pools = self.kept_pools if kept else self.descriptor_pools
        at = self.kept_pool_in_use if kept else self.pool_in_use
        sets = ffi.new("VkDescriptorSet[1]")
        info = ffi.new("VkDescriptorSetAllocateInfo*", {"sType": vk.VK_STRUCTURE_TYPE_DESCRIPTOR_SET_ALLOCATE_INFO,
                                                        "descriptorPool": pools[at],
                                                        "descriptorSetCount": 1, "pSetLayouts": pipe.set_layout_ptr})
        result = lib.vkAllocateDescriptorSets(self.device, info, sets)
        if result in OUT_OF_POOL:  # the next pool: no submit, no wait
            at += 1
            if at == len(pools):
                pools.append(self._descriptor_pool())
            info.descriptorPool = pools[at]
            result = lib.vkAllocateDescriptorSets(self.device, info, sets)
            if kept:
                self.kept_pool_in_use = at
            else:
                self.pool_in_use = at
        check(result, "vkAllocateDescriptorSets")
        return sets

    @locked
    def dispatch(self, name: str, buffers: list[Allocation], push: bytes, groups: tuple[int, int, int]) -> None:
        pipe = self.pipelines.get(name)
        if pipe is None:
            pipe = self.pipelines[name] = Pipeline(self, name)
        self._begin()
        # a descriptor set is written once per (program, buffer ranges) and reused: a range's
        # descriptor stays right while its block lives (blocks live as long as the context)
        key = (name, *[(id(a.block), a.offset, a.size) for a in buffers])
        sets = self.sets.get(key)
        if sets is not None:
            self.set_hits += 1
        else:
            kept = len(self.sets) < CACHED_SETS
            if not kept:  # the cache is full: drop it at the next submit, when no command uses it
                self.drop_sets = True
            sets = self._write_set(pipe, buffers, kept)
            if kept:
                self.sets[key] = sets
        lib.vkCmdBindPipeline(self.cmd, vk.VK_PIPELINE_BIND_POINT_COMPUTE, pipe.pipeline)
        lib.vkCmdBindDescriptorSets(self.cmd, vk.VK_PIPELINE_BIND_POINT_COMPUTE, pipe.layout, 0, 1, sets, 0, ffi.NULL)
        data = push.ljust(PUSH_BYTES, b"\0")
        lib.vkCmdPushConstants(self.cmd, pipe.layout, vk.VK_SHADER_STAGE_COMPUTE_BIT, 0, PUSH_BYTES, ffi.from_buffer(data))
        lib.vkCmdDispatch(self.cmd, *groups)
        self._barrier()
        self.held.extend(buffers)

    def _write_set(self, pipe: Pipeline, buffers: list[Allocation], kept: bool):
        sets = self._allocate_set(pipe, kept)
        n = len(buffers)
        infos = ffi.new("VkDescriptorBufferInfo[]", [{"buffer": a.block.buffer, "offset": a.offset, "range": a.size}
                                                     for a in buffers])
        writes = ffi.new("VkWriteDescriptorSet[]", [
            {"sType": vk.VK_STRUCTURE_TYPE_WRITE_DESCRIPTOR_SET, "dstSet": sets[0], "dstBinding": i, "descriptorCount": 1,
             "descriptorType": vk.VK_DESCRIPTOR_TYPE_STORAGE_BUFFER, "pBufferInfo": infos + i} for i in range(n)])
        lib.vkUpdateDescriptorSets(self.device, n, writes, 0, ffi.NULL)
        return sets

    @locked
    def fill_zero(self, alloc: Allocation) -> None:
        self._begin()
        lib.vkCmdFillBuffer(self.cmd, alloc.block.buffer, alloc.offset, alloc.size, 0)
        self._barrier()
        self.held.append(alloc)

    @locked
    def upload(self, alloc: Allocation, host: np.ndarray) -> None:
        data = memoryview(np.ascontiguousarray(host)).cast("B")
        n = len(data)
        if n == 0:
            return
        room = -(-n // 16) * 16
        staging = self.stagings[self.staging_in_use]
        if self.staged + room > staging.size:  # the next staging buffer: no submit, no wait
            self.staging_in_use += 1
            self.staged = 0
            if self.staging_in_use == len(self.stagings):
                self.stagings.append(self._host_block(max(STAGING_BYTES, room)))
            elif self.stagings[self.staging_in_use].size < room:
                self.stagings[self.staging_in_use].destroy()
                self.stagings[self.staging_in_use] = self._host_block(room)
            staging = self.stagings[self.staging_in_use]
        ffi.memmove(staging.mapped + self.staged, data, n)
        self._begin()
        region = ffi.new("VkBufferCopy*", {"srcOffset": self.staged, "dstOffset": alloc.offset, "size": n})
        lib.vkCmdCopyBuffer(self.cmd, staging.buffer, alloc.block.buffer, 1, region)
        self._barrier()
        self.held.append(alloc)
        self.staged += room

    @locked
    def download(self, alloc: Allocation, offset: int, nbytes: int) -> bytes:
        if nbytes > self.readback.size:  # pending commands never use the readback buffer
            self.readback.destroy()
            self.readback = self._host_block(-(-nbytes // 4096) * 4096)
        self._begin()
        region = ffi.new("VkBufferCopy*", {"srcOffset": alloc.offset + offset, "dstOffset": 0, "size": nbytes})
        lib.vkCmdCopyBuffer(self.cmd, alloc.block.buffer, self.readback.buffer, 1, region)
        host = ffi.new("VkMemoryBarrier*", {"sType": vk.VK_STRUCTURE_TYPE_MEMORY_BARRIER,
                                            "srcAccessMask": vk.VK_ACCESS_TRANSFER_WRITE_BIT,
                                            "dstAccessMask": vk.VK_ACCESS_HOST_READ_BIT})
        lib.vkCmdPipelineBarrier(self.cmd, vk.VK_PIPELINE_STAGE_TRANSFER_BIT, vk.VK_PIPELINE_STAGE_HOST_BIT, 0, 1, host,
                                 0, ffi.NULL, 0, ffi.NULL)
        self.held.append(alloc)
        self.flush()
        return bytes(ffi.buffer(self.readback.mapped, nbytes))

    @locked
    def flush(self) -> None:
        """Submit what is recorded and wait for it."""
        if not self.recording:
            return
        check(lib.vkEndCommandBuffer(self.cmd), "vkEndCommandBuffer")
        cmds = ffi.new("VkCommandBuffer[1]", [self.cmd])
        submit = ffi.new("VkSubmitInfo*", {"sType": vk.VK_STRUCTURE_TYPE_SUBMIT_INFO, "commandBufferCount": 1,
                                           "pCommandBuffers": cmds})
        check(lib.vkQueueSubmit(self.queue, 1, submit, self.fence), "vkQueueSubmit")
        fences = ffi.new("VkFence[1]", [self.fence])
        check(lib.vkWaitForFences(self.device, 1, fences, 1, 2**64 - 1), "vkWaitForFences")
        lib.vkResetFences(self.device, 1, fences)
        lib.vkResetCommandBuffer(self.cmd, 0)
        for pool in self.descriptor_pools[: self.pool_in_use + 1]:
            lib.vkResetDescriptorPool(self.device, pool, 0)
        self.pool_in_use = 0
        if self.drop_sets:  # nothing pending uses the kept sets now
            for pool in self.kept_pools[: self.kept_pool_in_use + 1]:
                lib.vkResetDescriptorPool(self.device, pool, 0)
            self.sets.clear()
            self.kept_pool_in_use = 0
            self.drop_sets = False
        self.staging_in_use = 0
        self.recording = False
        self.held.clear()
        self.staged = 0
        self.submits += 1

    def close(self) -> None:
        self.flush()
        vk.vkDeviceWaitIdle(self.device)
        for pipe in self.pipelines.values():
            pipe.destroy(self.device)
        for block in [*self.blocks, *self.stagings, self.readback]:
            block.destroy()
        for pool in [*self.descriptor_pools, *self.kept_pools]:
            vk.vkDestroyDescriptorPool(self.device, pool, None)
        vk.vkDestroyFence(self.device, self.fence, None)
        vk.vkDestroyCommandPool(self.device, self.command_pool, None)
        vk.vkDestroyPipelineCache(self.device, self.pipeline_cache, None)
        vk.vkDestroyDevice(self.device, None)
        vk.vkDestroyInstance(self.instance, None)


def pack(fmt: str, *values) -> bytes:
    """Push constants: ``fmt`` in struct's letters (i int32, f float32), little-endian."""
    return struct.pack("<" + fmt, *values)


_contexts: dict[tuple[int | None, bool], VulkanContext] = {}
_contexts_lock = threading.Lock()


def shared_context(device_index: int | None = None) -> VulkanContext:
    """The process's context for the requested device (the argument, else
    COLIBRI_VULKAN_DEVICE, else the default choice) and COLIBRI_VULKAN_PLAIN: made on first
    use, kept for the process."""
    from colibri_vulkan.probe import requested_index

    key = (requested_index(device_index), plain_requested())
    with _contexts_lock:
        if key not in _contexts:
            _contexts[key] = VulkanContext(*key)
        return _contexts[key]
