"""Mixtral on colibri's shared blocks (transformers: models/mixtral/modeling_mixtral.py).

Pre-norm layers of grouped-query attention with RoPE (a sliding window over every layer
when ``sliding_window`` is set) and a sparse MoE: a softmax router whose top-k weights
are always renormalised, over SwiGLU experts. Checkpoints name the MoE as published
(``block_sparse_moe.gate``, ``block_sparse_moe.experts.{e}.w1/w3/w2``, which is also what
transformers 5 saves) or as transformers 5 keeps it in memory (``mlp.gate``,
``mlp.experts.gate_up_proj`` / ``down_proj``); both load.
"""

from __future__ import annotations

from dataclasses import dataclass

from colibri_core.errors import UnsupportedModelError
from colibri_core.model.builders import softmax_moe
from colibri_core.model.config import ModelArgs, bounded
from colibri_core.model.family import Family
from colibri_core.nn import Attention, build_rope
from colibri_core.nn.assembly import build_decoder


ROPE_THETA = 1e6


@dataclass
class MixtralArgs(ModelArgs):
    """config.json's fields (transformers' MixtralConfig defaults): unknown keys are
    ignored, types and sizes checked."""

    vocab_size: int = 32000
    hidden_size: int = 4096
    intermediate_size: int = 14336
    num_hidden_layers: int = 32
    num_attention_heads: int = 32
    num_key_value_heads: int = 8
    head_dim: int | None = None
    num_local_experts: int = bounded(1, 1 << 14, default=8)
    num_experts_per_tok: int = 2
    max_position_embeddings: int = 4096 * 32
    rms_norm_eps: float = 1e-5
    sliding_window: int | None = bounded(1, 1 << 24, default=None)
    tie_word_embeddings: bool = False
    hidden_act: str = "silu"

    def validate(self, source):
        self.default_head_dim(source)
        self.require_multiple(source, "num_attention_heads", "num_key_value_heads")
        self.require_at_most(source, "num_experts_per_tok", "num_local_experts")
        if self.hidden_act != "silu":
            raise UnsupportedModelError(f"{source}: hidden_act {self.hidden_act!r} is not supported by the "
                                        "mixtral family (only 'silu')")


class Mixtral(Family):
    name = "mixtral"

    def build(self, config, w):
        a = MixtralArgs.from_dict(config, w.config_source)
        hidden, heads, kv_heads, head_dim = a.hidden_size, a.num_attention_heads, a.num_key_value_heads, a.head_dim
        # a config that spells no rope_theta gets Mixtral's (transformers' default_theta), not 10000
        rope = build_rope({"rope_theta": ROPE_THETA, **config}, head_dim, w.config_source)

        def attention(i, p):
            return Attention(layer=i, **w.attention_projections(f"{p}.self_attn", hidden, heads, kv_heads, head_dim),
                             n_heads=heads, n_kv_heads=kv_heads, head_dim=head_dim, rope=rope, window=a.sliding_window)

        def moe(i, p):
            # published (and saved) as block_sparse_moe; transformers 5's in-memory name is mlp
            s = f"{p}.block_sparse_moe" if w.has(f"{p}.block_sparse_moe.gate.weight") else f"{p}.mlp"
            return softmax_moe(w, i, s, a.num_local_experts, a.num_experts_per_tok, True, hidden, a.intermediate_size)

        return build_decoder(a, w, attention, moe)
