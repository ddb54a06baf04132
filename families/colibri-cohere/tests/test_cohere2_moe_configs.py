"""Cohere 2 MoE's config.json parses as transformers parses it (the attention and MLP layer
schedules, ``first_k_dense_replace`` and the prefix pattern, an explicit null window);
malformed ones are refused naming the field."""

import pytest
import transformers

from colibri_cohere.model import Cohere2Moe
from colibri_core.errors import ModelFormatError, UnsupportedModelError

# transformers' defaults, spelled out as a saved config.json spells them
COHERE2_MOE = {"architectures": ["Cohere2MoeForCausalLM"], "model_type": "cohere2_moe", "vocab_size": 256000,
               "hidden_size": 8192, "intermediate_size": 22528, "logit_scale": 0.0625, "num_hidden_layers": 40,
               "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 128, "max_position_embeddings": 8192,
               "layer_norm_eps": 1e-05, "tie_word_embeddings": True, "rope_theta": 50000, "sliding_window": 4096,
               "sliding_window_pattern": 4, "num_experts": 64, "num_experts_per_tok": 4, "num_shared_experts": 1,
               "shared_expert_combination_strategy": "average", "expert_selection_fn": "softmax",
               "prefix_dense_sliding_window_pattern": 1, "prefix_dense_intermediate_size": 36864,
               "first_k_dense_replace": 2}


@pytest.mark.parametrize("changes", [{}, {"first_k_dense_replace": 0}, {"prefix_dense_sliding_window_pattern": 2},
                                     {"sliding_window": None, "layer_types": ["full_attention"] * 40}],
                         ids=["dense-first", "all-moe", "prefix-pattern", "no-window"])
def test_config_parses_like_transformers(changes):
    raw = {**COHERE2_MOE, **changes}
    a = Cohere2Moe.parse(raw)
    ref = transformers.Cohere2MoeConfig(**raw)
    assert (a.layer_types, a.mlp_layer_types, a.sliding_window) == (ref.layer_types, ref.mlp_layer_types, ref.sliding_window)
    assert (a.num_key_value_heads, a.prefix_dense_intermediate_size) == (
        ref.num_key_value_heads, ref.prefix_dense_intermediate_size or ref.intermediate_size)


@pytest.mark.parametrize("changes, error, field", [
    ({"num_experts_per_tok": 65}, ModelFormatError, "num_experts_per_tok 65 exceeds num_experts 64"),
    ({"num_key_value_heads": 7}, ModelFormatError, "num_attention_heads 64 is not a multiple of num_key_value_heads 7"),
    ({"expert_selection_fn": "topk"}, UnsupportedModelError, "expert_selection_fn 'topk'"),
    ({"shared_expert_combination_strategy": "max"}, UnsupportedModelError, "shared_expert_combination_strategy 'max'"),
    ({"layer_types": ["local"] * 40}, ModelFormatError, "layer_types must give"),
    ({"sliding_window": None}, ModelFormatError, "sliding_window is null"),
    ({"sliding_window_pattern": 0}, ModelFormatError, "sliding_window_pattern"),
    ({"logit_scale": 0}, ModelFormatError, "logit_scale"),
])
def test_malformed_configs_are_refused(changes, error, field):
    with pytest.raises(error, match=field):
        Cohere2Moe.parse({**COHERE2_MOE, **changes})
