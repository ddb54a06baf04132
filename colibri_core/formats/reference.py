"""The numpy reference decode of a packed weight (``QuantTensor``) to float32.

Backends that have no native form for a packed kind decode it once when the weight is
prepared (``Backend.prepare_weight``); the conformance kit checks every backend's packed
products against ``x @ dequantize(w).T``.
"""

from __future__ import annotations

import numpy as np

from colibri_core.formats.base import QuantTensor, bf16_to_f32
from colibri_core.formats.fp8 import dequantize as fp8_blocks, e4m3_to_f32
from colibri_core.formats.compressed_tensors import decode_pairs
from colibri_core.formats.integer import decode_mxfp4, decode_q4, decode_q8
from colibri_core.formats.mxfp4_hub import decode_blocks


def dequantize(w: QuantTensor) -> np.ndarray:
    """``w`` as a float32 (rows, cols) array: exactly the numbers the kernels compute with."""
    n, k = w.shape
    if w.kind == "bf16":
        return bf16_to_f32(w.data).reshape(n, k)
    if w.kind == "q8":
        return decode_q8(w.data, w.scales)
    if w.kind == "q4":
        return np.ascontiguousarray(decode_q4(w.data, w.scales, k))
    if w.kind == "mxfp4":
        return np.ascontiguousarray(decode_mxfp4(w.data, w.scales, k))
    if w.kind == "q4g32":
        return np.ascontiguousarray(decode_pairs(w.data, w.scales, k))
    if w.kind == "mxfp4pair":
        return np.ascontiguousarray(decode_blocks(w.data.reshape(n, -1, 16), w.scales)[:, :k])
    if w.kind == "fp8":
        return fp8_blocks(e4m3_to_f32(w.data), np.asarray(w.scales, dtype=np.float32), w.block)
    raise ValueError(f"no reference decode for packed kind {w.kind!r}")


def host_weight(w) -> np.ndarray:
    """A host weight (``QuantTensor`` or array) as float32 numbers."""
    return dequantize(w) if isinstance(w, QuantTensor) else np.asarray(w, dtype=np.float32)
