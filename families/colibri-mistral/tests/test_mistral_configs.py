"""Mixtral's config.json as published (Mixtral-8x7B's spelling: top-level ``rope_theta``,
``sliding_window: null``) parses to the sizes its checkpoints have; malformed ones are
refused naming the field."""

import pytest

from colibri_core.errors import ModelFormatError
from colibri_core.nn import build_rope
from colibri_mistral.model import ROPE_THETA, MixtralArgs

HUB = {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "hidden_act": "silu", "hidden_size": 4096,
       "intermediate_size": 14336, "max_position_embeddings": 32768, "num_attention_heads": 32,
       "num_experts_per_tok": 2, "num_hidden_layers": 32, "num_key_value_heads": 8, "num_local_experts": 8,
       "rms_norm_eps": 1e-05, "rope_theta": 1e6, "sliding_window": None, "tie_word_embeddings": False,
       "vocab_size": 32000}


def test_published_config():
    a = MixtralArgs.from_dict(HUB)
    assert (a.head_dim, a.num_key_value_heads, a.num_local_experts, a.sliding_window) == (128, 8, 8, None)
    rope = build_rope({"rope_theta": ROPE_THETA, **{k: v for k, v in HUB.items() if k != "rope_theta"}}, a.head_dim)
    assert rope.inv_freq[1] == pytest.approx(1e6 ** (-2 / 128), rel=1e-6)


@pytest.mark.parametrize("changes, field", [
    ({"num_experts_per_tok": 9}, "num_experts_per_tok"),
    ({"num_key_value_heads": 5}, "num_key_value_heads"),
    ({"sliding_window": 0}, "sliding_window"),
    ({"num_local_experts": "8"}, "num_local_experts"),
])
def test_malformed_configs_are_refused(changes, field):
    with pytest.raises(ModelFormatError, match=field):
        MixtralArgs.from_dict({**HUB, **changes})
