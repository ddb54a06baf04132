"""Jamba's config.json as published parses as transformers parses it (the layer kinds from
the periods and offsets, the dt rank "auto"); malformed ones are refused naming the field,
and options colibri does not run are refused in one line."""

import math

import pytest
import transformers

from colibri_core.errors import ModelFormatError, UnsupportedModelError
from colibri_ai21.model import Jamba

# ai21labs/AI21-Jamba-1.5-Mini (the fields colibri reads, and the ones it ignores as transformers does)
MINI = {"architectures": ["JambaForCausalLM"], "model_type": "jamba", "attn_layer_offset": 4, "attn_layer_period": 8,
        "expert_layer_offset": 1, "expert_layer_period": 2, "hidden_act": "silu", "hidden_size": 4096,
        "intermediate_size": 14336, "mamba_conv_bias": True, "mamba_d_conv": 4, "mamba_d_state": 16,
        "mamba_dt_rank": 256, "mamba_expand": 2, "mamba_proj_bias": False, "max_position_embeddings": 262144,
        "num_attention_heads": 32, "num_experts": 16, "num_experts_per_tok": 2, "num_hidden_layers": 32,
        "num_key_value_heads": 8, "num_logits_to_keep": 1, "rms_norm_eps": 1e-06, "sliding_window": None,
        "tie_word_embeddings": False, "use_mamba_kernels": True, "vocab_size": 65536}
# AI21-Jamba-1.5-Large's sizes
LARGE = {"hidden_size": 8192, "intermediate_size": 24576, "mamba_dt_rank": 512, "num_attention_heads": 64,
         "num_hidden_layers": 72}


@pytest.mark.parametrize("changes", [{}, LARGE, {"mamba_dt_rank": "auto", "hidden_size": 1000, "num_attention_heads": 8},
                                     {"num_experts": 1}, {"num_experts": None, "num_local_experts": 4},
                                     {"attn_layer_period": 3, "attn_layer_offset": 0, "expert_layer_period": 1,
                                      "expert_layer_offset": 0}],
                         ids=["mini", "large", "auto-rank", "dense", "num-local-experts", "periods"])
def test_config_parses_like_transformers(changes):
    raw = {**MINI, **changes}
    a = Jamba.parse(raw)
    ref = transformers.JambaConfig(**{k: v for k, v in raw.items() if k not in ("num_logits_to_keep", "sliding_window")
                                      and v is not None})
    assert a.mamba_dt_rank == ref.mamba_dt_rank
    if changes.get("mamba_dt_rank") == "auto":
        assert a.mamba_dt_rank == math.ceil(1000 / 16)
    assert a.num_experts == ref.num_experts
    kinds = ["attention" if a.is_attention(i) else "mamba" for i in range(a.num_hidden_layers)]
    assert kinds == ref.layers_block_type
    assert [a.num_experts if a.is_moe(i) else 1 for i in range(a.num_hidden_layers)] == ref.layers_num_experts
    assert a.head_dim == a.hidden_size // a.num_attention_heads


@pytest.mark.parametrize("changes, error, field", [
    ({"attn_layer_offset": 8}, ModelFormatError, "attn_layer_offset 8 must be smaller than attn_layer_period 8"),
    ({"expert_layer_offset": 2}, ModelFormatError, "expert_layer_offset 2 must be smaller than expert_layer_period 2"),
    ({"attn_layer_period": 0}, ModelFormatError, "attn_layer_period"),
    ({"mamba_dt_rank": "full"}, ModelFormatError, "mamba_dt_rank must be 'auto' or a positive integer"),
    ({"mamba_dt_rank": 0}, ModelFormatError, "mamba_dt_rank must be 'auto' or a positive integer"),
    ({"mamba_d_state": 0}, ModelFormatError, "mamba_d_state"),
    ({"mamba_conv_bias": "true"}, ModelFormatError, "mamba_conv_bias"),
    ({"num_experts_per_tok": 17}, ModelFormatError, "num_experts_per_tok 17 exceeds num_experts 16"),
    ({"num_key_value_heads": 5}, ModelFormatError, "num_attention_heads 32 is not a multiple of num_key_value_heads 5"),
    ({"hidden_act": "gelu"}, UnsupportedModelError, "hidden_act 'gelu'"),
    ({"sliding_window": 4096}, UnsupportedModelError, "sliding_window"),
])
def test_bad_or_unsupported_configs_are_refused(changes, error, field):
    with pytest.raises(error, match=field) as info:
        Jamba.parse({**MINI, **changes})
    assert "\n" not in str(info.value)
