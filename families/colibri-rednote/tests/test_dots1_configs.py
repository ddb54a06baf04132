"""dots.llm1's config.json as published parses as transformers parses it; malformed ones
are refused naming the field."""

import pytest
import transformers

from colibri_core.errors import ModelFormatError
from colibri_rednote.model import Dots1

# rednote-hilab/dots.llm1.inst
DOTS1 = {"architectures": ["Dots1ForCausalLM"], "model_type": "dots1", "attention_bias": False, "attention_dropout": 0.0,
         "first_k_dense_replace": 1, "hidden_act": "silu", "hidden_size": 4096, "intermediate_size": 10944,
         "max_position_embeddings": 32768, "max_window_layers": 62, "moe_intermediate_size": 1408, "moe_layer_freq": 1,
         "n_routed_experts": 128, "n_shared_experts": 2, "norm_topk_prob": True, "num_attention_heads": 32,
         "num_experts_per_tok": 6, "num_hidden_layers": 62, "num_key_value_heads": 32, "rms_norm_eps": 1e-05,
         "rope_scaling": None, "rope_theta": 10000000, "routed_scaling_factor": 2.5, "sliding_window": None,
         "tie_word_embeddings": False, "use_sliding_window": False, "vocab_size": 152064, "bos_token_id": None,
         "eos_token_id": 151649, "pad_token_id": None, "scoring_func": "noaux_tc"}


def test_published_config_parses_like_transformers():
    a = Dots1.parse(DOTS1)
    ref = transformers.Dots1Config(**DOTS1)
    assert (a.n_routed_experts, a.num_experts_per_tok, a.n_shared_experts, a.head_dim) == (
        ref.n_routed_experts, ref.num_experts_per_tok, ref.n_shared_experts, ref.hidden_size // ref.num_attention_heads)
    assert a.layer_types == ref.layer_types == ["full_attention"] * 62
    assert [a.is_moe(i) for i in range(62)] == [i >= ref.first_k_dense_replace for i in range(62)]


@pytest.mark.parametrize("changes", [{"sliding_window": 4096, "max_window_layers": 60}, {"max_window_layers": 60},
                                     {"sliding_window": None, "max_window_layers": 60}], ids=["window", "default", "null"])
def test_sliding_layers_from_max_window_layers(changes):
    raw = {k: v for k, v in DOTS1.items() if k != "sliding_window"} | changes
    a, ref = Dots1.parse(raw), transformers.Dots1Config(**raw)
    assert (a.layer_types, a.sliding_window) == (ref.layer_types, ref.sliding_window)


@pytest.mark.parametrize("changes, field", [
    ({"num_experts_per_tok": 129}, "num_experts_per_tok 129 must be within"),
    ({"num_key_value_heads": 5}, "num_attention_heads 32 is not a multiple of num_key_value_heads 5"),
    ({"layer_types": ["full_attention"]}, "layer_types must give"),
    ({"layer_types": ["sliding_attention"] * 62}, "sliding_window is null"),
    ({"n_shared_experts": None}, "missing field 'n_shared_experts'"),
    ({"n_group": 3}, "n_routed_experts 128 is not divisible by n_group 3"),
])
def test_malformed_configs_are_refused(changes, field):
    raw = {k: v for k, v in {**DOTS1, **changes}.items() if v is not None or k not in changes}
    with pytest.raises(ModelFormatError, match=field):
        Dots1.parse(raw)
