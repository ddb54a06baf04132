"""Inkling (model_type ``inkling_text``; transformers: models/inkling) and the text model
of the multimodal ``inkling_mm_model`` checkpoint, on colibri's shared blocks.

- Attention (``RelativeBiasAttention``): no RoPE; q/k RMS-normalised per head, scale
  1 / head_dim; a relative position bias conditioned on the hidden state (``r_proj``
  mixing the bank ``rel_logits_proj.proj``); k and v through short convolutions.
  ``hybrid_sliding`` layers have their own head counts and head dim (``swa_*``), a
  window of ``sliding_window_size`` (also their bias extent) and a cache bounded by it;
  ``hybrid`` layers attend to everything, the bias over ``rel_extent``, with log-length
  scaling when ``log_scaling_n_floor`` is set.
- Short convolutions with a residual on both branch outputs (``attn_sconv``,
  ``mlp_sconv``); their states are per-sequence recurrent state.
- MLP: ``dense`` layers (``mlp_layer_types``) a SwiGLU times ``global_scale``, else the
  sigmoid router that weighs the shared experts with the routed ones (``SinkMoE``).
- Normed embeddings; the LM head sees the final hidden states divided by
  ``logits_mup_width_multiplier``; a head padded beyond ``unpadded_vocab_size`` gives
  only its first rows.

``inkling_mm_model`` nests this config in ``text_config``. Its checkpoints keep the
original names (``model.llm.*``, ``attn.wq_du``, gate and up interleaved row by row in
``w13`` tensors; transformers renames them on load and back on ``save_pretrained``):
they are read under those names, and under transformers' (``model.language_model.*``)
too. The vision and audio towers are never loaded, and prompts holding an image, audio
or video placeholder are refused. Multi-token-prediction layers are ignored.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np

from colibri_core.errors import ModelFormatError, UnsupportedModelError
from colibri_core.model.config import ModelArgs, bounded
from colibri_core.model.family import Family
from colibri_core.nn.assembly import Names, build_decoder
from colibri_core.nn.deltanet import conv_weight_2d
from colibri_core.nn.layers import Linear, RoutedExperts, SwiGLU
from colibri_core.nn.relative import RelativeBiasAttention
from colibri_core.nn.shortconv import ShortConv
from colibri_core.nn.sinkmoe import SigmoidSinkRouter, SinkMoE, WeightedSharedExperts, stack_columns, stack_rows

# transformers' attribute_map: config.json may spell these fields its own way
ALIASES = {"sliding_window": "sliding_window_size", "num_local_experts": "n_routed_experts",
           "sconv_kernel_size": "conv_kernel_size", "embedding_multiplier": "logits_mup_width_multiplier",
           "model_max_length": "max_position_embeddings"}
MEDIA_TOKENS = {"image_token_id": "image", "audio_token_id": "audio", "video_token_id": "video"}
MM_TEXT = Names(model="model.language_model.", lm_head="lm_head")
# The original checkpoint's text names -> transformers' (its conversion_mapping for
# inkling_mm_model), applied in order.
ORIGINAL_NAMES = [
    (r"^model\.llm\.layers\.", "model.language_model.layers."),
    (r"^model\.llm\.embed_norm\.weight$", "model.language_model.embed_tokens.embed_norm.weight"),
    (r"^model\.llm\.embed\.weight$", "model.language_model.embed_tokens.weight"),
    (r"^model\.llm\.norm\.weight$", "model.language_model.norm.weight"),
    (r"^model\.llm\.unembed\.weight$", "lm_head.weight"),
    (r"\.shared_experts\.shared_w2_weight$", ".shared_experts.down_proj"),
    (r"\.mlp\.experts\.w2_weight$", ".mlp.experts.down_proj"),
    (r"\.mlp\.w2_md\.weight$", ".mlp.down_proj.weight"),
    (r"\.mlp\.gate\.bias$", ".mlp.gate.e_score_correction_bias"),
    (r"\.attn\.wq_du\.", ".self_attn.q_proj."), (r"\.attn\.wk_dv\.", ".self_attn.k_proj."),
    (r"\.attn\.wv_dv\.", ".self_attn.v_proj."), (r"\.attn\.wr_du\.", ".self_attn.r_proj."),
    (r"\.attn\.wo_ud\.", ".self_attn.o_proj."),
    (r"\.attn\.(q_norm|k_norm|rel_logits_proj)\.", r".self_attn.\1."),
    (r"\.attn\.(k_sconv|v_sconv)\.weight$", r".self_attn.\1.conv1d.weight"),
    (r"\.(attn_sconv|mlp_sconv)\.weight$", r".\1.conv1d.weight"),
    (r"\.mlp_norm\.", ".post_attention_layernorm."),
    (r"\.attn_norm\.", ".input_layernorm."),
]
# Tensors whose rows alternate gate, up, gate, ...: the names transformers splits them into.
INTERLEAVED = {".mlp.experts.w13_weight": (".mlp.experts.gate_up_proj",),
               ".shared_experts.shared_w13_weight": (".shared_experts.gate_proj", ".shared_experts.up_proj"),
               ".mlp.w13_dn.weight": (".mlp.gate_proj.weight", ".mlp.up_proj.weight")}


@dataclass
class InklingArgs(ModelArgs):
    """transformers' InklingTextConfig defaults."""

    vocab_size: int = 201024
    unpadded_vocab_size: int | None = None
    hidden_size: int = 6144
    num_hidden_layers: int = 66
    num_attention_heads: int = 64
    num_key_value_heads: int = 8
    head_dim: int = 128
    swa_num_attention_heads: int = bounded(1, 1 << 12, default=64)
    swa_num_key_value_heads: int = bounded(1, 1 << 12, default=16)
    swa_head_dim: int = bounded(1, 1 << 12, default=128)
    sliding_window_size: int = bounded(1, 1 << 24, default=512)
    d_rel: int = bounded(1, 1 << 12, default=16)
    rel_extent: int = bounded(1, 1 << 20, default=1024)
    log_scaling_n_floor: int | None = bounded(1, 1 << 24, default=None)
    log_scaling_alpha: float = bounded(-1e3, 1e3, default=0.1)
    local_layer_ids: list | None = None
    layer_types: list | None = None
    mlp_layer_types: list | None = None
    max_position_embeddings: int = 131072
    rms_norm_eps: float = 1e-6
    conv_kernel_size: int = bounded(1, 64, default=4)
    intermediate_size: int = 24576
    moe_intermediate_size: int = 3072
    hidden_act: str = "silu"
    n_routed_experts: int = bounded(1, 1 << 14, default=256)
    num_experts_per_tok: int = 6
    n_shared_experts: int = bounded(1, 1 << 8, default=2)
    route_scale: float = bounded(0.0, 1e6, default=8.0)
    logits_mup_width_multiplier: float = bounded(1e-6, 1e6, default=24.0)
    tie_word_embeddings: bool = False  # never tied: transformers' _tied_weights_keys = {}

    def validate(self, source):
        n = self.num_hidden_layers
        if self.layer_types is None:  # transformers' default: every 6th layer (from the 6th) full attention
            local = set(self.local_layer_ids) if self.local_layer_ids is not None else {i for i in range(n) if (i + 1) % 6}
            self.layer_types = ["hybrid_sliding" if i in local else "hybrid" for i in range(n)]
        _check_list(source, "layer_types", self.layer_types, n, ("hybrid", "hybrid_sliding"))
        if self.mlp_layer_types is None:
            self.mlp_layer_types = ["sparse"] * n
        _check_list(source, "mlp_layer_types", self.mlp_layer_types, n, ("dense", "sparse"))
        self.require_multiple(source, "num_attention_heads", "num_key_value_heads")
        self.require_multiple(source, "swa_num_attention_heads", "swa_num_key_value_heads")
        self.require_at_most(source, "num_experts_per_tok", "n_routed_experts")
        if self.unpadded_vocab_size is not None and not 1 <= self.unpadded_vocab_size:
            raise ModelFormatError(f"{source}: unpadded_vocab_size must be >= 1, got {self.unpadded_vocab_size}")
        if self.hidden_act != "silu":
            raise UnsupportedModelError(f"{source}: hidden_act {self.hidden_act!r} is not supported (only 'silu')")
        self.tie_word_embeddings = False


def _check_list(source, name, values, n, allowed):
    if len(values) != n or not all(v in allowed for v in values):
        raise ModelFormatError(f"{source}: {name} must list one of {', '.join(map(repr, allowed))} for each of the {n} "
                               f"layers, got {values!r}")


def normalise(config: dict, source: str) -> dict:
    """config.json in our field names: transformers' aliases resolved, the raw checkpoint's
    ``dense_mlp_idx`` / ``dense_intermediate_size`` applied as its config class does."""
    out = {k: v for k, v in config.items() if k not in ALIASES}
    for alias, name in ALIASES.items():
        if config.get(alias) is None:
            continue
        if out.get(name) is not None and out[name] != config[alias]:
            raise ModelFormatError(f"{source}: fields {alias!r} ({config[alias]!r}) and {name!r} ({out[name]!r}) disagree")
        out[name] = config[alias]
    dense = config.get("dense_mlp_idx")
    if out.get("mlp_layer_types") is None and dense is not None:
        n = out.get("num_hidden_layers", 66)
        if not isinstance(dense, int) or isinstance(dense, bool) or not isinstance(n, int) or not 0 <= dense <= n:
            raise ModelFormatError(f"{source}: field 'dense_mlp_idx' must be a layer count, got {dense!r}")
        out["mlp_layer_types"] = ["dense" if i < dense else "sparse" for i in range(n)]
    if config.get("dense_intermediate_size") is not None:
        out["moe_intermediate_size"] = config.get("intermediate_size", InklingArgs.intermediate_size)
        out["intermediate_size"] = config["dense_intermediate_size"]
    return out


class Inkling(Family):
    name = "inkling"

    def build(self, config, w):
        src = w.config_source
        if config.get("model_type") != "inkling_mm_model" and "text_config" not in config:
            return _build(InklingArgs.from_dict(normalise(config, src), src), w)
        text = config.get("text_config")
        if not isinstance(text, dict):
            raise ModelFormatError(f"{src}: text_config must be an object")
        if text.get("model_type", "inkling_text") != "inkling_text":
            raise UnsupportedModelError(f"{src}: text_config model_type {text.get('model_type')!r} is not inkling_text")
        original = "model.llm.embed.weight" in w.checkpoint
        if original:
            w.aliases.update(original_names(w.checkpoint.tensors))
        elif f"{MM_TEXT.model}embed_tokens.weight" not in w.checkpoint:
            raise ModelFormatError(f"{w.checkpoint.model_dir}: no text model: neither model.llm.embed.weight (the "
                                   f"original names) nor {MM_TEXT.model}embed_tokens.weight (transformers') is stored")
        a = InklingArgs.from_dict(normalise(text, f"{src}: text_config"), f"{src}: text_config")
        refused = {config[key]: f"Inkling's {what} placeholder: colibri runs the text model only; {what} input is not "
                                "supported" for key, what in MEDIA_TOKENS.items() if isinstance(config.get(key), int)}
        return _build(a, w, MM_TEXT, refused, interleaved=original)


def original_names(stored) -> dict[str, str]:
    """transformers' name -> the original checkpoint's, for every text tensor stored."""
    table = {}
    for key in stored:
        if not key.startswith("model.llm."):
            continue
        name = key
        for pattern, replacement in ORIGINAL_NAMES:
            name = re.sub(pattern, replacement, name)
        fused = next((suffix for suffix in INTERLEAVED if name.endswith(suffix)), None)
        for target in INTERLEAVED[fused] if fused else (None,):
            table[name[:-len(fused)] + target if fused else name] = key
    return table


def even_rows(w):
    """Load transform: the gate rows of a row-interleaved gate/up tensor (.., 2 * inter, in)."""
    return np.ascontiguousarray(np.asarray(w)[..., 0::2, :])


def odd_rows(w):
    return np.ascontiguousarray(np.asarray(w)[..., 1::2, :])


def stacked_gates(w):
    """(n, 2 * inter, in) row-interleaved shared experts -> their gates, (n * inter, in)."""
    return stack_rows(even_rows(w))


def stacked_ups(w):
    return stack_rows(odd_rows(w))


def _build(a: InklingArgs, w, names: Names = Names(), refused: dict[int, str] | None = None, interleaved: bool = False):
    """``interleaved``: the MLPs' gate and up rows alternate in one stored tensor (the
    original layout); the aliases name it for both."""
    hidden, eps = a.hidden_size, a.rms_norm_eps

    def conv(i, name, channels):
        return ShortConv(i, name.rsplit(".", 1)[-1], w.param(f"{name}.conv1d.weight", (channels, 1, a.conv_kernel_size), conv_weight_2d))

    def mixer(i, p):
        s = f"{p}.self_attn"
        sliding = a.layer_types[i] == "hybrid_sliding"
        heads, kv, d = ((a.swa_num_attention_heads, a.swa_num_key_value_heads, a.swa_head_dim) if sliding
                        else (a.num_attention_heads, a.num_key_value_heads, a.head_dim))
        extent = a.sliding_window_size if sliding else a.rel_extent
        log = None if sliding or a.log_scaling_n_floor is None else (a.log_scaling_n_floor, a.log_scaling_alpha)
        return RelativeBiasAttention(
            layer=i, q=w.linear(f"{s}.q_proj", heads * d, hidden), k=w.linear(f"{s}.k_proj", kv * d, hidden),
            v=w.linear(f"{s}.v_proj", kv * d, hidden), r=w.linear(f"{s}.r_proj", heads * a.d_rel, hidden),
            o=w.linear(f"{s}.o_proj", hidden, heads * d), n_heads=heads, n_kv_heads=kv, head_dim=d,
            table=w.param(f"{s}.rel_logits_proj.proj", (a.d_rel, extent)),
            q_norm=w.rms_norm(f"{s}.q_norm", d, eps), k_norm=w.rms_norm(f"{s}.k_norm", d, eps),
            k_conv=conv(i, f"{s}.k_sconv", kv * d), v_conv=conv(i, f"{s}.v_sconv", kv * d), scale=1.0 / d,
            window=a.sliding_window_size if sliding else None, log_scaling=log)

    def mlp(i, p):
        m = f"{p}.mlp"
        if a.mlp_layer_types[i] == "dense":
            inner = a.intermediate_size
            if interleaved:
                fused = (2 * inner, hidden)
                dense = SwiGLU(Linear(w.param(f"{m}.gate_proj.weight", fused, even_rows)),
                               Linear(w.param(f"{m}.up_proj.weight", fused, odd_rows)), w.linear(f"{m}.down_proj", hidden, inner))
            else:
                dense = w.swiglu(m, hidden, inner)
            return ScaledMLP(dense, w.param(f"{m}.global_scale", (1,)))
        n, inter, routed = a.n_shared_experts, a.moe_intermediate_size, a.n_routed_experts
        router = SigmoidSinkRouter(w.linear(f"{m}.gate", routed + n, hidden), a.num_experts_per_tok, n,
                                   bias=w.optional(f"{m}.gate.e_score_correction_bias", (routed,)),
                                   global_scale=w.optional(f"{m}.gate.global_scale", (1,)), route_scale=a.route_scale)
        sh = f"{m}.shared_experts"
        if interleaved:
            gate = w.param(f"{sh}.gate_proj", (n, 2 * inter, hidden), stacked_gates)
            up = w.param(f"{sh}.up_proj", (n, 2 * inter, hidden), stacked_ups)
            experts = RoutedExperts(w.expert_layer(i, routed, {"gate_up": (f"{m}.experts.gate_up_proj", (2 * inter, hidden)),
                                                               "down": (f"{m}.experts.down_proj", (hidden, inter))},
                                                   interleaved=True))
        else:
            gate = w.param(f"{sh}.gate_proj", (n, inter, hidden), stack_rows)
            up = w.param(f"{sh}.up_proj", (n, inter, hidden), stack_rows)
            experts = w.swiglu_experts(i, f"{m}.experts", routed, hidden, inter)
        shared = WeightedSharedExperts(gate, up, w.param(f"{sh}.down_proj", (n, hidden, inter), stack_columns), n, inter)
        return SinkMoE(router, experts, shared)

    def post(i, p):
        return conv(i, f"{p}.attn_sconv", hidden), conv(i, f"{p}.mlp_sconv", hidden)

    return build_decoder(a, w, mixer, mlp, names, refused_tokens=refused, post=post, embed_norm=True,
                         head_divisor=a.logits_mup_width_multiplier, head_rows=a.unpadded_vocab_size)


class ScaledMLP:
    """A dense MLP's output times its learned ``global_scale`` (1,)."""

    def __init__(self, mlp, scale):
        self.mlp, self.scale = mlp, scale

    def __call__(self, x, step):
        return self.mlp(x, step) * self.scale.value
