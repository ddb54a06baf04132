"""Weight formats: how stored tensor bytes become the numbers the model computes with.

A format turns the raw arrays of one logical weight (the tensor itself plus, for
quantised formats, its companion scale tensors) into float32. The core ships the plain
float formats; quantised formats plug in through the same ``QuantSpec`` hook.
"""

from __future__ import annotations

import numpy as np

from .safetensors_file import TensorInfo


class QuantFormat:
    """Base class of weight formats."""

    name = "base"

    def companions(self, info: TensorInfo, lookup) -> list[TensorInfo]:
        """Extra tensors (scales) this weight needs, found with ``lookup(name)``."""
        return []

    def decode(self, info: TensorInfo, raw: np.ndarray, companions: dict[str, np.ndarray]) -> np.ndarray:
        """Return the weight as a float32 array of ``info.shape``."""
        raise NotImplementedError


class F32(QuantFormat):
    name = "f32"

    def decode(self, info, raw, companions):
        return np.array(raw, dtype=np.float32, copy=True)


class F16(QuantFormat):
    name = "f16"

    def decode(self, info, raw, companions):
        return raw.astype(np.float32)


class BF16(QuantFormat):
    name = "bf16"

    def decode(self, info, raw, companions):
        return bf16_to_f32(raw)


def bf16_to_f32(raw: np.ndarray) -> np.ndarray:
    """bfloat16 bits (uint16) -> float32: the bf16 bits are the high half of an f32."""
    out = np.empty(raw.shape, dtype=np.uint32)
    np.left_shift(raw, 16, out=out, dtype=np.uint32)
    return out.view(np.float32)


def f32_to_bf16(x: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bits (uint16), rounding to nearest even like torch does."""
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    rounding = ((bits >> 16) & 1) + np.uint32(0x7FFF)
    out = ((bits + rounding) >> 16).astype(np.uint16)
    nan = np.isnan(x)
    if nan.any():
        out[nan] = 0x7FC0
    return out


class FormatResolver:
    """Chooses the registered format that decodes each stored tensor.

    Today the choice follows the tensor's dtype; formats that need a checkpoint-level
    stamp (quantisation config, colibri metadata) extend this resolver. A tensor no
    installed format reads is an error naming it, never a silent guess.
    """

    def __init__(self, registry):
        self._by_dtype: dict[str, QuantFormat] = {}
        for entry in registry.all("quant"):
            for dtype in entry.spec.dtypes:
                self._by_dtype.setdefault(dtype, entry.spec.load()())

    def format_for(self, info: TensorInfo) -> QuantFormat:
        fmt = self._by_dtype.get(info.dtype)
        if fmt is None:
            from .errors import UnsupportedModelError

            raise UnsupportedModelError(
                f"{info.path}: tensor {info.name!r} is stored as {info.dtype}, which no installed weight format reads"
            )
        return fmt

    def read_decoded(self, checkpoint, infos: list[TensorInfo]) -> dict[str, np.ndarray]:
        """Read tensors (merging nearby reads) and decode each to float32."""
        raw = checkpoint.read_many(infos)
        return {info.name: self.format_for(info).decode(info, raw[info.name], {}) for info in infos}
