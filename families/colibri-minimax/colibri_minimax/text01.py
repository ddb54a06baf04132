"""MiniMax-Text-01 / MiniMax-M1 on colibri's shared blocks (transformers: models/minimax).

Layers of two kinds, as ``layer_types`` lists them: lightning attention (linear attention
with a fixed exponential decay per head, ``nn.LightningAttention``) and grouped-query
softmax attention with RoPE on whole heads; a MoE in every layer (softmax router, top
``num_experts_per_tok`` renormalised, SwiGLU experts). The residual of each branch is its
normalised input, both scaled: h = a * norm(x) + b * mixer(norm(x)), then
a' * norm(h) + b' * moe(norm(h)) (``full_attn_alpha/beta_factor`` or
``linear_attn_alpha/beta_factor`` for the mixer by its kind, ``mlp_alpha/beta_factor``).
Checkpoints name the MoE as published and saved (``block_sparse_moe``: ``gate``, per-expert
``w1``/``w3``/``w2``) or as transformers keeps it in memory (``mlp``, fused experts).
"""

from __future__ import annotations

from dataclasses import dataclass

from colibri_core.errors import ModelFormatError, UnsupportedModelError
from colibri_core.model.config import ModelArgs, bounded
from colibri_core.model.family import Family
from colibri_core.nn import (Attention, DecoderLayer, LightningAttention, SoftmaxTopKRouter, SparseMoE, build_rope,
                             lightning_slopes)
from colibri_core.nn.assembly import build_decoder

ROPE_THETA = 1000000.0  # transformers' default_theta for a config spelling none
LINEAR, FULL = "linear_attention", "full_attention"
# MiniMax's own config keys (its remote code) and the field transformers reads instead
OWN_KEYS = {"layernorm_full_attention_alpha": "full_attn_alpha_factor",
            "layernorm_full_attention_beta": "full_attn_beta_factor",
            "layernorm_linear_attention_alpha": "linear_attn_alpha_factor",
            "layernorm_linear_attention_beta": "linear_attn_beta_factor",
            "layernorm_mlp_alpha": "mlp_alpha_factor", "layernorm_mlp_beta": "mlp_beta_factor"}


@dataclass
class MiniMaxArgs(ModelArgs):
    """config.json's fields (transformers' MiniMaxConfig defaults). ``intermediate_size``
    is each expert's; ``layer_types`` defaults to transformers' alternation (full
    attention at even layers)."""

    vocab_size: int = 32000
    hidden_size: int = 4096
    intermediate_size: int = 14336
    num_hidden_layers: int = 32
    num_attention_heads: int = 32
    num_key_value_heads: int = 8
    head_dim: int | None = None
    max_position_embeddings: int = 4096 * 32
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    num_local_experts: int = bounded(1, 1 << 14, default=8)
    num_experts_per_tok: int = 2
    hidden_act: str = "silu"
    sliding_window: int | None = None
    layer_types: list | None = None
    block_size: int = bounded(1, 1 << 16, default=256)
    full_attn_alpha_factor: float = 1.0
    full_attn_beta_factor: float = 1.0
    linear_attn_alpha_factor: float = 1.0
    linear_attn_beta_factor: float = 1.0
    mlp_alpha_factor: float = 1.0
    mlp_beta_factor: float = 1.0
    attn_type_list: list | None = None
    rotary_dim: int | None = None
    shared_intermediate_size: int | None = None
    postnorm: bool | None = None

    @classmethod
    def from_dict(cls, raw, source="config.json"):
        a = super().from_dict(raw, source)
        for own, theirs in OWN_KEYS.items():  # MiniMax's spelling, which transformers does not read
            value = raw.get(own)
            if value is not None and value != getattr(a, theirs):
                raise UnsupportedModelError(f"{source}: {own} {value!r} differs from {theirs} {getattr(a, theirs)!r}, "
                                            f"the field transformers' MiniMax reads (give {theirs})")
        return a

    def validate(self, source):
        self.default_head_dim(source)
        self.require_multiple(source, "num_attention_heads", "num_key_value_heads")
        self.require_at_most(source, "num_experts_per_tok", "num_local_experts")
        if self.hidden_act != "silu":
            raise UnsupportedModelError(f"{source}: hidden_act {self.hidden_act!r} is not supported by the "
                                        "minimax family (only 'silu')")
        if self.sliding_window is not None:
            raise UnsupportedModelError(f"{source}: sliding_window {self.sliding_window} is not supported by the "
                                        "minimax family (whole-sequence softmax attention only)")
        if self.layer_types is None:
            self.layer_types = [FULL if (i + 1) % 2 else LINEAR for i in range(self.num_hidden_layers)]
        if len(self.layer_types) != self.num_hidden_layers or any(t not in (LINEAR, FULL) for t in self.layer_types):
            raise ModelFormatError(f"{source}: layer_types must list {self.num_hidden_layers} of "
                                   f"{LINEAR!r} / {FULL!r}, got {self.layer_types!r}")
        if self.attn_type_list is not None and [FULL if t else LINEAR for t in self.attn_type_list] != self.layer_types:
            raise UnsupportedModelError(f"{source}: attn_type_list (MiniMax's own, 1 = softmax) disagrees with "
                                        "layer_types, which transformers reads (give layer_types)")
        if self.rotary_dim is not None and self.rotary_dim != self.head_dim:
            raise UnsupportedModelError(f"{source}: rotary_dim {self.rotary_dim} (a partial rotary) is not supported: "
                                        "transformers' MiniMax ignores it and rotates whole heads, MiniMax's own code "
                                        "rotates rotary_dim features of each head")
        if self.shared_intermediate_size:
            raise UnsupportedModelError(f"{source}: shared_intermediate_size {self.shared_intermediate_size} (shared "
                                        "experts) is not supported by the minimax family")
        if self.postnorm is False:
            raise UnsupportedModelError(f"{source}: postnorm false is not supported: transformers' MiniMax takes "
                                        "each residual from the normalised input")


class NormResidualLayer(DecoderLayer):
    """MiniMax's layer: the residual of each branch is the branch's normalised input, both
    scaled: h = attn_scales[0] * n + attn_scales[1] * attn(n), n = attn_norm(x); then
    mlp_scales[0] * m + mlp_scales[1] * mlp(m), m = mlp_norm(h)."""

    def __init__(self, attn_norm, attn, mlp_norm, mlp, attn_scales: tuple[float, float],
                 mlp_scales: tuple[float, float]):
        super().__init__(attn_norm, attn, mlp_norm, mlp)
        self.attn_scales, self.mlp_scales = attn_scales, mlp_scales

    def __call__(self, x, step):
        normed = self.attn_norm(x, step)
        h = _scaled_sum(normed, self.mix_normed(normed, step), self.attn_scales)
        if step.prefetcher is not None:
            step.prefetcher.after_attention(self, h, step)
        normed = self.mlp_norm(h, step)
        return _scaled_sum(normed, self.mlp(normed, step), self.mlp_scales)


def _scaled_sum(residual, branch, scales):
    a, b = scales
    return (residual if a == 1.0 else residual * a) + (branch if b == 1.0 else branch * b)


class MiniMax(Family):
    name = "minimax"

    def build(self, config, w):
        src = w.config_source
        a = MiniMaxArgs.from_dict(config, src)
        if w.mtp_layers:
            raise UnsupportedModelError(f"{src}: MiniMax has no multi-token-prediction layers to load")
        hidden, heads, kv_heads, d = a.hidden_size, a.num_attention_heads, a.num_key_value_heads, a.head_dim
        rope = build_rope({"rope_theta": ROPE_THETA, **config}, d, src, whole_heads="minimax")

        def mixer(i, p):
            s = f"{p}.self_attn"
            if a.layer_types[i] == FULL:
                return Attention(layer=i, **w.attention_projections(s, hidden, heads, kv_heads, d),
                                 n_heads=heads, n_kv_heads=kv_heads, head_dim=d, rope=rope)
            inner = heads * d
            return LightningAttention(layer=i, qkv_proj=w.linear(f"{s}.qkv_proj", 3 * inner, hidden),
                                      output_gate=w.linear(f"{s}.output_gate", inner, hidden),
                                      norm=w.rms_norm(f"{s}.norm", inner, 1e-6), out_proj=w.linear(f"{s}.out_proj", hidden, inner),
                                      slopes=lightning_slopes(heads, i, a.num_hidden_layers), n_heads=heads, head_dim=d,
                                      block_size=a.block_size)

        def moe(i, p):
            # published (and saved) as block_sparse_moe; transformers 5's in-memory name is mlp
            s = f"{p}.block_sparse_moe" if w.has(f"{p}.block_sparse_moe.gate.weight") else f"{p}.mlp"
            n = a.num_local_experts
            router = SoftmaxTopKRouter(w.linear(f"{s}.gate", n, hidden), a.num_experts_per_tok, norm_topk_prob=True)
            return SparseMoE(router, w.swiglu_experts(i, f"{s}.experts", n, hidden, a.intermediate_size))

        lm = build_decoder(a, w, mixer, moe)
        scales = {FULL: (a.full_attn_alpha_factor, a.full_attn_beta_factor),
                  LINEAR: (a.linear_attn_alpha_factor, a.linear_attn_beta_factor)}
        mlp_scales = (a.mlp_alpha_factor, a.mlp_beta_factor)
        lm.layers = [NormResidualLayer(layer.attn_norm, layer.attn, layer.mlp_norm, layer.mlp, scales[kind], mlp_scales)
                     for layer, kind in zip(lm.layers, a.layer_types)]
        return lm
