"""Jamba on colibri's shared blocks (transformers: models/jamba).

Pre-norm decoder layers (``input_layernorm``, ``pre_ff_layernorm``, the final norm
``final_layernorm``), each with one token mixer and one feed-forward block:

- the mixer is attention in the layers i with i % ``attn_layer_period`` ==
  ``attn_layer_offset`` (grouped-query, no positional encoding, no biases) and a Mamba
  (v1) mixer (``colibri_core.nn.Mamba1Mixer``, under ``mamba.``) in the others: a
  depthwise causal conv, the selective scan with a per-channel state, and Jamba's RMS
  norms of dt, B and C (``dt_layernorm``, ``b_layernorm``, ``c_layernorm``, eps
  ``rms_norm_eps``);
- the feed-forward block is a MoE in the layers i with i % ``expert_layer_period`` ==
  ``expert_layer_offset`` (when ``num_experts`` > 1): the top ``num_experts_per_tok`` of
  the softmax over ``feed_forward.router``, not renormalised (transformers'
  JambaTopKRouter), over SwiGLU experts ``feed_forward.experts.{e}.{gate,up,down}_proj``
  as published and saved, or fused ``experts.gate_up_proj`` / ``down_proj`` as
  transformers 5 keeps them in memory; a dense SwiGLU ``feed_forward`` elsewhere.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from colibri_core.errors import ModelFormatError, UnsupportedModelError
from colibri_core.model.config import ModelArgs, bounded
from colibri_core.model.family import Family
from colibri_core.nn import Attention, Mamba1Mixer, SoftmaxTopKRouter, SparseMoE
from colibri_core.nn.assembly import Names, build_decoder


@dataclass
class JambaArgs(ModelArgs):
    """config.json's fields (transformers' JambaConfig defaults)."""

    vocab_size: int = 65536
    hidden_size: int = 4096
    intermediate_size: int = 14336
    num_hidden_layers: int = 32
    num_attention_heads: int = 32
    num_key_value_heads: int | None = 8
    head_dim: int | None = None
    hidden_act: str = "silu"
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 262144
    num_experts: int = bounded(1, 1 << 14, default=16)
    num_experts_per_tok: int = bounded(1, 1 << 14, default=2)
    expert_layer_period: int = bounded(1, 1 << 10, default=2)
    expert_layer_offset: int = bounded(0, 1 << 10, default=1)
    attn_layer_period: int = bounded(1, 1 << 10, default=8)
    attn_layer_offset: int = bounded(0, 1 << 10, default=4)
    mamba_d_state: int = bounded(1, 1 << 12, default=16)
    mamba_d_conv: int = bounded(1, 1 << 10, default=4)
    mamba_expand: int = bounded(1, 1 << 6, default=2)
    mamba_dt_rank: int | str = "auto"
    mamba_conv_bias: bool = True
    mamba_proj_bias: bool = False
    sliding_window: int | None = None

    def validate(self, source):
        if self.hidden_act != "silu":
            raise UnsupportedModelError(f"{source}: hidden_act {self.hidden_act!r} is not supported by jamba "
                                        "(only 'silu')")
        if self.sliding_window is not None:
            raise UnsupportedModelError(f"{source}: sliding_window is not supported by jamba (it must be null: "
                                        "transformers' Jamba attends to every position)")
        for period, offset in (("attn_layer_period", "attn_layer_offset"),
                               ("expert_layer_period", "expert_layer_offset")):
            if getattr(self, offset) >= getattr(self, period):
                raise ModelFormatError(f"{source}: {offset} {getattr(self, offset)} must be smaller than {period} "
                                       f"{getattr(self, period)}")
        if self.mamba_dt_rank == "auto":
            self.mamba_dt_rank = math.ceil(self.hidden_size / 16)
        if isinstance(self.mamba_dt_rank, bool) or not isinstance(self.mamba_dt_rank, int) \
                or not 1 <= self.mamba_dt_rank <= 1 << 16:
            raise ModelFormatError(f"{source}: mamba_dt_rank must be 'auto' or a positive integer, "
                                   f"got {self.mamba_dt_rank!r}")
        self.num_key_value_heads = self.num_key_value_heads or self.num_attention_heads
        self.default_head_dim(source)
        self.require_multiple(source, "num_attention_heads", "num_key_value_heads")
        if self.num_experts > 1:  # one expert: every layer dense (transformers' layers_num_experts)
            self.require_at_most(source, "num_experts_per_tok", "num_experts")

    def is_attention(self, i: int) -> bool:
        return i % self.attn_layer_period == self.attn_layer_offset

    def is_moe(self, i: int) -> bool:  # transformers' layers_num_experts: a MoE where it gives more than one
        return self.num_experts > 1 and i % self.expert_layer_period == self.expert_layer_offset


def conv_2d(m: np.ndarray) -> np.ndarray:
    """conv1d.weight (D, 1, K) as (D, K)."""
    return np.ascontiguousarray(m.reshape(m.shape[0], m.shape[-1]))


def neg_exp(m: np.ndarray) -> np.ndarray:
    """A_log as A = -exp(A_log)."""
    return -np.exp(m.astype(np.float32))


class Jamba(Family):
    name = "jamba"

    @staticmethod
    def parse(config: dict, source: str = "config.json") -> JambaArgs:
        """The config as transformers reads it (``num_local_experts``: its attribute map)."""
        raw = dict(config)
        if raw.get("num_experts") is None and raw.get("num_local_experts") is not None:
            raw["num_experts"] = raw["num_local_experts"]
        return JambaArgs.from_dict(raw, source)

    def build(self, config, w):
        a = self.parse(config, w.config_source)
        hidden, heads, kv_heads, d = a.hidden_size, a.num_attention_heads, a.num_key_value_heads, a.head_dim
        inner, n, r, eps = a.mamba_expand * hidden, a.mamba_d_state, a.mamba_dt_rank, a.rms_norm_eps

        def mixer(i, p):
            if a.is_attention(i):
                return Attention(layer=i, **w.attention_projections(f"{p}.self_attn", hidden, heads, kv_heads, d),
                                 n_heads=heads, n_kv_heads=kv_heads, head_dim=d, rope=None)
            s = f"{p}.mamba"
            return Mamba1Mixer(
                layer=i, in_proj=w.linear(f"{s}.in_proj", 2 * inner, hidden, bias=a.mamba_proj_bias),
                conv_weight=w.param(f"{s}.conv1d.weight", (inner, 1, a.mamba_d_conv), conv_2d),
                conv_bias=w.param(f"{s}.conv1d.bias", (inner,)) if a.mamba_conv_bias else None,
                x_proj=w.linear(f"{s}.x_proj", r + 2 * n, inner), dt_proj=w.linear(f"{s}.dt_proj", inner, r, bias=True),
                a_neg=w.param(f"{s}.A_log", (inner, n), neg_exp), d=w.param(f"{s}.D", (inner,)),
                out_proj=w.linear(f"{s}.out_proj", hidden, inner, bias=a.mamba_proj_bias), inner=inner,
                state_size=n, dt_rank=r, dt_norm=w.param(f"{s}.dt_layernorm.weight", (r,)),
                b_norm=w.param(f"{s}.b_layernorm.weight", (n,)), c_norm=w.param(f"{s}.c_layernorm.weight", (n,)),
                eps=eps)

        def mlp(i, p):
            s = f"{p}.feed_forward"
            if not a.is_moe(i):
                return w.swiglu(s, hidden, a.intermediate_size)
            router = SoftmaxTopKRouter(w.linear(f"{s}.router", a.num_experts, hidden), a.num_experts_per_tok, False)
            return SparseMoE(router, w.swiglu_experts(i, f"{s}.experts", a.num_experts, hidden, a.intermediate_size))

        return build_decoder(a, w, mixer, mlp, Names(norm="final_layernorm"),
                             norm_names=("input_layernorm", "pre_ff_layernorm"))
