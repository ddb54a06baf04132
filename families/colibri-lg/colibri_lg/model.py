"""K-EXAONE on colibri's shared blocks (transformers: models/exaone_moe).

Pre-norm layers of EXAONE 4's attention (grouped-query, per-head q/k RMSNorm, no biases)
and an MLP. The layers ``layer_types`` marks "sliding_attention" (by default all but
every ``sliding_window_pattern``-th) see the last ``sliding_window`` positions and rotate
q and k; the global layers use no position embedding (NoPE: ``Attention`` with
``rope=None``). The MLP is a dense SwiGLU where
``mlp_layer_types`` says "dense" (by default the first ``first_k_dense_replace`` layers),
else DeepSeek-V3's MoE: the sigmoid group-limited router (``e_score_correction_bias``,
saved beside the gate, for choosing only) over routed SwiGLU experts, plus
``num_shared_experts`` shared experts. Multi-token-prediction weights (``mtp.*``) are
ignored.
"""

from __future__ import annotations

from dataclasses import dataclass

from colibri_core.errors import ModelFormatError, UnsupportedModelError
from colibri_core.model.config import ModelArgs, bounded
from colibri_core.model.family import Family
from colibri_core.nn import Attention, SigmoidGroupedTopKRouter, SparseMoE, build_rope
from colibri_core.nn.assembly import build_decoder

LAYER_TYPES = ("full_attention", "sliding_attention")
MLP_TYPES = ("dense", "sparse")


@dataclass
class ExaoneMoeArgs(ModelArgs):
    """config.json's fields (transformers' ExaoneMoeConfig defaults)."""

    vocab_size: int = 102400
    hidden_size: int = 4096
    intermediate_size: int = 16384
    num_hidden_layers: int = 32
    num_attention_heads: int = 32
    num_key_value_heads: int = 32
    head_dim: int | None = None
    max_position_embeddings: int = 2048
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    hidden_act: str = "silu"
    sliding_window: int = bounded(1, 1 << 24, default=4096)  # always set (transformers refuses null)
    sliding_window_pattern: int | str | None = 4
    layer_types: list | None = None
    mlp_layer_types: list | None = None
    first_k_dense_replace: int = bounded(0, 1 << 10, default=1)
    moe_intermediate_size: int = 1024
    num_experts: int = bounded(1, 1 << 14, default=64)
    num_experts_per_tok: int = 8
    num_shared_experts: int = bounded(0, 1 << 8, default=1)
    norm_topk_prob: bool = True
    routed_scaling_factor: float = bounded(0.0, 1e6, default=2.5)
    n_group: int = bounded(1, 1 << 10, default=1)
    topk_group: int = bounded(1, 1 << 10, default=1)

    def validate(self, source):
        self.default_head_dim(source)
        self.require_multiple(source, "num_attention_heads", "num_key_value_heads")
        if self.hidden_act != "silu":
            raise UnsupportedModelError(f"{source}: hidden_act {self.hidden_act!r} is not supported by the "
                                        "exaone_moe family (only 'silu')")
        experts, groups = self.num_experts, self.n_group
        if experts % groups:
            raise ModelFormatError(f"{source}: num_experts {experts} is not divisible by n_group {groups}")
        if self.topk_group > groups:
            raise ModelFormatError(f"{source}: topk_group {self.topk_group} exceeds n_group {groups}")
        if groups > 1 and experts // groups < 2:
            raise ModelFormatError(f"{source}: groups of one expert cannot be scored (num_experts {experts}, n_group {groups})")
        if self.num_experts_per_tok > self.topk_group * (experts // groups):
            raise ModelFormatError(f"{source}: num_experts_per_tok {self.num_experts_per_tok} exceeds the "
                                   f"{self.topk_group * (experts // groups)} experts of topk_group groups")
        n = self.num_hidden_layers
        if self.mlp_layer_types is None:
            self.mlp_layer_types = ["dense" if i < self.first_k_dense_replace else "sparse" for i in range(n)]
        elif len(self.mlp_layer_types) != n or not set(self.mlp_layer_types) <= set(MLP_TYPES):
            raise ModelFormatError(f"{source}: mlp_layer_types must give one of {MLP_TYPES} for each of the {n} layers, "
                                   f"got {self.mlp_layer_types!r}")
        if self.layer_types is None:
            self.layer_types = self._derived_layer_types(source)
        elif len(self.layer_types) != n or not set(self.layer_types) <= set(LAYER_TYPES):
            raise ModelFormatError(f"{source}: layer_types must give one of {LAYER_TYPES} for each of the {n} layers, "
                                   f"got {self.layer_types!r}")

    def _derived_layer_types(self, source) -> list:
        """transformers' schedule: every ``sliding_window_pattern``-th layer global, the
        others sliding (it derives nothing from a pattern spelled "LLLG" or null: such a
        config must give layer_types)."""
        pattern = self.sliding_window_pattern
        if not isinstance(pattern, int) or pattern < 1:
            raise ModelFormatError(f"{source}: without layer_types, sliding_window_pattern must be a positive number "
                                   f"of layers, got {pattern!r}")
        return ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(self.num_hidden_layers)]

    def sliding(self, layer: int) -> bool:
        return self.layer_types[layer] == "sliding_attention"


class ExaoneMoe(Family):
    name = "exaone_moe"

    @staticmethod
    def parse(config: dict, source: str = "config.json") -> ExaoneMoeArgs:
        if "sliding_window" in config and config["sliding_window"] is None:  # not "the default": transformers refuses it
            raise ModelFormatError(f"{source}: field 'sliding_window' must be int, got None")
        if "sliding_window_pattern" in config and config["sliding_window_pattern"] is None and not config.get("layer_types"):
            raise ModelFormatError(f"{source}: without layer_types, sliding_window_pattern must be a positive number "
                                   "of layers, got None")
        return ExaoneMoeArgs.from_dict(config, source)

    def build(self, config, w):
        src = w.config_source
        a = self.parse(config, src)
        hidden, heads, kv_heads, d, eps = a.hidden_size, a.num_attention_heads, a.num_key_value_heads, a.head_dim, a.rms_norm_eps
        rope = build_rope(config, d, src, whole_heads="exaone_moe")

        def attention(i, p):
            s = f"{p}.self_attn"
            sliding = a.sliding(i)
            return Attention(
                layer=i, **w.attention_projections(s, hidden, heads, kv_heads, d),
                n_heads=heads, n_kv_heads=kv_heads, head_dim=d,
                rope=rope if sliding else None,  # global layers: NoPE
                q_norm=w.rms_norm(f"{s}.q_norm", d, eps), k_norm=w.rms_norm(f"{s}.k_norm", d, eps), qk_norm_per_head=True,
                window=a.sliding_window if sliding else None)

        def mlp(i, p):
            p = f"{p}.mlp"
            if a.mlp_layer_types[i] == "dense":
                return w.swiglu(p, hidden, a.intermediate_size)
            n, inner = a.num_experts, a.moe_intermediate_size
            # saved (and published) beside the gate; transformers keeps it inside the gate in memory
            bias = next((f"{s}.e_score_correction_bias" for s in (p, f"{p}.gate") if w.has(f"{s}.e_score_correction_bias")),
                        None)
            router = SigmoidGroupedTopKRouter(
                w.linear(f"{p}.gate", n, hidden), a.num_experts_per_tok, bias=w.param(bias, (n,)) if bias else None,
                n_group=a.n_group, topk_group=a.topk_group, norm_topk_prob=a.norm_topk_prob,
                routed_scaling_factor=a.routed_scaling_factor)
            shared = w.swiglu(f"{p}.shared_experts", hidden, inner * a.num_shared_experts) if a.num_shared_experts else None
            return SparseMoE(router, w.swiglu_experts(i, f"{p}.experts", n, hidden, inner), shared=shared)

        return build_decoder(a, w, attention, mlp)
