"""The weight layouts colibri-cuda's kernels read, made on the host from the stored forms.

Every packed kind keeps its stored bytes: the kernels (``kernels/formats.cuh``) read
colibri's layouts as they are. Only scales change where a kernel wants one type:

| kind  | data                           | scales                                    | p0, p1           |
|-------|--------------------------------|-------------------------------------------|------------------|
| q4    | uint8 (N, G*32), as stored     | float32 (N, G): bfloat16 scales widened    | G, 0             |
| q8    | int8 (N, K)                    | float32 (N,)                              | 0, 0             |
| mxfp4 | uint8 (N, G*16)                | uint8 exponents (N, G)                    | G, 0             |
| fp8   | uint8 e4m3 (N, K)              | float32 (ceil(N/bm), ceil(K/bn))          | bm, bn           |
| bf16  | uint16 bits (N, K)             | none                                      | 0, 0             |

Widening a bfloat16 scale is exact, so the kernels compute with exactly the numbers of
``colibri_core.formats.reference.dequantize``. ``decode`` below is the kernels' decode
written in numpy, bit operation for bit operation: the tests check it against the
reference decode for every kind, and every e4m3 / e2m1 / e8m0 code.

This module is plain numpy: it runs, and is tested, without a GPU.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from colibri_core.formats.base import QuantTensor, bf16_to_f32

KINDS = ("q4", "q8", "mxfp4", "fp8", "bf16")  # the packed kinds the kernels compute with
GROUP = {"q4": 64, "mxfp4": 32}  # inputs per scale group


@dataclass
class HostPacked:
    """A weight laid out for the kernels, still in host memory (numpy)."""

    kind: str
    shape: tuple[int, int]  # logical (N, K)
    data: np.ndarray
    scales: np.ndarray | None
    p0: int = 0
    p1: int = 0

    @property
    def nbytes(self) -> int:
        return int(self.data.nbytes + (0 if self.scales is None else self.scales.nbytes))

    def arrays(self) -> list[np.ndarray]:
        return [self.data] + ([] if self.scales is None else [self.scales])


@dataclass
class PackedWeight:
    """A prepared packed weight: ``data`` and ``scales`` are the backend's arrays (CuPy on
    a GPU). ``ready`` is the event an asynchronous upload records (None: usable now)."""

    kind: str
    shape: tuple[int, int]
    data: object
    scales: object | None
    p0: int = 0
    p1: int = 0
    ready: object | None = field(default=None, repr=False, compare=False)

    @property
    def nbytes(self) -> int:
        return int(self.data.nbytes + (0 if self.scales is None else self.scales.nbytes))


def groups(kind: str, cols: int) -> int:
    return -(-cols // GROUP[kind])


def host_pack(w: QuantTensor) -> HostPacked:
    """The kernels' layout of a stored packed weight (``QuantTensor``), on the host."""
    n, k = (int(d) for d in w.shape)
    if w.kind not in KINDS:
        raise ValueError(f"no CUDA kernel for packed kind {w.kind!r} (kernels: {', '.join(KINDS)})")
    data = np.ascontiguousarray(w.data)
    if w.kind == "bf16":
        return HostPacked("bf16", (n, k), data.view(np.uint16).reshape(n, k), None)
    if w.kind == "q8":
        return HostPacked("q8", (n, k), data.view(np.int8).reshape(n, k),
                          np.ascontiguousarray(w.scales, dtype=np.float32).reshape(n))
    if w.kind == "q4":
        g = groups("q4", k)
        scales = bf16_to_f32(w.scales) if w.scales.dtype == np.uint16 else np.asarray(w.scales, dtype=np.float32)
        return HostPacked("q4", (n, k), data.view(np.uint8).reshape(n, g * 32),
                          np.ascontiguousarray(scales, dtype=np.float32).reshape(n, g), g)
    if w.kind == "mxfp4":
        g = groups("mxfp4", k)
        return HostPacked("mxfp4", (n, k), data.view(np.uint8).reshape(n, g * 16),
                          np.ascontiguousarray(w.scales, dtype=np.uint8).reshape(n, g), g)
    bm, bn = (int(b) for b in w.block)  # fp8
    return HostPacked("fp8", (n, k), data.view(np.uint8).reshape(n, k),
                      np.ascontiguousarray(w.scales, dtype=np.float32).reshape(-(-n // bm), -(-k // bn)), bm, bn)


def packed_nbytes(kind: str, shape: tuple[int, int], block: tuple[int, int] = (128, 128)) -> int:
    """Bytes ``host_pack`` makes of a weight of this kind and logical shape."""
    n, k = (int(d) for d in shape)
    if kind == "bf16":
        return 2 * n * k
    if kind == "q8":
        return n * k + 4 * n
    if kind == "q4":
        return n * groups("q4", k) * (32 + 4)
    if kind == "mxfp4":
        return n * groups("mxfp4", k) * (16 + 1)
    if kind == "fp8":
        bm, bn = block
        return n * k + 4 * -(-n // bm) * -(-k // bn)
    raise ValueError(f"no CUDA kernel for packed kind {kind!r}")


# -- the kernels' decodes, in numpy (common.cuh / formats.cuh) -----------------------------
def bf16_value(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << 16).view(np.float32)


def e4m3_value(byte: np.ndarray) -> np.ndarray:
    b = byte.astype(np.uint32)
    exponent, mantissa = (b >> 3) & 15, b & 7
    normal = (((exponent + 120) << 23) | (mantissa << 20)).astype(np.uint32).view(np.float32)
    magnitude = np.where(exponent == 0, mantissa.astype(np.float32) * np.float32(0.001953125), normal)
    value = np.where(b & 0x80, -magnitude, magnitude).astype(np.float32)
    return np.where((b & 0x7F) == 0x7F, np.float32(np.nan), value)


def e2m1_value(code: np.ndarray) -> np.ndarray:
    c = code.astype(np.uint32)
    exponent, mantissa = (c >> 1) & 3, c & 1
    normal = (((exponent + 126) << 23) | (mantissa << 22)).astype(np.uint32).view(np.float32)
    magnitude = np.where(exponent == 0, np.float32(0.5) * mantissa.astype(np.float32), normal)
    return np.where(c & 8, -magnitude, magnitude).astype(np.float32)


def e8m0_value(e: np.ndarray) -> np.ndarray:
    bits = np.where(e == 0, np.uint32(0x00400000), e.astype(np.uint32) << 23).astype(np.uint32)
    return bits.view(np.float32)


def _nibbles(data: np.ndarray, n: int, g: int, group: int) -> np.ndarray:
    """(n, g, group) codes: byte j of a group holds element j (low) and j + group/2 (high)."""
    b = data.reshape(n, g, group // 2).astype(np.uint32)
    return np.concatenate((b & 15, b >> 4), axis=-1)


def decode(p: HostPacked) -> np.ndarray:
    """W (N, K) float32 as the kernels decode it from their layout."""
    n, k = p.shape
    if p.kind == "bf16":
        return bf16_value(p.data)
    if p.kind == "q8":
        return p.data.astype(np.float32) * p.scales[:, None]
    if p.kind == "q4":
        codes = _nibbles(p.data, n, p.p0, 64).astype(np.int32) - 8
        return (codes.astype(np.float32) * p.scales[..., None]).reshape(n, -1)[:, :k]
    if p.kind == "mxfp4":
        values = e2m1_value(_nibbles(p.data, n, p.p0, 32)) * e8m0_value(p.scales)[..., None]
        return values.reshape(n, -1)[:, :k]
    if p.kind == "fp8":
        scale = p.scales[np.arange(n)[:, None] // p.p0, np.arange(k)[None, :] // p.p1]
        return e4m3_value(p.data) * scale
    raise ValueError(f"no CUDA kernel for packed kind {p.kind!r}")
