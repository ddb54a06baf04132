"""Nemotron-H on colibri's shared blocks (transformers: models/nemotron_h).

Every layer is one pre-norm residual block, x + mixer(norm(x)), its kind given by
``layers_block_type`` (or the published ``hybrid_override_pattern``: M, *, -, E):

- "linear_attention" (M): a Mamba-2 mixer (``colibri_core.model.builders.mamba2``), dt
  floored at ``time_step_min`` in the chunked scan, as transformers' mixer does (it reads
  no ``time_step_limit``);
- "full_attention" (*): grouped-query attention without positional encoding or biases;
- "mlp" (-): up_proj, squared ReLU, down_proj;
- "moe" (E): sigmoid scores, the top ``num_experts_per_tok`` chosen on the scores plus
  ``e_score_correction_bias`` among the ``topk_group`` best of ``n_group`` groups,
  renormalised (+ 1e-20) when ``norm_topk_prob``, times ``routed_scaling_factor``, over
  squared-ReLU experts without a gate (``experts.{e}.up_proj`` / ``down_proj``, or fused
  ``experts.up_proj`` (E, I, H) / ``down_proj`` (E, H, I)), plus a squared-ReLU shared
  expert on the same input.

A mixer layer is a ``DecoderLayer`` without an MLP and an MLP or MoE layer one without a
mixer; its one norm is ``norm`` either way. Tensors live under ``backbone.`` as published
(``embeddings``, ``norm_f``), or ``model.`` as transformers keeps them in memory.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from colibri_core.errors import ModelFormatError, UnsupportedModelError
from colibri_core.model.builders import mamba2
from colibri_core.model.config import ModelArgs, bounded
from colibri_core.model.family import Family
from colibri_core.nn import (Attention, RoutedExperts, SigmoidGroupedTopKRouter, SparseMoE, UngatedActivation,
                             UngatedMLP)
from colibri_core.nn.assembly import Names, build_decoder

KINDS = ("linear_attention", "full_attention", "mlp", "moe")
PATTERN = {"M": "linear_attention", "*": "full_attention", "-": "mlp", "E": "moe"}
LEGACY_KINDS = {"mamba": "linear_attention", "attention": "full_attention"}  # transformers' remap_legacy_layer_types
# older configs' names, which transformers reads in place of the current ones
LEGACY_FIELDS = {"mamba_n_groups": "n_groups", "mamba_d_conv": "conv_kernel", "mamba_dt_min": "time_step_min",
                 "mamba_conv_bias": "use_conv_bias", "mamba_chunk_size": "chunk_size"}
ROUTER_NORM_EPS = 1e-20  # what transformers' NemotronHTopkRouter adds to the sum of the chosen scores


@dataclass
class NemotronHArgs(ModelArgs):
    """config.json's fields (transformers' NemotronHConfig defaults)."""

    vocab_size: int = 131072
    hidden_size: int = 4096
    layers_block_type: list | None = None
    num_attention_heads: int = 32
    num_key_value_heads: int | None = 8
    head_dim: int | None = 128
    max_position_embeddings: int = 4096
    sliding_window: int | None = None
    intermediate_size: int = 21504
    mlp_hidden_act: str = "relu2"
    mlp_bias: bool = False
    ssm_state_size: int = bounded(1, 1 << 12, default=128)
    mamba_num_heads: int = bounded(1, 1 << 12, default=128)
    mamba_head_dim: int = bounded(1, 1 << 12, default=64)
    mamba_hidden_act: str = "silu"
    n_groups: int = bounded(1, 1 << 12, default=8)
    conv_kernel: int = bounded(1, 1 << 10, default=4)
    time_step_min: float = bounded(0.0, 1e3, default=0.001)
    use_conv_bias: bool = True
    chunk_size: int = bounded(1, 1 << 16, default=128)
    use_bias: bool = False
    n_routed_experts: int = bounded(1, 1 << 14, default=8)
    num_experts_per_tok: int = 2
    moe_intermediate_size: int = 7688
    moe_shared_expert_intermediate_size: int = bounded(1, 1 << 19, default=7688)
    moe_latent_size: int | None = None
    routed_scaling_factor: float = bounded(0.0, 1e6, default=1.0)
    n_group: int = bounded(1, 1 << 10, default=1)
    topk_group: int = bounded(1, 1 << 10, default=1)
    norm_topk_prob: bool = True
    layer_norm_epsilon: float = bounded(0.0, 1.0, default=1e-5)

    @property
    def num_hidden_layers(self) -> int:  # transformers derives it from the layer kinds too
        return len(self.layers_block_type)

    @property
    def tie_word_embeddings(self) -> bool:
        """transformers' NemotronHForCausalLM ties nothing, whatever the config's
        tie_word_embeddings says: its lm_head is a tensor of its own, saved and read."""
        return False

    @property
    def rms_norm_eps(self) -> float:  # what build_decoder reads
        return self.layer_norm_epsilon

    def validate(self, source):
        kinds = self.layers_block_type
        if not isinstance(kinds, list) or not kinds or not all(k in KINDS for k in kinds):
            raise ModelFormatError(f"{source}: layers_block_type must list one of {KINDS} per layer, got {kinds!r}")
        if len(kinds) > 1 << 10:
            raise ModelFormatError(f"{source}: layers_block_type lists {len(kinds)} layers, more than {1 << 10}")
        for name, value, wanted in (("mlp_hidden_act", self.mlp_hidden_act, "relu2"),
                                    ("mamba_hidden_act", self.mamba_hidden_act, "silu")):
            if value != wanted:
                raise UnsupportedModelError(f"{source}: {name} {value!r} is not supported by nemotron_h (only {wanted!r})")
        for name in ("moe_latent_size", "sliding_window"):
            if getattr(self, name) is not None:
                raise UnsupportedModelError(f"{source}: {name} is not supported by nemotron_h (it must be null)")
        self.num_key_value_heads = self.num_key_value_heads or self.num_attention_heads
        self.default_head_dim(source)
        self.require_multiple(source, "num_attention_heads", "num_key_value_heads")
        self.require_multiple(source, "mamba_num_heads", "n_groups")
        self.require_at_most(source, "num_experts_per_tok", "n_routed_experts")
        self.require_multiple(source, "n_routed_experts", "n_group")
        self.require_at_most(source, "topk_group", "n_group")


class NemotronH(Family):
    name = "nemotron_h"

    @staticmethod
    def parse(config: dict, source: str = "config.json") -> NemotronHArgs:
        """The config as transformers reads it: legacy field names, ``layer_types`` and
        ``num_local_experts`` (its attribute map), ``hybrid_override_pattern``."""
        raw = dict(config)
        for old, new in LEGACY_FIELDS.items():
            if old in raw:
                raw[new] = raw[old]
        for alias, name in (("layer_types", "layers_block_type"), ("num_local_experts", "n_routed_experts")):
            if raw.get(name) is None and raw.get(alias) is not None:
                raw[name] = raw[alias]
        kinds = raw.get("layers_block_type")
        if kinds is None:
            pattern = raw.get("hybrid_override_pattern")
            if pattern is None:
                kinds = ["linear_attention", "moe", "full_attention", "mlp"]  # transformers' default
            elif not isinstance(pattern, str) or not pattern or set(pattern) - set(PATTERN):
                raise ModelFormatError(f"{source}: hybrid_override_pattern must be a string of {''.join(PATTERN)}, "
                                       f"got {pattern!r}")
            else:
                kinds = [PATTERN[c] for c in pattern]
        if isinstance(kinds, list):
            kinds = [LEGACY_KINDS.get(k, k) if isinstance(k, str) else k for k in kinds]
        raw["layers_block_type"] = kinds
        return NemotronHArgs.from_dict(raw, source)

    def build(self, config, w):
        a = self.parse(config, w.config_source)
        hidden, heads, kv_heads, d = a.hidden_size, a.num_attention_heads, a.num_key_value_heads, a.head_dim
        root = "backbone." if w.has("backbone.embeddings.weight") else "model."
        relu2 = UngatedActivation("relu2")

        def dense(s, inner):
            b = a.mlp_bias
            return UngatedMLP(w.linear(f"{s}.up_proj", inner, hidden, bias=b), w.linear(f"{s}.down_proj", hidden, inner, bias=b),
                              relu2)

        def mixer(i, p):
            kind, s = a.layers_block_type[i], f"{p}.mixer"
            if kind == "linear_attention":
                return mamba2(w, i, s, hidden=hidden, heads=a.mamba_num_heads, head_dim=a.mamba_head_dim,
                              groups=a.n_groups, state_size=a.ssm_state_size, conv_kernel=a.conv_kernel,
                              eps=a.layer_norm_epsilon, chunk_size=a.chunk_size, conv_bias=a.use_conv_bias,
                              proj_bias=a.use_bias, dt_limit=(a.time_step_min, math.inf))
            if kind == "full_attention":
                return Attention(layer=i, **w.attention_projections(s, hidden, heads, kv_heads, d), n_heads=heads,
                                 n_kv_heads=kv_heads, head_dim=d, rope=None)
            return None

        def mlp(i, p):
            kind, s = a.layers_block_type[i], f"{p}.mixer"
            if kind == "mlp":
                return dense(s, a.intermediate_size)
            if kind != "moe":
                return None
            n, inner = a.n_routed_experts, a.moe_intermediate_size
            if w.has(f"{s}.experts.up_proj"):  # fused, as transformers keeps them in memory
                up, down = f"{s}.experts.up_proj", f"{s}.experts.down_proj"
            else:  # one tensor per expert, as published and saved
                up, down = f"{s}.experts.{{e}}.up_proj.weight", f"{s}.experts.{{e}}.down_proj.weight"
            experts = RoutedExperts(w.expert_layer(i, n, {"up": (up, (inner, hidden)), "down": (down, (hidden, inner))},
                                                   activation=relu2))
            router = SigmoidGroupedTopKRouter(
                w.linear(f"{s}.gate", n, hidden), a.num_experts_per_tok, bias=w.param(f"{s}.gate.e_score_correction_bias", (n,)),
                n_group=a.n_group, topk_group=a.topk_group, norm_topk_prob=a.norm_topk_prob,
                routed_scaling_factor=a.routed_scaling_factor, norm_eps=ROUTER_NORM_EPS)
            return SparseMoE(router, experts, shared=dense(f"{s}.shared_experts", a.moe_shared_expert_intermediate_size))

        return build_decoder(a, w, mixer, mlp, Names(model=root, norm="norm_f", embed="embeddings"),
                             norm_names=("norm", "norm"))
