"""colibri's packed weights (``QuantTensor``) in MLX's own forms, made once at prepare.

A kind goes to an MLX quantised layout only where that layout holds exactly the numbers
of ``colibri_core.formats.reference.dequantize``; otherwise it is decoded once to float32.

- "q4" (int4-gs64, bfloat16 scales): MLX "affine" 4-bit, group 64, w = scale * q + bias
  with q the unsigned nibble and bias = -8 * scale. Exact: a bfloat16 scale has 8
  significant bits, so scale * q (q < 16) and -8 * scale are exact float32 products and
  their sum, scale * (q - 8), is representable. float32 scales (older containers) have
  24 significant bits, scale * q may round: those weights are decoded instead.
- "mxfp4": MLX "mxfp4" (e2m1 codes, one e8m0 exponent per 32): the same numbers by
  definition; only the nibbles move.
- "bf16": kept as bfloat16 (2 bytes a weight) and widened to float32 in each product,
  which is exact.
- "q8" (int8, one float32 scale per row) has no exact MLX form: as 8-bit affine, scale
  * (code + 128) rounds for most scales (24 + 8 significant bits). "fp8" (e4m3 with
  128 x 128 float32 block scales) neither. Both are decoded to float32.

A row whose length is not a whole number of groups (the container pads the last group)
is decoded too: MLX's products take whole groups only.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from colibri_core.formats.base import QuantTensor, bf16_to_f32
from colibri_core.formats.integer import nibble_codes
from colibri_core.formats.reference import dequantize

NATIVE_KINDS = frozenset({"q4", "mxfp4", "bf16"})  # kinds with an exact MLX form
GROUP = {"q4": 64, "mxfp4": 32}


@dataclass(frozen=True)
class Quantized:
    """A weight in an MLX quantised layout: ``data`` uint32 (rows, cols * bits / 32),
    ``scales`` (and for "affine" ``biases``) per group."""

    data: mx.array
    scales: mx.array
    biases: mx.array | None
    mode: str
    group: int
    shape: tuple[int, int]

    @property
    def nbytes(self) -> int:
        return int(self.data.nbytes + self.scales.nbytes + (self.biases.nbytes if self.biases is not None else 0))

    def matmul(self, x: mx.array) -> mx.array:
        """x @ w.T"""
        return mx.quantized_matmul(x, self.data, self.scales, self.biases, transpose=True, group_size=self.group,
                                   bits=4, mode=self.mode)

    def rows(self, ids: mx.array) -> mx.array:
        """Rows ``ids`` decoded to float32 (embedding lookups)."""
        return self._decode(self.data[ids], self.scales[ids], None if self.biases is None else self.biases[ids])

    def dequantized(self) -> mx.array:
        return self._decode(self.data, self.scales, self.biases)

    def _decode(self, data, scales, biases) -> mx.array:
        return mx.dequantize(data, scales, biases, group_size=self.group, bits=4, mode=self.mode, dtype=mx.float32)


@dataclass(frozen=True)
class Bf16:
    """A bfloat16 weight, widened to float32 where it is used. Its bits are held as
    uint16 and viewed as bfloat16 at use, so preparing one runs no MLX operation."""

    bits: mx.array  # uint16 (rows, cols)

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.bits.shape)

    @property
    def nbytes(self) -> int:
        return int(self.bits.nbytes)

    def matmul(self, x: mx.array) -> mx.array:
        return x @ self.dequantized().T

    def rows(self, ids: mx.array) -> mx.array:
        return self.bits[ids].view(mx.bfloat16).astype(mx.float32)

    def dequantized(self) -> mx.array:
        return self.bits.view(mx.bfloat16).astype(mx.float32)


def has_native_form(w: QuantTensor) -> bool:
    """Whether ``prepare`` keeps this weight in an MLX packed form (else it decodes it)."""
    if w.kind == "bf16":
        return True
    if w.kind not in GROUP or w.shape[1] % GROUP[w.kind]:
        return False
    return w.kind == "mxfp4" or w.scales.dtype == np.uint16  # q4: bfloat16 scales only (see above)


def prepare(w: QuantTensor):
    """``w`` as an MLX form: ``Quantized``, ``Bf16`` or a float32 ``mx.array``. The
    expert store's reading threads call it: it only builds arrays from host memory (the
    repacking is numpy) and queues no MLX operation."""
    if not has_native_form(w):
        return mx.array(dequantize(w))
    n, k = w.shape
    if w.kind == "bf16":
        return Bf16(mx.array(np.ascontiguousarray(w.data, dtype=np.uint16).reshape(n, k)))
    data = mx.array(nibbles_to_mlx(w.data, n, GROUP[w.kind]))
    if w.kind == "mxfp4":
        return Quantized(data, mx.array(np.ascontiguousarray(w.scales, dtype=np.uint8)), None, "mxfp4", 32, (n, k))
    scales = bf16_to_f32(w.scales)
    return Quantized(data, mx.array(scales), mx.array(scales * np.float32(-8.0)), "affine", 64, (n, k))


def nibbles_to_mlx(data: np.ndarray, rows: int, group: int) -> np.ndarray:
    """colibri's nibble layout (byte j of a group: element j low, element j + group/2
    high) to MLX's (eight elements per uint32, element i in bits 4i..4i+3: byte j holds
    elements 2j (low) and 2j+1 (high), little-endian)."""
    data = np.ascontiguousarray(data, dtype=np.uint8).reshape(rows, -1)
    codes = nibble_codes(data, data.shape[1] * 2 // group, group).reshape(rows, -1)  # element order
    packed = codes[:, 0::2] | (codes[:, 1::2] << 4)
    return np.ascontiguousarray(packed).view("<u4")


def prepared_nbytes(kind: str, shape: tuple[int, int], stored_nbytes: int) -> int:
    """Bytes ``prepare`` gives a weight of this kind, shape and stored size."""
    n, k = shape
    decoded = 4 * n * k
    if kind == "bf16":
        return 2 * n * k
    group = GROUP.get(kind)
    if group is None or k % group:
        return decoded
    groups = n * (k // group)
    if kind == "mxfp4":
        return n * k // 2 + groups  # codes + one exponent byte per group
    scale_bytes = (stored_nbytes - n * k // 2) // groups  # 2: bfloat16 scales; 4: float32, decoded
    return n * k // 2 + 8 * groups if scale_bytes == 2 else decoded  # codes + float32 scale and bias per group
