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

``inkling_mm_model`` nests this config in ``text_config``; its text tensors are read
under transformers' names (``model.language_model.*``, ``lm_head``); the vision and
audio towers are never loaded, and prompts holding an image, audio or video placeholder
are refused. Multi-token-prediction layers are ignored.
"""

from __future__ import annotations

from dataclasses import dataclass

from colibri_core.errors import ModelFormatError, UnsupportedModelError
from colibri_core.model.config import ModelArgs, bounded
from colibri_core.model.family import Family
from colibri_core.nn.assembly import Names, build_decoder
from colibri_core.nn.deltanet import conv_weight_2d
from colibri_core.nn.relative import RelativeBiasAttention
from colibri_core.nn.shortconv import ShortConv
from colibri_core.nn.sinkmoe import SigmoidSinkRouter, SinkMoE, WeightedSharedExperts, stack_columns, stack_rows

# transformers' attribute_map: config.json may spell these fields its own way
ALIASES = {"sliding_window": "sliding_window_size", "num_local_experts": "n_routed_experts",
           "sconv_kernel_size": "conv_kernel_size", "embedding_multiplier": "logits_mup_width_multiplier",
           "model_max_length": "max_position_embeddings"}
MEDIA_TOKENS = {"image_token_id": "image", "audio_token_id": "audio", "video_token_id": "video"}
MM_TEXT = Names(model="model.language_model.", lm_head="lm_head")


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
        for heads, kv in (("num_attention_heads", "num_key_value_heads"), ("swa_num_attention_heads", "swa_num_key_value_heads")):
            if getattr(self, heads) % getattr(self, kv):
                raise ModelFormatError(f"{source}: {heads} {getattr(self, heads)} is not a multiple of {kv} {getattr(self, kv)}")
        if self.num_experts_per_tok > self.n_routed_experts:
            raise ModelFormatError(f"{source}: num_experts_per_tok {self.num_experts_per_tok} exceeds n_routed_experts "
                                   f"{self.n_routed_experts}")
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
        if f"{MM_TEXT.model}embed_tokens.weight" not in w.checkpoint:
            raise UnsupportedModelError(f"{w.checkpoint.model_dir}: no text model under transformers' names "
                                        f"({MM_TEXT.model}embed_tokens.weight); the original layout (model.llm.*) "
                                        "is not read: convert it with transformers first")
        a = InklingArgs.from_dict(normalise(text, f"{src}: text_config"), f"{src}: text_config")
        refused = {config[key]: f"Inkling's {what} placeholder: colibri runs the text model only; {what} input is not "
                                "supported" for key, what in MEDIA_TOKENS.items() if isinstance(config.get(key), int)}
        return _build(a, w, MM_TEXT, refused)


def _build(a: InklingArgs, w, names: Names = Names(), refused: dict[int, str] | None = None):
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
            return ScaledMLP(w.swiglu(m, hidden, a.intermediate_size), w.param(f"{m}.global_scale", (1,)))
        n, inter, routed = a.n_shared_experts, a.moe_intermediate_size, a.n_routed_experts
        router = SigmoidSinkRouter(w.linear(f"{m}.gate", routed + n, hidden), a.num_experts_per_tok, n,
                                   bias=w.optional(f"{m}.gate.e_score_correction_bias", (routed,)),
                                   global_scale=w.optional(f"{m}.gate.global_scale", (1,)), route_scale=a.route_scale)
        sh = f"{m}.shared_experts"
        shared = WeightedSharedExperts(w.param(f"{sh}.gate_proj", (n, inter, hidden), stack_rows),
                                       w.param(f"{sh}.up_proj", (n, inter, hidden), stack_rows),
                                       w.param(f"{sh}.down_proj", (n, hidden, inter), stack_columns), n, inter)
        return SinkMoE(router, w.swiglu_experts(i, f"{m}.experts", routed, hidden, inter), shared)

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
