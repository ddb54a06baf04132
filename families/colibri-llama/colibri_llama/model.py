"""Llama 4 on colibri's shared blocks (transformers: models/llama4/modeling_llama4.py).

Pre-norm layers of grouped-query attention and a dense or MoE feed-forward.

Attention: q/k/v/o biased by ``attention_bias``. Layers ``no_rope_layers`` marks 1 (by
default all but every ``no_rope_layer_interval``-th) rotate q and k with RoPE
(``rope_parameters`` / ``rope_theta`` + ``rope_scaling``, llama3 included) and then, with
``use_qk_norm``, RMS-normalise each head of q and k without a weight (transformers'
``Llama4TextL2Norm``, eps ``rms_norm_eps``). Llama 4's RoPE rotates interleaved pairs
(features 2i and 2i + 1 at frequency i); colibri's attention rotates halves, so each
head's q_proj and k_proj rows (and biases) are read reordered, even features first: the
same vectors in another feature order, so dot products and norms are unchanged. The
other layers use no position embedding (NoPE); with ``attn_temperature_tuning`` their
query at position p is multiplied by log1p(floor((p + 1) / floor_scale)) * attn_scale
+ 1. Layers ``layer_types`` marks "chunked_attention" (by default the RoPE layers) see
only the keys of their own chunk of ``attention_chunk_size`` positions (from position 0),
up to themselves; the others see every earlier position.

Feed-forward: layers in ``moe_layers`` (by default every ``interleave_moe_layer_step``-th,
from layer step - 1) are MoE, the others a dense SwiGLU of ``intermediate_size_mlp``. The
MoE: the top ``num_experts_per_tok`` experts by router logit, each weighted by the
sigmoid of its logit, not renormalised, the weight scaling the expert's *input*
(``SparseMoE(weight_inputs=True)``), over SwiGLU experts of ``intermediate_size``, plus a
shared SwiGLU expert of the same size. The experts are fused as published and as
transformers keeps them: ``experts.gate_up_proj`` (experts, hidden, 2 x inter; gate
columns first) and ``experts.down_proj`` (experts, inter, hidden), each expert's slice
read on its own from disk and transposed.

``llama4`` (``Llama4ForConditionalGeneration``): the text model of the multimodal
checkpoint, config under ``text_config`` (which also says whether the LM head is tied),
weights under ``language_model.``; the vision tower and projector are not loaded, and a
prompt holding the image placeholder (``image_token_index``) is refused.
"""

from __future__ import annotations

from dataclasses import dataclass

from colibri_core.errors import ModelFormatError, UnsupportedModelError
from colibri_core.model.config import ModelArgs, bounded
from colibri_core.model.family import Family
from colibri_core.nn import (Attention, RMSNorm, RoPE, RoutedExperts, SigmoidTopKRouter, SparseMoE, build_rope,
                             temperature_tuning)
from colibri_core.nn.assembly import Names, build_decoder

ROPE_THETA = 500000.0  # transformers' default_theta for a config spelling none
LAYER_TYPES = ("chunked_attention", "full_attention")
# fields whose explicit null transformers cannot run (a null is otherwise the default)
NOT_NULL = ("attention_chunk_size", "floor_scale", "attn_scale", "intermediate_size_mlp", "intermediate_size")
IMAGE_TOKEN = 200092  # Llama4Config's image_token_index default


@dataclass
class Llama4TextArgs(ModelArgs):
    """config.json's fields (transformers' Llama4TextConfig defaults): unknown keys are
    ignored, types and sizes checked."""

    vocab_size: int = 202048
    hidden_size: int = 5120
    intermediate_size: int = 8192
    intermediate_size_mlp: int = bounded(1, 1 << 19, default=16384)
    num_hidden_layers: int = 48
    num_attention_heads: int = 40
    num_key_value_heads: int | None = 8
    head_dim: int | None = 128
    hidden_act: str = "silu"
    max_position_embeddings: int = 4096 * 32
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    num_experts_per_tok: int = 1
    num_local_experts: int = bounded(1, 1 << 14, default=16)
    moe_layers: list | None = None
    interleave_moe_layer_step: int = bounded(1, 1 << 10, default=1)
    use_qk_norm: bool = True
    no_rope_layers: list | None = None
    no_rope_layer_interval: int = bounded(1, 1 << 10, default=4)
    attention_chunk_size: int = bounded(1, 1 << 30, default=8192)
    layer_types: list | None = None
    # an int in early configs (4): transformers reads it as a truth value
    attn_temperature_tuning: bool | int = True
    floor_scale: float = bounded(1e-9, 1e30, default=8192)
    attn_scale: float = bounded(-1e6, 1e6, default=0.1)
    attention_bias: bool = False

    def validate(self, source):
        n = self.num_hidden_layers
        self.num_key_value_heads = self.num_key_value_heads or self.num_attention_heads
        self.default_head_dim(source)
        self.require_multiple(source, "num_attention_heads", "num_key_value_heads")
        self.require_at_most(source, "num_experts_per_tok", "num_local_experts")
        if self.hidden_act != "silu":
            raise UnsupportedModelError(f"{source}: hidden_act {self.hidden_act!r} is not supported by the "
                                        "llama4 family (only 'silu')")
        if not self.no_rope_layers:  # transformers: an empty list is the default too
            self.no_rope_layers = [int((i + 1) % self.no_rope_layer_interval != 0) for i in range(n)]
        elif len(self.no_rope_layers) < n or not all(v in (0, 1) for v in self.no_rope_layers[:n]):
            raise ModelFormatError(f"{source}: no_rope_layers must give 1 (RoPE) or 0 (NoPE) for each of the {n} "
                                   f"layers, got {self.no_rope_layers!r}")
        if self.moe_layers is None:
            step = self.interleave_moe_layer_step
            self.moe_layers = list(range(step - 1, n, step))
        elif not all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < n for i in self.moe_layers):
            raise ModelFormatError(f"{source}: moe_layers must list layer indices from 0 to {n - 1}, "
                                   f"got {self.moe_layers!r}")
        if self.layer_types is None:
            self.layer_types = ["chunked_attention" if self.no_rope_layers[i] else "full_attention" for i in range(n)]
        elif len(self.layer_types) != n or not set(self.layer_types) <= set(LAYER_TYPES):
            raise ModelFormatError(f"{source}: layer_types must give one of {LAYER_TYPES} for each of the {n} layers, "
                                   f"got {self.layer_types!r}")

    def rope(self, i: int) -> bool:
        return bool(self.no_rope_layers[i])

    def chunked(self, i: int) -> bool:
        return self.layer_types[i] == "chunked_attention"


class Llama4Text(Family):
    name = "llama4_text"
    names = Names()

    def text_config(self, config: dict, source: str) -> tuple[dict, str]:
        return config, source

    def refused_tokens(self, config: dict) -> dict[int, str]:
        return {}

    def parse(self, config: dict, source: str = "config.json") -> tuple[Llama4TextArgs, RoPE]:
        """The typed arguments and the RoPE of a config.json dict."""
        text, source = self.text_config(config, source)
        for key in NOT_NULL:
            if key in text and text[key] is None:
                raise ModelFormatError(f"{source}: field {key!r} must be a number, got None")
        a = Llama4TextArgs.from_dict(text, source)
        # Llama 4 rotates whole heads (its complex-pair RoPE fails on a partial table)
        return a, build_rope({"rope_theta": ROPE_THETA, **text}, a.head_dim, source, whole_heads="llama4")

    def build(self, config, w):
        a, rope = self.parse(config, w.config_source)
        hidden, heads, kv_heads, d = a.hidden_size, a.num_attention_heads, a.num_key_value_heads, a.head_dim
        temperature = temperature_tuning(a.floor_scale, a.attn_scale) if a.attn_temperature_tuning else None
        qk_norm = RMSNorm(None, a.rms_norm_eps)  # Llama4TextL2Norm: an RMSNorm without a weight
        b = a.attention_bias

        def attention(i, p):
            s = f"{p}.self_attn"
            rotates = a.rope(i)
            if rotates:  # interleaved pairs read as halves
                q, k = (w.halves_linear(f"{s}.q_proj", heads, d, hidden, bias=b),
                        w.halves_linear(f"{s}.k_proj", kv_heads, d, hidden, bias=b))
            else:
                q, k = w.linear(f"{s}.q_proj", heads * d, hidden, bias=b), w.linear(f"{s}.k_proj", kv_heads * d, hidden, bias=b)
            norms = dict(q_norm=qk_norm, k_norm=qk_norm, qk_norm_per_head=True, qk_norm_after_rope=True) \
                if rotates and a.use_qk_norm else {}
            return Attention(layer=i, q=q, k=k, v=w.linear(f"{s}.v_proj", kv_heads * d, hidden, bias=b),
                             o=w.linear(f"{s}.o_proj", hidden, heads * d, bias=b), n_heads=heads, n_kv_heads=kv_heads,
                             head_dim=d, rope=rope if rotates else None, **norms,
                             chunk=a.attention_chunk_size if a.chunked(i) else None,
                             query_scale=None if rotates else temperature)

        def feed_forward(i, p):
            p = f"{p}.feed_forward"
            if i not in a.moe_layers:
                return w.swiglu(p, hidden, a.intermediate_size_mlp)
            n, inner = a.num_local_experts, a.intermediate_size
            e = f"{p}.experts"
            # stored (in, out) per expert: gate_up (hidden, 2 x inter), gate columns first
            matrices = {"gate_up": (f"{e}.gate_up_proj", (hidden, 2 * inner)), "down": (f"{e}.down_proj", (inner, hidden))}
            experts = RoutedExperts(w.expert_layer(i, n, matrices, transforms={"gate_up": _transpose, "down": _transpose}))
            return SparseMoE(SigmoidTopKRouter(w.linear(f"{p}.router", n, hidden), a.num_experts_per_tok), experts,
                             shared=w.swiglu(f"{p}.shared_expert", hidden, inner), weight_inputs=True)

        return build_decoder(a, w, attention, feed_forward, self.names, refused_tokens=self.refused_tokens(config))


class Llama4(Llama4Text):
    """The text model of the multimodal checkpoint (``Llama4ForConditionalGeneration``)."""

    name = "llama4"
    names = Names(model="language_model.model.", lm_head="language_model.lm_head")

    def text_config(self, config, source):
        text = config.get("text_config")
        if not isinstance(text, dict):
            raise ModelFormatError(f"{source}: a llama4 config needs a 'text_config' object")
        return text, f"{source} (text_config)"

    def refused_tokens(self, config):
        token = config.get("image_token_index", config.get("image_token_id", IMAGE_TOKEN))
        if not isinstance(token, int) or isinstance(token, bool):
            raise ModelFormatError(f"config.json: field 'image_token_index' must be a token id, got {token!r}")
        return {token: "image input is not supported: colibri runs the text model of this llama4 checkpoint"}


def _transpose(m):
    """Load transform: a stored (in, out) matrix as (out, in)."""
    import numpy as np

    return np.ascontiguousarray(m.T)
