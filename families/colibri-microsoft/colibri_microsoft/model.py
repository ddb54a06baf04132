"""Phi-MoE on colibri's shared blocks (transformers: models/phimoe).

Mixtral's skeleton with LayerNorms: pre-norm layers whose norms (and the final one) are
LayerNorms with a bias (eps ``rms_norm_eps``), grouped-query attention (every
projection biased by ``attention_bias``; a sliding window when ``sliding_window`` is
shorter than the context) and a MoE of SwiGLU experts routed by the sparsemixer as
transformers evaluates it (``SparseMixerRouter``: always 2 experts, thresholds of
2 x ``router_jitter_noise``); the LM head biased by ``lm_head_bias``. Checkpoints name the
MoE as published and saved (``block_sparse_moe.gate``, ``block_sparse_moe.experts.{e}.w1/
w3/w2``) or as transformers keeps it in memory (``mlp.router``, ``mlp.experts.gate_up_proj``
/ ``down_proj``); both load.

RoPE: default, or ``longrope`` as transformers' phimoe computes it: the short factors at
every length (its rotary embedding recomputes the frequencies without the sequence
length), cos and sin times ``short_mscale``, or ``long_mscale`` in a forward pass whose
last position passes ``original_max_position_embeddings``. That switch depends on how a
sequence is cut into passes, which no KV cache reproduces, so the two must be equal
(they are in Phi-3.5-MoE).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from colibri_core.errors import ModelFormatError, UnsupportedModelError
from colibri_core.model.config import ModelArgs, bounded
from colibri_core.model.family import Family
from colibri_core.nn import Attention, LayerNorm, RoPE, SparseMixerRouter, SparseMoE, build_rope, rope_parameters
from colibri_core.nn.assembly import build_decoder

ROPE_THETA = 1e6  # transformers' default_theta for a config spelling none


@dataclass
class PhiMoeArgs(ModelArgs):
    """config.json's fields (transformers' PhimoeConfig defaults)."""

    vocab_size: int = 32064
    hidden_size: int = 4096
    intermediate_size: int = 6400
    num_hidden_layers: int = 32
    num_attention_heads: int = 32
    num_key_value_heads: int | None = 8
    head_dim: int | None = None
    max_position_embeddings: int = 4096 * 32
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    sliding_window: int | None = bounded(1, 1 << 24, default=None)
    num_local_experts: int = bounded(2, 1 << 14, default=16)
    num_experts_per_tok: int = 2
    router_jitter_noise: float = bounded(0.0, 1e6, default=0.01)
    attention_bias: bool = False
    lm_head_bias: bool = False
    hidden_act: str = "silu"

    def validate(self, source):
        self.num_key_value_heads = self.num_key_value_heads or self.num_attention_heads
        self.default_head_dim(source)
        self.require_multiple(source, "num_attention_heads", "num_key_value_heads")
        if self.num_experts_per_tok != 2:
            raise UnsupportedModelError(f"{source}: num_experts_per_tok {self.num_experts_per_tok} is not supported: "
                                        "the sparsemixer router chooses 2 experts (transformers ignores the field)")
        if self.hidden_act != "silu":
            raise UnsupportedModelError(f"{source}: hidden_act {self.hidden_act!r} is not supported by the "
                                        "phimoe family (only 'silu')")


def _number(params: dict, name: str, source: str) -> float:
    value = params.get(name)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ModelFormatError(f"{source}: rope parameter {name!r} must be a number, got {value!r}")
    return float(value)


def phimoe_rope(config: dict, head_dim: int, source: str) -> RoPE:
    """transformers' PhimoeRotaryEmbedding (see the module's docstring)."""
    config = {"rope_theta": ROPE_THETA, **config}
    params = rope_parameters(config, source)
    kind = params["rope_type"]
    if kind == "default":
        return build_rope(config, head_dim, source)
    if kind != "longrope":
        raise UnsupportedModelError(f"{source}: rope_type {kind!r} is not supported by the phimoe family "
                                    "(default, longrope)")
    short_mscale, long_mscale = _number(params, "short_mscale", source), _number(params, "long_mscale", source)
    if short_mscale != long_mscale:
        raise UnsupportedModelError(f"{source}: rope parameter 'long_mscale' {long_mscale} differs from 'short_mscale' "
                                    f"{short_mscale}: transformers' phimoe switches between them by the last position "
                                    "of each forward pass, which a KV cache cannot reproduce")
    factors = params.get("short_factor")
    if not (isinstance(factors, list) and len(factors) == head_dim // 2 and all(
            isinstance(f, (int, float)) and not isinstance(f, bool) and math.isfinite(f) and f > 0 for f in factors)):
        raise ModelFormatError(f"{source}: rope parameter 'short_factor' must list {head_dim // 2} positive numbers "
                               f"(half of head_dim {head_dim})")
    theta = _number(params, "rope_theta", source)
    if theta <= 1:
        raise ModelFormatError(f"{source}: rope_theta must be > 1, got {theta}")
    # transformers' _compute_longrope_parameters without a sequence length, in float32
    exponents = np.arange(0, head_dim, 2, dtype=np.int64).astype(np.float32) / np.float32(head_dim)
    inv_freq = np.float32(1.0) / (np.asarray(factors, dtype=np.float32) * np.float32(theta) ** exponents)
    return RoPE(inv_freq.astype(np.float32), short_mscale, head_dim)


class PhiMoe(Family):
    name = "phimoe"

    def build(self, config, w):
        a = PhiMoeArgs.from_dict(config, w.config_source)
        hidden, heads, kv_heads, d, n = a.hidden_size, a.num_attention_heads, a.num_key_value_heads, a.head_dim, a.num_local_experts
        rope = phimoe_rope(config, d, w.config_source)
        # a window as long as the context hides nothing (Phi-3.5-MoE's): plain attention
        window = a.sliding_window if a.sliding_window and a.sliding_window < a.max_position_embeddings else None

        def attention(i, p):
            b = a.attention_bias
            return Attention(layer=i, **w.attention_projections(f"{p}.self_attn", hidden, heads, kv_heads, d, qkv_bias=b,
                                                                o_bias=b),
                             n_heads=heads, n_kv_heads=kv_heads, head_dim=d, rope=rope, window=window)

        def moe(i, p):
            s, gate = f"{p}.block_sparse_moe", f"{p}.block_sparse_moe.gate"  # as published and saved
            if not w.has(f"{gate}.weight"):  # transformers' in-memory names
                s, gate = f"{p}.mlp", f"{p}.mlp.router"
            router = SparseMixerRouter(w.linear(gate, n, hidden), a.router_jitter_noise)
            return SparseMoE(router, w.swiglu_experts(i, f"{s}.experts", n, hidden, a.intermediate_size))

        def layer_norm(prefix):  # with a bias, eps rms_norm_eps
            return LayerNorm(w.param(f"{prefix}.weight", (hidden,)), w.param(f"{prefix}.bias", (hidden,)), a.rms_norm_eps)

        return build_decoder(a, w, attention, moe, make_norm=layer_norm, head_bias=a.lm_head_bias)
