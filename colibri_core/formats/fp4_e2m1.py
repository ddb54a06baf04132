"""``fp4-e2m1-g32``: DeepSeek-V4's routed experts as its published shards store them (fp4
e2m1 values, one power-of-two scale per 32 inputs), read natively, without converting
the file.

Layout (DeepSeek-V4-Flash / -Pro, ``expert_dtype: fp4``):

- ``<m>.weight`` I8 (rows, cols / 2): byte j of a row holds element 2j in its low nibble
  and element 2j + 1 in its high nibble, each an e2m1 code (1 sign, 2 exponent, 1
  mantissa bits: 0, 0.5, 1, 1.5, 2, 3, 4, 6 and their negatives; code 8 is -0).
- ``<m>.scale`` F8_E8M0 (rows, cols / 32): byte E of group g of a row scales inputs
  32g .. 32g + 31 by 2^(E - 127) (U8 holding the same bytes, and F32 powers of two, are
  read too).

``w = e2m1 * 2^(E - 127)``, exact in float32. Sources: transformers 5.23
``integrations/finegrained_fp8.py`` (``FP8Experts`` with ``expert_dtype == "fp4"``: int8
weight with K halved, ``sf_gran_n`` 1 and ``sf_gran_k`` 32, the scales float8_e8m0fnu for
``scale_fmt: ue8m0``; ``Fp8Dequantize._unpack_fp4``: low nibble first), its
``quantizer_finegrained_fp8.py`` (``<m>.scale`` read as ``<m>.weight_scale_inv``) and
``configuration_deepseek_v4.py`` (V4's top-level ``expert_dtype`` moves into
``quantization_config``, where V4.1 ships it); DeepSeek's own ``inference/convert.py``
(``cast_e2m1fn_to_e4m3fn`` unpacks ``x & 0x0F`` before ``x >> 4``, asserts
``scale.size(1) == in_dim // 32`` and views the weight as ``float4_e2m1fn_x2``). The
dense weights of the same checkpoints are fp8 e4m3 with ``<m>.scale`` 128 x 128 block
scales (``colibri_core.formats.fp8``).

The tensor is claimed only when ``quantization_config`` is ``quant_method: fp8`` with
``expert_dtype: fp4`` (in it or, as V4 ships it, at the top of config.json) and the
tensor has its ``<m>.scale``. The nibble order and the per-32 exponent are those of
gpt-oss's MXFP4 blocks (``mxfp4_hub``): 16 bytes per group, element 2j low, so a row is
exactly the ``mxfp4pair`` kernel's operand and the experts compute packed, as stored.
"""

from __future__ import annotations

import numpy as np

from colibri_core.errors import ModelFormatError
from colibri_core.formats.base import QuantFormat, QuantTensor
from colibri_core.formats.fp8 import quantization_config
from colibri_core.formats.mxfp4_hub import decode_blocks
from colibri_core.io.safetensors import TensorInfo

GROUP = 32
SCALE_SUFFIX = ".scale"
SCALE_DTYPES = ("F8_E8M0", "U8", "F32")


def expert_dtype(config: dict) -> str | None:
    """``expert_dtype`` of a DeepSeek-V4 checkpoint whose ``quantization_config`` is
    fp8 (None otherwise): in the quantization config (V4.1) or at the top (V4)."""
    qc = quantization_config(config)
    if not isinstance(qc, dict) or qc.get("quant_method") != "fp8":
        return None
    value = qc.get("expert_dtype", config.get("expert_dtype"))
    if value is None and isinstance(config.get("text_config"), dict):
        value = config["text_config"].get("expert_dtype")
    return value


def _scale_of(name: str) -> str | None:
    return name[: -len(".weight")] + SCALE_SUFFIX if name.endswith(".weight") else None


def exponents(scale: np.ndarray, info: TensorInfo) -> np.ndarray:
    """Scale tensor as read (F8_E8M0 / U8 as uint8, F32) -> the uint8 exponents E with
    scale = 2^(E - 127); an F32 scale that is no power of two in range is refused."""
    if scale.dtype == np.uint8:
        return scale
    scale = np.asarray(scale, dtype=np.float32)
    mantissa, exponent = np.frexp(scale)  # scale = mantissa * 2^exponent, mantissa 0.5 for powers of two
    biased = exponent.astype(np.int64) - 1 + 127
    if not (np.all(mantissa == 0.5) and np.all((biased >= 0) & (biased <= 254))):
        raise ModelFormatError(f"{info.path}: scale tensor {info.name!r} holds values that are not powers of two "
                               "2^-127 .. 2^127; fp4 expert scales must be (ue8m0)")
    return biased.astype(np.uint8)


class FP4E2M1Group32(QuantFormat):
    name = "fp4-e2m1-g32"
    kernel = "mxfp4pair"
    from_quantization_config = True  # ``colibri convert`` keeps the config while such tensors remain

    def matches(self, info: TensorInfo, context) -> bool:
        if info.dtype != "I8" or context.checkpoint is None or expert_dtype(context.config) != "fp4":
            return False
        scale_name = _scale_of(info.name)
        scale = context.checkpoint.tensors.get(scale_name) if scale_name else None
        if scale is None:
            raise ModelFormatError(f"{info.path}: tensor {info.name!r} is I8 in a checkpoint with fp4 experts "
                                   f"(expert_dtype: fp4) but has no scales {scale_name or info.name + SCALE_SUFFIX!r}")
        if len(info.shape) != 2 or info.shape[1] % (GROUP // 2):
            raise ModelFormatError(f"{info.path}: tensor {info.name!r}: fp4 experts are stored (rows, cols / 2) with cols "
                                   f"a multiple of {GROUP}, found shape {list(info.shape)}")
        rows, packed = info.shape
        expected = (rows, packed * 2 // GROUP)
        if scale.dtype not in SCALE_DTYPES or scale.shape != expected:
            raise ModelFormatError(f"{scale.path}: scale tensor {scale.name!r} must be {' / '.join(SCALE_DTYPES)} "
                                   f"{list(expected)} (one exponent per {GROUP} inputs of {info.name!r}), found "
                                   f"{scale.dtype} {list(scale.shape)}")
        return True

    def logical_shape(self, info, context):
        return (info.shape[0], info.shape[1] * 2)

    def companions(self, info, lookup):
        scale_name = _scale_of(info.name)
        scale = lookup(scale_name) if scale_name else None
        if scale is None:
            raise ModelFormatError(f"{info.path}: tensor {info.name!r} has no scales {scale_name or info.name + SCALE_SUFFIX!r}")
        return [scale]

    def _parts(self, info, raw, companions):
        """(codes as (rows, groups, 16) uint8, exponents (rows, groups) uint8)."""
        ((scale_name, scale),) = companions.items()
        rows, packed = info.shape
        groups = packed * 2 // GROUP
        codes = np.ascontiguousarray(raw).view(np.uint8).reshape(rows, groups, GROUP // 2)
        scale_info = TensorInfo(scale_name, info.path, "", (rows, groups), 0, 0)
        return codes, exponents(np.asarray(scale).reshape(rows, groups), scale_info)

    def decode(self, info, raw, companions):
        codes, scale = self._parts(info, raw, companions)
        return decode_blocks(codes, scale)

    def quantized(self, info, raw, companions):
        codes, scale = self._parts(info, raw, companions)
        rows, groups = scale.shape
        return QuantTensor(self.kernel, codes.reshape(rows, groups * GROUP // 2), np.ascontiguousarray(scale),
                           (rows, groups * GROUP))
