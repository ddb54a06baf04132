"""DeepSeek-V3 and V3.2 on colibri's shared blocks (transformers: models/deepseek_v3,
models/deepseek_v32). MLA, the DSA indexer, the sigmoid grouped router and the fp8
format are colibri_core blocks; this file only declares the weights and wires them."""

from __future__ import annotations

from dataclasses import dataclass

from colibri_core.config import ModelArgs, bounded
from colibri_core.errors import ModelFormatError, UnsupportedModelError
from colibri_core.family import Family
from colibri_core.nn import (
    CausalLM, DecoderLayer, Embedding, LayerNorm, LightningIndexer, Linear, MLAttention, RoutedExperts,
    SigmoidGroupedTopKRouter, SparseMoE, SwiGLU, build_rope, mla_softmax_scale,
)

LATENT_NORM_EPS = 1e-6  # q_a_layernorm / kv_a_layernorm / indexer k_norm use the default eps, not rms_norm_eps


@dataclass
class DeepseekV3Args(ModelArgs):
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    moe_intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    n_routed_experts: int = bounded(1, 1 << 14)
    kv_lora_rank: int = bounded(1, 1 << 14)
    qk_rope_head_dim: int = bounded(2, 1 << 12)
    qk_nope_head_dim: int = bounded(1, 1 << 12)
    v_head_dim: int = bounded(1, 1 << 12)
    num_experts_per_tok: int = 8
    q_lora_rank: int | None = bounded(1, 1 << 16, default=None)
    num_key_value_heads: int | None = None
    n_shared_experts: int = bounded(0, 1 << 8, default=1)
    n_group: int = bounded(1, 1 << 10, default=8)
    topk_group: int = bounded(1, 1 << 10, default=4)
    routed_scaling_factor: float = bounded(0.0, 1e6, default=2.5)
    norm_topk_prob: bool = True
    first_k_dense_replace: int = bounded(0, 1 << 10, default=3)
    mlp_layer_types: list | None = None
    rope_interleave: bool = True
    attention_bias: bool = False
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 4096
    rms_norm_eps: float = 1e-6
    hidden_act: str = "silu"
    scoring_func: str = "sigmoid"
    topk_method: str = "noaux_tc"
    moe_layer_freq: int = 1

    def validate(self, source):
        heads = self.num_attention_heads
        if self.num_key_value_heads not in (None, heads):
            raise ModelFormatError(f"{source}: MLA expands the latent into all {heads} heads; num_key_value_heads "
                                   f"{self.num_key_value_heads} must equal num_attention_heads")
        if self.hidden_act != "silu":
            raise UnsupportedModelError(f"{source}: hidden_act {self.hidden_act!r} is not supported (only 'silu')")
        if self.scoring_func != "sigmoid" or self.topk_method != "noaux_tc":
            raise UnsupportedModelError(
                f"{source}: router scoring_func {self.scoring_func!r} / topk_method {self.topk_method!r} is not supported; "
                "only DeepSeek-V3's sigmoid 'noaux_tc' router is (DeepSeek-V2's softmax routers are not)")
        if self.moe_layer_freq != 1:
            raise UnsupportedModelError(f"{source}: moe_layer_freq {self.moe_layer_freq} is not supported (only 1)")
        experts, group = self.n_routed_experts, self.n_group
        if experts % group:
            raise ModelFormatError(f"{source}: n_routed_experts {experts} is not divisible by n_group {group}")
        if self.topk_group > group:
            raise ModelFormatError(f"{source}: topk_group {self.topk_group} exceeds n_group {group}")
        if group > 1 and experts // group < 2:
            raise ModelFormatError(f"{source}: groups of one expert cannot be scored (n_routed_experts {experts}, n_group {group})")
        if not 1 <= self.num_experts_per_tok <= self.topk_group * (experts // group):
            raise ModelFormatError(f"{source}: num_experts_per_tok {self.num_experts_per_tok} must be within 1.."
                                   f"{self.topk_group * (experts // group)} (the experts of topk_group groups)")
        kinds = self.mlp_layer_types
        if kinds is not None and (len(kinds) != self.num_hidden_layers or not set(kinds) <= {"dense", "sparse"}):
            raise ModelFormatError(f"{source}: mlp_layer_types must list 'dense' or 'sparse' for each of the "
                                   f"{self.num_hidden_layers} layers, got {kinds!r}")

    def is_moe(self, layer: int) -> bool:
        return layer >= self.first_k_dense_replace


@dataclass
class DeepseekV32Args(DeepseekV3Args):
    index_topk: int = bounded(1, 1 << 24, default=2048)
    index_head_dim: int = bounded(1, 1 << 12, default=128)
    index_n_heads: int = bounded(1, 1 << 10, default=64)

    def validate(self, source):
        super().validate(source)
        if self.q_lora_rank is None:
            raise ModelFormatError(f"{source}: DeepSeek-V3.2 needs q_lora_rank (its indexer reads the q LoRA activation)")
        if self.qk_rope_head_dim > self.index_head_dim:
            raise ModelFormatError(f"{source}: qk_rope_head_dim {self.qk_rope_head_dim} exceeds index_head_dim {self.index_head_dim}")

    def is_moe(self, layer: int) -> bool:
        if self.mlp_layer_types is not None:
            return self.mlp_layer_types[layer] == "sparse"
        return layer >= min(self.first_k_dense_replace, self.num_hidden_layers)


@dataclass(frozen=True)
class Names:
    """Where the text model's tensors live: DeepSeek's own checkpoints use the defaults;
    wrappers (Kimi K2.5: ``language_model.model.``) prefix them."""

    model: str = "model."
    layers: str = "layers"
    lm_head: str = "lm_head"


def build_deepseek(a: DeepseekV3Args, config: dict, w, names: Names = Names(), *, interleave: bool | None = None,
                   lm_class=CausalLM, **lm_kwargs):
    """The DeepSeek-V3 text model (also V3.2 when ``a`` has index fields, and Kimi K2)."""
    src = w.config_source
    hidden, heads = a.hidden_size, a.num_attention_heads
    dn, dr, dv, rank = a.qk_nope_head_dim, a.qk_rope_head_dim, a.v_head_dim, a.kv_lora_rank
    rope = build_rope(config, dr, src)
    scale = mla_softmax_scale(config, dn + dr, src)
    interleave = a.rope_interleave if interleave is None else interleave
    dsa = isinstance(a, DeepseekV32Args)
    layers = []
    for i in range(a.num_hidden_layers):  # MTP layers (index >= num_hidden_layers) are never declared
        p = f"{names.model}{names.layers}.{i}"
        s = f"{p}.self_attn"
        bias = a.attention_bias
        if a.q_lora_rank is None:
            q = dict(q=w.linear(f"{s}.q_proj", heads * (dn + dr), hidden))
        else:
            q = dict(q_a=w.linear(f"{s}.q_a_proj", a.q_lora_rank, hidden, bias=bias),
                     q_a_norm=w.rms_norm(f"{s}.q_a_layernorm", a.q_lora_rank, LATENT_NORM_EPS),
                     q_b=w.linear(f"{s}.q_b_proj", heads * (dn + dr), a.q_lora_rank))
        indexer = None
        if dsa:
            x = f"{s}.indexer"
            d = a.index_head_dim
            indexer = LightningIndexer(
                wq_b=w.linear(f"{x}.wq_b", a.index_n_heads * d, a.q_lora_rank), wk=w.linear(f"{x}.wk", d, hidden),
                k_norm=LayerNorm(w.param(f"{x}.k_norm.weight", (d,)), w.param(f"{x}.k_norm.bias", (d,)), LATENT_NORM_EPS),
                weights_proj=w.linear(f"{x}.weights_proj", a.index_n_heads, hidden), n_heads=a.index_n_heads,
                head_dim=d, rope_dim=dr, rope=rope, topk=a.index_topk, rope_interleave=False)
        attn = MLAttention(
            layer=i, **q,
            kv_a=w.linear(f"{s}.kv_a_proj_with_mqa", rank + dr, hidden, bias=bias),
            kv_a_norm=w.rms_norm(f"{s}.kv_a_layernorm", rank, LATENT_NORM_EPS),
            kv_b=w.linear(f"{s}.kv_b_proj", heads * (dn + dv), rank),
            o=w.linear(f"{s}.o_proj", hidden, heads * dv, bias=bias),
            n_heads=heads, kv_lora_rank=rank, nope_dim=dn, rope_dim=dr, v_dim=dv, rope=rope, scale=scale,
            rope_interleave=interleave, indexer=indexer,
        )
        layers.append(DecoderLayer(w.rms_norm(f"{p}.input_layernorm", hidden, a.rms_norm_eps), attn,
                                   w.rms_norm(f"{p}.post_attention_layernorm", hidden, a.rms_norm_eps),
                                   _moe(a, w, i, f"{p}.mlp") if a.is_moe(i) else _mlp(w, f"{p}.mlp", a.intermediate_size, hidden)))
    embed = Embedding(w.param(f"{names.model}embed_tokens.weight", (a.vocab_size, hidden)))
    lm_head = Linear(embed.weight) if a.tie_word_embeddings else w.linear(names.lm_head, a.vocab_size, hidden)
    return lm_class(embed=embed, layers=layers, norm=w.rms_norm(f"{names.model}norm", hidden, a.rms_norm_eps),
                    lm_head=lm_head, vocab_size=a.vocab_size, max_context=a.max_position_embeddings, **lm_kwargs)


def _mlp(w, p: str, inner: int, hidden: int) -> SwiGLU:
    return SwiGLU(w.linear(f"{p}.gate_proj", inner, hidden), w.linear(f"{p}.up_proj", inner, hidden),
                  w.linear(f"{p}.down_proj", hidden, inner))


def _moe(a: DeepseekV3Args, w, layer: int, p: str) -> SparseMoE:
    hidden, inner, n = a.hidden_size, a.moe_intermediate_size, a.n_routed_experts
    experts = w.expert_layer(layer, n, {
        "gate": (f"{p}.experts.{{e}}.gate_proj.weight", (inner, hidden)),
        "up": (f"{p}.experts.{{e}}.up_proj.weight", (inner, hidden)),
        "down": (f"{p}.experts.{{e}}.down_proj.weight", (hidden, inner)),
    })
    router = SigmoidGroupedTopKRouter(
        w.linear(f"{p}.gate", n, hidden), a.num_experts_per_tok, bias=w.optional(f"{p}.gate.e_score_correction_bias", (n,)),
        n_group=a.n_group, topk_group=a.topk_group, norm_topk_prob=a.norm_topk_prob,
        routed_scaling_factor=a.routed_scaling_factor)
    shared = _mlp(w, f"{p}.shared_experts", inner * a.n_shared_experts, hidden) if a.n_shared_experts else None
    return SparseMoE(router, RoutedExperts(experts), shared=shared)


class DeepseekV3(Family):
    name = "deepseek-v3"

    def build(self, config, w):
        return build_deepseek(DeepseekV3Args.from_dict(config, w.config_source), config, w)


class DeepseekV32(Family):
    name = "deepseek-v32"

    def build(self, config, w):
        # V3.2's MLA always uses interleaved rope (transformers has no rope_interleave for it);
        # its indexer uses the half-split layout.
        return build_deepseek(DeepseekV32Args.from_dict(config, w.config_source), config, w, interleave=True)
