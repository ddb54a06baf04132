"""``fp8-e4m3-b128``: float8 e4m3 weights with block scales, the native format of the
DeepSeek-V3 / V3.1 / V3.2 and Kimi K2 checkpoints.

A weight ``<name>`` stored as F8_E4M3 (shape (rows, cols)) comes with a companion
``<name>_scale_inv`` (the DeepSeek naming: ``...proj.weight`` + ``...proj.weight_scale_inv``)
of shape (ceil(rows / bm), ceil(cols / bn)): one float32 multiplier per bm x bn block,
the last block of a row or column possibly partial. ``quantization_config``
(``quant_method: fp8``) gives the block size in ``weight_block_size``; 128 x 128 when it
is absent. The weight is ``e4m3_value * scale`` per element, computed in float32 like
transformers' dequantisation, so the result is bit-identical to it. Scales may be stored
as F32, BF16 or F8_E8M0 (``scale_fmt: ue8m0`` checkpoints).

DeepSeek-V4's published shards name the scales of ``<m>.weight`` ``<m>.scale`` (F8_E8M0,
``scale_fmt: ue8m0``; F32 in the fp8-expert base checkpoints); transformers renames
``<m>.scale`` to ``<m>.weight_scale_inv`` at load (quantizer_finegrained_fp8.py,
``update_weight_conversions``). Both spellings are read; ``<name>_scale_inv`` wins when a
checkpoint had both.

Activations are not quantised: colibri computes in float32 with the dequantised weights,
as transformers does with ``dequantize=True``.
"""

from __future__ import annotations

import math

import numpy as np

from colibri_core.errors import ModelFormatError, UnsupportedModelError
from colibri_core.formats.base import QuantFormat, QuantTensor, bf16_to_f32
from colibri_core.io.safetensors import TensorInfo

SCALE_SUFFIX = "_scale_inv"
V4_SCALE_SUFFIX = ".scale"  # DeepSeek-V4: "<m>.scale" beside "<m>.weight"
SCALE_DTYPES = ("F32", "BF16", "F8_E8M0")
DEFAULT_BLOCK = (128, 128)


def _e4m3_table() -> np.ndarray:
    """float32 value of every e4m3fn byte: 1 sign, 4 exponent (bias 7), 3 mantissa bits;
    exponent 0 is subnormal; S.1111.111 is NaN; there is no infinity."""
    bits = np.arange(256, dtype=np.int64)
    exponent, mantissa = (bits >> 3) & 0xF, bits & 0x7
    magnitude = np.where(exponent == 0, mantissa / 8.0 * 2.0**-6, (1.0 + mantissa / 8.0) * np.exp2(exponent - 7.0))
    values = np.where(bits & 0x80, -magnitude, magnitude)
    values[(bits & 0x7F) == 0x7F] = np.nan
    return values.astype(np.float32)


E4M3_TO_F32 = _e4m3_table()


def e4m3_to_f32(raw: np.ndarray) -> np.ndarray:
    """e4m3fn bytes (uint8) -> float32, through the 256-entry table."""
    return E4M3_TO_F32[raw]


def _e8m0_table() -> np.ndarray:
    values = np.ldexp(1.0, np.arange(255) - 127)  # exact in float32, 2**-127 (subnormal) included
    return np.append(values, np.nan).astype(np.float32)  # 0xFF is NaN


E8M0_TO_F32 = _e8m0_table()


def e8m0_to_f32(raw: np.ndarray) -> np.ndarray:
    """ue8m0 bytes (uint8) -> float32 powers of two 2**(b - 127); 255 is NaN."""
    return E8M0_TO_F32[raw]


def scale_name(name: str, tensors) -> str | None:
    """The block scales' tensor name of weight ``name`` in ``tensors`` (a name -> info
    mapping, or a lookup function): ``<name>_scale_inv``, or DeepSeek-V4's ``<m>.scale``
    for ``<m>.weight``; None when neither is there."""
    lookup = tensors if callable(tensors) else tensors.get
    if lookup(name + SCALE_SUFFIX) is not None:
        return name + SCALE_SUFFIX
    if name.endswith(".weight"):
        v4 = name[: -len(".weight")] + V4_SCALE_SUFFIX
        if lookup(v4) is not None:
            return v4
    return None


def _scale_names(name: str) -> str:
    names = [name + SCALE_SUFFIX] + ([name[: -len(".weight")] + V4_SCALE_SUFFIX] if name.endswith(".weight") else [])
    return " or ".join(repr(n) for n in names)


def quantization_config(config: dict) -> dict | None:
    """The model's ``quantization_config``, at the top of config.json or, for wrapped
    models (Kimi K2.5), in its ``text_config``."""
    qc = config.get("quantization_config")
    if qc is None and isinstance(config.get("text_config"), dict):
        qc = config["text_config"].get("quantization_config")
    return qc


def block_size(config: dict) -> tuple[int, int] | None:
    """The (rows, cols) block of fp8 scales from ``quantization_config``; (128, 128) when
    there is none; None when the config names another quantisation method."""
    qc = quantization_config(config)
    if qc is None:
        return DEFAULT_BLOCK
    if not isinstance(qc, dict):
        raise ModelFormatError(f"config.json: quantization_config must be an object, got {qc!r}")
    if qc.get("quant_method") != "fp8":
        return None
    fmt = qc.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise UnsupportedModelError(f"config.json: quantization_config fmt {fmt!r} is not supported (only 'e4m3')")
    block = qc.get("weight_block_size", list(DEFAULT_BLOCK))
    if block is None:
        raise UnsupportedModelError("config.json: fp8 with per-tensor scales (weight_block_size null) is not supported; "
                                    "only block scales are")
    if not (isinstance(block, list) and len(block) == 2 and all(isinstance(b, int) and not isinstance(b, bool) and b > 0
                                                                  for b in block)):
        raise ModelFormatError(f"config.json: quantization_config weight_block_size must be two positive integers, got {block!r}")
    return block[0], block[1]


class FP8E4M3Block(QuantFormat):
    """float8 e4m3 weights with float32 block scales in ``<name>_scale_inv``."""

    name = "fp8-e4m3-b128"
    kernel = "fp8"
    from_quantization_config = True  # ``colibri convert`` keeps the config while such tensors remain

    def __init__(self):
        self._blocks: dict[str, tuple[int, int]] = {}

    def matches(self, info: TensorInfo, context) -> bool:
        if info.dtype != "F8_E4M3" or context.checkpoint is None:
            return False
        block = block_size(context.config)
        if block is None:
            return False
        found = scale_name(info.name, context.checkpoint.tensors)
        scale = None if found is None else context.checkpoint.tensors[found]
        if scale is None:
            if quantization_config(context.config) is not None:
                raise ModelFormatError(f"{info.path}: tensor {info.name!r} is float8 e4m3 but has no block scales "
                                       f"{_scale_names(info.name)}")
            return False
        self._check(info, scale, block)
        self._blocks[info.name] = block
        return True

    @staticmethod
    def _check(info: TensorInfo, scale: TensorInfo, block: tuple[int, int]) -> None:
        if len(info.shape) != 2:
            raise UnsupportedModelError(f"{info.path}: tensor {info.name!r}: fp8 block scales need a 2-D weight, "
                                        f"got shape {list(info.shape)}")
        if scale.dtype not in SCALE_DTYPES:
            raise ModelFormatError(f"{scale.path}: scale tensor {scale.name!r} is {scale.dtype}; expected one of "
                                   f"{', '.join(SCALE_DTYPES)}")
        expected = tuple(math.ceil(n / b) for n, b in zip(info.shape, block))
        if scale.shape != expected:
            raise ModelFormatError(
                f"{scale.path}: scale tensor {scale.name!r} has shape {list(scale.shape)}, but weight {info.name!r} "
                f"{list(info.shape)} in {block[0]}x{block[1]} blocks needs {list(expected)}")

    def block(self, info):
        return self._blocks.get(info.name, DEFAULT_BLOCK)

    def companions(self, info, lookup):
        found = scale_name(info.name, lookup)
        if found is None:
            raise ModelFormatError(f"{info.path}: tensor {info.name!r} has no block scales {_scale_names(info.name)}")
        return [lookup(found)]

    def decode(self, info, raw, companions):
        (scale,) = companions.values()
        return dequantize(e4m3_to_f32(raw), scales_to_f32(scale), self._blocks.get(info.name, DEFAULT_BLOCK))

    def quantized(self, info, raw, companions):
        (scale,) = companions.values()
        scale = np.ascontiguousarray(scales_to_f32(scale), dtype=np.float32)
        return QuantTensor("fp8", np.ascontiguousarray(raw), scale, tuple(info.shape),
                           self._blocks.get(info.name, DEFAULT_BLOCK))


def scales_to_f32(raw: np.ndarray) -> np.ndarray:
    """Scale tensors as read (F32 as float32, BF16 as uint16, F8_E8M0 as uint8) -> float32."""
    if raw.dtype == np.uint16:
        return bf16_to_f32(raw)
    if raw.dtype == np.uint8:
        return e8m0_to_f32(raw)
    return np.asarray(raw, dtype=np.float32)


def dequantize(values: np.ndarray, scale: np.ndarray, block: tuple[int, int]) -> np.ndarray:
    """values (rows, cols) float32 times the scale of their (bm, bn) block."""
    rows, cols = values.shape
    bm, bn = block
    expected = (math.ceil(rows / bm), math.ceil(cols / bn))
    if scale.shape != expected:
        raise ModelFormatError(f"fp8 scales of shape {list(scale.shape)} do not cover a {rows}x{cols} weight in "
                               f"{bm}x{bn} blocks (expected {list(expected)})")
    full = np.repeat(np.repeat(scale, bm, axis=0)[:rows], bn, axis=1)[:, :cols]
    return values * full
