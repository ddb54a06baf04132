"""OLMoE on colibri's shared blocks (transformers: models/olmoe/modeling_olmoe.py).

This file and __init__.py are also what ``colibri new-family`` writes, renamed, for a new
family (colibri_core/cli/scaffold.py): after a change here, regenerate its templates
(tests/test_scaffold_templates.py says how).
"""

from __future__ import annotations

from dataclasses import dataclass

from colibri_core.model.config import ModelArgs
from colibri_core.errors import ModelFormatError, UnsupportedModelError
from colibri_core.model.family import Family
from colibri_core.nn import Attention, build_rope
from colibri_core.nn.assembly import build_decoder
from colibri_core.model.builders import softmax_moe


@dataclass
class OlmoeArgs(ModelArgs):
    """config.json's fields: unknown keys are ignored, types and sizes checked."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_experts: int
    num_experts_per_tok: int
    num_key_value_heads: int | None = None
    max_position_embeddings: int = 4096
    rms_norm_eps: float = 1e-5
    norm_topk_prob: bool = False
    clip_qkv: float | None = None
    attention_bias: bool = False
    tie_word_embeddings: bool = False
    hidden_act: str = "silu"

    def validate(self, source):
        self.num_key_value_heads = self.num_key_value_heads or self.num_attention_heads
        if self.hidden_size % self.num_attention_heads:
            raise ModelFormatError(f"{source}: hidden_size {self.hidden_size} is not divisible by "
                                   f"num_attention_heads {self.num_attention_heads}")
        self.require_multiple(source, "num_attention_heads", "num_key_value_heads")
        self.require_at_most(source, "num_experts_per_tok", "num_experts")
        if self.hidden_act != "silu":
            raise UnsupportedModelError(f"{source}: hidden_act {self.hidden_act!r} is not supported by the "
                                        "olmoe family (only 'silu')")


class Olmoe(Family):
    name = "olmoe"

    def build(self, config, w):
        a = OlmoeArgs.from_dict(config, w.config_source)
        hidden, heads, kv_heads = a.hidden_size, a.num_attention_heads, a.num_key_value_heads
        head_dim = hidden // heads
        rope = build_rope(config, head_dim, w.config_source)

        def attention(i, p):
            s = f"{p}.self_attn"
            return Attention(
                layer=i,
                **w.attention_projections(s, hidden, heads, kv_heads, head_dim, qkv_bias=a.attention_bias,
                                          o_bias=a.attention_bias),
                n_heads=heads, n_kv_heads=kv_heads, head_dim=head_dim, rope=rope,
                # OLMoE normalises q and k over the whole projection, before splitting heads
                q_norm=w.rms_norm(f"{s}.q_norm", heads * head_dim, a.rms_norm_eps),
                k_norm=w.rms_norm(f"{s}.k_norm", kv_heads * head_dim, a.rms_norm_eps),
                clip_qkv=a.clip_qkv,
            )

        def moe(i, p):
            return softmax_moe(w, i, f"{p}.mlp", a.num_experts, a.num_experts_per_tok, a.norm_topk_prob, hidden,
                               a.intermediate_size)

        return build_decoder(a, w, attention, moe)
