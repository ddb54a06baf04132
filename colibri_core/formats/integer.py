"""colibri's quantised weight formats: ``int8-row``, ``int4-gs64`` and ``mxfp4``.

Each lives in a colibri container (see ``container.py``): packed bytes under the
tensor's name, scales under ``<name>.qs``, and the format plus the logical
(rows, cols) shape in the file's metadata stamp. A row's last partial group is padded
with zeros.

- int8-row:  int8 values, one float32 scale per row (absmax / 127).     w = q * s
- int4-gs64: 4-bit values, one bfloat16 scale per 64 inputs (4.25 bits per weight).
             w = (nibble - 8) * s. The scale is the group's largest-magnitude value / -8
             (rounded to bfloat16; the values are quantised against the rounded scale), so
             all 16 levels are used (44% less error than one scale per row in the C
             colibri's measurement). bfloat16 rather than float32 scales: 5.6% fewer bytes
             for the memory-bound kernels to read, the same error to four digits
             (docs/benchmarks.md, third pass). Containers written with float32 scales
             (before 2026-11-29) are read as they are; the scales' dtype says which.
             Byte j of a group holds input j (low nibble) and input j + 32 (high nibble),
             a layout the kernels read without shuffles.
- mxfp4:     OCP microscaling: e2m1 values (0, 0.5, 1, 1.5, 2, 3, 4, 6 and their
             negatives), one UE8M0 exponent per 32 inputs, 2^(floor(log2(absmax)) - 2).
             Byte j of a group holds input j (low) and input j + 16 (high).

A stamp's shape is (rows, cols), or (experts, rows, cols) for experts stored fused
(``colibri convert`` of a checkpoint that keeps them so): packed bytes (experts, rows,
...) and scales (experts, rows, groups), one expert's slice (``X[e]``, or a part of it
``X[e][p/n]``, as ``Weights.expert_layer`` names it) read on its own with the matching
slice of the scales.

``decode`` is the numpy reference; the CPU backend computes with the packed form through
``colibri_core.compute.cpu._kernels``.
"""

from __future__ import annotations

import re

import numpy as np

from colibri_core.io.container import SCALES_SUFFIX, stamp_of
from colibri_core.errors import ModelFormatError
from colibri_core.formats.base import QuantFormat, QuantTensor, bf16_to_f32, f32_to_bf16
from colibri_core.io.safetensors import TensorInfo

# one expert's slice of a fused tensor: "<base>[e]" or "<base>[e][p/n]"
_SLICE = re.compile(r"^(?P<base>.+?)\[(?P<e>\d+)\](?:\[(?P<p>\d+)/(?P<n>\d+)\])?$")

E2M1_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
                       dtype=np.float32)


class StampedFormat(QuantFormat):
    """A format claimed through the colibri container stamp."""

    group: int = 1
    packed_dtype = "U8"
    scale_dtype = "F32"  # what encode writes
    read_scale_dtypes: tuple[str, ...] = ()  # what is read besides

    def __init__(self):
        self._shapes: dict[str, tuple[int, ...]] = {}  # logical shapes of the tensors claimed
        self._slices: dict[str, tuple[TensorInfo, int, int, int]] = {}  # slice name -> (whole, e, part, parts)

    def matches(self, info, context):
        stamp = stamp_of(context.checkpoint, info)
        if stamp is None:
            return self._matches_slice(info, context)
        if stamp["fmt"] != self.name:
            return False
        self._shapes[info.name] = tuple(stamp["shape"])
        return True

    def _matches_slice(self, info, context) -> bool:
        m = _SLICE.match(info.name)
        whole = context.checkpoint.tensors.get(m["base"]) if m and context.checkpoint is not None else None
        if whole is None or not self.matches(whole, context):
            return False
        shape = self._shapes[whole.name]
        e, part, parts = int(m["e"]), int(m["p"] or 0), int(m["n"] or 1)
        if len(shape) != 3 or e >= shape[0] or part >= parts or shape[1] % parts:
            raise ModelFormatError(f"{whole.path}: tensor {whole.name!r} of {self.name} shape {list(shape)} has no slice "
                                   f"{info.name[len(whole.name):]}")
        self.logical_shape(whole, context)  # the whole tensor and its scales are checked once, here
        self._shapes[info.name] = (shape[1] // parts, shape[2])
        self._slices[info.name] = (whole, e, part, parts)
        return True

    def shape_of(self, info) -> tuple[int, ...]:
        return self._shapes[info.name]

    def logical_shape(self, info, context):
        shape = self.shape_of(info)
        if info.name in self._slices:
            return shape
        expected = self.packed_shape(shape)
        if info.shape != expected["data"] or info.dtype != self.packed_dtype:
            raise ModelFormatError(f"{info.path}: tensor {info.name!r}: {self.name} of logical shape {list(shape)} must be "
                                   f"stored as {self.packed_dtype} {list(expected['data'])}, found {info.dtype} {list(info.shape)}")
        scales = context.checkpoint.tensors.get(info.name + SCALES_SUFFIX)
        dtypes = (self.scale_dtype, *self.read_scale_dtypes)
        if scales is None or scales.shape != expected["scales"] or scales.dtype not in dtypes:
            found = "nothing" if scales is None else f"{scales.dtype} {list(scales.shape)}"
            raise ModelFormatError(f"{info.path}: tensor {info.name!r}: {self.name} needs scales "
                                   f"{info.name + SCALES_SUFFIX!r} as {' or '.join(dtypes)} {list(expected['scales'])}, "
                                   f"found {found}")
        return shape

    def companions(self, info, lookup):
        whole = self._slices.get(info.name)
        base = whole[0] if whole else info
        scales = lookup(base.name + SCALES_SUFFIX)
        if scales is None:
            raise ModelFormatError(f"{info.path}: tensor {info.name!r} has no scales {base.name + SCALES_SUFFIX!r}")
        if whole is None:
            return [scales]
        # the same slice of the scales as of the data, named as the slice's own scales
        _, e, part, parts = whole
        stride = scales.nbytes // scales.shape[0]
        piece = stride // parts
        return [TensorInfo(info.name + SCALES_SUFFIX, scales.path, scales.dtype, (scales.shape[1] // parts, *scales.shape[2:]),
                           scales.offset + e * stride + part * piece, piece)]

    def packed_shape(self, shape) -> dict[str, tuple[int, ...]]:
        """The stored data's and scales' shapes for a logical (rows, cols) or (experts,
        rows, cols)."""
        raise NotImplementedError

    def specs(self, name: str, shape) -> list[tuple[str, str, tuple[int, ...]]]:
        """(name, dtype, shape) of the tensors ``encode`` writes for a weight of ``shape``."""
        packed = self.packed_shape(shape)
        return [(name, self.packed_dtype, packed["data"]), (name + SCALES_SUFFIX, self.scale_dtype, packed["scales"])]

    def quantized(self, info, raw, companions):
        return QuantTensor(self.kernel, np.ascontiguousarray(raw),
                           np.ascontiguousarray(companions[info.name + SCALES_SUFFIX]), self.shape_of(info))


def _as_rows(weight: np.ndarray, name: str) -> np.ndarray:
    w = np.asarray(weight, dtype=np.float32)
    if w.ndim != 2:
        raise ValueError(f"{name}: only 2-D weights are quantised, got shape {list(w.shape)}")
    return w


def _padded_groups(w: np.ndarray, group: int) -> np.ndarray:
    n, k = w.shape
    g = -(-k // group)
    padded = np.zeros((n, g * group), dtype=np.float32)
    padded[:, :k] = w
    return padded.reshape(n, g, group)


class Int8Row(StampedFormat):
    name = "int8-row"
    kernel = "q8"
    packed_dtype = "I8"

    def packed_shape(self, shape):
        *lead, n, k = shape
        return {"data": (*lead, n, k), "scales": (*lead, n)}

    def encode(self, name, weight):
        w = _as_rows(weight, name)
        absmax = np.abs(w).max(axis=1)
        scale = np.where(absmax > 0, absmax / 127, 1.0).astype(np.float32)
        q = np.clip(np.rint(w / scale[:, None]), -127, 127).astype(np.int8)
        return {name: ("I8", q), name + SCALES_SUFFIX: ("F32", scale)}

    def decode(self, info, raw, companions):
        return decode_q8(raw, companions[info.name + SCALES_SUFFIX])


class NibbleFormat(StampedFormat):
    """4-bit values, two per byte, with one scale per ``group`` inputs (the last group
    zero-padded)."""

    def packed_shape(self, shape):
        *lead, n, k = shape
        g = -(-k // self.group)
        return {"data": (*lead, n, g * self.group // 2), "scales": (*lead, n, g)}


class Int4GS64(NibbleFormat):
    name = "int4-gs64"
    kernel = "q4"
    group = 64
    scale_dtype = "BF16"
    read_scale_dtypes = ("F32",)

    def encode(self, name, weight):
        w = _as_rows(weight, name)
        groups = _padded_groups(w, 64)
        idx = np.abs(groups).argmax(axis=-1)
        extreme = np.take_along_axis(groups, idx[..., None], axis=-1)[..., 0]
        bits = f32_to_bf16((extreme / -8.0).astype(np.float32))
        scale = bf16_to_f32(bits)
        safe = np.where(scale != 0, scale, 1.0)[..., None]
        q = np.where(scale[..., None] != 0, np.clip(np.rint(groups / safe) + 8, 0, 15), 8).astype(np.uint8)
        packed = (q[..., :32] | (q[..., 32:] << 4)).astype(np.uint8).reshape(w.shape[0], -1)
        return {name: ("U8", packed), name + SCALES_SUFFIX: ("BF16", bits)}

    def decode(self, info, raw, companions):
        return decode_q4(raw, companions[info.name + SCALES_SUFFIX], self.shape_of(info)[1])


class MXFP4(NibbleFormat):
    name = "mxfp4"
    kernel = "mxfp4"
    group = 32
    scale_dtype = "U8"

    def encode(self, name, weight):
        w = _as_rows(weight, name)
        groups = _padded_groups(w, 32)
        absmax = np.abs(groups).max(axis=-1)
        with np.errstate(divide="ignore"):
            exponent = np.where(absmax > 0, np.floor(np.log2(np.where(absmax > 0, absmax, 1))) - 2, -127)
        biased = np.clip(exponent + 127, 0, 254).astype(np.uint8)
        scaled = groups / np.ldexp(1.0, biased.astype(np.int32) - 127)[..., None]
        magnitudes = E2M1_VALUES[:8]
        code = np.abs(np.abs(scaled)[..., None] - magnitudes).argmin(axis=-1).astype(np.uint8)  # nearest, saturating at 6
        code |= np.where(scaled < 0, 8, 0).astype(np.uint8)
        packed = (code[..., :16] | (code[..., 16:] << 4)).astype(np.uint8).reshape(w.shape[0], -1)
        return {name: ("U8", packed), name + SCALES_SUFFIX: ("U8", biased)}

    def decode(self, info, raw, companions):
        return decode_mxfp4(raw, companions[info.name + SCALES_SUFFIX], self.shape_of(info)[1])


def decode_q8(data: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """int8-row values (rows, cols) times their row's scale, as float32."""
    return data.astype(np.float32) * np.asarray(scales, dtype=np.float32).reshape(-1, 1)


def nibble_codes(data: np.ndarray, groups: int, group: int) -> np.ndarray:
    """(rows, groups, group) 4-bit codes: byte j of a group holds element j (low nibble)
    and element j + group/2 (high nibble)."""
    b = data.reshape(data.shape[0], groups, group // 2)
    return np.concatenate((b & 15, b >> 4), axis=-1)


def decode_q4(data: np.ndarray, scales: np.ndarray, cols: int) -> np.ndarray:
    """int4-gs64 (bfloat16 bits or float32 scales) as float32 (rows, cols)."""
    scale = bf16_to_f32(scales) if scales.dtype == np.uint16 else np.asarray(scales, dtype=np.float32)
    n, g = scale.shape
    q = nibble_codes(data, g, 64).astype(np.float32) - 8
    return (q * scale[..., None]).reshape(n, g * 64)[:, :cols]


def decode_mxfp4(data: np.ndarray, exponents: np.ndarray, cols: int) -> np.ndarray:
    """MXFP4 (e2m1 codes, one e8m0 exponent per 32) as float32 (rows, cols)."""
    n, g = exponents.shape
    scale = np.ldexp(np.float32(1.0), exponents.astype(np.int32) - 127).astype(np.float32)
    return (E2M1_VALUES[nibble_codes(data, g, 32)] * scale[..., None]).reshape(n, g * 32)[:, :cols]


FORMATS = {f.name: f for f in (Int8Row, Int4GS64, MXFP4)}
