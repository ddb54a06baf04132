"""``ct-int4-g32``: compressed-tensors ``pack-quantized`` int4, as Kimi K2.5 and
K2-Thinking ship their routed experts, read natively.

A quantised Linear ``<prefix>`` is stored as three tensors:
- ``<prefix>.weight_packed`` I32 (rows, ceil(cols / 8)): eight 4-bit codes per int32,
  element 8i + j in bits 4j..4j+3 of int32 i, each code the value + 8 (symmetric int4,
  -8..7, offset to 0..15: compressed-tensors' ``pack_to_int32``). Read as little-endian
  bytes, byte b holds element 2b (low nibble) and 2b + 1 (high nibble).
- ``<prefix>.weight_scale`` BF16 (F16 and F32 read too) (rows, ceil(cols / 32)): one
  scale per 32 inputs of a row.
- ``<prefix>.weight_shape`` I64 / I32 (2,): the logical (rows, cols).

``w = (code - 8) * scale``, computed in float32 (exact: a 4-bit integer times a bfloat16
fits float32's mantissa). ``quantization_config`` (``quant_method: compressed-tensors``,
``format: pack-quantized``) must describe symmetric int4 weights in groups of 32; the
tensors themselves say which modules are quantised, and a module the ``ignore`` list
names must not be stored packed. The CPU backend computes with the packed bytes (the
``q4g32`` kernel); other backends get float32.
"""

from __future__ import annotations

import re

import numpy as np

from colibri_core.errors import ModelFormatError, UnsupportedModelError
from colibri_core.formats.base import QuantFormat, QuantTensor, bf16_to_f32
from colibri_core.formats.fp8 import quantization_config
from colibri_core.io.safetensors import TensorInfo

PACKED = ".weight_packed"
SCALE = ".weight_scale"
SHAPE = ".weight_shape"
GROUP = 32
SCALE_DTYPES = ("BF16", "F16", "F32")
PAD_BYTE = 0x88  # two codes of value 0: what a row's padding to whole groups holds


def pack_config(config: dict) -> dict | None:
    """The ``quantization_config`` when it is compressed-tensors, checked to describe what
    this format reads (symmetric int4 in groups of 32, pack-quantized); None otherwise."""
    qc = quantization_config(config)
    if not isinstance(qc, dict) or qc.get("quant_method") != "compressed-tensors":
        return None
    groups = qc.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise ModelFormatError("config.json: quantization_config (compressed-tensors) has no config_groups")
    for key, group in groups.items():
        where = f"config.json: quantization_config.config_groups.{key}"
        if not isinstance(group, dict) or not isinstance(group.get("weights"), dict):
            raise ModelFormatError(f"{where}: must be an object with 'weights'")
        fmt = group.get("format", qc.get("format"))
        if fmt != "pack-quantized":
            raise UnsupportedModelError(f"{where}: format {fmt!r} is not supported (only 'pack-quantized')")
        w = group["weights"]
        wanted = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": GROUP}
        for field, value in wanted.items():
            if w.get(field, "int" if field == "type" else None) != value:
                raise UnsupportedModelError(f"{where}.weights.{field} is {w.get(field)!r}; only symmetric int4 in "
                                            f"groups of {GROUP} is supported ({field} {value!r})")
        if group.get("input_activations") is not None:
            raise UnsupportedModelError(f"{where}: quantised input activations are not supported (weight-only)")
    ignore = qc.get("ignore", [])
    if not isinstance(ignore, list) or not all(isinstance(i, str) for i in ignore):
        raise ModelFormatError("config.json: quantization_config.ignore must be a list of module names")
    return qc


def ignored(module: str, ignore: list[str]) -> bool:
    """Whether compressed-tensors' ``ignore`` list names ``module`` (an exact name, or
    ``re:PATTERN`` matched from the start)."""
    return any(re.match(i[3:], module) if i.startswith("re:") else i == module for i in ignore)


def decode_pairs(data: np.ndarray, scales: np.ndarray, cols: int) -> np.ndarray:
    """Packed bytes (rows, >= cols / 2; byte b: element 2b low, 2b + 1 high) and per-32
    scales (rows, groups; bfloat16 bits or float) -> float32 (rows, cols) of (code - 8) * s."""
    data = np.asarray(data).view(np.uint8).reshape(data.shape[0], -1)
    codes = np.stack((data & 15, data >> 4), axis=-1).reshape(data.shape[0], -1)[:, :cols]
    scale = bf16_to_f32(scales) if scales.dtype == np.uint16 else np.asarray(scales, dtype=np.float32)
    full = np.repeat(scale, GROUP, axis=1)[:, :cols]
    return (codes.astype(np.float32) - 8) * full


class CompressedTensorsInt4(QuantFormat):
    name = "ct-int4-g32"
    kernel = "q4g32"
    from_quantization_config = True  # ``colibri convert`` keeps the config while such tensors remain

    def __init__(self):
        self._shapes: dict[str, tuple[int, int]] = {}
        # (packed shape, scale shape) -> cols, read from the first weight_shape of that
        # layout: a checkpoint has thousands of experts of a few layouts, and a read per
        # tensor at claim time would cost a syscall each. Every weight_shape is still
        # checked when it is read with its weight (it is a companion).
        self._cols: dict[tuple, int] = {}

    def stored_name(self, name, context):
        if name.endswith(".weight") and context.checkpoint is not None:
            packed = name[: -len(".weight")] + PACKED
            if packed in context.checkpoint.tensors and pack_config(context.config) is not None:
                return packed
        return None

    def logical_name(self, info):
        return info.name[: -len(PACKED)] + ".weight"

    def matches(self, info: TensorInfo, context) -> bool:
        if not info.name.endswith(PACKED) or context.checkpoint is None:
            return False
        qc = pack_config(context.config)
        if qc is None:
            return False
        prefix = info.name[: -len(PACKED)]
        if ignored(prefix, qc.get("ignore", [])):
            raise ModelFormatError(f"{info.path}: tensor {info.name!r} is stored packed, but quantization_config.ignore "
                                   f"lists module {prefix!r}")
        self._shapes[info.name] = self._check(info, context.checkpoint, self._cols)
        return True

    @staticmethod
    def _check(info: TensorInfo, checkpoint, known: dict) -> tuple[int, int]:
        prefix = info.name[: -len(PACKED)]
        if info.dtype != "I32" or len(info.shape) != 2:
            raise ModelFormatError(f"{info.path}: tensor {info.name!r} must be I32 (rows, cols / 8), "
                                   f"found {info.dtype} {list(info.shape)}")
        tensors = checkpoint.tensors
        if prefix + ".weight_zero_point" in tensors:
            raise UnsupportedModelError(f"{info.path}: tensor {info.name!r} has zero points; only symmetric int4 is supported")
        shape_info, scale = tensors.get(prefix + SHAPE), tensors.get(prefix + SCALE)
        for companion, what in ((shape_info, SHAPE), (scale, SCALE)):
            if companion is None:
                raise ModelFormatError(f"{info.path}: tensor {info.name!r} has no {prefix + what!r}")
        if shape_info.dtype not in ("I64", "I32") or shape_info.shape != (2,):
            raise ModelFormatError(f"{shape_info.path}: tensor {shape_info.name!r} must be I64 or I32 (2,), "
                                   f"found {shape_info.dtype} {list(shape_info.shape)}")
        if scale.dtype not in SCALE_DTYPES or len(scale.shape) != 2:
            raise ModelFormatError(f"{scale.path}: tensor {scale.name!r} must be {' or '.join(SCALE_DTYPES)} "
                                   f"(rows, cols / {GROUP}), found {scale.dtype} {list(scale.shape)}")
        layout = (info.shape, scale.shape)
        if layout in known:
            rows, cols = info.shape[0], known[layout]
        else:
            rows, cols = (int(v) for v in checkpoint.read(shape_info.name))
        packed_cols = -(-cols // 8)
        if rows < 1 or cols < 1 or info.shape != (rows, packed_cols):
            raise ModelFormatError(f"{shape_info.path}: tensor {shape_info.name!r} says the weight is {[rows, cols]}, "
                                   f"which packs to I32 {[rows, packed_cols]}, but {info.name!r} is {list(info.shape)}")
        groups = -(-cols // GROUP)
        if scale.dtype not in SCALE_DTYPES or scale.shape != (rows, groups):
            raise ModelFormatError(f"{scale.path}: tensor {scale.name!r} must be {' or '.join(SCALE_DTYPES)} "
                                   f"{[rows, groups]} for a {rows}x{cols} weight in groups of {GROUP}, "
                                   f"found {scale.dtype} {list(scale.shape)}")
        known[layout] = cols
        return rows, cols

    def _checked(self, info, companions) -> tuple[int, int]:
        """The logical shape, checked against the weight_shape read with the weight."""
        shape = self._shapes[info.name]
        stored = companions.get(info.name[: -len(PACKED)] + SHAPE)
        if stored is not None and tuple(int(v) for v in np.asarray(stored).ravel()) != shape:
            raise ModelFormatError(f"{info.path}: tensor {info.name[: -len(PACKED)] + SHAPE!r} says "
                                   f"{[int(v) for v in np.asarray(stored).ravel()]}, but {info.name!r} was read as "
                                   f"{list(shape)} (the shape of the other weights stored like it)")
        return shape

    def logical_shape(self, info, context):
        return self._shapes[info.name]

    def companions(self, info, lookup):
        prefix = info.name[: -len(PACKED)]
        scale, shape = lookup(prefix + SCALE), lookup(prefix + SHAPE)
        if scale is None:
            raise ModelFormatError(f"{info.path}: tensor {info.name!r} has no scales {prefix + SCALE!r}")
        return [scale] + ([shape] if shape is not None else [])  # the shape goes with it (``colibri convert``)

    def _scales(self, info, companions) -> np.ndarray:
        return companions[info.name[: -len(PACKED)] + SCALE]

    def decode(self, info, raw, companions):
        return decode_pairs(raw, self._scales(info, companions), self._checked(info, companions)[1])

    def quantized(self, info, raw, companions):
        rows, cols = self._checked(info, companions)
        data = np.ascontiguousarray(raw).view(np.uint8).reshape(rows, -1)
        groups = -(-cols // GROUP)
        if data.shape[1] != groups * GROUP // 2:  # the kernel reads whole groups
            padded = np.full((rows, groups * GROUP // 2), PAD_BYTE, dtype=np.uint8)
            padded[:, : data.shape[1]] = data
            data = padded
        scales = self._scales(info, companions)
        scales = scales if scales.dtype == np.uint16 else np.asarray(scales, dtype=np.float32)  # F16: widened
        return QuantTensor(self.kernel, data, np.ascontiguousarray(scales), (rows, cols))
