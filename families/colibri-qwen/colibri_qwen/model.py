"""The Qwen MoE families on colibri's shared blocks (transformers: models/qwen2_moe,
qwen3_moe, qwen3_next, qwen3_5_moe (and its text model, qwen3_5_moe_text) and qwen3_vl_moe, modeling_*.py)."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from colibri_core.model.config import ModelArgs, bounded
from colibri_core.errors import ModelFormatError, UnsupportedModelError
from colibri_core.model.family import Family
from colibri_core.nn import (Attention, GatedDeltaNet, GatedRMSNorm, Linear, RoutedExperts, SoftmaxTopKRouter, SparseMoE,
                             build_rope, rope_parameters)
from colibri_core.nn.assembly import Names, build_decoder
from colibri_core.model.builders import softmax_moe
from colibri_core.nn.deltanet import conv_weight_2d, neg_exp


@dataclass
class QwenArgs(ModelArgs):
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    intermediate_size: int | None = None  # the dense MLP of non-MoE layers
    shared_expert_intermediate_size: int | None = bounded(1, 1 << 19, default=None)
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    max_position_embeddings: int = 32768
    rms_norm_eps: float = 1e-6
    norm_topk_prob: bool = False
    decoder_sparse_step: int = bounded(1, 1 << 10, default=1)
    mlp_only_layers: list[int] = field(default_factory=list)
    attention_bias: bool = False
    qkv_bias: bool = True  # qwen2_moe's name for q/k/v biases
    use_sliding_window: bool = False
    layer_types: list[str] | None = None
    tie_word_embeddings: bool = False
    hidden_act: str = "silu"

    def validate(self, source):
        self.num_key_value_heads = self.num_key_value_heads or self.num_attention_heads
        self.default_head_dim(source)
        self.require_multiple(source, "num_attention_heads", "num_key_value_heads")
        self.require_at_most(source, "num_experts_per_tok", "num_experts")
        if not all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < self.num_hidden_layers for i in self.mlp_only_layers):
            raise ModelFormatError(f"{source}: mlp_only_layers must list layer indices below {self.num_hidden_layers}, got {self.mlp_only_layers!r}")
        if self.hidden_act != "silu":
            raise UnsupportedModelError(f"{source}: hidden_act {self.hidden_act!r} is not supported by the qwen families (only 'silu')")
        if self.use_sliding_window:
            raise UnsupportedModelError(f"{source}: use_sliding_window is not supported (no sliding-window attention yet)")
        if self.intermediate_size is None and not all(self.is_moe(i) for i in range(self.num_hidden_layers)):
            raise ModelFormatError(f"{source}: missing field 'intermediate_size' (the dense MLP of non-MoE layers)")

    def is_moe(self, i: int) -> bool:
        return i not in self.mlp_only_layers and (i + 1) % self.decoder_sparse_step == 0


@dataclass
class HybridArgs(QwenArgs):
    """Qwen3-Next / Qwen3.5: Gated DeltaNet layers between gated full-attention layers."""

    head_dim: int | None = 256
    norm_topk_prob: bool = True
    linear_conv_kernel_dim: int = bounded(1, 64, default=4)
    linear_key_head_dim: int = bounded(1, 1 << 12, default=128)
    linear_value_head_dim: int = bounded(1, 1 << 12, default=128)
    linear_num_key_heads: int = bounded(1, 1 << 12, default=16)
    linear_num_value_heads: int = bounded(1, 1 << 12, default=32)
    full_attention_interval: int = bounded(1, 1 << 10, default=4)

    def validate(self, source):
        super().validate(source)
        if self.layer_types is None:
            n = self.full_attention_interval
            self.layer_types = ["full_attention" if (i + 1) % n == 0 else "linear_attention" for i in range(self.num_hidden_layers)]
        if len(self.layer_types) != self.num_hidden_layers:
            raise ModelFormatError(f"{source}: layer_types has {len(self.layer_types)} entries for {self.num_hidden_layers} layers")
        self.require_multiple(source, "linear_num_value_heads", "linear_num_key_heads")


class QwenMoe(Family):
    """Decoder layers of (token mixer, MoE or dense MLP); subclasses change the pieces."""

    name = "qwen_moe"
    args_class = QwenArgs
    names = Names()  # where embed_tokens, layers and norm live
    offset_norms = False  # True: RMSNorms scale by (1 + w)
    shared_expert = True  # MoE layers add a shared expert scaled by sigmoid(shared_expert_gate)
    partial_rotary_factor = 1.0  # when the config gives none
    mixers = ("full_attention",)

    def parse(self, config: dict, source: str):
        """The typed arguments and the RoPE of a config.json dict."""
        text, source = self.text_config(config, source)
        a = self.args_class.from_dict(text, source)
        if any(t not in self.mixers for t in a.layer_types or ()):
            raise UnsupportedModelError(f"{source}: layer types {sorted(set(a.layer_types) - set(self.mixers))} are not supported by {self.name}")
        params = rope_parameters(text, source)
        params.setdefault("partial_rotary_factor", self.partial_rotary_factor)
        return a, build_rope({**text, "rope_parameters": params}, a.head_dim, source)

    def build(self, config, w):
        a, rope = self.parse(config, w.config_source)
        a.tie_word_embeddings = self.tied(config, a)

        def norm(prefix, dim):
            return w.rms_norm(prefix, dim, a.rms_norm_eps, offset=self.offset_norms)

        def mixer(i, p):  # past the decoder layers: an MTP layer, full attention (nn.mtp)
            kind = a.layer_types[i] if a.layer_types and i < a.num_hidden_layers else "full_attention"
            return self.attention(a, w, i, p, rope, norm) if kind == "full_attention" else self.linear_attention(a, w, i, p)

        return build_decoder(a, w, mixer, lambda i, p: self.mlp(a, w, i, p), self.names,
                             offset_norms=self.offset_norms, refused_tokens=self.refused_tokens(config))

    def text_config(self, config: dict, source: str) -> tuple[dict, str]:
        return config, source

    def tied(self, config: dict, a: QwenArgs) -> bool:
        """Whether the LM head is the embeddings (the text config says, unless overridden)."""
        return a.tie_word_embeddings

    def refused_tokens(self, config: dict) -> dict[int, str]:
        return {}

    def attention(self, a, w, i, p, rope, norm):  # qwen2_moe: q/k/v biases, no q/k norms
        return Attention(layer=i, **w.attention_projections(f"{p}.self_attn", a.hidden_size, a.num_attention_heads,
                                                            a.num_key_value_heads, a.head_dim, qkv_bias=a.qkv_bias),
                         n_heads=a.num_attention_heads, n_kv_heads=a.num_key_value_heads, head_dim=a.head_dim, rope=rope)

    def mlp(self, a, w, i, p):
        p = f"{p}.mlp"
        # an MTP layer (past the decoder layers) is MoE or dense by its own index (vLLM's qwen3_next_mtp)
        if not a.is_moe(i if i < a.num_hidden_layers else i - a.num_hidden_layers):
            return w.swiglu(p, a.hidden_size, a.intermediate_size)
        shared = {}
        if self.shared_expert:
            if a.shared_expert_intermediate_size is None:
                raise ModelFormatError(f"{w.config_source}: missing field 'shared_expert_intermediate_size'")
            shared = dict(shared=w.swiglu(f"{p}.shared_expert", a.hidden_size, a.shared_expert_intermediate_size),
                          shared_gate=w.linear(f"{p}.shared_expert_gate", 1, a.hidden_size))
        return softmax_moe(w, i, p, a.num_experts, a.num_experts_per_tok, a.norm_topk_prob, a.hidden_size,
                           a.moe_intermediate_size, **shared)


class Qwen2Moe(QwenMoe):
    name = "qwen2_moe"


class Qwen3Moe(QwenMoe):
    """Per-head q/k RMSNorm before RoPE; all four projections biased by attention_bias."""

    name = "qwen3_moe"
    shared_expert = False

    def text_config(self, config, source):
        if "num_experts" not in config and "num_local_experts" in config:  # transformers 5 writes the alias
            config = {**config, "num_experts": config["num_local_experts"]}
        return config, source

    def attention(self, a, w, i, p, rope, norm):
        b = a.attention_bias
        return Attention(layer=i, **w.attention_projections(f"{p}.self_attn", a.hidden_size, a.num_attention_heads,
                                                            a.num_key_value_heads, a.head_dim, qkv_bias=b, o_bias=b),
                         n_heads=a.num_attention_heads, n_kv_heads=a.num_key_value_heads, head_dim=a.head_dim, rope=rope,
                         q_norm=norm(f"{p}.self_attn.q_norm", a.head_dim), k_norm=norm(f"{p}.self_attn.k_norm", a.head_dim),
                         qk_norm_per_head=True)


class Qwen3Next(Qwen3Moe):
    """Gated DeltaNet and gated full attention, (1 + w) RMSNorms, partial RoPE, shared expert."""

    name = "qwen3_next"
    args_class = HybridArgs
    offset_norms = True
    shared_expert = True
    partial_rotary_factor = 0.25  # transformers' default when the config gives none
    mixers = ("full_attention", "linear_attention")

    def attention(self, a, w, i, p, rope, norm):
        b = a.attention_bias
        return Attention(layer=i, **w.attention_projections(f"{p}.self_attn", a.hidden_size, a.num_attention_heads,
                                                            a.num_key_value_heads, a.head_dim, qkv_bias=b, o_bias=b, q_per_head=2),
                         n_heads=a.num_attention_heads, n_kv_heads=a.num_key_value_heads, head_dim=a.head_dim, rope=rope,
                         q_norm=norm(f"{p}.self_attn.q_norm", a.head_dim), k_norm=norm(f"{p}.self_attn.k_norm", a.head_dim),
                         qk_norm_per_head=True, output_gate=True)

    def linear_attention(self, a, w, i, p):
        hk, hv, dk, dv = a.linear_num_key_heads, a.linear_num_value_heads, a.linear_key_head_dim, a.linear_value_head_dim
        conv_dim = 2 * hk * dk + hv * dv
        p = f"{p}.linear_attn"
        return GatedDeltaNet(
            layer=i, projections=self.delta_projections(a, w, p),
            conv_weight=w.param(f"{p}.conv1d.weight", (conv_dim, 1, a.linear_conv_kernel_dim), conv_weight_2d),
            a_neg=w.param(f"{p}.A_log", (hv,), neg_exp), dt_bias=w.param(f"{p}.dt_bias", (hv,)),
            norm=GatedRMSNorm(w.param(f"{p}.norm.weight", (dv,)), a.rms_norm_eps),
            out=w.linear(f"{p}.out_proj", a.hidden_size, hv * dv),
            n_k_heads=hk, n_v_heads=hv, k_head_dim=dk, v_head_dim=dv)

    def delta_projections(self, a, w, p):
        """in_proj_qkvz and in_proj_ba store their rows grouped by key head ([q k v z] and
        [b a] per group); regrouped once at load to [q | k | v | z] and [b | a]."""
        hk, r, dk, dv = a.linear_num_key_heads, a.linear_num_value_heads // a.linear_num_key_heads, a.linear_key_head_dim, a.linear_value_head_dim
        qkvz, ba = regroup_rows(hk, (dk, dk, r * dv, r * dv)), regroup_rows(hk, (r, r))
        return [Linear(w.param(f"{p}.in_proj_qkvz.weight", (len(qkvz), a.hidden_size), lambda m: m[qkvz])),
                Linear(w.param(f"{p}.in_proj_ba.weight", (len(ba), a.hidden_size), lambda m: m[ba]))]


class VisionLanguageText:
    """Mixed into a Qwen family that runs the text model of a vision-language checkpoint:
    the config under ``text_config`` (``ignored`` keys dropped), the LM head tied or not
    as the top-level config says, and prompts holding the image or video placeholder
    (``media_tokens``: kind -> the id when the config names none) refused."""

    ignored: tuple[str, ...] = ()
    media_tokens: tuple[tuple[str, int], ...] = ()

    def text_config(self, config, source):
        text = config.get("text_config")
        if not isinstance(text, dict):
            raise ModelFormatError(f"{source}: a {self.name} config needs a 'text_config' object")
        return {k: v for k, v in text.items() if k not in self.ignored}, f"{source} (text_config)"

    def tied(self, config, a):  # the vision-language config decides, at its top level
        tied = config.get("tie_word_embeddings", False)
        if not isinstance(tied, bool):
            raise ModelFormatError(f"config.json: field 'tie_word_embeddings' must be bool, got {tied!r}")
        return tied

    def refused_tokens(self, config):
        why = "{} input is not supported: colibri runs the text model of this " + self.name + " checkpoint"
        ids = {kind: config.get(f"{kind}_token_id", default) for kind, default in self.media_tokens}
        return {i: why.format(kind) for kind, i in ids.items() if isinstance(i, int) and not isinstance(i, bool)}


class Qwen3_5Moe(VisionLanguageText, Qwen3Next):
    """The text model of the Qwen3.5/3.6 MoE vision-language checkpoint: config under
    ``text_config``, weights under ``model.language_model.*``. The vision tower and the MTP
    head are not loaded; prompts holding image or video placeholders are refused."""

    name = "qwen3_5_moe"
    names = Names(model="model.language_model.")
    # every layer is MoE and top-k weights are always renormalised (the text config has
    # no mlp_only_layers, decoder_sparse_step, norm_topk_prob or intermediate_size)
    ignored = ("mlp_only_layers", "decoder_sparse_step", "norm_topk_prob", "intermediate_size")
    media_tokens = (("image", 248056), ("video", 248057))

    def delta_projections(self, a, w, p):
        hv, key_dim, value_dim = a.linear_num_value_heads, a.linear_num_key_heads * a.linear_key_head_dim, a.linear_num_value_heads * a.linear_value_head_dim
        return [w.linear(f"{p}.in_proj_qkv", 2 * key_dim + value_dim, a.hidden_size), w.linear(f"{p}.in_proj_z", value_dim, a.hidden_size),
                w.linear(f"{p}.in_proj_b", hv, a.hidden_size), w.linear(f"{p}.in_proj_a", hv, a.hidden_size)]


class Qwen3_5MoeText(Qwen3_5Moe):
    """Qwen3.5/3.6 MoE's text model saved on its own (``qwen3_5_moe_text``, transformers'
    Qwen3_5MoeForCausalLM): the same layers, the config flat, weights under ``model.*``,
    the LM head tied as that config says; no media placeholders to refuse."""

    name = "qwen3_5_moe_text"
    names = Names()

    def text_config(self, config, source):
        return {k: v for k, v in config.items() if k not in self.ignored}, source

    def tied(self, config, a):
        return a.tie_word_embeddings

    def refused_tokens(self, config):
        return {}


class Qwen3VLMoe(VisionLanguageText, Qwen3Moe):
    """The text model of Qwen3-VL's MoE checkpoints (``qwen3_vl_moe``; transformers:
    models/qwen3_vl_moe): Qwen3-MoE layers (per-head q/k norm, dense ``mlp_only_layers`` /
    ``decoder_sparse_step``) under ``model.language_model.*``, config under ``text_config``.

    Its rope is interleaved MRoPE: each frequency of the rotary half takes the time,
    height or width position (``mrope_section``); a text token's three positions are all
    its index, so for text the rotation is plain RoPE over ``rope_theta`` and the
    sections change nothing. The router always renormalises its top-k weights (the
    model reads no ``norm_topk_prob``). The vision tower and DeepStack are not loaded;
    prompts holding image or video placeholders are refused. Experts are fused: published
    checkpoints store ``experts.gate_up_proj`` as (experts, hidden, 2 x inter) and
    ``experts.down_proj`` as (experts, inter, hidden), transformers 5 saves them as it
    keeps them in memory, (experts, 2 x inter, hidden) and (experts, hidden, inter);
    both load: a layer's experts read in the layout both tensors' shapes fit,
    transformers 5's tried first."""

    name = "qwen3_vl_moe"
    names = Names(model="model.language_model.")
    media_tokens = (("image", 151655), ("video", 151656))
    ROPE_THETA = 500000.0  # transformers' default_theta for a text config spelling none

    def text_config(self, config, source):
        text, source = super().text_config(config, source)
        text = {"rope_theta": self.ROPE_THETA, **text, "norm_topk_prob": True}  # whatever the config says
        if "num_experts" not in text and "num_local_experts" in text:  # transformers 5 writes the alias
            text["num_experts"] = text["num_local_experts"]
        return text, source

    def mlp(self, a, w, i, p):
        if not a.is_moe(i):
            return super().mlp(a, w, i, p)
        p = f"{p}.mlp"
        hidden, inner, n = a.hidden_size, a.moe_intermediate_size, a.num_experts
        router = SoftmaxTopKRouter(w.linear(f"{p}.gate", n, hidden), a.num_experts_per_tok, a.norm_topk_prob)
        return SparseMoE(router, self.experts(w, i, f"{p}.experts", n, hidden, inner))

    @staticmethod
    def experts(w, layer, e, n, hidden, inner):
        try:  # transformers 5's layout (or per-expert tensors)
            return w.swiglu_experts(layer, e, n, hidden, inner)
        except ModelFormatError as error:
            if not w.has(f"{e}.gate_up_proj"):
                raise
            first = error
        try:  # the published layout: each expert's matrices stored (in, out)
            matrices = {"gate_up": (f"{e}.gate_up_proj", (hidden, 2 * inner)), "down": (f"{e}.down_proj", (inner, hidden))}
            return RoutedExperts(w.expert_layer(layer, n, matrices, transforms={"gate_up": np.transpose, "down": np.transpose}))
        except ModelFormatError:
            raise ModelFormatError(f"{first} (nor the published layout: gate_up_proj {[n, hidden, 2 * inner]}, "
                                   f"down_proj {[n, inner, hidden]})") from None


def regroup_rows(groups: int, sizes: tuple[int, ...]) -> np.ndarray:
    """Row order turning [group 0: part 0, part 1, ... | group 1: ...] into
    [part 0 of every group | part 1 of every group | ...]."""
    width, starts = sum(sizes), np.cumsum((0,) + tuple(sizes))
    return np.concatenate([np.arange(g * width + starts[j], g * width + starts[j] + size)
                           for j, size in enumerate(sizes) for g in range(groups)])
