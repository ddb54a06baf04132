"""FlexOlmo on colibri's shared blocks (transformers: models/flex_olmo).

OLMo 2's layers: no norm before attention or the MLP; their outputs are normalised
(``post_attention_layernorm``, ``post_feedforward_layernorm``) before they join the
residual: x + norm(attn(x)), then h + norm(mlp(h)) (``build_decoder``'s ``pre_norms=False``
with ``post``). The attention normalises q and k over the whole projection, before the
heads are split, as OLMoE's does; the MLP is OLMoE's softmax top-k MoE in every layer.
"""

from __future__ import annotations

from dataclasses import dataclass

from colibri_core.errors import UnsupportedModelError
from colibri_core.model.builders import softmax_moe
from colibri_core.model.config import ModelArgs, bounded
from colibri_core.model.family import Family
from colibri_core.nn import Attention, build_rope
from colibri_core.nn.assembly import build_decoder

ROPE_THETA = 500000.0  # transformers' default_theta for a config spelling none


@dataclass
class FlexOlmoArgs(ModelArgs):
    """config.json's fields (transformers' FlexOlmoConfig defaults)."""

    vocab_size: int = 100352
    hidden_size: int = 4096
    intermediate_size: int = 11008
    num_hidden_layers: int = 32
    num_attention_heads: int = 32
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    num_experts: int = bounded(1, 1 << 14, default=7)
    num_experts_per_tok: int = 5
    norm_topk_prob: bool = False
    max_position_embeddings: int = 4096
    rms_norm_eps: float = 1e-6
    attention_bias: bool = False
    tie_word_embeddings: bool = False
    hidden_act: str = "silu"

    def validate(self, source):
        self.num_key_value_heads = self.num_key_value_heads or self.num_attention_heads
        self.default_head_dim(source)
        self.require_multiple(source, "num_attention_heads", "num_key_value_heads")
        self.require_at_most(source, "num_experts_per_tok", "num_experts")
        if self.hidden_act != "silu":
            raise UnsupportedModelError(f"{source}: hidden_act {self.hidden_act!r} is not supported by the "
                                        "flex_olmo family (only 'silu')")


class FlexOlmo(Family):
    name = "flex_olmo"

    def build(self, config, w):
        src = w.config_source
        a = FlexOlmoArgs.from_dict(config, src)
        hidden, heads, kv_heads, d, eps = a.hidden_size, a.num_attention_heads, a.num_key_value_heads, a.head_dim, a.rms_norm_eps
        rope = build_rope({"rope_theta": ROPE_THETA, **config}, d, src, whole_heads="flex_olmo")

        def attention(i, p):
            s = f"{p}.self_attn"
            return Attention(
                layer=i, **w.attention_projections(s, hidden, heads, kv_heads, d, qkv_bias=a.attention_bias,
                                                   o_bias=a.attention_bias),
                n_heads=heads, n_kv_heads=kv_heads, head_dim=d, rope=rope,
                q_norm=w.rms_norm(f"{s}.q_norm", heads * d, eps), k_norm=w.rms_norm(f"{s}.k_norm", kv_heads * d, eps))

        def moe(i, p):
            return softmax_moe(w, i, f"{p}.mlp", a.num_experts, a.num_experts_per_tok, a.norm_topk_prob, hidden,
                               a.intermediate_size)

        def post(i, p):  # the branches' outputs normalised before the residual
            return (w.rms_norm(f"{p}.post_attention_layernorm", hidden, eps),
                    w.rms_norm(f"{p}.post_feedforward_layernorm", hidden, eps))

        return build_decoder(a, w, attention, moe, post=post, pre_norms=False)
