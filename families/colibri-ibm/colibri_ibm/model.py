"""Granite MoE on colibri's shared blocks (transformers: models/granitemoe and
models/granitemoeshared).

Mixtral's skeleton with Granite's muP multipliers: the embeddings times
``embedding_multiplier``, attention scaled by ``attention_multiplier`` (not 1/sqrt(d)),
each branch times ``residual_multiplier`` before it joins the residual, the logits divided
by ``logits_scaling``. The router takes the softmax of the top-k logits (the renormalised
top-k of the softmax). Experts are fused: ``block_sparse_moe.input_linear`` (E, 2I, H;
gate rows first) and ``output_linear`` (E, H, I) as published and saved, or transformers'
in-memory ``experts.gate_up_proj`` / ``down_proj``; granitemoeshared adds a dense shared
SwiGLU, ``shared_mlp.input_linear`` (2S, H) / ``output_linear``, to the routed sum.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from colibri_core.errors import UnsupportedModelError
from colibri_core.model.config import ModelArgs, bounded
from colibri_core.model.family import Family
from colibri_core.nn import Attention, Linear, RoutedExperts, SoftmaxTopKRouter, SparseMoE, SwiGLU, build_rope
from colibri_core.nn.assembly import build_decoder


@dataclass
class GraniteMoeArgs(ModelArgs):
    """config.json's fields (transformers' GraniteMoeConfig / GraniteMoeSharedConfig defaults)."""

    vocab_size: int = 32000
    hidden_size: int = 4096
    intermediate_size: int = 11008
    num_hidden_layers: int = 32
    num_attention_heads: int = 32
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    num_local_experts: int = bounded(1, 1 << 14, default=8)
    num_experts_per_tok: int = 2
    shared_intermediate_size: int = bounded(0, 1 << 19, default=0)
    max_position_embeddings: int = 2048
    rms_norm_eps: float = 1e-6
    attention_bias: bool = False
    embedding_multiplier: float = bounded(-1e6, 1e6, default=1.0)
    attention_multiplier: float = bounded(-1e6, 1e6, default=1.0)
    residual_multiplier: float = bounded(-1e6, 1e6, default=1.0)
    logits_scaling: float = bounded(1e-6, 1e6, default=1.0)
    tie_word_embeddings: bool = False
    hidden_act: str = "silu"

    def validate(self, source):
        self.num_key_value_heads = self.num_key_value_heads or self.num_attention_heads
        self.default_head_dim(source)
        self.require_multiple(source, "num_attention_heads", "num_key_value_heads")
        self.require_at_most(source, "num_experts_per_tok", "num_local_experts")
        if self.hidden_act != "silu":
            raise UnsupportedModelError(f"{source}: hidden_act {self.hidden_act!r} is not supported by the "
                                        "granitemoe families (only 'silu')")


class Scaled:
    """``attn_post`` / ``mlp_post``: a branch's output times ``residual_multiplier``."""

    def __init__(self, scale: float):
        self.scale = float(scale)

    def __call__(self, x, step):
        return x * self.scale


def half(i: int):
    """Load transform: half ``i`` (0: gate, 1: up) of a fused (2S, H) gate/up matrix's rows."""
    def rows(m):
        n = m.shape[0] // 2
        return np.ascontiguousarray(m[i * n:(i + 1) * n])

    return rows


class GraniteMoe(Family):
    name = "granitemoe"

    def build(self, config, w):
        a = GraniteMoeArgs.from_dict(config, w.config_source)
        hidden, heads, kv_heads, d = a.hidden_size, a.num_attention_heads, a.num_key_value_heads, a.head_dim
        inter, n = a.intermediate_size, a.num_local_experts
        rope = build_rope(config, d, w.config_source)

        def attention(i, p):
            b = a.attention_bias
            return Attention(layer=i, **w.attention_projections(f"{p}.self_attn", hidden, heads, kv_heads, d, qkv_bias=b,
                                                                o_bias=b),
                             n_heads=heads, n_kv_heads=kv_heads, head_dim=d, rope=rope, scale=a.attention_multiplier)

        def moe(i, p):
            s = f"{p}.block_sparse_moe"
            if w.has(f"{s}.router.layer.weight"):  # as published and saved
                gate, matrices = f"{s}.router.layer", {
                    "gate": (f"{s}.input_linear.weight", (inter, hidden), (0, 2)),
                    "up": (f"{s}.input_linear.weight", (inter, hidden), (1, 2)),
                    "down": (f"{s}.output_linear.weight", (hidden, inter))}
                experts = RoutedExperts(w.expert_layer(i, n, matrices))
            else:  # transformers' in-memory names
                gate, experts = f"{s}.router", w.swiglu_experts(i, f"{s}.experts", n, hidden, inter)
            # softmax(top-k logits) = the top-k of softmax(logits), renormalised
            router = SoftmaxTopKRouter(w.linear(gate, n, hidden), a.num_experts_per_tok, True)
            return SparseMoE(router, experts, shared=shared_mlp(f"{p}.shared_mlp"))

        def shared_mlp(s):
            # granitemoe has no shared expert whatever its config says (transformers ignores the key there)
            inner = 0 if config.get("model_type") == "granitemoe" else a.shared_intermediate_size
            if not inner:
                return None
            fused = f"{s}.input_linear.weight"  # gate rows, then up rows
            w.aliases.update({f"{s}.gate_proj.weight": fused, f"{s}.up_proj.weight": fused})
            gate, up = (Linear(w.param(f"{s}.{role}_proj.weight", (2 * inner, hidden), half(k)))
                        for k, role in enumerate(("gate", "up")))
            return SwiGLU(gate, up, w.linear(f"{s}.output_linear", hidden, inner))

        post = (Scaled(a.residual_multiplier),) * 2 if a.residual_multiplier != 1.0 else None
        return build_decoder(a, w, attention, moe, post=(lambda i, p: post) if post else None,
                             head_divisor=a.logits_scaling, embed_scale=a.embedding_multiplier)
