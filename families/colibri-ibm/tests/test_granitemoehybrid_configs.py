"""Granite 4's config.json parses as transformers parses it (``mamba_d_head`` "auto",
``time_step_limit`` as saved, legacy layer kinds); malformed ones and options colibri does
not run are refused in one line naming the field."""

import math

import pytest
import transformers

from colibri_core.errors import ModelFormatError, UnsupportedModelError
from colibri_ibm.model import GraniteMoeHybridArgs

# ibm-granite/granite-4.0-h-tiny (the fields colibri reads)
TINY = {"model_type": "granitemoehybrid", "vocab_size": 100352, "hidden_size": 1536, "intermediate_size": 512,
        "shared_intermediate_size": 1024, "num_hidden_layers": 4, "num_attention_heads": 12, "num_key_value_heads": 4,
        "layer_types": ["mamba", "mamba", "attention", "mamba"], "num_local_experts": 64, "num_experts_per_tok": 6,
        "mamba_n_heads": 48, "mamba_n_groups": 1, "mamba_d_state": 128, "mamba_d_head": 64, "mamba_d_conv": 4,
        "mamba_expand": 2, "mamba_chunk_size": 256, "mamba_conv_bias": True, "mamba_proj_bias": False,
        "position_embedding_type": "nope", "embedding_multiplier": 12.0, "attention_multiplier": 0.0078125,
        "residual_multiplier": 0.22, "logits_scaling": 6.0, "rms_norm_eps": 1e-05, "tie_word_embeddings": True,
        "time_step_limit": [0.0, {"__float__": "Infinity"}]}


@pytest.mark.parametrize("changes", [{"position_embedding_type": None}, {"mamba_d_head": "auto"},
                                     {"time_step_limit": [0.001, 0.1], "position_embedding_type": "rope"}],
                         ids=["nope", "auto-head", "limits-rope"])
def test_config_parses_like_transformers(changes):
    raw = {**TINY, **changes}
    a = GraniteMoeHybridArgs.from_dict(raw)
    ref = transformers.GraniteMoeHybridConfig(**{**raw, "time_step_limit": a.time_step_limit})
    assert a.layer_types == ref.layer_types and a.mamba_d_head == ref.mamba_d_head
    assert a.time_step_limit == tuple(ref.time_step_limit)
    if "time_step_limit" not in changes:
        assert a.time_step_limit == (0.0, math.inf)


@pytest.mark.parametrize("changes, error, field", [
    ({"layer_types": ["mamba"] * 3}, ModelFormatError, "layer_types must give"),
    ({"layer_types": ["mamba", "mamba", "moe", "mamba"]}, ModelFormatError, "layer_types must give"),
    ({"mamba_d_head": 60}, ModelFormatError, "mamba_n_heads 48 x mamba_d_head 60 must be"),
    ({"mamba_n_groups": 5}, ModelFormatError, "mamba_n_heads 48 is not a multiple of mamba_n_groups 5"),
    ({"time_step_limit": [0.1]}, ModelFormatError, "time_step_limit must be two numbers"),
    ({"time_step_limit": [0.2, 0.1]}, ModelFormatError, "time_step_limit"),
    ({"position_embedding_type": "alibi"}, UnsupportedModelError, "position_embedding_type 'alibi'"),
    ({"hidden_act": "gelu"}, UnsupportedModelError, "hidden_act 'gelu'"),
    ({"num_local_experts": 0}, ModelFormatError, "num_local_experts"),
])
def test_bad_or_unsupported_configs_are_refused(changes, error, field):
    with pytest.raises(error, match=field) as info:
        GraniteMoeHybridArgs.from_dict({**TINY, **changes})
    assert "\n" not in str(info.value)
