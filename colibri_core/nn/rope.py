"""Rotary position embeddings: the frequency schedules of Hugging Face configs.

Supported ``rope_type`` values: default, linear, dynamic (which equals default inside the
trained context, the only range colibri runs), llama3 and yarn. Frequencies are computed
in float32 the way transformers computes them, so positions rotate identically.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from colibri_core.errors import ModelFormatError, UnsupportedModelError

SUPPORTED = ("default", "linear", "dynamic", "llama3", "yarn")


@dataclass(frozen=True)
class RoPE:
    inv_freq: np.ndarray  # (rotary_dim / 2,) float32
    attention_scaling: float
    rotary_dim: int

    def cos_sin(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(T, rotary_dim) cos and sin for integer positions, as transformers makes them."""
        freqs = positions.astype(np.float32)[:, None] * self.inv_freq[None, :]
        emb = np.concatenate((freqs, freqs), axis=-1)
        cos, sin = np.cos(emb), np.sin(emb)
        if self.attention_scaling != 1.0:
            scale = np.float32(self.attention_scaling)
            cos, sin = cos * scale, sin * scale
        return cos, sin


def rope_parameters(config: dict[str, Any], source: str = "config.json") -> dict[str, Any]:
    """The rope settings of a config, in either the transformers 5 (``rope_parameters``)
    or the older (``rope_theta`` + ``rope_scaling``) spelling."""
    params = config.get("rope_parameters")
    if params is None:
        params = dict(config.get("rope_scaling") or {})
        if "rope_theta" in config:
            params.setdefault("rope_theta", config["rope_theta"])
    if not isinstance(params, dict):
        raise ModelFormatError(f"{source}: rope_parameters must be an object, got {params!r}")
    params = dict(params)
    params.setdefault("rope_type", params.get("type", "default"))
    params.setdefault("rope_theta", config.get("rope_theta", 10000.0))
    if config.get("partial_rotary_factor") is not None:  # older configs keep it at the top level
        params.setdefault("partial_rotary_factor", config["partial_rotary_factor"])
    return params


def build_rope(config: dict[str, Any], head_dim: int, source: str = "config.json", partial_rotary_factor: float | None = None,
               whole_heads: str | None = None) -> RoPE:
    """``whole_heads``: the family (named in the error) whose attention rotates whole heads, as
    transformers' code for it does (a partial table fails there): a partial factor is refused."""
    params = rope_parameters(config, source)
    rope_type = params["rope_type"]
    if rope_type not in SUPPORTED:
        raise UnsupportedModelError(f"{source}: rope_type {rope_type!r} is not supported (supported: {', '.join(SUPPORTED)})")
    base = _number(params, "rope_theta", source)
    if base <= 1:
        raise ModelFormatError(f"{source}: rope_theta must be > 1, got {base}")
    factor_partial = partial_rotary_factor
    if factor_partial is None:
        factor_partial = _number(params, "partial_rotary_factor", source) if params.get("partial_rotary_factor") is not None else 1.0
    dim = int(head_dim * factor_partial)
    if dim < 2 or dim > head_dim or dim % 2:
        raise ModelFormatError(f"{source}: rotary dimension {dim} (head_dim {head_dim} x {factor_partial}) must be even and within head_dim")
    if whole_heads is not None and dim != head_dim:
        raise UnsupportedModelError(f"{source}: partial_rotary_factor is not supported by the {whole_heads} family "
                                    "(its attention rotates whole heads)")

    exponents = np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / np.float32(dim)
    inv_freq = (np.float32(1.0) / (np.float32(base) ** exponents)).astype(np.float32)
    scaling = 1.0

    if rope_type == "linear":
        inv_freq = (inv_freq / np.float32(_positive(params, "factor", source))).astype(np.float32)
    elif rope_type == "llama3":
        inv_freq = _llama3(inv_freq, params, source)
    elif rope_type == "yarn":
        inv_freq, scaling = _yarn(params, config, dim, base, source)
    # "dynamic" only changes frequencies beyond max_position_embeddings, which colibri
    # never runs (generation stops at the context length).
    return RoPE(inv_freq.astype(np.float32), float(scaling), dim)


def _number(params: dict, key: str, source: str) -> float:
    value = params.get(key)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ModelFormatError(f"{source}: rope parameter {key!r} must be a number, got {value!r}")
    return float(value)


def _positive(params: dict, key: str, source: str) -> float:
    value = _number(params, key, source)
    if value <= 0:
        raise ModelFormatError(f"{source}: rope parameter {key!r} must be > 0, got {value!r}")
    return value


def _llama3(inv_freq: np.ndarray, params: dict, source: str) -> np.ndarray:
    factor = _positive(params, "factor", source)
    low = _positive(params, "low_freq_factor", source)
    high = _positive(params, "high_freq_factor", source)
    old_len = _positive(params, "original_max_position_embeddings", source)
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = np.float32(2 * math.pi) / inv_freq
    scaled = np.where(wavelen > low_wavelen, inv_freq / np.float32(factor), inv_freq).astype(np.float32)
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    if high == low:  # no band to smooth (Llama 4 Scout's 1.0 and 1.0): transformers' 0 / 0 is used only on its edge
        if medium.any():
            raise ModelFormatError(f"{source}: llama3 rope with high_freq_factor == low_freq_factor has a wavelength "
                                   "on the band's edge, where transformers divides by zero")
        return scaled
    smooth = ((old_len / wavelen - low) / (high - low)).astype(np.float32)
    smoothed = (1 - smooth) * scaled / np.float32(factor) + smooth * scaled
    return np.where(medium, smoothed, scaled).astype(np.float32)


def _yarn(params: dict, config: dict, dim: int, base: float, source: str) -> tuple[np.ndarray, float]:
    original = _positive(params, "original_max_position_embeddings", source)
    factor = params.get("factor")
    factor = _positive(params, "factor", source) if factor is not None else _positive(config, "max_position_embeddings", source) / original
    # optional numbers: absent (or, like transformers, falsy for the betas) means the default
    attention_factor = _number(params, "attention_factor", source) if params.get("attention_factor") is not None else None
    mscale, mscale_all_dim = (_number(params, k, source) if params.get(k) is not None else None for k in ("mscale", "mscale_all_dim"))

    def get_mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if attention_factor is None:
        if mscale and mscale_all_dim:
            attention_factor = get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim)
        else:
            attention_factor = get_mscale(factor)
    beta_fast = _positive({"beta_fast": params.get("beta_fast") or 32}, "beta_fast", source)
    beta_slow = _positive({"beta_slow": params.get("beta_slow") or 1}, "beta_slow", source)

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    pos_freqs = np.float32(base) ** (np.arange(0, dim, 2).astype(np.float32) / np.float32(dim))
    extrapolation = np.float32(1.0) / pos_freqs
    interpolation = np.float32(1.0) / (np.float32(factor) * pos_freqs)
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - np.float32(low)) / np.float32(high - low), 0, 1)
    extrapolation_factor = np.float32(1) - ramp
    inv_freq = interpolation * (1 - extrapolation_factor) + extrapolation * extrapolation_factor
    return inv_freq.astype(np.float32), float(attention_factor)
