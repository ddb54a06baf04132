"""AFMoE on colibri's shared blocks (transformers: models/afmoe).

Each layer normalises both branches before and after: x + norm(attn(norm(x))), then
h + norm(mlp(norm(h))) (``build_decoder``'s ``post``, with the MLP's pre-norm named
``pre_mlp_layernorm``: ``norm_names``). The attention is grouped-query with per-head q/k
RMSNorm before RoPE and an output gate of its own projection (``gate_proj``: the output
times sigmoid(gate_proj(x)) before o_proj, ``Attention``'s ``gate``); the layers
``layer_types`` marks "sliding_attention" see the last ``sliding_window`` positions and
rotate q and k, the global ones use no position embedding (NoPE). The first
``num_dense_layers`` layers have a dense SwiGLU, the others a MoE: sigmoid scores, the
top ``num_experts_per_tok`` chosen on the scores plus ``expert_bias``, weighted by their
scores renormalised, times ``route_scale`` (the core ``SigmoidGroupedTopKRouter`` with one
group), over routed SwiGLU experts, plus ``num_shared_experts`` shared experts. With
``mup_enabled`` the embeddings are multiplied by sqrt(hidden_size).
"""

from __future__ import annotations

from dataclasses import dataclass

from colibri_core.errors import ModelFormatError, UnsupportedModelError
from colibri_core.model.config import ModelArgs, bounded
from colibri_core.model.family import Family
from colibri_core.nn import Attention, SigmoidGroupedTopKRouter, SparseMoE, build_rope
from colibri_core.nn.assembly import build_decoder

LAYER_TYPES = ("full_attention", "sliding_attention")
# transformers' defaults where config.json spells none (an explicit null means something else)
DEFAULTS = {"sliding_window": 1024, "global_attn_every_n_layers": 4}


@dataclass
class AfmoeArgs(ModelArgs):
    """config.json's fields (transformers' AfmoeConfig defaults; see ``Afmoe.parse`` for
    the fields whose null is not their default)."""

    vocab_size: int = 200192
    hidden_size: int = 2048
    intermediate_size: int = 6144
    moe_intermediate_size: int = 1408
    num_hidden_layers: int = 32
    num_dense_layers: int = bounded(0, 1 << 10, default=1)
    num_attention_heads: int = 16
    num_key_value_heads: int | None = None
    head_dim: int = 128
    hidden_act: str = "silu"
    max_position_embeddings: int = 16384
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    num_experts: int = bounded(1, 1 << 14, default=64)
    num_experts_per_tok: int = 6
    num_shared_experts: int = bounded(0, 1 << 8, default=2)
    route_scale: float = bounded(0.0, 1e6, default=1.0)
    global_attn_every_n_layers: int | None = bounded(1, 1 << 10, default=None)
    sliding_window: int | None = bounded(1, 1 << 24, default=None)
    layer_types: list | None = None
    mup_enabled: bool = False
    attention_bias: bool = False

    def validate(self, source):
        self.num_key_value_heads = self.num_key_value_heads or self.num_attention_heads
        self.require_multiple(source, "num_attention_heads", "num_key_value_heads")
        self.require_at_most(source, "num_experts_per_tok", "num_experts")
        if self.hidden_act != "silu":
            raise UnsupportedModelError(f"{source}: hidden_act {self.hidden_act!r} is not supported by the "
                                        "afmoe family (only 'silu')")
        n = self.num_hidden_layers
        if self.layer_types is None:  # transformers: every global_attn_every_n_layers-th layer global
            if self.global_attn_every_n_layers is None:
                raise ModelFormatError(f"{source}: without layer_types, global_attn_every_n_layers must be a number "
                                       "of layers, got None")
            self.layer_types = ["sliding_attention" if (i + 1) % self.global_attn_every_n_layers else "full_attention"
                                for i in range(n)]
        elif len(self.layer_types) != n or not set(self.layer_types) <= set(LAYER_TYPES):
            raise ModelFormatError(f"{source}: layer_types must give one of {LAYER_TYPES} for each of the {n} layers, "
                                   f"got {self.layer_types!r}")
        if "sliding_attention" in self.layer_types and self.sliding_window is None:
            raise ModelFormatError(f"{source}: layer_types has sliding_attention layers but sliding_window is null")

    def sliding(self, layer: int) -> bool:
        return self.layer_types[layer] == "sliding_attention"


class Afmoe(Family):
    name = "afmoe"

    @staticmethod
    def parse(config: dict, source: str = "config.json") -> AfmoeArgs:
        if "head_dim" in config and config["head_dim"] is None:  # not "the default": transformers' attention fails on it
            raise ModelFormatError(f"{source}: field 'head_dim' must be int, got None")
        return AfmoeArgs.from_dict({**DEFAULTS, **config}, source)

    def build(self, config, w):
        src = w.config_source
        a = self.parse(config, src)
        hidden, heads, kv_heads, d, eps = a.hidden_size, a.num_attention_heads, a.num_key_value_heads, a.head_dim, a.rms_norm_eps
        rope = build_rope(config, d, src, whole_heads="afmoe")

        def attention(i, p):
            s = f"{p}.self_attn"
            sliding = a.sliding(i)
            return Attention(
                layer=i, **w.attention_projections(s, hidden, heads, kv_heads, d, qkv_bias=a.attention_bias,
                                                   o_bias=a.attention_bias),
                n_heads=heads, n_kv_heads=kv_heads, head_dim=d, rope=rope if sliding else None,  # global layers: NoPE
                q_norm=w.rms_norm(f"{s}.q_norm", d, eps), k_norm=w.rms_norm(f"{s}.k_norm", d, eps), qk_norm_per_head=True,
                window=a.sliding_window if sliding else None, gate=w.linear(f"{s}.gate_proj", heads * d, hidden))

        def mlp(i, p):
            p = f"{p}.mlp"
            if i < a.num_dense_layers:
                return w.swiglu(p, hidden, a.intermediate_size)
            n, inner = a.num_experts, a.moe_intermediate_size
            router = SigmoidGroupedTopKRouter(w.linear(f"{p}.router.gate", n, hidden), a.num_experts_per_tok,
                                              bias=w.param(f"{p}.expert_bias", (n,)), norm_topk_prob=True,
                                              routed_scaling_factor=a.route_scale)
            shared = w.swiglu(f"{p}.shared_experts", hidden, inner * a.num_shared_experts) if a.num_shared_experts else None
            return SparseMoE(router, w.swiglu_experts(i, f"{p}.experts", n, hidden, inner), shared=shared)

        def post(i, p):  # the branches' outputs normalised before the residual
            return w.rms_norm(f"{p}.post_attention_layernorm", hidden, eps), w.rms_norm(f"{p}.post_mlp_layernorm", hidden, eps)

        return build_decoder(a, w, attention, mlp, post=post, norm_names=("input_layernorm", "pre_mlp_layernorm"),
                             embed_scale=hidden**0.5 if a.mup_enabled else 1.0)
