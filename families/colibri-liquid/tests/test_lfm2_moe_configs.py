"""LFM2-MoE's config.json as published (``tie_embedding``, ``norm_eps``) parses as
transformers parses it; malformed ones are refused naming the field."""

import pytest
import transformers

from colibri_core.errors import ModelFormatError
from colibri_liquid.model import Lfm2Moe

LAYERS = ["conv", "conv", "full_attention", "conv", "conv", "conv", "full_attention", "conv", "conv", "conv",
          "full_attention", "conv", "conv", "conv", "full_attention", "conv", "conv", "conv", "full_attention", "conv",
          "conv", "full_attention", "conv", "conv"]
# LiquidAI/LFM2-8B-A1B
LFM2_8B = {"architectures": ["Lfm2MoeForCausalLM"], "model_type": "lfm2_moe", "vocab_size": 65536, "hidden_size": 2048,
           "intermediate_size": 7168, "moe_intermediate_size": 1792, "num_hidden_layers": 24, "num_attention_heads": 32,
           "num_key_value_heads": 8, "max_position_embeddings": 128000, "norm_eps": 1e-05, "conv_bias": False,
           "conv_L_cache": 3, "num_dense_layers": 2, "num_experts": 32, "num_experts_per_tok": 4,
           "use_expert_bias": True, "routed_scaling_factor": 1.0, "norm_topk_prob": True, "rope_theta": 1000000.0,
           "tie_embedding": True, "layer_types": LAYERS}


@pytest.mark.parametrize("changes", [{}, {"tie_embedding": False}], ids=["published", "untied"])
def test_config_parses_like_transformers(changes):
    raw = {**LFM2_8B, **changes}
    a = Lfm2Moe.parse(raw)
    ref = transformers.Lfm2MoeConfig(**raw)
    assert (a.tie_word_embeddings, a.layer_types, a.rms_norm_eps, a.head_dim) == (
        ref.tie_word_embeddings, ref.layer_types, ref.norm_eps, ref.hidden_size // ref.num_attention_heads)


@pytest.mark.parametrize("changes, field", [
    ({"num_experts_per_tok": 33}, "num_experts_per_tok 33 exceeds num_experts 32"),
    ({"num_key_value_heads": 5}, "num_attention_heads 32 is not a multiple of num_key_value_heads 5"),
    ({"layer_types": None}, "layer_types must give"),
    ({"layer_types": ["mamba"] * 24}, "layer_types must give"),
    ({"conv_L_cache": 0}, "conv_L_cache"),
])
def test_malformed_configs_are_refused(changes, field):
    with pytest.raises(ModelFormatError, match=field):
        Lfm2Moe.parse({**LFM2_8B, **changes})
