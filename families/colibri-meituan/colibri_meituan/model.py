"""LongCat-Flash on colibri's shared blocks (transformers: models/longcat_flash).

Each of the ``num_layers`` layers holds two attention sublayers, two dense MLPs and one
MoE, joined as transformers' LongcatFlashDecoderLayer joins them:

    h0 = x + mla0(input_layernorm.0(x));   n0 = post_attention_layernorm.0(h0)
    shortcut = moe(n0);                   h1 = h0 + mlps.0(n0)
    h2 = h1 + mla1(input_layernorm.1(h1))
    out = h2 + mlps.1(post_attention_layernorm.1(h2)) + shortcut

colibri runs them as two decoder layers (``lm.layers[2i]`` and ``[2i + 1]``, each with
its MLA cache, as transformers' cache numbers them): the first keeps the MoE's output
for the second (``Step.memo``). The attention is DeepSeek's multi-head latent attention
with a q LoRA (``q_a_proj`` -> ``q_a_layernorm`` -> ``q_b_proj``) and interleaved-pair
rotary features, its q scaled by sqrt(hidden_size / q_lora_rank) and its normed kv
latent by sqrt(hidden_size / kv_lora_rank) (folded into the two latent norms' weights,
which transformers leaves at eps 1e-6). The MoE's router (``router.classifier``) takes a
softmax over ``n_routed_experts + zero_expert_num`` slots, chooses the top ``moe_topk`` of
the probabilities plus ``e_score_correction_bias`` and weights them by their
probabilities (not renormalised) times ``routed_scaling_factor`` (the core
``SoftmaxGroupedTopKRouter``). The slots from ``n_routed_experts`` on are
zero-computation experts: the token itself times its weight (``SparseMoE``'s
``zero_experts``: never read, no cache slot; the routing statistics count the real
experts only). Checkpoints hold one tensor per expert, as published and as transformers
saves them (its ``gate_proj``/``up_proj`` for the zero experts' slots are never read).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from colibri_core.errors import ModelFormatError, UnsupportedModelError
from colibri_core.model.config import ModelArgs, bounded
from colibri_core.model.family import Family
from colibri_core.nn import (CausalLM, DecoderLayer, Embedding, Linear, MLAttention, RMSNorm, SoftmaxGroupedTopKRouter,
                             SparseMoE, build_rope, mla_softmax_scale)

ROPE_THETA = 10_000_000.0  # transformers' default_theta for a config spelling none
LATENT_NORM_EPS = 1e-6  # transformers builds q_a_layernorm and kv_a_layernorm with its RMSNorm's default
# transformers' attribute_map: these names set the field they stand for (and win over it)
ALIASES = {"num_local_experts": "n_routed_experts", "num_experts_per_tok": "moe_topk",
           "intermediate_size": "ffn_hidden_size", "moe_intermediate_size": "expert_ffn_hidden_size"}


@dataclass
class LongcatFlashArgs(ModelArgs):
    """config.json's fields (transformers' LongcatFlashConfig defaults)."""

    vocab_size: int = 131072
    hidden_size: int = 6144
    num_layers: int = bounded(1, 1 << 9, default=28)
    num_attention_heads: int = 64
    num_key_value_heads: int | None = None
    hidden_act: str = "silu"
    max_position_embeddings: int = 131072
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    ffn_hidden_size: int = bounded(1, 1 << 19, default=12288)
    q_lora_rank: int = bounded(1, 1 << 16, default=1536)
    kv_lora_rank: int = bounded(1, 1 << 14, default=512)
    qk_nope_head_dim: int = bounded(1, 1 << 12, default=128)
    qk_rope_head_dim: int = bounded(2, 1 << 12, default=64)
    head_dim: int = 64
    v_head_dim: int = bounded(1, 1 << 12, default=128)
    qk_head_dim: int | None = bounded(1, 1 << 13, default=None)
    moe_topk: int = bounded(1, 1 << 10, default=12)
    n_routed_experts: int = bounded(1, 1 << 14, default=512)
    zero_expert_num: int = bounded(0, 1 << 14, default=256)
    expert_ffn_hidden_size: int = bounded(1, 1 << 19, default=2048)
    routed_scaling_factor: float = bounded(0.0, 1e6, default=6.0)

    @property
    def num_hidden_layers(self) -> int:  # transformers: two attention sublayers per layer
        return 2 * self.num_layers

    def validate(self, source):
        heads = self.num_attention_heads
        if self.num_key_value_heads not in (None, heads):
            raise ModelFormatError(f"{source}: MLA expands the latent into all {heads} heads; num_key_value_heads "
                                   f"{self.num_key_value_heads} must equal num_attention_heads")
        qk = self.qk_nope_head_dim + self.qk_rope_head_dim
        if self.qk_head_dim is not None and self.qk_head_dim != qk:
            raise ModelFormatError(f"{source}: qk_head_dim {self.qk_head_dim} must be qk_nope_head_dim + "
                                   f"qk_rope_head_dim = {qk}")
        self.qk_head_dim = qk
        if self.head_dim != self.qk_rope_head_dim:  # transformers' rope tables are head_dim wide
            raise ModelFormatError(f"{source}: head_dim {self.head_dim} (the rotary width) must equal "
                                   f"qk_rope_head_dim {self.qk_rope_head_dim}")
        if self.qk_rope_head_dim % 2:
            raise ModelFormatError(f"{source}: qk_rope_head_dim {self.qk_rope_head_dim} must be even")
        slots = self.n_routed_experts + self.zero_expert_num
        if self.moe_topk > slots:
            raise ModelFormatError(f"{source}: moe_topk {self.moe_topk} exceeds the {slots} router slots "
                                   "(n_routed_experts + zero_expert_num)")
        if self.hidden_act != "silu":
            raise UnsupportedModelError(f"{source}: hidden_act {self.hidden_act!r} is not supported by the "
                                        "longcat_flash family (only 'silu')")


def _refuse_unless(config: dict, field: str, allowed, what: str, source: str) -> None:
    value = config.get(field)
    if value is not None and value not in allowed:
        raise UnsupportedModelError(f"{source}: {field} {value!r} is not supported by the longcat_flash family ({what})")


class LongcatFlash(Family):
    name = "longcat_flash"

    @staticmethod
    def parse(config: dict, source: str = "config.json") -> LongcatFlashArgs:
        raw = dict(config)
        for alias, field in ALIASES.items():
            if raw.get(alias) is not None:
                raw[field] = raw[alias]
        layers = raw.get("num_hidden_layers")
        if layers is not None:  # transformers' setter: num_layers = num_hidden_layers // 2
            if isinstance(layers, bool) or not isinstance(layers, int) or layers < 2 or layers % 2:
                raise ModelFormatError(f"{source}: field 'num_hidden_layers' must be an even int >= 2 (two "
                                       f"sublayers per layer), got {layers!r}")
            if raw.get("num_layers") not in (None, layers // 2):
                raise ModelFormatError(f"{source}: num_hidden_layers {layers} must be 2 x num_layers {raw['num_layers']}")
            raw["num_layers"] = layers // 2
        if "zero_expert_num" in raw and raw["zero_expert_num"] is None:  # not "the default": transformers refuses it
            raise ModelFormatError(f"{source}: field 'zero_expert_num' must be int, got None")
        a = LongcatFlashArgs.from_dict(raw, source)
        # fields of Meituan's own code for what transformers' model always does
        _refuse_unless(raw, "zero_expert_type", ("identity",), "its zero experts are identities", source)
        _refuse_unless(raw, "attention_method", ("MLA",), "its attention is MLA", source)
        _refuse_unless(raw, "mla_scale_q_lora", (True,), "its MLA scales the q LoRA", source)
        _refuse_unless(raw, "mla_scale_kv_lora", (True,), "its MLA scales the kv latent", source)
        _refuse_unless(raw, "router_bias", (False,), "transformers' router computes its logits without the bias",
                       source)
        return a

    def build(self, config, w):
        src = w.config_source
        a = self.parse(config, src)
        hidden, heads, eps = a.hidden_size, a.num_attention_heads, a.rms_norm_eps
        dn, dr, dv, rank, qrank = a.qk_nope_head_dim, a.qk_rope_head_dim, a.v_head_dim, a.kv_lora_rank, a.q_lora_rank
        full = {"rope_theta": ROPE_THETA, **config}
        rope = build_rope(full, dr, src)
        scale = mla_softmax_scale(full, a.qk_head_dim, src)
        bias = a.attention_bias

        def scaled_norm(name: str, dim: int, factor: float) -> RMSNorm:
            # norm(x) * w * factor: the LoRA scale folded into the norm's weight
            return RMSNorm(w.param(f"{name}.weight", (dim,), lambda v: v * np.float32(factor)), LATENT_NORM_EPS)

        def mla(layer: int, s: str) -> MLAttention:
            return MLAttention(
                layer=layer, q_a=w.linear(f"{s}.q_a_proj", qrank, hidden, bias=bias),
                q_a_norm=scaled_norm(f"{s}.q_a_layernorm", qrank, (hidden / qrank) ** 0.5),
                q_b=w.linear(f"{s}.q_b_proj", heads * (dn + dr), qrank),
                kv_a=w.linear(f"{s}.kv_a_proj_with_mqa", rank + dr, hidden, bias=bias),
                kv_a_norm=scaled_norm(f"{s}.kv_a_layernorm", rank, (hidden / rank) ** 0.5),
                kv_b=w.linear(f"{s}.kv_b_proj", heads * (dn + dv), rank),
                o=w.linear(f"{s}.o_proj", hidden, heads * dv, bias=bias),
                n_heads=heads, kv_lora_rank=rank, nope_dim=dn, rope_dim=dr, v_dim=dv, rope=rope, scale=scale,
                rope_interleave=True)

        def moe(layer: int, p: str) -> SparseMoE:
            n, zero = a.n_routed_experts, a.zero_expert_num
            slots = n + zero
            router = SoftmaxGroupedTopKRouter(w.linear(f"{p}.router.classifier", slots, hidden), a.moe_topk,
                                              routed_scaling_factor=a.routed_scaling_factor,
                                              bias=w.optional(f"{p}.router.e_score_correction_bias", (slots,)))
            experts = w.swiglu_experts(layer, f"{p}.experts", n, hidden, a.expert_ffn_hidden_size)
            return SparseMoE(router, experts, zero_experts=zero)

        def norm(name: str) -> RMSNorm:
            return w.rms_norm(name, hidden, eps)

        layers = []
        for i in range(a.num_layers):
            p = f"model.layers.{i}"
            key = ("longcat shortcut", i)
            first, second = 2 * i, 2 * i + 1
            layers.append(ShortcutLayer(norm(f"{p}.input_layernorm.0"), mla(first, f"{p}.self_attn.0"),
                                        norm(f"{p}.post_attention_layernorm.0"), moe(first, f"{p}.mlp"),
                                        w.swiglu(f"{p}.mlps.0", hidden, a.ffn_hidden_size), key))
            layers.append(JoinLayer(norm(f"{p}.input_layernorm.1"), mla(second, f"{p}.self_attn.1"),
                                    norm(f"{p}.post_attention_layernorm.1"),
                                    w.swiglu(f"{p}.mlps.1", hidden, a.ffn_hidden_size), key))
        embed = Embedding(w.param("model.embed_tokens.weight", (a.vocab_size, hidden)))
        lm_head = Linear(embed.weight) if a.tie_word_embeddings else w.linear("lm_head", a.vocab_size, hidden)
        return CausalLM(embed=embed, layers=layers, norm=norm("model.norm"), lm_head=lm_head, vocab_size=a.vocab_size,
                        max_context=a.max_position_embeddings)


class ShortcutLayer(DecoderLayer):
    """A layer's first half: h = x + attn(norm(x)), n = mlp_norm(h); the MoE of n (``mlp``)
    kept in ``Step.memo`` under ``key`` for the second half; returns h + dense(n)."""

    def __init__(self, attn_norm, attn, mlp_norm, moe, dense, key):
        super().__init__(attn_norm, attn, mlp_norm, moe)
        self.dense, self.key = dense, key

    def __call__(self, x, step):
        h = x + self.mix(x, step)
        if step.prefetcher is not None:
            step.prefetcher.after_attention(self, h, step)
        normed = self.mlp_norm(h, step)
        step.memo[self.key] = self.mlp(normed, step)
        return h + self.dense(normed, step)


class JoinLayer(DecoderLayer):
    """A layer's second half: h = x + attn(norm(x)); returns h + mlp(mlp_norm(h)) plus the
    first half's MoE output."""

    def __init__(self, attn_norm, attn, mlp_norm, mlp, key):
        super().__init__(attn_norm, attn, mlp_norm, mlp)
        self.key = key

    def __call__(self, x, step):
        h = x + self.mix(x, step)
        if step.prefetcher is not None:
            step.prefetcher.after_attention(self, h, step)
        return h + self.mlp(self.mlp_norm(h, step), step) + step.memo.pop(self.key)
