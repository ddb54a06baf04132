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

import math
from dataclasses import dataclass

import numpy as np

from colibri_core.errors import ModelFormatError, UnsupportedModelError
from colibri_core.model.builders import mamba2
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
        blocks = GraniteBlocks(a, w, config)
        return blocks.decoder(blocks.attention, lambda i, p: blocks.moe(i, p, blocks.shared_mlp(f"{p}.shared_mlp")))


class GraniteBlocks:
    """The blocks every Granite MoE model type declares the same way, and its assembly."""

    def __init__(self, a, w, config: dict, rope=True):
        self.a, self.w, self.config = a, w, config
        self.rope = build_rope(config, a.head_dim, w.config_source) if rope else None

    def attention(self, i, p):
        a, b = self.a, self.a.attention_bias
        return Attention(layer=i, **self.w.attention_projections(f"{p}.self_attn", a.hidden_size, a.num_attention_heads,
                                                                 a.num_key_value_heads, a.head_dim, qkv_bias=b, o_bias=b),
                         n_heads=a.num_attention_heads, n_kv_heads=a.num_key_value_heads, head_dim=a.head_dim,
                         rope=self.rope, scale=a.attention_multiplier)

    def moe(self, i, p, shared):
        w, hidden, inter, n = self.w, self.a.hidden_size, self.a.intermediate_size, self.a.num_local_experts
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
        router = SoftmaxTopKRouter(w.linear(gate, n, hidden), self.a.num_experts_per_tok, True)
        return SparseMoE(router, experts, shared=shared)

    def shared_mlp(self, s):
        # granitemoe has no shared expert whatever its config says (transformers ignores the key there)
        inner = 0 if self.config.get("model_type") == "granitemoe" else self.a.shared_intermediate_size
        if not inner:
            return None
        w, hidden = self.w, self.a.hidden_size
        fused = f"{s}.input_linear.weight"  # gate rows, then up rows
        w.aliases.update({f"{s}.gate_proj.weight": fused, f"{s}.up_proj.weight": fused})
        gate, up = (Linear(w.param(f"{s}.{role}_proj.weight", (2 * inner, hidden), half(k)))
                    for k, role in enumerate(("gate", "up")))
        return SwiGLU(gate, up, w.linear(f"{s}.output_linear", hidden, inner))

    def decoder(self, mixer, mlp):
        a = self.a
        post = (Scaled(a.residual_multiplier),) * 2 if a.residual_multiplier != 1.0 else None
        return build_decoder(a, self.w, mixer, mlp, post=(lambda i, p: post) if post else None,
                             head_divisor=a.logits_scaling, embed_scale=a.embedding_multiplier)


HYBRID_KINDS = {"linear_attention": "linear_attention", "mamba": "linear_attention", "full_attention": "full_attention",
                "attention": "full_attention"}  # transformers' remap_legacy_layer_types


@dataclass
class GraniteMoeHybridArgs(GraniteMoeArgs):
    """GraniteMoeHybridConfig's further fields (its defaults)."""

    shared_intermediate_size: int = bounded(1, 1 << 19, default=1024)
    position_embedding_type: str | None = None
    layer_types: list | None = None
    mamba_n_heads: int = bounded(1, 1 << 12, default=128)
    mamba_n_groups: int = bounded(1, 1 << 12, default=1)
    mamba_d_state: int = bounded(1, 1 << 12, default=256)
    mamba_d_head: int | str = "auto"
    mamba_d_conv: int = bounded(1, 1 << 10, default=4)
    mamba_expand: int = bounded(1, 1 << 6, default=2)
    mamba_chunk_size: int = bounded(1, 1 << 16, default=256)
    mamba_conv_bias: bool = True
    mamba_proj_bias: bool = False
    time_step_limit: list | None = None

    def validate(self, source):
        super().validate(source)
        n = self.num_hidden_layers
        kinds = ["linear_attention"] * n if self.layer_types is None else self.layer_types
        if len(kinds) != n or not all(isinstance(k, str) and k in HYBRID_KINDS for k in kinds):
            raise ModelFormatError(f"{source}: layer_types must give 'linear_attention' or 'full_attention' for each of "
                                   f"the {n} layers, got {self.layer_types!r}")
        self.layer_types = [HYBRID_KINDS[k] for k in kinds]
        if self.position_embedding_type not in (None, "nope", "rope"):  # transformers: RoPE if "rope", else none
            raise UnsupportedModelError(f"{source}: position_embedding_type {self.position_embedding_type!r} is not "
                                        "supported by granitemoehybrid (only 'rope', 'nope' or null)")
        inner = self.mamba_expand * self.hidden_size
        if self.mamba_d_head == "auto":
            self.mamba_d_head = inner // self.mamba_n_heads
        if not isinstance(self.mamba_d_head, int) or self.mamba_d_head * self.mamba_n_heads != inner:
            raise ModelFormatError(f"{source}: mamba_n_heads {self.mamba_n_heads} x mamba_d_head {self.mamba_d_head!r} "
                                   f"must be mamba_expand x hidden_size ({inner})")
        self.require_multiple(source, "mamba_n_heads", "mamba_n_groups")
        self.time_step_limit = dt_limit(source, self.time_step_limit)


def dt_limit(source: str, value) -> tuple[float, float]:
    """``time_step_limit`` as (low, high): null is transformers' (0, inf); transformers
    saves infinity as {"__float__": "Infinity"}."""
    if value is None:
        return 0.0, math.inf

    def number(v):
        if isinstance(v, dict) and set(v) == {"__float__"} and v["__float__"] in ("Infinity", "inf"):
            return math.inf
        if isinstance(v, (int, float)) and not isinstance(v, bool) and not math.isnan(v):
            return float(v)
        raise ModelFormatError(f"{source}: time_step_limit must be two numbers, got {value!r}")

    if not isinstance(value, list) or len(value) != 2:
        raise ModelFormatError(f"{source}: time_step_limit must be two numbers, got {value!r}")
    low, high = (number(v) for v in value)
    if not 0.0 <= low <= high:
        raise ModelFormatError(f"{source}: time_step_limit {value!r} must be 0 <= low <= high")
    return low, high


class GraniteMoeHybrid(Family):
    """Granite 4 (granitemoehybrid): Granite MoE's layers with a Mamba-2 mixer (``mamba``) in
    place of attention where ``layer_types`` says "linear_attention"; attention with RoPE
    only when ``position_embedding_type`` is "rope" (else NoPE); the shared SwiGLU always
    beside the MoE."""

    name = "granitemoehybrid"

    def build(self, config, w):
        a = GraniteMoeHybridArgs.from_dict(config, w.config_source)
        blocks = GraniteBlocks(a, w, config, rope=a.position_embedding_type == "rope")

        def mixer(i, p):
            if a.layer_types[i] == "full_attention":
                return blocks.attention(i, p)
            return mamba2(w, i, f"{p}.mamba", hidden=a.hidden_size, heads=a.mamba_n_heads, head_dim=a.mamba_d_head,
                          groups=a.mamba_n_groups, state_size=a.mamba_d_state, conv_kernel=a.mamba_d_conv,
                          eps=a.rms_norm_eps, chunk_size=a.mamba_chunk_size, conv_bias=a.mamba_conv_bias,
                          proj_bias=a.mamba_proj_bias, dt_limit=a.time_step_limit)

        return blocks.decoder(mixer, lambda i, p: blocks.moe(i, p, blocks.shared_mlp(f"{p}.shared_mlp")))
