"""MiMo-V2-Flash's config.json as published (Xiaomi's own spelling of the schedule, the
ropes and the window, which transformers' config does not read: its defaults are the
published values) parses as transformers parses it, and so does transformers' own
spelling; fields asking for what transformers' model cannot run are refused as
unsupported, malformed ones as malformed, each naming the field."""

import pytest
import transformers

from colibri_core.errors import ModelFormatError, UnsupportedModelError
from colibri_core.nn import build_rope
from colibri_xiaomi.model import MiMoV2Flash, rope_config

N = 48
# XiaomiMiMo/MiMo-V2-Flash (its quantization_config and auto_map left out)
MIMO_V2_FLASH = {
    "architectures": ["MiMoV2FlashForCausalLM"], "model_type": "mimo_v2_flash", "vocab_size": 152576,
    "hidden_size": 4096, "intermediate_size": 16384, "num_hidden_layers": N, "num_attention_heads": 64,
    "num_key_value_heads": 4, "head_dim": 192, "v_head_dim": 128, "swa_num_attention_heads": 64,
    "swa_num_key_value_heads": 8, "swa_head_dim": 192, "swa_v_head_dim": 128, "partial_rotary_factor": 0.334,
    "rope_theta": 5000000, "swa_rope_theta": 10000, "sliding_window": 128, "sliding_window_size": 128,
    "hybrid_layer_pattern": [0 if i == 0 or (i + 1) % 6 == 0 else 1 for i in range(N)],
    "moe_layer_freq": [0] + [1] * (N - 1), "add_swa_attention_sink_bias": True, "add_full_attention_sink_bias": False,
    "n_routed_experts": 256, "num_experts_per_tok": 8, "moe_intermediate_size": 2048, "routed_scaling_factor": None,
    "scoring_func": "sigmoid", "topk_method": "noaux_tc", "n_group": 1, "topk_group": 1, "n_shared_experts": None,
    "norm_topk_prob": True, "layernorm_epsilon": 1e-5, "attention_value_scale": 0.707, "attention_bias": False,
    "hidden_act": "silu", "max_position_embeddings": 262144, "tie_word_embeddings": False,
    "num_nextn_predict_layers": 3, "attention_projection_layout": "split",
}


def transformers_view(raw):
    ref = transformers.MiMoV2FlashConfig(**raw)
    ropes = {}
    for kind in sorted(set(ref.layer_types)):
        params = ref.rope_parameters[kind]
        dim = int(ref.head_dim * params.get("partial_rotary_factor", 0.334))
        ropes[kind] = (dim, float(params["rope_theta"]))
    return (ref.layer_types, ref.mlp_layer_types, ref.sliding_window, ref.rms_norm_eps, ref.routed_scaling_factor,
            ref.num_key_value_heads, ref.v_head_dim, ref.attention_value_scale or 1.0, ref.n_routed_experts, ropes)


def colibri_view(raw):
    a = MiMoV2Flash.parse(raw)
    ropes = {}
    for kind in sorted(set(a.layer_types)):
        cfg, partial = rope_config(raw, kind, "config.json")
        rope = build_rope(cfg, a.head_dim, "config.json", partial)
        ropes[kind] = (rope.rotary_dim, float(cfg["rope_parameters"]["rope_theta"]))
        assert float(rope.inv_freq[1]) == pytest.approx(ropes[kind][1] ** (-2 / rope.rotary_dim), rel=1e-6)
    return (a.layer_types, a.mlp_layer_types, a.sliding_window, a.rms_norm_eps, a.routed_scaling_factor,
            a.num_key_value_heads, a.v_head_dim, a.attention_value_scale, a.n_routed_experts, ropes)


def transformers_spelling(**changes):
    """The published shape as transformers saves it (its own fields only)."""
    return {**{k: MIMO_V2_FLASH[k] for k in ("model_type", "vocab_size", "hidden_size", "intermediate_size",
                                             "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                                             "head_dim", "v_head_dim", "n_routed_experts", "num_experts_per_tok",
                                             "moe_intermediate_size", "max_position_embeddings")}, **changes}


@pytest.mark.parametrize("raw", [
    MIMO_V2_FLASH,
    {**MIMO_V2_FLASH, "sliding_window_size": None, "sliding_window": 129},
    transformers_spelling(),
    transformers_spelling(attention_value_scale=None, routed_scaling_factor=2.0, num_hidden_layers=7,
                          rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                                           "sliding_attention": {"rope_type": "default", "rope_theta": 1e4,
                                                                 "partial_rotary_factor": 0.5}}),
    transformers_spelling(num_local_experts=64, layer_types=["sliding_attention"] * 48, mlp_layer_types=["sparse"] * 48),
], ids=["published", "window-only", "transformers-defaults", "per-type-ropes", "all-sliding"])
def test_config_parses_like_transformers(raw):
    assert colibri_view(raw) == transformers_view(raw)


def test_published_values():
    a = MiMoV2Flash.parse(MIMO_V2_FLASH)
    assert a.sliding_window == 129  # 128 previous positions and the query
    assert a.layer_types.count("full_attention") == 9 and a.layer_types[5] == "full_attention"
    assert a.mlp_layer_types.count("dense") == 1 and a.attention_value_scale == 0.707
    cfg, partial = rope_config(MIMO_V2_FLASH, "sliding_attention", "config.json")
    assert build_rope(cfg, 192, "config.json", partial).rotary_dim == 64


@pytest.mark.parametrize("changes, error, field", [
    ({"num_experts_per_tok": 257}, ModelFormatError, "num_experts_per_tok 257 exceeds n_routed_experts 256"),
    ({"num_key_value_heads": 5, "swa_num_key_value_heads": 10}, ModelFormatError,
     "num_attention_heads 64 is not a multiple of num_key_value_heads 5"),
    ({"num_key_value_heads": 64, "swa_num_key_value_heads": 128}, ModelFormatError, "2 x num_key_value_heads 128"),
    ({"hybrid_layer_pattern": [0, 1]}, ModelFormatError, "hybrid_layer_pattern must be a list of 0 or 1"),
    ({"moe_layer_freq": [2] * N}, ModelFormatError, "moe_layer_freq must be a list of 0 or 1"),
    ({"layer_types": ["local"] * N}, ModelFormatError, "layer_types must give"),
    ({"mlp_layer_types": ["moe"] * N}, ModelFormatError, "mlp_layer_types must give"),
    ({"sliding_window_size": -1}, ModelFormatError, "'sliding_window_size' must be an int"),
    ({"sliding_window_size": None, "sliding_window": None}, ModelFormatError, "'sliding_window' must be int"),
    ({"n_group": 3}, ModelFormatError, "n_routed_experts 256 cannot form n_group 3"),
    ({"n_group": 8, "topk_group": 9}, ModelFormatError, "topk_group 9 exceeds n_group 8"),
    ({"n_group": 64, "topk_group": 1}, ModelFormatError, "num_experts_per_tok 8 exceeds the 4 experts"),
    ({"v_head_dim": 0}, ModelFormatError, "v_head_dim"),
    ({"rope_parameters": {"full_attention": {"rope_theta": 1e6}}}, ModelFormatError, "rope_parameters must give"),
    ({"hidden_act": "gelu"}, UnsupportedModelError, "hidden_act 'gelu'"),
    ({"swa_num_key_value_heads": 4}, UnsupportedModelError, "swa_num_key_value_heads 4"),
    ({"swa_num_attention_heads": 32}, UnsupportedModelError, "swa_num_attention_heads 32"),
    ({"swa_head_dim": 128}, UnsupportedModelError, "swa_head_dim 128"),
    ({"swa_v_head_dim": 192}, UnsupportedModelError, "swa_v_head_dim 192"),
    ({"add_swa_attention_sink_bias": False}, UnsupportedModelError, "add_swa_attention_sink_bias False"),
    ({"add_full_attention_sink_bias": True}, UnsupportedModelError, "add_full_attention_sink_bias True"),
    ({"scoring_func": "softmax"}, UnsupportedModelError, "scoring_func 'softmax'"),
    ({"topk_method": "greedy"}, UnsupportedModelError, "topk_method 'greedy'"),
    ({"n_shared_experts": 1}, UnsupportedModelError, "n_shared_experts 1"),
    ({"attention_projection_layout": "fused_qkv"}, UnsupportedModelError, "attention_projection_layout 'fused_qkv'"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 2.0}}, UnsupportedModelError, "rope_scaling"),
])
def test_malformed_or_unsupported_configs_are_refused(changes, error, field):
    raw = {**MIMO_V2_FLASH, **changes}
    with pytest.raises(error, match=field):
        a = MiMoV2Flash.parse(raw)
        for kind in set(a.layer_types):
            rope_config(raw, kind, "config.json")
