"""MiniMax-M2 on colibri's shared blocks (transformers: models/minimax_m2).

Pre-norm layers of grouped-query attention and a MoE in every layer. The attention
normalises q and k over the whole projection (before the heads are split) and rotates
the first ``rotary_dim`` features of each head (the published configs' spelling of
``partial_rotary_factor``). The router takes sigmoid scores, chooses the top
``num_experts_per_tok`` of the scores plus ``e_score_correction_bias`` and weights the
chosen experts by their scores divided by their sum: the core
``SigmoidGroupedTopKRouter`` with one group. Checkpoints name the MoE as published
(``block_sparse_moe``: ``gate``, ``e_score_correction_bias``, per-expert ``w1``/``w3``/``w2``,
also what transformers saves) or as transformers keeps it in memory (``mlp``, fused
experts); both load.
"""

from __future__ import annotations

from dataclasses import dataclass

from colibri_core.errors import ModelFormatError, UnsupportedModelError
from colibri_core.model.config import ModelArgs, bounded
from colibri_core.model.family import Family
from colibri_core.nn import Attention, SigmoidGroupedTopKRouter, SparseMoE, build_rope, rope_parameters
from colibri_core.nn.assembly import build_decoder

ROPE_THETA = 5000000.0  # transformers' default_theta for a config spelling none


@dataclass
class MiniMaxM2Args(ModelArgs):
    """config.json's fields (transformers' MiniMaxM2Config defaults). ``intermediate_size``
    is each expert's; fields of MiniMax's own code that transformers does not read
    (``use_qk_norm``, ``scoring_func``, ``shared_intermediate_size``, the MTP modules) are
    ignored as it ignores them."""

    vocab_size: int = 200064
    hidden_size: int = 3072
    intermediate_size: int = 1536
    num_hidden_layers: int = 62
    num_attention_heads: int = 48
    num_key_value_heads: int = 8
    head_dim: int = 128
    max_position_embeddings: int = 196608
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    num_local_experts: int = bounded(1, 1 << 14, default=256)
    num_experts_per_tok: int = 8
    rotary_dim: int | None = bounded(1, 1 << 12, default=None)
    hidden_act: str = "silu"

    def validate(self, source):
        self.require_multiple(source, "num_attention_heads", "num_key_value_heads")
        self.require_at_most(source, "num_experts_per_tok", "num_local_experts")
        if self.rotary_dim is not None and self.rotary_dim > self.head_dim:
            raise ModelFormatError(f"{source}: rotary_dim {self.rotary_dim} exceeds head_dim {self.head_dim}")
        if self.hidden_act != "silu":
            raise UnsupportedModelError(f"{source}: hidden_act {self.hidden_act!r} is not supported by the "
                                        "minimax_m2 family (only 'silu')")


def partial_rotary_factor(config: dict, a: MiniMaxM2Args, source: str) -> float | None:
    """transformers' priority: ``partial_rotary_factor`` in rope_parameters or at the top
    level (None: ``build_rope`` reads it), then ``rotary_dim / head_dim``, then whole heads."""
    if rope_parameters(config, source).get("partial_rotary_factor") is not None or a.rotary_dim is None:
        return None
    return a.rotary_dim / a.head_dim


class MiniMaxM2(Family):
    name = "minimax_m2"

    def build(self, config, w):
        src = w.config_source
        a = MiniMaxM2Args.from_dict(config, src)
        hidden, heads, kv_heads, d, eps = a.hidden_size, a.num_attention_heads, a.num_key_value_heads, a.head_dim, a.rms_norm_eps
        rope = build_rope({"rope_theta": ROPE_THETA, **config}, d, src, partial_rotary_factor(config, a, src))

        def attention(i, p):
            s = f"{p}.self_attn"
            return Attention(layer=i, **w.attention_projections(s, hidden, heads, kv_heads, d),
                             n_heads=heads, n_kv_heads=kv_heads, head_dim=d, rope=rope,
                             q_norm=w.rms_norm(f"{s}.q_norm", heads * d, eps),
                             k_norm=w.rms_norm(f"{s}.k_norm", kv_heads * d, eps))

        def moe(i, p):
            # published (and saved) as block_sparse_moe; transformers 5's in-memory name is mlp
            s = f"{p}.block_sparse_moe" if w.has(f"{p}.block_sparse_moe.gate.weight") else f"{p}.mlp"
            n = a.num_local_experts
            router = SigmoidGroupedTopKRouter(w.linear(f"{s}.gate", n, hidden), a.num_experts_per_tok,
                                              bias=w.optional(f"{s}.e_score_correction_bias", (n,)), norm_topk_prob=True)
            return SparseMoE(router, w.swiglu_experts(i, f"{s}.experts", n, hidden, a.intermediate_size))

        return build_decoder(a, w, attention, moe)
