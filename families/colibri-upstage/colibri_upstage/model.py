"""Solar Open on colibri's shared blocks (transformers: models/solar_open).

Pre-norm layers of Llama's attention (grouped-query, RoPE over whole heads, q/k/v biased
by ``attention_bias``, o_proj never) and, in every layer, GLM-4.5's MoE: the sigmoid
group-limited router (``e_score_correction_bias`` for choosing only) over routed SwiGLU
experts, plus ``n_shared_experts`` shared experts. All of it is core blocks (``Attention``,
``model.builders.sigmoid_moe_mlp``); what is Solar Open's own is its config.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from colibri_core.model.builders import SigmoidMoEArgs, sigmoid_moe_mlp
from colibri_core.model.config import bounded
from colibri_core.model.family import Family
from colibri_core.nn import Attention, build_rope
from colibri_core.nn.assembly import build_decoder

ROPE_THETA = 1_000_000.0  # transformers' default_theta for a config spelling none


@dataclass(kw_only=True)
class SolarOpenArgs(SigmoidMoEArgs):
    """config.json's fields (transformers' SolarOpenConfig defaults)."""

    vocab_size: int = 196608
    hidden_size: int = 4096
    moe_intermediate_size: int = 1280
    num_hidden_layers: int = 48
    num_attention_heads: int = 64
    num_key_value_heads: int = 8
    head_dim: int = 128
    n_routed_experts: int = bounded(1, 1 << 14, default=128)
    num_experts_per_tok: int = 8
    n_shared_experts: int = bounded(0, 1 << 8, default=1)
    max_position_embeddings: int = 131072
    rms_norm_eps: float = 1e-5
    # GLM-4.5's fields Solar Open's model does not have (no dense layers: every layer is
    # MoE) or does not read (its router is always noaux_tc): ignored as transformers ignores them
    intermediate_size: int = field(default=0, init=False)
    first_k_dense_replace: int = field(default=0, init=False)
    mlp_layer_types: list | None = field(default=None, init=False)
    scoring_func: str = field(default="sigmoid", init=False)
    topk_method: str = field(default="noaux_tc", init=False)
    moe_layer_freq: int = field(default=1, init=False)

    def validate(self, source):
        super().validate(source)
        self.require_multiple(source, "num_attention_heads", "num_key_value_heads")


class SolarOpen(Family):
    name = "solar_open"

    def build(self, config, w):
        src = w.config_source
        a = SolarOpenArgs.from_dict(config, src)
        hidden, heads, kv_heads, d = a.hidden_size, a.num_attention_heads, a.num_key_value_heads, a.head_dim
        rope = build_rope({"rope_theta": ROPE_THETA, **config}, d, src, whole_heads="solar_open")

        def attention(i, p):
            return Attention(layer=i, **w.attention_projections(f"{p}.self_attn", hidden, heads, kv_heads, d,
                                                                qkv_bias=a.attention_bias),
                             n_heads=heads, n_kv_heads=kv_heads, head_dim=d, rope=rope)

        return build_decoder(a, w, attention, sigmoid_moe_mlp(a, w))
