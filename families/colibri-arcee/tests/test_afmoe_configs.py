"""AFMoE's config.json parses as transformers parses it (the layer schedule, the fields
whose null is not their default); malformed ones (a null head_dim, on which transformers'
attention fails) are refused naming the field."""

import pytest
import transformers

from colibri_arcee.model import Afmoe
from colibri_core.errors import ModelFormatError, UnsupportedModelError

# arcee-ai/Trinity-Mini's shape
TRINITY = {"architectures": ["AfmoeForCausalLM"], "model_type": "afmoe", "vocab_size": 200192, "hidden_size": 2048,
           "intermediate_size": 6144, "moe_intermediate_size": 1024, "num_hidden_layers": 32, "num_dense_layers": 2,
           "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128, "max_position_embeddings": 131072,
           "rms_norm_eps": 1e-05, "tie_word_embeddings": False, "rope_theta": 10000, "num_experts": 128,
           "num_experts_per_tok": 8, "num_shared_experts": 1, "route_scale": 2.826, "global_attn_every_n_layers": 4,
           "sliding_window": 2048, "mup_enabled": True}


@pytest.mark.parametrize("changes", [{}, {"global_attn_every_n_layers": 3},
                                     {"layer_types": ["full_attention"] * 32, "sliding_window": None}],
                         ids=["published", "pattern", "all-global"])
def test_config_parses_like_transformers(changes):
    raw = {**TRINITY, **changes}
    a = Afmoe.parse(raw)
    ref = transformers.AfmoeConfig(**raw)
    assert (a.layer_types, a.sliding_window, a.num_key_value_heads) == (ref.layer_types, ref.sliding_window,
                                                                       ref.num_key_value_heads)
    assert a.head_dim == ref.head_dim


@pytest.mark.parametrize("changes, error, field", [
    ({"num_experts_per_tok": 129}, ModelFormatError, "num_experts_per_tok 129 exceeds num_experts 128"),
    ({"num_key_value_heads": 5}, ModelFormatError, "num_attention_heads 32 is not a multiple of num_key_value_heads 5"),
    ({"sliding_window": None}, ModelFormatError, "sliding_window is null"),
    ({"head_dim": None}, ModelFormatError, "'head_dim' must be int"),
    ({"global_attn_every_n_layers": None}, ModelFormatError, "global_attn_every_n_layers must be"),
    ({"layer_types": ["local"] * 32}, ModelFormatError, "layer_types must give"),
    ({"hidden_act": "gelu"}, UnsupportedModelError, "hidden_act 'gelu'"),
])
def test_malformed_configs_are_refused(changes, error, field):
    with pytest.raises(error, match=field):
        Afmoe.parse({**TRINITY, **changes})
