"""MiMo-V2-Flash on colibri's shared blocks (transformers: models/mimo_v2_flash).

Pre-norm layers of grouped-query attention and an MLP. The attention's q and k heads are
``head_dim`` wide, its value heads ``v_head_dim`` (narrower: 128 beside 192); the values
are multiplied by ``attention_value_scale`` and the scores scaled by head_dim**-0.5. RoPE
rotates the first ``int(head_dim * partial_rotary_factor)`` features of q and k with a
theta of each layer type's own (``rope_parameters`` keyed by layer type). The layers
``layer_types`` marks ``sliding_attention`` have twice ``num_key_value_heads`` KV heads,
see the last ``sliding_window`` positions and add a learned sink logit per query head to
the softmax; the ``full_attention`` layers see everything, without sinks. The layers
``mlp_layer_types`` marks ``dense`` have a SwiGLU of ``intermediate_size``; the ``sparse``
ones a MoE without shared experts: sigmoid scores, the top ``num_experts_per_tok`` chosen
on the scores plus ``e_score_correction_bias`` within the ``topk_group`` best of
``n_group`` groups, weighted by their scores (renormalised with ``norm_topk_prob``) times
``routed_scaling_factor`` (the core ``SigmoidGroupedTopKRouter``).

The published config.json spells the schedule with the fields of Xiaomi's own code,
which transformers' config does not read (it takes its defaults, equal to the published
values): ``hybrid_layer_pattern`` (1 = sliding), ``moe_layer_freq`` (1 = sparse),
``rope_theta`` / ``swa_rope_theta`` / ``partial_rotary_factor``, ``layernorm_epsilon``,
``sliding_window_size`` (the window is that plus the query, as transformers reads it),
``swa_num_attention_heads`` / ``swa_num_key_value_heads`` / ``swa_head_dim`` /
``swa_v_head_dim``, ``add_swa_attention_sink_bias`` / ``add_full_attention_sink_bias``,
``scoring_func`` / ``topk_method`` / ``n_shared_experts``. They are read where
transformers' fields are absent, and values transformers' model cannot run are refused
(``UnsupportedModelError`` naming the field). Checkpoints hold the sinks as published
(``attention_sink_bias``) or as transformers keeps them (``sinks``), the experts one
tensor each or fused.

The multi-token-prediction layers (``model.mtp.layers.{j}``, ``num_nextn_predict_layers``
of them; transformers does not read them) are read only for drafting
(``load(mtp=True)``, ``colibri_core.nn.mtp``), and of them only the first, as vLLM's
``mimo_v2_mtp`` reads them: ``enorm``, ``hnorm``, ``eh_proj`` and ``final_layernorm``
around a decoder layer (``input_layernorm``, ``self_attn``, ``pre_mlp_layernorm``,
``mlp``) whose attention is a sliding layer's (its heads, window, sinks and rope) and
whose MLP is dense, a SwiGLU of ``intermediate_size``.
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
# transformers' rope_parameters for a config spelling none (the published thetas)
ROPE_DEFAULTS = {"full_attention": 5_000_000.0, "sliding_attention": 10_000.0}
PARTIAL_ROTARY = 0.334  # transformers' default rope's partial_rotary_factor where a layer type's spells none


@dataclass
class MiMoV2FlashArgs(ModelArgs):
    """config.json's fields (transformers' MiMoV2FlashConfig defaults; ``MiMoV2Flash.parse``
    maps the published config's own spellings onto them)."""

    vocab_size: int = 152576
    hidden_size: int = 4096
    intermediate_size: int = 16384
    num_hidden_layers: int = 48
    num_attention_heads: int = 64
    num_key_value_heads: int = 4
    head_dim: int = 192
    v_head_dim: int = bounded(1, 1 << 12, default=128)
    hidden_act: str = "silu"
    max_position_embeddings: int = 131072
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    moe_intermediate_size: int = 2048
    num_experts_per_tok: int = 8
    n_routed_experts: int = bounded(1, 1 << 14, default=256)
    routed_scaling_factor: float = bounded(0.0, 1e6, default=1.0)
    n_group: int = bounded(1, 1 << 10, default=1)
    topk_group: int = bounded(1, 1 << 10, default=1)
    norm_topk_prob: bool = True
    sliding_window: int = bounded(1, 1 << 24, default=129)
    layer_types: list | None = None
    mlp_layer_types: list | None = None
    attention_value_scale: float = bounded(0.0, 1e6, default=0.707)

    def validate(self, source):
        n = self.num_hidden_layers
        self.require_multiple(source, "num_attention_heads", "num_key_value_heads")
        if self.num_attention_heads % (2 * self.num_key_value_heads):
            raise ModelFormatError(f"{source}: num_attention_heads {self.num_attention_heads} is not a multiple of the "
                                   f"sliding layers' 2 x num_key_value_heads {2 * self.num_key_value_heads}")
        self.require_at_most(source, "num_experts_per_tok", "n_routed_experts")
        if self.hidden_act != "silu":
            raise UnsupportedModelError(f"{source}: hidden_act {self.hidden_act!r} is not supported by the "
                                        "mimo_v2_flash family (only 'silu')")
        if self.layer_types is None:  # transformers: the first layer and every 6th full, the rest sliding
            self.layer_types = ["full_attention" if i == 0 or not (i + 1) % 6 else "sliding_attention" for i in range(n)]
        if len(self.layer_types) != n or not set(self.layer_types) <= set(LAYER_TYPES):
            raise ModelFormatError(f"{source}: layer_types must give one of {LAYER_TYPES} for each of the {n} layers, "
                                   f"got {self.layer_types!r}")
        if self.mlp_layer_types is None:  # transformers: a dense first layer, the rest sparse
            self.mlp_layer_types = ["dense"] + ["sparse"] * (n - 1)
        if len(self.mlp_layer_types) != n or not set(self.mlp_layer_types) <= set(MLP_TYPES):
            raise ModelFormatError(f"{source}: mlp_layer_types must give one of {MLP_TYPES} for each of the {n} layers, "
                                   f"got {self.mlp_layer_types!r}")
        experts, groups = self.n_routed_experts, self.n_group
        if experts % groups or experts // groups < 2:  # a group is scored by its two best experts
            raise ModelFormatError(f"{source}: n_routed_experts {experts} cannot form n_group {groups} groups of at "
                                   "least two experts")
        if self.topk_group > groups:
            raise ModelFormatError(f"{source}: topk_group {self.topk_group} exceeds n_group {groups}")
        if self.num_experts_per_tok > self.topk_group * (experts // groups):
            raise ModelFormatError(f"{source}: num_experts_per_tok {self.num_experts_per_tok} exceeds the "
                                   f"{self.topk_group * (experts // groups)} experts of topk_group {self.topk_group} groups")

    def sliding(self, layer: int) -> bool:
        """Whether layer ``layer`` is sliding; past the decoder layers (MTP) it is, as vLLM builds it."""
        return layer >= self.num_hidden_layers or self.layer_types[layer] == "sliding_attention"

    def dense(self, layer: int) -> bool:
        """Whether layer ``layer`` is dense; past the decoder layers (MTP) it is, as vLLM builds it."""
        return layer >= self.num_hidden_layers or self.mlp_layer_types[layer] == "dense"


def _schedule(config: dict, field: str, names: tuple[str, str], n: object, source: str) -> list:
    """A published 0/1 list (``hybrid_layer_pattern``, ``moe_layer_freq``) as layer types."""
    values = config[field]
    if not isinstance(values, list) or any(v not in (0, 1) or isinstance(v, bool) for v in values) or len(values) != n:
        raise ModelFormatError(f"{source}: {field} must be a list of 0 or 1 for each of the {n} layers, got {values!r}")
    return [names[v] for v in values]


def _refuse_unless(config: dict, field: str, allowed, what: str, source: str) -> None:
    value = config.get(field)
    if value is not None and value not in allowed:
        raise UnsupportedModelError(f"{source}: {field} {value!r} is not supported by the mimo_v2_flash family ({what})")


def rope_config(config: dict, layer_type: str, source: str) -> tuple[dict, float | None]:
    """The rope settings of one layer type as ``build_rope`` reads them, and the partial
    rotary factor transformers gives it (its default rope's 0.334 where none is spelt; the
    other rope types' own default, whole heads)."""
    params = config.get("rope_parameters")
    if params is not None:
        if not isinstance(params, dict) or not isinstance(params.get(layer_type), dict):
            raise ModelFormatError(f"{source}: rope_parameters must give an object for each layer type, "
                                   f"here {layer_type!r}, got {params!r}")
        mine = dict(params[layer_type])
    else:
        if config.get("rope_scaling") is not None:
            raise UnsupportedModelError(f"{source}: rope_scaling {config['rope_scaling']!r} is not supported by the "
                                        "mimo_v2_flash family (rope_parameters keyed by layer type are)")
        theta_field = "swa_rope_theta" if layer_type == "sliding_attention" else "rope_theta"
        theta = config.get(theta_field)
        mine = {"rope_type": "default", "rope_theta": ROPE_DEFAULTS[layer_type] if theta is None else theta}
        if config.get("partial_rotary_factor") is not None:
            mine["partial_rotary_factor"] = config["partial_rotary_factor"]
    mine.setdefault("rope_type", mine.get("type", "default"))
    partial = None
    if mine.get("partial_rotary_factor") is None and mine["rope_type"] == "default":
        partial = PARTIAL_ROTARY
    return {"max_position_embeddings": config.get("max_position_embeddings", 131072), "rope_parameters": mine}, partial


class MiMoV2Flash(Family):
    name = "mimo_v2_flash"

    @staticmethod
    def parse(config: dict, source: str = "config.json") -> MiMoV2FlashArgs:
        raw = dict(config)
        n = raw.get("num_hidden_layers", 48)
        # the published config's own spellings, where transformers' fields are absent
        if raw.get("layer_types") is None and raw.get("hybrid_layer_pattern") is not None:
            raw["layer_types"] = _schedule(raw, "hybrid_layer_pattern", LAYER_TYPES, n, source)
        if raw.get("mlp_layer_types") is None and raw.get("moe_layer_freq") is not None:
            raw["mlp_layer_types"] = _schedule(raw, "moe_layer_freq", MLP_TYPES, n, source)
        if raw.get("rms_norm_eps") is None and raw.get("layernorm_epsilon") is not None:
            raw["rms_norm_eps"] = raw["layernorm_epsilon"]
        if raw.get("num_local_experts") is not None:  # transformers' attribute_map: it wins over n_routed_experts
            raw["n_routed_experts"] = raw["num_local_experts"]
        if "attention_value_scale" in raw and raw["attention_value_scale"] is None:
            raw["attention_value_scale"] = 1.0  # transformers: a null scale scales nothing
        size = raw.get("sliding_window_size")
        if size is not None:  # transformers: the reference attends to that many previous positions plus the query
            if isinstance(size, bool) or not isinstance(size, int) or size < 0:
                raise ModelFormatError(f"{source}: field 'sliding_window_size' must be an int >= 0, got {size!r}")
            raw["sliding_window"] = size + 1
        elif "sliding_window" in raw and raw["sliding_window"] is None:
            raise ModelFormatError(f"{source}: field 'sliding_window' must be int, got None")
        a = MiMoV2FlashArgs.from_dict(raw, source)
        # Xiaomi's fields for what transformers' model fixes: refused where they ask for another model
        heads, kv = a.num_attention_heads, a.num_key_value_heads
        for field, value in (("swa_num_attention_heads", heads), ("swa_num_key_value_heads", 2 * kv),
                             ("swa_head_dim", a.head_dim), ("swa_v_head_dim", a.v_head_dim)):
            _refuse_unless(raw, field, (value,), f"its sliding layers have {value}, as transformers' model", source)
        _refuse_unless(raw, "add_swa_attention_sink_bias", (True,), "its sliding layers have attention sinks", source)
        _refuse_unless(raw, "add_full_attention_sink_bias", (False,), "its full layers have no attention sinks", source)
        _refuse_unless(raw, "scoring_func", ("sigmoid",), "a sigmoid router", source)
        _refuse_unless(raw, "topk_method", ("noaux_tc",), "the router chooses on its scores plus a bias", source)
        _refuse_unless(raw, "n_shared_experts", (0,), "no shared experts", source)
        _refuse_unless(raw, "attention_projection_layout", ("split",), "separate q_proj, k_proj and v_proj", source)
        return a

    def build(self, config, w):
        src = w.config_source
        a = self.parse(config, src)
        hidden, heads, d, dv, eps = a.hidden_size, a.num_attention_heads, a.head_dim, a.v_head_dim, a.rms_norm_eps
        ropes = {}
        for kind in set(a.layer_types) | ({"sliding_attention"} if w.mtp_layers else set()):
            rope_cfg, partial = rope_config(config, kind, src)
            ropes[kind] = build_rope(rope_cfg, d, src, partial)

        def attention(i, p):
            s = f"{p}.self_attn"
            sliding = a.sliding(i)
            rope = ropes["sliding_attention" if sliding else "full_attention"]
            kv = 2 * a.num_key_value_heads if sliding else a.num_key_value_heads
            sinks = None
            if sliding:  # published as attention_sink_bias, kept by transformers as sinks
                name = f"{s}.attention_sink_bias" if w.has(f"{s}.attention_sink_bias") else f"{s}.sinks"
                sinks = w.param(name, (heads,))
            return Attention(
                layer=i, **w.attention_projections(s, hidden, heads, kv, d, qkv_bias=a.attention_bias, v_head_dim=dv),
                n_heads=heads, n_kv_heads=kv, head_dim=d, v_head_dim=dv, value_scale=a.attention_value_scale,
                rope=rope, window=a.sliding_window if sliding else None, sinks=sinks)

        def mlp(i, p):
            p = f"{p}.mlp"
            if a.dense(i):
                return w.swiglu(p, hidden, a.intermediate_size)
            n = a.n_routed_experts
            router = SigmoidGroupedTopKRouter(w.linear(f"{p}.gate", n, hidden), a.num_experts_per_tok,
                                              bias=w.param(f"{p}.gate.e_score_correction_bias", (n,)),
                                              n_group=a.n_group, topk_group=a.topk_group,
                                              norm_topk_prob=a.norm_topk_prob,
                                              routed_scaling_factor=a.routed_scaling_factor)
            return SparseMoE(router, w.swiglu_experts(i, f"{p}.experts", n, hidden, a.moe_intermediate_size))

        return build_decoder(a, w, attention, mlp)
