"""Hy3 on colibri's shared blocks (transformers: models/hy_v3).

Pre-norm layers of grouped-query attention (q/k/v/o biased by ``attention_bias``)
whose per-head q/k RMSNorms (``q_norm``, ``k_norm``) come before RoPE, then, as
``mlp_layer_types`` says (by default the first layer dense, the others sparse), a dense
SwiGLU of ``intermediate_size`` or a MoE: a sigmoid router (float32 logits, one group)
choosing the top ``num_experts_per_tok`` experts by score plus ``expert_bias`` (for
choosing only), their unbiased scores renormalised and multiplied by
``router_scaling_factor``, over SwiGLU experts of ``moe_intermediate_size``, plus a
shared SwiGLU ``num_shared_experts`` times as wide added to their sum. All of it is core
blocks (``Attention``, ``SigmoidGroupedTopKRouter``, ``SparseMoE``).

The checkpoint's names (as published and as transformers saves them) are
``mlp.router.gate``, ``mlp.expert_bias`` and ``mlp.shared_mlp``; transformers' in-memory
names (``mlp.gate``, ``mlp.e_score_correction_bias``, ``mlp.shared_experts``) are read too.
"""

from __future__ import annotations

from dataclasses import dataclass

from colibri_core.errors import ModelFormatError, UnsupportedModelError
from colibri_core.model.config import ModelArgs, bounded
from colibri_core.model.family import Family
from colibri_core.nn import Attention, SigmoidGroupedTopKRouter, SparseMoE, build_rope
from colibri_core.nn.assembly import build_decoder

ROPE_THETA = 11_158_840.0  # transformers' default_theta for a config spelling none
MLP_LAYER_TYPES = ("dense", "sparse")


@dataclass
class HYV3Args(ModelArgs):
    """config.json's fields (transformers' HYV3Config defaults)."""

    vocab_size: int = 120832
    hidden_size: int = 4096
    intermediate_size: int = 13312
    num_hidden_layers: int = 80
    num_attention_heads: int = 64
    num_key_value_heads: int = 8
    head_dim: int = 128  # transformers' default, not hidden_size / num_attention_heads
    hidden_act: str = "silu"
    max_position_embeddings: int = 131072
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    num_experts: int = bounded(1, 1 << 14, default=192)
    num_experts_per_tok: int = bounded(1, 1 << 10, default=8)
    num_shared_experts: int = bounded(0, 1 << 8, default=1)
    moe_intermediate_size: int = 1536
    router_scaling_factor: float = bounded(0.0, 1e6, default=2.826)
    # how transformers adds the shared MLP in a low precision: colibri sums in float32 anyway
    enable_moe_fp32_combine: bool = True
    mlp_layer_types: list | None = None

    def validate(self, source):
        self.require_multiple(source, "num_attention_heads", "num_key_value_heads")
        self.require_at_most(source, "num_experts_per_tok", "num_experts")
        if self.hidden_act != "silu":
            raise UnsupportedModelError(f"{source}: hidden_act {self.hidden_act!r} is not supported by the "
                                        "hy_v3 family (only 'silu')")
        if self.mlp_bias:
            raise UnsupportedModelError(f"{source}: mlp_bias true is not supported by the hy_v3 family "
                                        "(biased dense and shared MLPs)")
        if self.num_shared_experts < 1:
            raise UnsupportedModelError(f"{source}: num_shared_experts {self.num_shared_experts} is not supported by the "
                                        "hy_v3 family (transformers then builds an intermediate_size-wide shared MLP)")
        n = self.num_hidden_layers
        if self.mlp_layer_types is None:  # transformers: the first layer dense, the others sparse
            self.mlp_layer_types = ["dense"] * min(n, 1) + ["sparse"] * max(n - 1, 0)
        elif len(self.mlp_layer_types) != n or not set(self.mlp_layer_types) <= set(MLP_LAYER_TYPES):
            raise ModelFormatError(f"{source}: mlp_layer_types must give one of {MLP_LAYER_TYPES} for each of the "
                                   f"{n} layers, got {self.mlp_layer_types!r}")

    def is_moe(self, layer: int) -> bool:
        return self.mlp_layer_types[layer] == "sparse"


def alias(config: dict) -> dict:
    """transformers' attribute name ``num_local_experts`` for ``num_experts`` where only it is spelled."""
    out = dict(config)
    if "num_experts" not in out and "num_local_experts" in out:
        out["num_experts"] = out["num_local_experts"]
    return out


def _named(w, stored: str, in_memory: str, tensor: str) -> str:
    """The checkpoint's prefix ``stored``, or transformers' in-memory ``in_memory`` where
    only that one holds ``tensor``."""
    return in_memory if not w.has(f"{stored}{tensor}") and w.has(f"{in_memory}{tensor}") else stored


class HYV3(Family):
    name = "hy_v3"

    @staticmethod
    def parse(config: dict, source: str = "config.json") -> HYV3Args:
        return HYV3Args.from_dict(alias(config), source)

    def build(self, config, w):
        src = w.config_source
        a = self.parse(config, src)
        hidden, heads, kv_heads, d, eps = a.hidden_size, a.num_attention_heads, a.num_key_value_heads, a.head_dim, a.rms_norm_eps
        rope = build_rope({"rope_theta": ROPE_THETA, **config}, d, src, whole_heads="hy_v3")

        def attention(i, p):
            s, b = f"{p}.self_attn", a.attention_bias
            return Attention(layer=i, **w.attention_projections(s, hidden, heads, kv_heads, d, qkv_bias=b, o_bias=b),
                             n_heads=heads, n_kv_heads=kv_heads, head_dim=d, rope=rope,
                             q_norm=w.rms_norm(f"{s}.q_norm", d, eps), k_norm=w.rms_norm(f"{s}.k_norm", d, eps),
                             qk_norm_per_head=True)

        def mlp(i, p):
            p = f"{p}.mlp"
            if not a.is_moe(i):
                return w.swiglu(p, hidden, a.intermediate_size)
            n, inner = a.num_experts, a.moe_intermediate_size
            gate = _named(w, f"{p}.router.gate", f"{p}.gate", ".weight")
            bias = _named(w, f"{p}.expert_bias", f"{p}.e_score_correction_bias", "")
            shared = _named(w, f"{p}.shared_mlp", f"{p}.shared_experts", ".gate_proj.weight")
            router = SigmoidGroupedTopKRouter(w.linear(gate, n, hidden), a.num_experts_per_tok,
                                              bias=w.optional(bias, (n,)), norm_topk_prob=True,
                                              routed_scaling_factor=a.router_scaling_factor)
            return SparseMoE(router, w.swiglu_experts(i, f"{p}.experts", n, hidden, inner),
                             shared=w.swiglu(shared, hidden, inner * a.num_shared_experts))

        return build_decoder(a, w, attention, mlp)
