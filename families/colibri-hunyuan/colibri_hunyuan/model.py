"""Hunyuan MoE on colibri's shared blocks (transformers: models/hunyuan_v1_moe).

Pre-norm layers of grouped-query attention (every projection biased by
``attention_bias``) whose per-head q/k RMSNorms (``query_layernorm``,
``key_layernorm``) come after RoPE, and in every layer a MoE: a softmax router
(``mlp.gate.wg``) choosing the top ``moe_topk`` experts (one count, or one per layer),
their probabilities renormalised, over SwiGLU experts, plus a shared SwiGLU
(``mlp.shared_mlp``) added to their sum. Experts and the shared MLP are
``intermediate_size`` wide, as transformers builds them (Hunyuan-A13B's
``moe_intermediate_size`` lists equal it, its ``num_shared_expert`` lists are 1).

RoPE ``dynamic`` with an ``alpha`` (Hunyuan-A13B) is NTK-alpha scaling: the base
stretched once to rope_theta * alpha ** (d / (d - 2)), the same at every length.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from colibri_core.errors import ModelFormatError, UnsupportedModelError
from colibri_core.model.config import ModelArgs, bounded
from colibri_core.model.family import Family
from colibri_core.nn import Attention, SoftmaxTopKRouter, SparseMoE, build_rope, rope_parameters
from colibri_core.nn.assembly import build_decoder


@dataclass
class HunYuanMoeArgs(ModelArgs):
    """config.json's fields (transformers' HunYuanMoEV1Config defaults)."""

    vocab_size: int = 290943
    hidden_size: int = 4096
    intermediate_size: int = 11008
    num_hidden_layers: int = 32
    num_attention_heads: int = 32
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    max_position_embeddings: int = 2048
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    hidden_act: str = "silu"
    num_experts: int | list = bounded(1, 1 << 14, default=1)
    moe_topk: int | list = bounded(1, 1 << 10, default=1)
    # read by the original code, not by transformers: checked to be what transformers builds
    moe_intermediate_size: int | list | None = None
    num_shared_expert: int | list | None = None

    def validate(self, source):
        self.num_key_value_heads = self.num_key_value_heads or self.num_attention_heads
        self.default_head_dim(source)
        self.require_multiple(source, "num_attention_heads", "num_key_value_heads")
        if self.hidden_act != "silu":
            raise UnsupportedModelError(f"{source}: hidden_act {self.hidden_act!r} is not supported by the "
                                        "hunyuan_v1_moe family (only 'silu')")
        if isinstance(self.num_experts, list):  # transformers' config takes one count
            raise UnsupportedModelError(f"{source}: num_experts {self.num_experts!r}: per-layer expert counts are not "
                                        "supported (one count for every layer, as transformers' HunYuanMoEV1Config)")
        n, layers = self.num_experts, self.num_hidden_layers
        if isinstance(self.moe_topk, list) and (len(self.moe_topk) != layers or not all(
                isinstance(k, int) and not isinstance(k, bool) and 1 <= k <= n for k in self.moe_topk)):
            raise ModelFormatError(f"{source}: moe_topk {self.moe_topk!r} must list {layers} counts within 1..{n}")
        if isinstance(self.moe_topk, int) and self.moe_topk > n:
            raise ModelFormatError(f"{source}: moe_topk {self.moe_topk} exceeds num_experts {n}")
        for name, built in (("moe_intermediate_size", self.intermediate_size), ("num_shared_expert", 1)):
            value = getattr(self, name)
            if value is not None and any(v != built for v in (value if isinstance(value, list) else [value])):
                raise UnsupportedModelError(f"{source}: {name} {value!r} is not supported: transformers' hunyuan_v1_moe "
                                            f"builds every layer with {name} {built}")

    def top_k(self, i: int) -> int:
        return self.moe_topk[i] if isinstance(self.moe_topk, list) else self.moe_topk


def alias(config: dict) -> dict:
    """transformers' attribute names (``num_experts_per_tok``, ``num_local_experts``) for
    Hunyuan's own, where only those are spelled."""
    out = dict(config)
    for own, name in (("moe_topk", "num_experts_per_tok"), ("num_experts", "num_local_experts")):
        if own not in out and name in out:
            out[own] = out[name]
    return out


def hunyuan_rope(config: dict, head_dim: int, source: str):
    """transformers' HunYuanMoEV1RotaryEmbedding: ``dynamic`` with a (truthy) ``alpha`` is
    NTK-alpha (the base, computed in double precision as transformers does, then the
    default schedule); any other type is the usual one."""
    params = rope_parameters(config, source)
    if params["rope_type"] != "dynamic" or not params.get("alpha"):
        return build_rope(config, head_dim, source)
    alpha, theta = params["alpha"], params["rope_theta"]
    for name, value in (("alpha", alpha), ("rope_theta", theta)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
            raise ModelFormatError(f"{source}: rope parameter {name!r} must be a positive number, got {value!r}")
    if head_dim <= 2:
        raise ModelFormatError(f"{source}: NTK-alpha RoPE needs head_dim > 2, got {head_dim}")
    base = theta * alpha ** (head_dim / (head_dim - 2))
    return build_rope({"rope_parameters": {"rope_type": "default", "rope_theta": base}}, head_dim, source)


class HunYuanMoeV1(Family):
    name = "hunyuan_v1_moe"

    @staticmethod
    def parse(config: dict, source: str = "config.json") -> HunYuanMoeArgs:
        return HunYuanMoeArgs.from_dict(alias(config), source)

    def build(self, config, w):
        a = self.parse(config, w.config_source)
        hidden, heads, kv_heads, d, inter = a.hidden_size, a.num_attention_heads, a.num_key_value_heads, a.head_dim, a.intermediate_size
        rope = hunyuan_rope(config, d, w.config_source)

        def attention(i, p):
            s, b = f"{p}.self_attn", a.attention_bias
            return Attention(layer=i, **w.attention_projections(s, hidden, heads, kv_heads, d, qkv_bias=b, o_bias=b),
                             n_heads=heads, n_kv_heads=kv_heads, head_dim=d, rope=rope,
                             q_norm=w.rms_norm(f"{s}.query_layernorm", d, a.rms_norm_eps),
                             k_norm=w.rms_norm(f"{s}.key_layernorm", d, a.rms_norm_eps),
                             qk_norm_per_head=True, qk_norm_after_rope=True)

        def moe(i, p):
            p, n = f"{p}.mlp", a.num_experts
            router = SoftmaxTopKRouter(w.linear(f"{p}.gate.wg", n, hidden), a.top_k(i), True)
            return SparseMoE(router, w.swiglu_experts(i, f"{p}.experts", n, hidden, inter),
                             shared=w.swiglu(f"{p}.shared_mlp", hidden, inter))

        return build_decoder(a, w, attention, moe)
