"""dots.llm1 on colibri's shared blocks (transformers: models/dots1).

Pre-norm layers of Qwen3's attention (grouped-query, per-head q/k RMSNorm before RoPE,
q/k/v/o biased by ``attention_bias``; a layer that ``layer_types`` marks
"sliding_attention" sees the last ``sliding_window`` positions) and DeepSeek-V3's MLP: a
dense SwiGLU in the first ``first_k_dense_replace`` layers, then the sigmoid
group-limited router (``e_score_correction_bias`` for choosing only) over routed SwiGLU
experts, plus ``n_shared_experts`` shared experts. All of it is core blocks
(``Attention``, ``model.builders.sigmoid_moe_mlp``); what is dots1's own is its config.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from colibri_core.errors import ModelFormatError
from colibri_core.model.builders import SigmoidMoEArgs, sigmoid_moe_mlp
from colibri_core.model.config import bounded
from colibri_core.model.family import Family
from colibri_core.nn import Attention, build_rope
from colibri_core.nn.assembly import build_decoder

LAYER_TYPES = ("full_attention", "sliding_attention")
SLIDING_WINDOW = 4096  # transformers' default where config.json spells none (an explicit null: no window)


@dataclass(kw_only=True)
class Dots1Args(SigmoidMoEArgs):
    """config.json's fields (transformers' Dots1Config defaults)."""

    vocab_size: int = 152064
    hidden_size: int = 4608
    intermediate_size: int = 10944
    moe_intermediate_size: int = 1408
    num_hidden_layers: int = 62
    num_attention_heads: int = 32
    num_key_value_heads: int | None = 32
    head_dim: int | None = None
    # no usable default in transformers (None fails when a MoE layer is built)
    num_experts_per_tok: int = bounded(1, 1 << 10)
    n_shared_experts: int = bounded(0, 1 << 8)
    first_k_dense_replace: int = bounded(0, 1 << 10, default=0)
    norm_topk_prob: bool = False
    max_position_embeddings: int = 2048
    rms_norm_eps: float = 1e-6
    sliding_window: int | None = bounded(1, 1 << 24, default=None)  # absent: SLIDING_WINDOW (see parse)
    max_window_layers: int = bounded(0, 1 << 10, default=62)
    layer_types: list | None = None
    # DeepSeek-V3's spellings dots1's model does not read (its router is always noaux_tc,
    # every layer from first_k_dense_replace on is MoE): ignored as transformers ignores them
    scoring_func: str = field(default="sigmoid", init=False)
    topk_method: str = field(default="noaux_tc", init=False)
    moe_layer_freq: int = field(default=1, init=False)
    mlp_layer_types: list | None = field(default=None, init=False)

    def validate(self, source):
        super().validate(source)
        self.num_key_value_heads = self.num_key_value_heads or self.num_attention_heads
        self.default_head_dim(source)
        self.require_multiple(source, "num_attention_heads", "num_key_value_heads")
        n = self.num_hidden_layers
        if self.layer_types is None:  # transformers: the layers from max_window_layers on slide
            self.layer_types = ["sliding_attention" if self.sliding_window is not None and i >= self.max_window_layers
                                else "full_attention" for i in range(n)]
        elif len(self.layer_types) != n or not set(self.layer_types) <= set(LAYER_TYPES):
            raise ModelFormatError(f"{source}: layer_types must give one of {LAYER_TYPES} for each of the {n} layers, "
                                   f"got {self.layer_types!r}")
        if "sliding_attention" in self.layer_types and self.sliding_window is None:
            raise ModelFormatError(f"{source}: layer_types has sliding_attention layers but sliding_window is null")

    def window(self, layer: int) -> int | None:
        return self.sliding_window if self.layer_types[layer] == "sliding_attention" else None


class Dots1(Family):
    name = "dots1"

    @staticmethod
    def parse(config: dict, source: str = "config.json") -> Dots1Args:
        return Dots1Args.from_dict({"sliding_window": SLIDING_WINDOW, **config}, source)

    def build(self, config, w):
        src = w.config_source
        a = self.parse(config, src)
        hidden, heads, kv_heads, d, eps = a.hidden_size, a.num_attention_heads, a.num_key_value_heads, a.head_dim, a.rms_norm_eps
        rope = build_rope(config, d, src, whole_heads="dots1")

        def attention(i, p):
            s = f"{p}.self_attn"
            return Attention(
                layer=i, **w.attention_projections(s, hidden, heads, kv_heads, d, qkv_bias=a.attention_bias,
                                                   o_bias=a.attention_bias),
                n_heads=heads, n_kv_heads=kv_heads, head_dim=d, rope=rope,
                q_norm=w.rms_norm(f"{s}.q_norm", d, eps), k_norm=w.rms_norm(f"{s}.k_norm", d, eps), qk_norm_per_head=True,
                window=a.window(i))

        return build_decoder(a, w, attention, sigmoid_moe_mlp(a, w))
