"""The numpy reference decode of a packed weight (``QuantTensor``) to float32.

Backends that have no native form for a packed kind decode it once when the weight is
prepared (``Backend.prepare_weight``); the conformance kit checks every backend's packed
products against ``x @ dequantize(w).T``.
"""

from __future__ import annotations

import numpy as np

from colibri_core.formats.base import QuantTensor, bf16_to_f32
from colibri_core.formats.fp8 import dequantize as fp8_blocks, e4m3_to_f32
from colibri_core.formats.integer import E2M1_VALUES


def dequantize(w: QuantTensor) -> np.ndarray:
    """``w`` as a float32 (rows, cols) array: exactly the numbers the kernels compute with."""
    n, k = w.shape
    if w.kind == "bf16":
        return bf16_to_f32(w.data).reshape(n, k)
    if w.kind == "q8":
        return w.data.astype(np.float32) * np.asarray(w.scales, dtype=np.float32).reshape(n, 1)
    if w.kind == "fp8":
        return fp8_blocks(e4m3_to_f32(w.data), np.asarray(w.scales, dtype=np.float32), w.block)
    if w.kind in ("q4", "mxfp4"):
        scales = w.scales
        g = scales.shape[1]
        group = 64 if w.kind == "q4" else 32
        b = w.data.reshape(n, g, group // 2)
        codes = np.concatenate((b & 15, b >> 4), axis=-1)
        if w.kind == "q4":
            s = bf16_to_f32(scales) if scales.dtype == np.uint16 else np.asarray(scales, dtype=np.float32)
            values = (codes.astype(np.float32) - 8) * s[..., None]
        else:
            s = np.ldexp(np.float32(1.0), scales.astype(np.int32) - 127).astype(np.float32)
            values = E2M1_VALUES[codes] * s[..., None]
        return np.ascontiguousarray(values.reshape(n, g * group)[:, :k], dtype=np.float32)
    raise ValueError(f"no reference decode for packed kind {w.kind!r}")


def host_weight(w) -> np.ndarray:
    """A host weight (``QuantTensor`` or array) as float32 numbers."""
    return dequantize(w) if isinstance(w, QuantTensor) else np.asarray(w, dtype=np.float32)
