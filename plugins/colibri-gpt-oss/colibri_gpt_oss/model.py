"""gpt-oss on colibri's shared blocks (transformers: models/gpt_oss/modeling_gpt_oss.py),
written against colibri-core's public plugin API only (docs/plugins.md).

- attention: q/k/v/o with biases, YaRN RoPE as configured, a learned sink logit per
  head, and on ``sliding_attention`` layers a window of ``sliding_window`` positions;
- MLP: a router with bias (the top k of the logits, softmaxed over the selected: the
  renormalised softmax top k) and experts with biases under the clamped SwiGLU
  (``GatedActivation(alpha, limit, up_offset=1)``).

Experts come fused as transformers keeps them, ``gate_up_proj`` (E, hidden, 2 * inter;
gate and up columns interleaved) and ``down_proj`` (E, inter, hidden), transposed and
de-interleaved at each read; or, in the original MXFP4 checkpoints (colibri-core's
``mxfp4-hub`` format reads ``X_blocks`` / ``X_scales`` for the tensor ``X``),
``gate_up_proj`` (E, 2 * inter, hidden: output-major, gate and up rows interleaved) and
``down_proj`` (E, hidden, inter), kept packed, their gate_up rows reordered (gate rows
first) once when an expert is read (``interleaved=True``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from colibri_core.errors import ModelFormatError, UnsupportedModelError
from colibri_core.model.config import ModelArgs
from colibri_core.model.family import Family
from colibri_core.nn import Attention, GatedActivation, RoutedExperts, SoftmaxTopKRouter, SparseMoE, build_rope
from colibri_core.nn.assembly import build_decoder

LAYER_TYPES = ("sliding_attention", "full_attention")


@dataclass
class GptOssArgs(ModelArgs):
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_local_experts: int
    num_experts_per_tok: int
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    sliding_window: int | None = 128
    layer_types: list | None = None
    max_position_embeddings: int = 131072
    rms_norm_eps: float = 1e-5
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    attention_bias: bool = True
    tie_word_embeddings: bool = False
    hidden_act: str = "silu"

    def validate(self, source):
        self.num_key_value_heads = self.num_key_value_heads or self.num_attention_heads
        self.head_dim = self.head_dim or self.hidden_size // self.num_attention_heads
        self.require_multiple(source, "num_attention_heads", "num_key_value_heads")
        self.require_at_most(source, "num_experts_per_tok", "num_local_experts")
        if self.layer_types is None:  # transformers' default: sliding first, then alternating
            self.layer_types = [LAYER_TYPES[i % 2] for i in range(self.num_hidden_layers)]
        if len(self.layer_types) != self.num_hidden_layers or any(t not in LAYER_TYPES for t in self.layer_types):
            raise ModelFormatError(f"{source}: layer_types must list {self.num_hidden_layers} of {list(LAYER_TYPES)}, "
                                   f"got {self.layer_types!r}")
        if "sliding_attention" in self.layer_types and (self.sliding_window is None or self.sliding_window < 1):
            raise ModelFormatError(f"{source}: sliding_window must be >= 1 for sliding_attention layers, "
                                   f"got {self.sliding_window!r}")
        if not self.swiglu_limit > 0:
            raise ModelFormatError(f"{source}: swiglu_limit must be > 0, got {self.swiglu_limit}")
        if self.hidden_act != "silu":
            raise UnsupportedModelError(f"{source}: hidden_act {self.hidden_act!r} is not supported by the gpt_oss "
                                        "family (only 'silu')")


def _deinterleave(a: np.ndarray) -> np.ndarray:
    """Gate/up alternating along the first axis -> all gate rows, then all up rows."""
    return np.concatenate([a[0::2], a[1::2]], axis=0)


def _gate_up(slice_: np.ndarray) -> np.ndarray:
    """One expert's (hidden, 2 * inter) interleaved slice -> (2 * inter, hidden), gate rows first."""
    return _deinterleave(slice_.T)


class GptOss(Family):
    name = "gpt_oss"

    def build(self, config, w):
        a = GptOssArgs.from_dict(config, w.config_source)
        hidden, heads, kv_heads, head_dim = a.hidden_size, a.num_attention_heads, a.num_key_value_heads, a.head_dim
        rope = build_rope(config, head_dim, w.config_source)
        activation = GatedActivation(alpha=a.swiglu_alpha, limit=a.swiglu_limit, up_offset=1.0)

        def attention(i, p):
            s = f"{p}.self_attn"
            return Attention(
                layer=i,
                **w.attention_projections(s, hidden, heads, kv_heads, head_dim, qkv_bias=a.attention_bias,
                                          o_bias=a.attention_bias),
                n_heads=heads, n_kv_heads=kv_heads, head_dim=head_dim, rope=rope,
                window=a.sliding_window if a.layer_types[i] == "sliding_attention" else None,
                sinks=w.param(f"{s}.sinks", (heads,)),
            )

        def experts(i, p):
            e, n, inter = f"{p}.mlp.experts", a.num_local_experts, a.intermediate_size
            biases = {"gate_up_bias": (f"{e}.gate_up_proj_bias", (2 * inter,)),
                      "down_bias": (f"{e}.down_proj_bias", (hidden,))}
            if w.has(f"{e}.gate_up_proj_blocks"):
                # the original MXFP4 checkpoints: the format reads X_blocks / X_scales for X, output-major
                # (out, in) with gate and up rows interleaved: read packed, rows reordered
                matrices = {"gate_up": (f"{e}.gate_up_proj", (2 * inter, hidden)),
                            "down": (f"{e}.down_proj", (hidden, inter)), **biases}
                return w.expert_layer(i, n, matrices, activation=activation, interleaved=True)
            matrices = {"gate_up": (f"{e}.gate_up_proj", (hidden, 2 * inter)), "down": (f"{e}.down_proj", (inter, hidden)),
                        **biases}
            return w.expert_layer(i, n, matrices, activation=activation,
                                  transforms={"gate_up": _gate_up, "down": np.transpose, "gate_up_bias": _deinterleave})

        def moe(i, p):
            router = SoftmaxTopKRouter(w.linear(f"{p}.mlp.router", a.num_local_experts, hidden, bias=True),
                                       a.num_experts_per_tok, norm_topk_prob=True)
            return SparseMoE(router, RoutedExperts(experts(i, p)))

        return build_decoder(a, w, attention, moe)
