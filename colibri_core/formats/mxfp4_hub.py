"""``mxfp4-hub``: MXFP4 as gpt-oss ships it (``<name>_blocks`` / ``<name>_scales``),
read natively, without converting the file.

- ``<name>_blocks`` U8 (..., rows, cols / 32, 16): per 32-input group of a row, 16 bytes;
  byte j holds element 2j in its low nibble and 2j + 1 in its high nibble, each an e2m1
  code (1 sign, 2 exponent, 1 mantissa bits: 0, 0.5, 1, 1.5, 2, 3, 4, 6 and negatives).
- ``<name>_scales`` U8 (..., rows, cols / 32): the group's exponent E, ``2^(E - 127)``.

``w = e2m1 * 2^(E - 127)``, exact in float32 (transformers' ``convert_moe_packed_tensors``
computes the same numbers). ``quantization_config.quant_method`` must be ``mxfp4``.
gpt-oss stores its experts fused, ``experts.gate_up_proj_blocks`` (E, 2I, H / 32, 16):
one expert's slice (``...[e]`` or a part of it ``...[e][p/n]``, as ``Weights.expert_layer``
names it) is read on its own, with the matching slice of the scales. The logical tensor
(``...gate_up_proj``, (E, 2I, H)) is output-major like any colibri linear weight.
colibri's own ``mxfp4`` container format holds the same numbers with another nibble
order (inputs j and j + 16 in byte j); this one computes with the ``mxfp4pair`` kernel.
"""

from __future__ import annotations

import re

import numpy as np

from colibri_core.errors import ModelFormatError
from colibri_core.formats.base import QuantFormat, QuantTensor
from colibri_core.formats.fp8 import quantization_config
from colibri_core.formats.integer import E2M1_VALUES
from colibri_core.io.safetensors import TensorInfo

BLOCKS = "_blocks"
SCALES = "_scales"
GROUP = 32
# a tensor or a slice of a fused one: "<base>_blocks", "<base>_blocks[e]", "<base>_blocks[e][p/n]"
_NAME = re.compile(r"^(?P<base>.*)_blocks(?:\[(?P<e>\d+)\](?:\[(?P<p>\d+)/(?P<n>\d+)\])?)?$")


def is_mxfp4(config: dict) -> bool:
    qc = quantization_config(config)
    return isinstance(qc, dict) and qc.get("quant_method") == "mxfp4"


def decode_blocks(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """(..., rows, groups, 16) codes and (..., rows, groups) exponents -> float32
    (..., rows, groups * 32)."""
    codes = np.stack((blocks & 15, blocks >> 4), axis=-1).reshape(*blocks.shape[:-1], GROUP)
    scale = np.ldexp(np.float32(1.0), scales.astype(np.int32) - 127).astype(np.float32)
    return (E2M1_VALUES[codes] * scale[..., None]).reshape(*blocks.shape[:-2], -1)


class MXFP4Hub(QuantFormat):
    name = "mxfp4-hub"
    kernel = "mxfp4pair"
    from_quantization_config = True

    def stored_name(self, name, context):
        if context.checkpoint is not None and name + BLOCKS in context.checkpoint.tensors and is_mxfp4(context.config):
            return name + BLOCKS
        return None

    def logical_name(self, info):
        return _NAME.match(info.name)["base"]

    def matches(self, info: TensorInfo, context) -> bool:
        m = _NAME.match(info.name)
        if m is None or context.checkpoint is None or not is_mxfp4(context.config):
            return False
        whole = context.checkpoint.tensors.get(m["base"] + BLOCKS)
        if whole is None:
            return False
        scales = context.checkpoint.tensors.get(m["base"] + SCALES)
        if scales is None:
            raise ModelFormatError(f"{whole.path}: tensor {whole.name!r} has no scales {m['base'] + SCALES!r}")
        if whole.dtype != "U8" or len(whole.shape) < 3 or whole.shape[-1] != 16:
            raise ModelFormatError(f"{whole.path}: tensor {whole.name!r} must be U8 (..., rows, cols / 32, 16), "
                                   f"found {whole.dtype} {list(whole.shape)}")
        if scales.dtype != "U8" or scales.shape != whole.shape[:-1]:
            raise ModelFormatError(f"{scales.path}: tensor {scales.name!r} must be U8 {list(whole.shape[:-1])} (one "
                                   f"exponent per 32 inputs of {whole.name!r}), found {scales.dtype} {list(scales.shape)}")
        if info.dtype != "U8" or info.shape[-1:] != (16,):
            raise ModelFormatError(f"{info.path}: tensor {info.name!r} must be U8 (..., 16), found {info.dtype} "
                                   f"{list(info.shape)}")
        return True

    def logical_shape(self, info, context):
        return (*info.shape[:-2], info.shape[-2] * GROUP)

    def companions(self, info, lookup):
        m = _NAME.match(info.name)
        scales = lookup(m["base"] + SCALES)
        if scales is None:
            raise ModelFormatError(f"{info.path}: tensor {info.name!r} has no scales {m['base'] + SCALES!r}")
        if m["e"] is None:
            return [scales]
        # the same slice of the scales as of the blocks: expert e, part p of n
        count = scales.shape[0]
        stride = scales.nbytes // count
        parts, part = (int(m["n"]), int(m["p"])) if m["n"] else (1, 0)
        piece = stride // parts
        suffix = info.name[len(m["base"]) + len(BLOCKS):]
        return [TensorInfo(scales.name + suffix, scales.path, scales.dtype, info.shape[:-1],
                           scales.offset + int(m["e"]) * stride + part * piece, piece)]

    def decode(self, info, raw, companions):
        (scales,) = companions.values()
        return decode_blocks(raw, np.asarray(scales).reshape(raw.shape[:-1]))

    def quantized(self, info, raw, companions):
        if len(info.shape) != 3:
            raise ModelFormatError(f"{info.path}: tensor {info.name!r}: only a 2-D weight (or one expert's slice) is "
                                   f"computed packed, got {list(self.logical_shape(info, None))}")
        (scales,) = companions.values()
        rows, groups = info.shape[:2]
        return QuantTensor(self.kernel, np.ascontiguousarray(raw).reshape(rows, groups * 16),
                           np.ascontiguousarray(scales).reshape(rows, groups), (rows, groups * GROUP))
