"""The GLM MoE models on colibri's shared blocks (transformers: models/glm4_moe,
models/glm4_moe_lite, models/glm_moe_dsa).

All three are ``colibri_core.nn.assembly``'s decoder with the MLPs of
``colibri_core.model.builders``: dense SwiGLU layers first, then the sigmoid group-limited
router with shared experts. What is GLM's own:

- glm4_moe: grouped-query attention (the core ``Attention``) with optional q/k/v bias,
  per-head q/k RMSNorm (``use_qk_norm``) and partial rotary (``partial_rotary_factor``,
  0.5 when absent; rotate-half on the first part of each head);
- glm4_moe_lite: DeepSeek-V3's MLA as is; dense first layer unless ``mlp_layer_types``;
- glm_moe_dsa (GLM-5): MLA with interleaved rope plus the DSA indexer, whose rope is
  interleaved too, and ``indexer_types``: a "shared" layer reuses the top-k selection
  of the last full indexer layer (derived from ``index_topk_pattern`` or
  ``index_topk_freq`` / ``index_skip_topk_offset`` when absent).

Multi-token-prediction layers (``num_nextn_predict_layers``, beyond
``num_hidden_layers``) are ignored.
"""

from __future__ import annotations

from dataclasses import dataclass

from colibri_core.model.config import bounded
from colibri_core.errors import ModelFormatError
from colibri_core.model.family import Family
from colibri_core.nn import Attention, build_rope
from colibri_core.nn.assembly import build_decoder
from colibri_core.model.builders import DSAArgs, MLAArgs, MLAMoEFamily, SigmoidMoEArgs, sigmoid_moe_mlp
from colibri_core.nn.rope import rope_parameters


@dataclass(kw_only=True)
class Glm4MoeArgs(SigmoidMoEArgs):
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    use_qk_norm: bool = False
    partial_rotary_factor: float | None = bounded(0.0, 1.0, default=None)  # the pre-rope_parameters spelling
    rms_norm_eps: float = 1e-5

    def validate(self, source):
        super().validate(source)
        heads = self.num_attention_heads
        self.num_key_value_heads = self.num_key_value_heads or heads
        if heads % self.num_key_value_heads:
            raise ModelFormatError(f"{source}: num_attention_heads {heads} is not a multiple of num_key_value_heads "
                                   f"{self.num_key_value_heads}")
        self.head_dim = self.head_dim or self.hidden_size // heads  # transformers' default
        if not self.head_dim:
            raise ModelFormatError(f"{source}: hidden_size {self.hidden_size} gives no head_dim for {heads} heads")


@dataclass(kw_only=True)
class Glm4MoeLiteArgs(MLAArgs):
    routed_scaling_factor: float = bounded(0.0, 1e6, default=1.8)
    rms_norm_eps: float = 1e-5

    def is_moe(self, layer):
        if self.mlp_layer_types is not None:
            return self.mlp_layer_types[layer] == "sparse"
        return layer >= 1  # transformers: ["dense"] + ["sparse"] * (n - 1), whatever first_k_dense_replace says


@dataclass(kw_only=True)
class GlmMoeDsaArgs(DSAArgs):
    routed_scaling_factor: float = bounded(0.0, 1e6, default=2.5)
    first_k_dense_replace: int = bounded(0, 1 << 10, default=3)
    index_n_heads: int = bounded(1, 1 << 10, default=32)
    rms_norm_eps: float = 1e-5
    indexer_types: list | None = None
    index_topk_pattern: str | list | None = None
    index_topk_freq: int = 1
    index_skip_topk_offset: int = 2

    def validate(self, source):
        super().validate(source)
        kinds = indexer_kinds(self, source)
        if kinds[0] == "shared":
            field = "indexer_types" if self.indexer_types is not None else "index_topk_pattern"
            raise ModelFormatError(f"{source}: {field}: layer 0 cannot be 'shared' (there is no earlier indexer to share)")
        self.indexer_types = kinds

    def shared_indexer(self, layer):
        return self.indexer_types[layer] == "shared"


def indexer_kinds(a, source) -> list:
    """Each layer's indexer, "full" or "shared", as transformers derives it (GLM-5 and
    GLM-5 Next), in its order: ``indexer_types``, ``index_topk_pattern`` ("FSSF..." or a
    list), ``index_topk_freq`` / ``index_skip_topk_offset``."""
    n = a.num_hidden_layers
    field, raw = ("indexer_types", a.indexer_types) if a.indexer_types is not None else (
        "index_topk_pattern", a.index_topk_pattern)
    if raw is None:
        freq, offset = max(a.index_topk_freq, 1), a.index_skip_topk_offset
        return ["full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(n)]
    kinds = [{"F": "full", "S": "shared"}.get(c, c) for c in raw] if isinstance(raw, str) else list(raw)
    if len(kinds) != n or not all(k in ("full", "shared") for k in kinds):
        raise ModelFormatError(f"{source}: {field} must give 'full' or 'shared' for each of the {n} layers, got {raw!r}")
    return kinds


class Glm4Moe(Family):
    name = "glm4-moe"

    def build(self, config, w):
        src = w.config_source
        a = Glm4MoeArgs.from_dict(config, src)
        hidden, heads, kv_heads, hd, eps = a.hidden_size, a.num_attention_heads, a.num_key_value_heads, a.head_dim, a.rms_norm_eps
        rope = build_rope(config, hd, src, partial_rotary_factor=_partial_rotary_factor(config, a, src))

        def attention(i, p):
            s = f"{p}.self_attn"
            return Attention(
                # q/k/v biased by attention_bias, o_proj never
                layer=i, **w.attention_projections(s, hidden, heads, kv_heads, hd, qkv_bias=a.attention_bias),
                n_heads=heads, n_kv_heads=kv_heads, head_dim=hd, rope=rope,
                q_norm=w.rms_norm(f"{s}.q_norm", hd, eps) if a.use_qk_norm else None,
                k_norm=w.rms_norm(f"{s}.k_norm", hd, eps) if a.use_qk_norm else None, qk_norm_per_head=True)

        return build_decoder(a, w, attention, sigmoid_moe_mlp(a, w))


def _partial_rotary_factor(config, a: Glm4MoeArgs, src) -> float | None:
    """transformers' priority: rope_parameters (None: build_rope reads and checks it), then
    the top-level field (an explicit null there means full rotary), then GLM's 0.5."""
    if rope_parameters(config, src).get("partial_rotary_factor") is not None:
        return None
    if "partial_rotary_factor" in config:
        return 1.0 if a.partial_rotary_factor is None else a.partial_rotary_factor
    return 0.5


class Glm4MoeLite(MLAMoEFamily):
    name, args = "glm4-moe-lite", Glm4MoeLiteArgs


class GlmMoeDsa(MLAMoEFamily):
    name, args = "glm-moe-dsa", GlmMoeDsaArgs
    mixer_options = {"interleave": True, "indexer_interleave": True}  # GLM-5 rotates as interleaved pairs in both
