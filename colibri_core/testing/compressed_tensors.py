"""Making compressed-tensors ``pack-quantized`` int4 checkpoints from tiny float32 models.

``ct_int4_rewrite()`` gives an ``OracleCase.rewrite`` hook: every selected Linear weight
``<m>.weight`` (by default the routed experts, as Kimi K2.5 / K2-Thinking ship them)
becomes ``<m>.weight_packed`` (I32, eight 4-bit codes per int32, element 8i + j in bits
4j.., code = value + 8), ``<m>.weight_scale`` (BF16, one per 32 inputs) and
``<m>.weight_shape`` (I64 (rows, cols)); the other 2-D weights are listed in the
config's ``ignore``. Written from compressed-tensors' specification, independently of
colibri's decoder (``colibri_core.formats.compressed_tensors``).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Callable

import numpy as np

from colibri_core.testing.rewrite import rewrite_checkpoint

ROUTED_EXPERTS = re.compile(r"\.experts\.\d+\.(gate|up|down)_proj\.weight$")


def _bf16(x: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bits, rounding to nearest even (finite inputs)."""
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)


def quantize_int4(w: np.ndarray, group: int = 32):
    """float32 (rows, cols) -> (packed int32 (rows, ceil(cols/8)), bf16 scale bits
    (rows, ceil(cols/group)), the float32 weight they stand for)."""
    rows, cols = w.shape
    groups = -(-cols // group)
    padded = np.zeros((rows, groups * group), dtype=np.float32)
    padded[:, :cols] = w
    amax = np.abs(padded.reshape(rows, groups, group)).max(axis=-1)
    scale_bits = _bf16(np.where(amax > 0, amax / 7.0, 1.0))
    scale = (scale_bits.astype(np.uint32) << 16).view(np.float32)
    full = np.repeat(scale, group, axis=1)
    q = np.clip(np.rint(padded / full), -8, 7).astype(np.int64)
    dequantised = (q * full).astype(np.float32)[:, :cols]
    codes = (q[:, :cols] + 8).astype(np.uint64)
    words = -(-cols // 8)
    codes = np.pad(codes, ((0, 0), (0, words * 8 - cols)), constant_values=8).reshape(rows, words, 8)
    packed = (codes << (4 * np.arange(8, dtype=np.uint64))).sum(axis=-1).astype(np.uint32).view(np.int32)
    return packed, scale_bits, dequantised


def quantization_config(ignore: list[str], group: int = 32) -> dict:
    scheme = {"targets": ["Linear"], "format": "pack-quantized", "input_activations": None, "output_activations": None,
              "weights": {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": group,
                          "dynamic": False, "actorder": None, "observer": "minmax"}}
    return {"quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
            "config_groups": {"group_0": scheme}, "ignore": ignore, "kv_cache_scheme": None}


def ct_int4_rewrite(select: Callable[[str], bool] = lambda name: bool(ROUTED_EXPERTS.search(name)),
                    config_key: str | None = None) -> Callable:
    """An ``OracleCase.rewrite`` hook quantising the selected ``.weight`` tensors."""
    ignore: list[str] = ["re:.*vision_tower.*"]

    def quantise(tensors):
        stored, dequantised, names = {}, {}, []
        for name, t in tensors.items():
            if t.ndim == 2 and name.endswith(".weight") and select(name):
                module = name[: -len(".weight")]
                packed, scale, dequantised[name] = quantize_int4(t.astype(np.float32))
                stored[module + ".weight_packed"] = packed
                stored[module + ".weight_scale"] = ("BF16", scale)
                stored[module + ".weight_shape"] = np.array(t.shape, dtype=np.int64)
                names.append(name)
            else:
                stored[name] = dequantised[name] = t
                if t.ndim == 2 and name.endswith(".weight"):
                    ignore.append(name[: -len(".weight")])
        return stored, dequantised, names

    def rewrite(path):
        return rewrite_checkpoint(Path(path), quantise, lambda: quantization_config(ignore), config_key)

    return rewrite
