"""Solar Open's config.json parses as transformers parses it (GLM-4.5's fields it does not
read, such as ``first_k_dense_replace``, ignored); malformed ones are refused naming the
field."""

import pytest
import transformers

from colibri_core.errors import ModelFormatError, UnsupportedModelError
from colibri_upstage.model import SolarOpenArgs

# upstage/Solar-Open-100B's shape
SOLAR_OPEN = {"architectures": ["SolarOpenForCausalLM"], "model_type": "solar_open", "attention_bias": False,
              "head_dim": 128, "hidden_act": "silu", "hidden_size": 4096, "max_position_embeddings": 131072,
              "moe_intermediate_size": 1280, "n_group": 1, "n_routed_experts": 128, "n_shared_experts": 1,
              "norm_topk_prob": True, "num_attention_heads": 64, "num_experts_per_tok": 8, "num_hidden_layers": 48,
              "num_key_value_heads": 8, "rms_norm_eps": 1e-05, "rope_theta": 1000000, "routed_scaling_factor": 1.0,
              "tie_word_embeddings": False, "topk_group": 1, "vocab_size": 196608}


def test_config_parses_like_transformers():
    raw = {**SOLAR_OPEN, "first_k_dense_replace": 3, "intermediate_size": 10240}  # read by GLM, not here
    a = SolarOpenArgs.from_dict(raw)
    ref = transformers.SolarOpenConfig(**raw)
    assert (a.n_routed_experts, a.num_experts_per_tok, a.n_shared_experts, a.head_dim, a.num_key_value_heads) == (
        ref.n_routed_experts, ref.num_experts_per_tok, ref.n_shared_experts, ref.head_dim, ref.num_key_value_heads)
    assert all(a.is_moe(i) for i in range(a.num_hidden_layers))


@pytest.mark.parametrize("changes, error, field", [
    ({"num_experts_per_tok": 129}, ModelFormatError, "num_experts_per_tok 129 must be within"),
    ({"num_key_value_heads": 6}, ModelFormatError, "num_attention_heads 64 is not a multiple of num_key_value_heads 6"),
    ({"n_group": 3}, ModelFormatError, "n_routed_experts 128 is not divisible by n_group 3"),
    ({"hidden_act": "gelu"}, UnsupportedModelError, "hidden_act 'gelu'"),
])
def test_malformed_configs_are_refused(changes, error, field):
    with pytest.raises(error, match=field):
        SolarOpenArgs.from_dict({**SOLAR_OPEN, **changes})
