"""K-EXAONE's config.json parses as transformers parses it (the attention and MLP layer
schedules); malformed ones are refused naming the field."""

import pytest
import transformers

from colibri_core.errors import ModelFormatError, UnsupportedModelError
from colibri_lg.model import ExaoneMoe

# LGAI-EXAONE/K-EXAONE-236B-A23B's shape
K_EXAONE = {"architectures": ["ExaoneMoeForCausalLM"], "model_type": "exaone_moe", "hidden_act": "silu",
            "hidden_size": 6144, "intermediate_size": 18432, "moe_intermediate_size": 2048, "num_attention_heads": 64,
            "num_key_value_heads": 8, "head_dim": 128, "num_hidden_layers": 48, "num_experts": 128,
            "num_experts_per_tok": 8, "num_shared_experts": 1, "first_k_dense_replace": 1, "n_group": 1, "topk_group": 1,
            "norm_topk_prob": True, "routed_scaling_factor": 2.5, "max_position_embeddings": 262144,
            "rms_norm_eps": 1e-05, "rope_theta": 1000000, "sliding_window": 128, "sliding_window_pattern": 4,
            "tie_word_embeddings": False, "vocab_size": 153600}


@pytest.mark.parametrize("changes", [{}, {"sliding_window_pattern": 3, "first_k_dense_replace": 2},
                                     {"mlp_layer_types": ["dense"] * 2 + ["sparse"] * 46, "sliding_window_pattern": "LLLG",
                                      "layer_types": ["sliding_attention"] * 47 + ["full_attention"]}],
                         ids=["published", "pattern", "explicit"])
def test_config_parses_like_transformers(changes):
    raw = {**K_EXAONE, **changes}
    a = ExaoneMoe.parse(raw)
    ref = transformers.ExaoneMoeConfig(**raw)
    assert (a.layer_types, a.mlp_layer_types, a.sliding_window) == (ref.layer_types, ref.mlp_layer_types, ref.sliding_window)
    assert (a.num_experts, a.num_experts_per_tok, a.num_shared_experts, a.head_dim) == (
        ref.num_experts, ref.num_experts_per_tok, ref.num_shared_experts, ref.head_dim)


def test_default_window():
    raw = {k: v for k, v in K_EXAONE.items() if k != "sliding_window"}
    assert ExaoneMoe.parse(raw).sliding_window == transformers.ExaoneMoeConfig(**raw).sliding_window == 4096


@pytest.mark.parametrize("changes, error, field", [
    ({"num_experts_per_tok": 129}, ModelFormatError, "num_experts_per_tok 129 exceeds"),
    ({"num_key_value_heads": 6}, ModelFormatError, "num_attention_heads 64 is not a multiple of num_key_value_heads 6"),
    ({"n_group": 3}, ModelFormatError, "num_experts 128 is not divisible by n_group 3"),
    ({"sliding_window_pattern": "LLLG"}, ModelFormatError, "sliding_window_pattern must be a positive number"),
    ({"sliding_window_pattern": None}, ModelFormatError, "sliding_window_pattern must be a positive number"),
    ({"sliding_window": None}, ModelFormatError, "'sliding_window' must be int"),
    ({"layer_types": ["global"] * 48}, ModelFormatError, "layer_types must give"),
    ({"mlp_layer_types": ["moe"] * 48}, ModelFormatError, "mlp_layer_types must give"),
    ({"hidden_act": "gelu"}, UnsupportedModelError, "hidden_act 'gelu'"),
])
def test_malformed_configs_are_refused(changes, error, field):
    with pytest.raises(error, match=field):
        ExaoneMoe.parse({**K_EXAONE, **changes})
