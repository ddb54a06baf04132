"""Granite MoE's config.json as published (granite-3.0-1b-a400m's spelling and muP
multipliers) parses to the sizes its checkpoints have; malformed ones are refused naming
the field."""

import pytest

from colibri_core.errors import ModelFormatError
from colibri_ibm.model import GraniteMoeArgs

HUB = {"architectures": ["GraniteMoeForCausalLM"], "model_type": "granitemoe", "attention_bias": False,
       "attention_multiplier": 0.015625, "embedding_multiplier": 12.0, "hidden_act": "silu", "hidden_size": 1024,
       "intermediate_size": 512, "logits_scaling": 6.0, "max_position_embeddings": 4096, "num_attention_heads": 16,
       "num_experts_per_tok": 8, "num_hidden_layers": 24, "num_key_value_heads": 8, "num_local_experts": 32,
       "residual_multiplier": 0.22, "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 10000,
       "tie_word_embeddings": True, "vocab_size": 49155}


def test_published_config():
    a = GraniteMoeArgs.from_dict(HUB)
    assert (a.head_dim, a.num_key_value_heads, a.shared_intermediate_size) == (64, 8, 0)
    assert (a.embedding_multiplier, a.attention_multiplier, a.residual_multiplier, a.logits_scaling) == \
        (12.0, 0.015625, 0.22, 6.0)
    b = GraniteMoeArgs.from_dict({**HUB, "num_key_value_heads": None})
    assert b.num_key_value_heads == 16  # transformers' default: one KV head per query head


@pytest.mark.parametrize("changes, field", [
    ({"num_experts_per_tok": 33}, "num_experts_per_tok"),
    ({"num_key_value_heads": 6}, "num_key_value_heads"),
    ({"logits_scaling": 0}, "logits_scaling"),
    ({"shared_intermediate_size": -1}, "shared_intermediate_size"),
])
def test_malformed_configs_are_refused(changes, field):
    with pytest.raises(ModelFormatError, match=field):
        GraniteMoeArgs.from_dict({**HUB, **changes})
