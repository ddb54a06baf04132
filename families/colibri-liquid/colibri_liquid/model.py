"""LFM2-MoE on colibri's shared blocks (transformers: models/lfm2_moe).

Pre-norm layers (``operator_norm``, ``ffn_norm``: ``build_decoder``'s ``norm_names``; the
final norm is ``embedding_norm``: ``Names.norm``). The token mixer of a layer that
``layer_types`` marks "conv" is the core ``GatedShortConv`` (``conv.in_proj`` into B, C and
h; C times the depthwise causal convolution ``conv.conv`` of B times h; ``conv.out_proj``),
of the others grouped-query attention with per-head q/k RMSNorm (``q_layernorm``,
``k_layernorm``) before RoPE and ``out_proj``. The MLP (``feed_forward``) is a dense SwiGLU
(``w1``, ``w3``, ``w2``) in the first ``num_dense_layers`` layers, else a MoE: sigmoid
scores, the top ``num_experts_per_tok`` chosen on the scores (plus ``expert_bias`` when
``use_expert_bias``), weighted by their scores divided by their sum + 1e-6 when
``norm_topk_prob``, times ``routed_scaling_factor`` (the core ``SigmoidGroupedTopKRouter``
with one group and ``norm_eps``), over routed SwiGLU experts.
"""

from __future__ import annotations

from dataclasses import dataclass

from colibri_core.errors import ModelFormatError
from colibri_core.model.config import ModelArgs, bounded
from colibri_core.model.family import Family
from colibri_core.nn import Attention, GatedShortConv, SigmoidGroupedTopKRouter, SparseMoE, SwiGLU, build_rope
from colibri_core.nn.assembly import Names, build_decoder

ROPE_THETA = 1_000_000.0  # transformers' default_theta for a config spelling none
LAYER_TYPES = ("conv", "full_attention")
ROUTER_NORM_EPS = 1e-6  # what LFM2's router adds to the sum of the chosen scores


@dataclass
class Lfm2MoeArgs(ModelArgs):
    """config.json's fields (transformers' Lfm2MoeConfig defaults)."""

    vocab_size: int = 65536
    hidden_size: int = 2048
    intermediate_size: int = 7168
    moe_intermediate_size: int = 1792
    num_hidden_layers: int = 32
    num_attention_heads: int = 32
    num_key_value_heads: int = 8
    head_dim: int | None = None
    max_position_embeddings: int = 128_000
    norm_eps: float = bounded(0.0, 1.0, default=1e-5)
    tie_word_embeddings: bool = True
    conv_bias: bool = False
    conv_L_cache: int = bounded(1, 1 << 10, default=3)
    num_dense_layers: int = bounded(0, 1 << 10, default=2)
    num_experts: int = bounded(1, 1 << 14, default=32)
    num_experts_per_tok: int = 4
    use_expert_bias: bool = True
    routed_scaling_factor: float = bounded(0.0, 1e6, default=1.0)
    norm_topk_prob: bool = True
    layer_types: list | None = None

    @property
    def rms_norm_eps(self) -> float:  # what build_decoder reads
        return self.norm_eps

    def validate(self, source):
        self.default_head_dim(source)
        self.require_multiple(source, "num_attention_heads", "num_key_value_heads")
        self.require_at_most(source, "num_experts_per_tok", "num_experts")
        n = self.num_hidden_layers
        if self.layer_types is None or len(self.layer_types) != n or not set(self.layer_types) <= set(LAYER_TYPES):
            raise ModelFormatError(f"{source}: layer_types must give one of {LAYER_TYPES} for each of the {n} layers, "
                                   f"got {self.layer_types!r}")


def conv_filters(w):
    """Load transform: a Conv1d weight (C, 1, K) as (C, K)."""
    return w.reshape(w.shape[0], w.shape[-1]).copy()


class Lfm2Moe(Family):
    name = "lfm2_moe"

    @staticmethod
    def parse(config: dict, source: str = "config.json") -> Lfm2MoeArgs:
        raw = dict(config)
        if "tie_embedding" in raw:  # LFM2's own spelling, which transformers reads first
            raw["tie_word_embeddings"] = raw["tie_embedding"]
        return Lfm2MoeArgs.from_dict(raw, source)

    def build(self, config, w):
        src = w.config_source
        a = self.parse(config, src)
        hidden, heads, kv_heads, d, eps = a.hidden_size, a.num_attention_heads, a.num_key_value_heads, a.head_dim, a.norm_eps
        rope = build_rope({"rope_theta": ROPE_THETA, **config}, d, src, whole_heads="lfm2_moe")

        def mixer(i, p):
            if a.layer_types[i] == "conv":
                s, bias = f"{p}.conv", a.conv_bias
                return GatedShortConv(
                    i, w.linear(f"{s}.in_proj", 3 * hidden, hidden, bias=bias),
                    w.param(f"{s}.conv.weight", (hidden, 1, a.conv_L_cache), conv_filters),
                    w.linear(f"{s}.out_proj", hidden, hidden, bias=bias),
                    bias=w.param(f"{s}.conv.bias", (hidden,)) if bias else None)
            s = f"{p}.self_attn"
            return Attention(layer=i, q=w.linear(f"{s}.q_proj", heads * d, hidden), k=w.linear(f"{s}.k_proj", kv_heads * d, hidden),
                             v=w.linear(f"{s}.v_proj", kv_heads * d, hidden), o=w.linear(f"{s}.out_proj", hidden, heads * d),
                             n_heads=heads, n_kv_heads=kv_heads, head_dim=d, rope=rope,
                             q_norm=w.rms_norm(f"{s}.q_layernorm", d, eps), k_norm=w.rms_norm(f"{s}.k_layernorm", d, eps),
                             qk_norm_per_head=True)

        def mlp(i, p):
            p = f"{p}.feed_forward"
            if i < a.num_dense_layers:
                inner = a.intermediate_size
                return SwiGLU(w.linear(f"{p}.w1", inner, hidden), w.linear(f"{p}.w3", inner, hidden),
                              w.linear(f"{p}.w2", hidden, inner))
            n = a.num_experts
            router = SigmoidGroupedTopKRouter(
                w.linear(f"{p}.gate", n, hidden), a.num_experts_per_tok,
                bias=w.param(f"{p}.expert_bias", (n,)) if a.use_expert_bias else None, norm_topk_prob=a.norm_topk_prob,
                routed_scaling_factor=a.routed_scaling_factor, norm_eps=ROUTER_NORM_EPS)
            return SparseMoE(router, w.swiglu_experts(i, f"{p}.experts", n, hidden, a.moe_intermediate_size))

        return build_decoder(a, w, mixer, mlp, Names(norm="embedding_norm"), norm_names=("operator_norm", "ffn_norm"))
