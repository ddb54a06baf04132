"""ERNIE 4.5 MoE on colibri's shared blocks (transformers: models/ernie4_5_moe).

Pre-norm layers of grouped-query attention and an MLP (with ``use_bias``, every linear
but the experts' and the router's has a bias, the LM head's included):
a dense SwiGLU, or in the layers from ``moe_layer_start_index`` to
``moe_layer_end_index`` every ``moe_layer_interval``-th, a MoE. Its router takes the
softmax of ``gate``'s logits, chooses the top ``moe_k`` of the probabilities plus
``moe_statics.e_score_correction_bias`` and weights them by their probabilities divided
by max(their sum, ``moe_norm_min``); ``moe_num_shared_experts`` shared experts add a
dense SwiGLU of ``moe_num_shared_experts * moe_intermediate_size``.

RoPE rotates interleaved pairs (features 2i and 2i + 1 at frequency i). Colibri's
attention rotates halves (i and i + d/2), so each head's q_proj and k_proj rows (and
biases) are read reordered, even features first, then odd: queries and keys are the
same vectors in another feature order, so their dot products are unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass

from colibri_core.errors import ModelFormatError, UnsupportedModelError
from colibri_core.model.config import ModelArgs, bounded
from colibri_core.model.family import Family
from colibri_core.nn import Attention, SoftmaxGroupedTopKRouter, SparseMoE, SwiGLU, build_rope
from colibri_core.nn.assembly import build_decoder

ROPE_THETA = 500000.0  # transformers' default_theta for a config spelling none


@dataclass
class Ernie4_5MoeArgs(ModelArgs):
    """config.json's fields (transformers' Ernie4_5_MoeConfig defaults)."""

    vocab_size: int = 103424
    hidden_size: int = 2560
    intermediate_size: int = 12288
    num_hidden_layers: int = 28
    num_attention_heads: int = 20
    num_key_value_heads: int | None = 4
    head_dim: int | None = None
    max_position_embeddings: int = 131072
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = True
    use_bias: bool = False
    hidden_act: str = "silu"
    moe_intermediate_size: int = 1536
    moe_k: int = 6
    moe_num_experts: int = bounded(1, 1 << 14, default=64)
    moe_num_shared_experts: int = bounded(0, 1 << 8, default=2)
    moe_layer_start_index: int = bounded(0, 1 << 10, default=1)
    moe_layer_end_index: int = bounded(-1, 1 << 10, default=-1)
    moe_layer_interval: int = bounded(1, 1 << 10, default=1)
    moe_norm_min: float = bounded(0.0, 1.0, default=1e-12)

    def validate(self, source):
        self.num_key_value_heads = self.num_key_value_heads or self.num_attention_heads
        self.default_head_dim(source)
        if self.head_dim % 2:
            raise ModelFormatError(f"{source}: head_dim {self.head_dim} must be even (RoPE rotates pairs)")
        self.require_multiple(source, "num_attention_heads", "num_key_value_heads")
        self.require_at_most(source, "moe_k", "moe_num_experts")
        if self.moe_layer_end_index == -1:  # transformers: -1 is the last layer
            self.moe_layer_end_index = self.num_hidden_layers - 1
        if self.hidden_act != "silu":
            raise UnsupportedModelError(f"{source}: hidden_act {self.hidden_act!r} is not supported by the "
                                        "ernie4_5_moe family (only 'silu')")

    def is_moe(self, i: int) -> bool:
        return (i + 1) % self.moe_layer_interval == 0 and self.moe_layer_start_index <= i <= self.moe_layer_end_index


def alias(config: dict) -> dict:
    """transformers' attribute names (``num_experts``, ``num_experts_per_tok``) for ERNIE's
    own, where only those are spelled."""
    out = dict(config)
    for ernie, name in (("moe_num_experts", "num_experts"), ("moe_k", "num_experts_per_tok")):
        if ernie not in out and name in out:
            out[ernie] = out[name]
    return out


class Ernie4_5Moe(Family):
    name = "ernie4_5_moe"

    @staticmethod
    def parse(config: dict, source: str = "config.json") -> Ernie4_5MoeArgs:
        return Ernie4_5MoeArgs.from_dict(alias(config), source)

    def build(self, config, w):
        a = self.parse(config, w.config_source)
        hidden, heads, kv_heads, d, bias = a.hidden_size, a.num_attention_heads, a.num_key_value_heads, a.head_dim, a.use_bias
        rope = build_rope({"rope_theta": ROPE_THETA, **config}, d, w.config_source)

        def attention(i, p):
            s = f"{p}.self_attn"
            return Attention(layer=i, q=w.halves_linear(f"{s}.q_proj", heads, d, hidden, bias=bias),
                             k=w.halves_linear(f"{s}.k_proj", kv_heads, d, hidden, bias=bias),
                             v=w.linear(f"{s}.v_proj", kv_heads * d, hidden, bias=bias),
                             o=w.linear(f"{s}.o_proj", hidden, heads * d, bias=bias),
                             n_heads=heads, n_kv_heads=kv_heads, head_dim=d, rope=rope)

        def swiglu(p, inner):
            return SwiGLU(w.linear(f"{p}.gate_proj", inner, hidden, bias=bias), w.linear(f"{p}.up_proj", inner, hidden, bias=bias),
                          w.linear(f"{p}.down_proj", hidden, inner, bias=bias))

        def mlp(i, p):
            p = f"{p}.mlp"
            if not a.is_moe(i):
                return swiglu(p, a.intermediate_size)
            n, inner = a.moe_num_experts, a.moe_intermediate_size
            # published (and saved) beside the gate; transformers keeps it inside the gate in memory
            statics = next((f"{s}.moe_statics.e_score_correction_bias" for s in (p, f"{p}.gate")
                            if w.has(f"{s}.moe_statics.e_score_correction_bias")), None)
            router = SoftmaxGroupedTopKRouter(
                w.linear(f"{p}.gate", n, hidden), a.moe_k, bias=w.param(statics, (1, n)) if statics else None,
                renormalise=True, norm_min=a.moe_norm_min)
            shared = swiglu(f"{p}.shared_experts", inner * a.moe_num_shared_experts) if a.moe_num_shared_experts else None
            return SparseMoE(router, w.swiglu_experts(i, f"{p}.experts", n, hidden, inner), shared=shared)

        return build_decoder(a, w, attention, mlp, head_bias=bias)  # use_bias: the LM head (tied or not) too
