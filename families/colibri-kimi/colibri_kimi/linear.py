"""Kimi Linear (model_type ``kimi_linear``, transformers: models/kimi_linear): Kimi Delta
Attention layers beside NoPE MLA layers, DeepSeek-V3's sigmoid MoE.

- KDA (``linear_attention`` layers): Gated DeltaNet with a decay per key channel
  (``GatedDeltaNet(gate_per_channel=True)``): q, k, v projections through short causal
  convolutions and silu, q and k L2-normalised, g = -exp(A_log) * softplus(f_b(f_a(x)) +
  dt_bias) per (head, key channel), beta = sigmoid(b_proj(x)); the output RMS-normalised
  (``o_norm``) and gated by sigmoid(g_b(g_a(x))), then o_proj. Its state is a
  ``RecurrentState`` in the core cache, as Gated DeltaNet's.
- MLA (``full_attention`` layers): DeepSeek-V3's latent attention without any position
  encoding (transformers' KimiLinearAttention: the "rope" part of the query and the
  shared key is used unrotated); scale qk_head_dim ** -0.5.
- MLP: a dense SwiGLU where ``mlp_layer_types`` says "dense" (else the first
  ``first_k_dense_replace`` layers, default 1), else the sigmoid group-limited router
  with its score-correction bias over routed experts plus shared experts.

Checkpoints name tensors as the Hub's (``block_sparse_moe``, per-expert ``w1/w2/w3``,
``q_conv1d``/``k_conv1d``/``v_conv1d``, the forget gate's tensors directly under
``self_attn``: what transformers' save_pretrained writes) or as transformers keeps them in
memory (``mlp``, fused experts, ``conv1d``, ``forget_gate.*``); both are read.
"""

from __future__ import annotations

from dataclasses import dataclass

from colibri_core.errors import ModelFormatError
from colibri_core.model.config import bounded
from colibri_core.model.family import Family
from colibri_core.nn.assembly import build_decoder
from colibri_core.model.builders import MLAArgs, kda, mla_attention, sigmoid_moe

# transformers' attribute_map: config.json spells these fields its own way
ALIASES = {
    "model_max_length": "max_position_embeddings",
    "moe_renormalize": "norm_topk_prob",
    "num_expert_group": "n_group",
    "num_experts": "n_routed_experts",
    "num_local_experts": "n_routed_experts",
    "num_experts_per_token": "num_experts_per_tok",
    "num_shared_experts": "n_shared_experts",
}
# the checkpoint's linear_attn_config sub-object (wins over the top-level fields)
LINEAR_ATTN_KEYS = {"head_dim": "linear_head_dim", "num_heads": "linear_num_heads",
                    "short_conv_kernel_size": "linear_conv_kernel_dim"}
# fields of the DeepSeek configs transformers' kimi_linear never reads: its router is
# always sigmoid noaux_tc, every layer past the dense ones is MoE
IGNORED = ("scoring_func", "topk_method", "moe_layer_freq", "rope_interleave")
LAYER_TYPES = ("full_attention", "linear_attention")


@dataclass(kw_only=True)
class KimiLinearArgs(MLAArgs):
    """transformers' KimiLinearConfig defaults, on the shared MLA / sigmoid MoE fields."""

    n_routed_experts: int = bounded(1, 1 << 14, default=256)
    num_experts_per_tok: int = 8
    n_shared_experts: int = bounded(0, 1 << 8, default=1)
    n_group: int = bounded(1, 1 << 10, default=1)
    topk_group: int = bounded(1, 1 << 10, default=1)
    routed_scaling_factor: float = bounded(0.0, 1e6, default=2.446)
    kv_lora_rank: int = bounded(1, 1 << 14, default=512)
    qk_rope_head_dim: int = bounded(1, 1 << 12, default=64)
    qk_nope_head_dim: int = bounded(1, 1 << 12, default=128)
    v_head_dim: int = bounded(1, 1 << 12, default=128)
    max_position_embeddings: int = 1048576
    rms_norm_eps: float = 1e-5
    layer_types: list | None = None
    linear_head_dim: int = bounded(1, 1 << 12, default=128)
    linear_num_heads: int = bounded(1, 1 << 12, default=32)
    linear_conv_kernel_dim: int = bounded(1, 64, default=4)

    def validate(self, source):
        super().validate(source)
        n = self.num_hidden_layers
        if self.layer_types is None:  # transformers' default: every 4th layer (from 4) full attention
            self.layer_types = ["full_attention" if i and i % 4 == 0 else "linear_attention" for i in range(n)]
        if len(self.layer_types) != n or not all(t in LAYER_TYPES for t in self.layer_types):
            raise ModelFormatError(f"{source}: layer_types must list 'full_attention' or 'linear_attention' for each "
                                   f"of the {n} layers, got {self.layer_types!r}")

    def is_moe(self, layer: int) -> bool:
        if self.mlp_layer_types is not None:
            return self.mlp_layer_types[layer] == "sparse"
        return layer >= self.first_k_dense_replace

    @classmethod
    def from_config(cls, config: dict, source: str) -> "KimiLinearArgs":
        return cls.from_dict(normalise(config, source), source)


def normalise(config: dict, source: str) -> dict:
    """config.json in our field names: transformers' aliases resolved, the checkpoint's
    ``linear_attn_config`` folded in (1-indexed layer lists to ``layer_types``), the fields
    transformers ignores dropped."""
    out = {k: v for k, v in config.items() if k not in IGNORED and k not in ALIASES}
    for alias, name in ALIASES.items():
        if config.get(alias) is None:
            continue
        if name in out and out[name] is not None and out[name] != config[alias]:
            raise ModelFormatError(f"{source}: fields {alias!r} ({config[alias]!r}) and {name!r} ({out[name]!r}) disagree")
        out[name] = config[alias]
    linear = config.get("linear_attn_config")
    if linear is None:
        return out
    if not isinstance(linear, dict):
        raise ModelFormatError(f"{source}: linear_attn_config must be an object")
    for key, name in LINEAR_ATTN_KEYS.items():
        if key in linear:
            out[name] = linear[key]
    if out.get("layer_types") is None and "full_attn_layers" in linear and "kda_layers" in linear:
        n = out.get("num_hidden_layers")
        if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= 1 << 10:
            raise ModelFormatError(f"{source}: field 'num_hidden_layers' must be an integer in [1, 1024], got {n!r}")
        types: list = [None] * n
        for key, kind in (("full_attn_layers", "full_attention"), ("kda_layers", "linear_attention")):
            layers = linear[key]
            if not isinstance(layers, list) or not all(isinstance(i, int) and not isinstance(i, bool) and 1 <= i <= n
                                                       for i in layers):
                raise ModelFormatError(f"{source}: linear_attn_config.{key} must list layer numbers 1..{n}, got {layers!r}")
            for i in layers:
                if types[i - 1] is not None:
                    raise ModelFormatError(f"{source}: layer {i} is listed twice in linear_attn_config")
                types[i - 1] = kind
        if None in types:
            missing = [i + 1 for i, t in enumerate(types) if t is None]
            raise ModelFormatError(f"{source}: linear_attn_config names no kind for layers {missing}")
        out["layer_types"] = types
    return out


class KimiLinear(Family):
    name = "kimi_linear"

    def build(self, config, w):
        src = w.config_source
        a = KimiLinearArgs.from_config(config, src)
        # transformers' KimiLinearForCausalLM ties nothing (_tied_weights_keys = {}): lm_head
        # is always its own tensor, whatever tie_word_embeddings says
        a.tie_word_embeddings = False
        scale = (a.qk_nope_head_dim + a.qk_rope_head_dim) ** -0.5

        def mixer(i: int, prefix: str):
            s = f"{prefix}.self_attn"
            if a.layer_types[i] == "full_attention":
                return mla_attention(a, w, i, s, None, scale, interleave=False)
            return kda_layer(a, w, i, s)

        def mlp(i: int, prefix: str):
            p = f"{prefix}.block_sparse_moe"
            if f"{p}.gate_proj.weight" not in w.checkpoint and f"{p}.gate.weight" not in w.checkpoint:
                p = f"{prefix}.mlp"
            return sigmoid_moe(a, w, i, p) if a.is_moe(i) else w.swiglu(p, a.hidden_size, a.intermediate_size)

        return build_decoder(a, w, mixer, mlp)


def kda_layer(a: KimiLinearArgs, w, layer: int, s: str):
    """Kimi Delta Attention at ``s`` (A_log stored (1, 1, heads, 1))."""
    return kda(w, layer, s, heads=a.linear_num_heads, head_dim=a.linear_head_dim, hidden=a.hidden_size,
               conv_kernel=a.linear_conv_kernel_dim, eps=a.rms_norm_eps, a_log_shape=(1, 1, a.linear_num_heads, 1))
