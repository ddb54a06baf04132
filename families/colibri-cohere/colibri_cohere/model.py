"""Cohere 2 MoE on colibri's shared blocks (transformers: models/cohere2_moe).

Parallel layers (``build_decoder``'s ``parallel``): x + attn(norm(x)) + mlp(norm(x)), one
norm per layer (``input_layernorm``): a LayerNorm without bias (``layer_norm_eps``), or an
RMSNorm when ``rms_norm_eps`` is set; the final norm likewise.

Attention: grouped-query, q/k/v/o biased by ``attention_bias``. The layers ``layer_types``
marks "sliding_attention" see the last ``sliding_window`` positions and rotate q and k;
the others use no position embedding, but for the dense layers when
``prefix_dense_sliding_window_pattern`` is 1 (transformers' ``force_rope``). Cohere's RoPE
rotates interleaved pairs (features 2i and 2i + 1 at frequency i); colibri's attention
rotates halves, so each head's q_proj and k_proj rows (and biases) are read reordered,
even features first: queries and keys are the same vectors in another feature order, so
their dot products are unchanged.

MLP: a dense SwiGLU of ``prefix_dense_intermediate_size`` where ``mlp_layer_types`` says
"dense" (by default the first ``first_k_dense_replace`` layers), else a MoE: the top
``num_experts_per_tok`` experts by the router's logits, weighted by the softmax of those
logits (``expert_selection_fn`` "softmax": the renormalised top-k probabilities) or by
their sigmoids (renormalised when ``norm_topk_prob``), over SwiGLU experts of
``intermediate_size``, plus ``num_shared_experts`` shared experts, added ("sum") or
averaged ("average": routed weights and the shared down projection halved, exactly).
The logits are the LM head's times ``logit_scale`` (the head sees the hidden states
divided by 1 / logit_scale: exact for a power of two, as Cohere's scales are).
"""

from __future__ import annotations

from dataclasses import dataclass

from colibri_core.errors import ModelFormatError, UnsupportedModelError
from colibri_core.model.config import ModelArgs, bounded
from colibri_core.model.family import Family
from colibri_core.nn import (Attention, LayerNorm, Linear, SigmoidGroupedTopKRouter, SoftmaxGroupedTopKRouter, SparseMoE,
                             SwiGLU, build_rope)
from colibri_core.nn.assembly import build_decoder

LAYER_TYPES = ("full_attention", "sliding_attention")
MLP_TYPES = ("dense", "sparse")
SELECTIONS = ("softmax", "sigmoid")
COMBINATIONS = ("sum", "average")
SLIDING_WINDOW = 4096  # transformers' default where config.json spells none (an explicit null: no window)


@dataclass
class Cohere2MoeArgs(ModelArgs):
    """config.json's fields (transformers' Cohere2MoeConfig defaults)."""

    vocab_size: int = 256000
    hidden_size: int = 8192
    intermediate_size: int = 22528
    logit_scale: float = bounded(1e-6, 1e6, default=0.0625)
    num_hidden_layers: int = 40
    num_attention_heads: int = 64
    num_key_value_heads: int | None = None
    head_dim: int = 128
    hidden_act: str = "silu"
    max_position_embeddings: int = 8192
    layer_norm_eps: float = bounded(0.0, 1.0, default=1e-5)
    rms_norm_eps: float | None = bounded(0.0, 1.0, default=None)  # set: RMSNorms instead of LayerNorms
    tie_word_embeddings: bool = True
    attention_bias: bool = False
    sliding_window: int | None = bounded(1, 1 << 24, default=None)  # absent: SLIDING_WINDOW (see Cohere2Moe.parse)
    sliding_window_pattern: int = bounded(1, 1 << 10, default=4)
    prefix_dense_sliding_window_pattern: int = bounded(1, 1 << 10, default=1)
    first_k_dense_replace: int = bounded(0, 1 << 10, default=0)
    layer_types: list | None = None
    mlp_layer_types: list | None = None
    prefix_dense_intermediate_size: int | None = bounded(1, 1 << 19, default=None)
    num_experts: int = bounded(1, 1 << 14, default=8)
    num_experts_per_tok: int = 2
    num_shared_experts: int = bounded(0, 1 << 8, default=0)
    shared_expert_combination_strategy: str = "average"
    expert_selection_fn: str = "softmax"
    norm_topk_prob: bool = True

    def validate(self, source):
        self.num_key_value_heads = self.num_key_value_heads or self.num_attention_heads
        self.require_multiple(source, "num_attention_heads", "num_key_value_heads")
        self.require_at_most(source, "num_experts_per_tok", "num_experts")
        if self.head_dim % 2:
            raise ModelFormatError(f"{source}: head_dim {self.head_dim} must be even (RoPE rotates pairs)")
        if self.hidden_act != "silu":
            raise UnsupportedModelError(f"{source}: hidden_act {self.hidden_act!r} is not supported by the "
                                        "cohere2_moe family (only 'silu')")
        if self.expert_selection_fn not in SELECTIONS:
            raise UnsupportedModelError(f"{source}: expert_selection_fn {self.expert_selection_fn!r} is not one of "
                                        f"{SELECTIONS}")
        if self.shared_expert_combination_strategy not in COMBINATIONS:
            raise UnsupportedModelError(f"{source}: shared_expert_combination_strategy "
                                        f"{self.shared_expert_combination_strategy!r} is not one of {COMBINATIONS}")
        n, k = self.num_hidden_layers, self.first_k_dense_replace
        if self.layer_types is None:  # transformers: the dense first layers follow their own pattern
            self.layer_types = [
                "sliding_attention" if (i + 1) % self.prefix_dense_sliding_window_pattern else "full_attention"
                for i in range(min(k, n))] + [
                "sliding_attention" if (i + 1) % self.sliding_window_pattern else "full_attention" for i in range(n - k)]
        if len(self.layer_types) != n or not set(self.layer_types) <= set(LAYER_TYPES):
            raise ModelFormatError(f"{source}: layer_types must give one of {LAYER_TYPES} for each of the {n} layers, "
                                   f"got {self.layer_types!r}")
        if self.mlp_layer_types is None:
            self.mlp_layer_types = ["dense" if i < k else "sparse" for i in range(n)]
        elif len(self.mlp_layer_types) != n or not set(self.mlp_layer_types) <= set(MLP_TYPES):
            raise ModelFormatError(f"{source}: mlp_layer_types must give one of {MLP_TYPES} for each of the {n} layers, "
                                   f"got {self.mlp_layer_types!r}")
        if "sliding_attention" in self.layer_types and self.sliding_window is None:
            raise ModelFormatError(f"{source}: layer_types has sliding_attention layers but sliding_window is null")
        self.prefix_dense_intermediate_size = self.prefix_dense_intermediate_size or self.intermediate_size

    def sliding(self, layer: int) -> bool:
        return self.layer_types[layer] == "sliding_attention"

    def rotates(self, layer: int) -> bool:
        """Sliding layers rotate; global ones do not, but dense layers with a prefix pattern of 1."""
        dense = self.mlp_layer_types[layer] == "dense"
        return self.sliding(layer) or (dense and self.prefix_dense_sliding_window_pattern == 1)


def _halved(m):
    return m * m.dtype.type(0.5)  # exact: a power of two


class Cohere2Moe(Family):
    name = "cohere2_moe"

    @staticmethod
    def parse(config: dict, source: str = "config.json") -> Cohere2MoeArgs:
        return Cohere2MoeArgs.from_dict({"sliding_window": SLIDING_WINDOW, **config}, source)

    def build(self, config, w):
        src = w.config_source
        a = self.parse(config, src)
        hidden, heads, kv_heads, d, bias = a.hidden_size, a.num_attention_heads, a.num_key_value_heads, a.head_dim, a.attention_bias
        rope = build_rope(config, d, src, whole_heads="cohere2_moe")

        def attention(i, p):
            s = f"{p}.self_attn"
            return Attention(layer=i, q=w.halves_linear(f"{s}.q_proj", heads, d, hidden, bias=bias),
                             k=w.halves_linear(f"{s}.k_proj", kv_heads, d, hidden, bias=bias),
                             v=w.linear(f"{s}.v_proj", kv_heads * d, hidden, bias=bias),
                             o=w.linear(f"{s}.o_proj", hidden, heads * d, bias=bias),
                             n_heads=heads, n_kv_heads=kv_heads, head_dim=d, rope=rope if a.rotates(i) else None,
                             window=a.sliding_window if a.sliding(i) else None)

        def mlp(i, p):
            p = f"{p}.mlp"
            if a.mlp_layer_types[i] == "dense":
                return w.swiglu(p, hidden, a.prefix_dense_intermediate_size)
            n, inner = a.num_experts, a.intermediate_size
            average = a.num_shared_experts and a.shared_expert_combination_strategy == "average"
            scale = 0.5 if average else 1.0  # (routed + shared) / 2 as routed / 2 + shared / 2
            gate = w.linear(f"{p}.gate", n, hidden)
            if a.expert_selection_fn == "softmax":  # softmax of the top-k logits: the renormalised top-k probabilities
                router = SoftmaxGroupedTopKRouter(gate, a.num_experts_per_tok, renormalise=True, routed_scaling_factor=scale)
            else:  # the top k by logit are the top k by sigmoid
                router = SigmoidGroupedTopKRouter(gate, a.num_experts_per_tok, norm_topk_prob=a.norm_topk_prob,
                                                  routed_scaling_factor=scale)
            shared = None
            if a.num_shared_experts:
                s, width = f"{p}.shared_experts", inner * a.num_shared_experts
                down = w.param(f"{s}.down_proj.weight", (hidden, width), _halved) if average else None
                shared = SwiGLU(w.linear(f"{s}.gate_proj", width, hidden), w.linear(f"{s}.up_proj", width, hidden),
                                Linear(down) if average else w.linear(f"{s}.down_proj", hidden, width))
            return SparseMoE(router, w.swiglu_experts(i, f"{p}.experts", n, hidden, inner), shared=shared)

        def norm(prefix):
            if a.rms_norm_eps is not None:
                return w.rms_norm(prefix, hidden, a.rms_norm_eps)
            return LayerNorm(w.param(f"{prefix}.weight", (hidden,)), None, a.layer_norm_eps)

        return build_decoder(a, w, attention, mlp, parallel=True, make_norm=norm, head_divisor=1.0 / a.logit_scale)
