"""FlexOlmo's config.json parses as transformers parses it; malformed ones are refused
naming the field."""

import pytest
import transformers

from colibri_core.errors import ModelFormatError, UnsupportedModelError
from colibri_olmoe.flex_olmo import FlexOlmoArgs

# allenai/FlexOlmo-7x7B-1T's shape
FLEX_OLMO = {"architectures": ["FlexOlmoForCausalLM"], "model_type": "flex_olmo", "vocab_size": 100352,
             "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32, "num_attention_heads": 32,
             "num_key_value_heads": 32, "max_position_embeddings": 4096, "rms_norm_eps": 1e-06, "rope_theta": 500000,
             "num_experts": 7, "num_experts_per_tok": 7, "norm_topk_prob": False, "attention_bias": False,
             "tie_word_embeddings": False, "pad_token_id": 100277, "eos_token_id": 100257}


def test_config_parses_like_transformers():
    a = FlexOlmoArgs.from_dict(FLEX_OLMO)
    ref = transformers.FlexOlmoConfig(**FLEX_OLMO)
    assert (a.num_experts, a.num_experts_per_tok, a.num_key_value_heads, a.head_dim) == (
        ref.num_experts, ref.num_experts_per_tok, ref.num_key_value_heads, ref.hidden_size // ref.num_attention_heads)


@pytest.mark.parametrize("changes, error, field", [
    ({"num_experts_per_tok": 8}, ModelFormatError, "num_experts_per_tok 8 exceeds num_experts 7"),
    ({"num_key_value_heads": 5}, ModelFormatError, "num_attention_heads 32 is not a multiple of num_key_value_heads 5"),
    ({"hidden_act": "gelu"}, UnsupportedModelError, "hidden_act 'gelu'"),
])
def test_malformed_configs_are_refused(changes, error, field):
    with pytest.raises(error, match=field):
        FlexOlmoArgs.from_dict({**FLEX_OLMO, **changes})
