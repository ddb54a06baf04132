"""MiniMax-M2's config.json as published (``rotary_dim`` for the partial rotary, MiniMax's
own keys ignored) parses as transformers parses it; malformed ones are refused naming the
field."""

import pytest
import transformers

from colibri_core.errors import ModelFormatError, UnsupportedModelError
from colibri_core.nn import build_rope
from colibri_minimax.model import ROPE_THETA, MiniMaxM2Args, partial_rotary_factor

# MiniMaxAI/MiniMax-M2 (its quantization_config and auto_map left out)
MINIMAX_M2 = {"architectures": ["MiniMaxM2ForCausalLM"], "model_type": "minimax_m2", "attn_type_list": [1] * 62,
              "head_dim": 128, "hidden_act": "silu", "hidden_size": 3072, "intermediate_size": 1536,
              "max_position_embeddings": 196608, "mtp_transformer_layers": 1, "num_attention_heads": 48,
              "num_experts_per_tok": 8, "num_hidden_layers": 62, "num_key_value_heads": 8, "num_local_experts": 256,
              "num_mtp_modules": 3, "qk_norm_type": "per_layer", "rms_norm_eps": 1e-06, "rope_theta": 5000000,
              "rotary_dim": 64, "scoring_func": "sigmoid", "shared_intermediate_size": 0, "tie_word_embeddings": False,
              "use_mtp": True, "use_qk_norm": True, "use_routing_bias": True, "vocab_size": 200064}


@pytest.mark.parametrize("changes", [{}, {"rope_theta": None}, {"partial_rotary_factor": 0.25},
                                     {"rotary_dim": None}, {"rope_scaling": {"rope_type": "linear", "factor": 2.0}}],
                         ids=["published", "default-theta", "factor-wins", "whole-heads", "scaled"])
def test_rope_as_transformers_reads_it(changes):
    raw = {k: v for k, v in (MINIMAX_M2 | changes).items() if v is not None}
    a = MiniMaxM2Args.from_dict(raw)
    ref = transformers.MiniMaxM2Config(**raw)
    rope = build_rope({"rope_theta": ROPE_THETA, **raw}, a.head_dim, "config.json", partial_rotary_factor(raw, a, "config.json"))
    params = ref.rope_parameters
    assert rope.rotary_dim == int(ref.head_dim * params.get("partial_rotary_factor", 1.0))
    assert float(rope.inv_freq[1]) == pytest.approx(params["rope_theta"] ** (-2 / rope.rotary_dim)
                                                    / params.get("factor", 1.0), rel=1e-6)
    assert (a.num_local_experts, a.num_experts_per_tok, a.intermediate_size) == (
        ref.num_local_experts, ref.num_experts_per_tok, ref.intermediate_size)


@pytest.mark.parametrize("changes, error, field", [
    ({"num_experts_per_tok": 257}, ModelFormatError, "num_experts_per_tok 257 exceeds num_local_experts 256"),
    ({"num_key_value_heads": 5}, ModelFormatError, "num_attention_heads 48 is not a multiple of num_key_value_heads 5"),
    ({"rotary_dim": 256}, ModelFormatError, "rotary_dim 256 exceeds head_dim 128"),
    ({"hidden_act": "gelu"}, UnsupportedModelError, "hidden_act 'gelu'"),
    ({"num_local_experts": 0}, ModelFormatError, "num_local_experts"),
])
def test_malformed_configs_are_refused(changes, error, field):
    with pytest.raises(error, match=field):
        MiniMaxM2Args.from_dict({**MINIMAX_M2, **changes})
