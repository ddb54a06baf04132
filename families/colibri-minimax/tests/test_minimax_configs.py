"""MiniMax-Text-01's config.json (model_type ``minimax``) parses as transformers parses it;
fields transformers reads differently from MiniMax's own code, and malformed configs, are
refused naming the field."""

import pytest
import transformers

from colibri_core.errors import ModelFormatError, UnsupportedModelError
from colibri_core.nn import build_rope
from colibri_minimax.text01 import FULL, LINEAR, ROPE_THETA, MiniMaxArgs

# MiniMaxAI/MiniMax-Text-01-hf's shape: 80 layers, every eighth softmax attention
MINIMAX_TEXT_01 = {"architectures": ["MiniMaxForCausalLM"], "model_type": "minimax", "head_dim": 128,
                   "hidden_act": "silu", "hidden_size": 6144, "intermediate_size": 9216,
                   "layer_types": [FULL if (i + 1) % 8 == 0 else LINEAR for i in range(80)],
                   "full_attn_alpha_factor": 3.5565588200778455, "full_attn_beta_factor": 1.0,
                   "linear_attn_alpha_factor": 3.5565588200778455, "linear_attn_beta_factor": 1.0,
                   "mlp_alpha_factor": 3.5565588200778455, "mlp_beta_factor": 1.0, "max_position_embeddings": 10240000,
                   "num_attention_heads": 64, "num_experts_per_tok": 2, "num_hidden_layers": 80, "num_key_value_heads": 8,
                   "num_local_experts": 32, "postnorm": True, "rms_norm_eps": 1e-05, "rope_theta": 10000000,
                   "shared_intermediate_size": 0, "shared_moe_mode": "sigmoid", "sliding_window": None,
                   "tie_word_embeddings": False, "vocab_size": 200064, "block_size": 256}
FIELDS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
          "head_dim", "num_local_experts", "num_experts_per_tok", "block_size", "layer_types", "full_attn_alpha_factor",
          "full_attn_beta_factor", "linear_attn_alpha_factor", "linear_attn_beta_factor", "mlp_alpha_factor",
          "mlp_beta_factor", "rms_norm_eps", "tie_word_embeddings")


@pytest.mark.parametrize("changes", [{}, {"layer_types": None, "num_hidden_layers": 5}, {"head_dim": None},
                                     {"block_size": None, "rope_theta": None},
                                     {"attn_type_list": [1 if (i + 1) % 8 == 0 else 0 for i in range(80)],
                                      "layernorm_mlp_alpha": 3.5565588200778455}],
                         ids=["published", "default-pattern", "default-head-dim", "defaults",
                              "own-keys-agreeing"])
def test_fields_as_transformers_reads_them(changes):
    raw = {k: v for k, v in (MINIMAX_TEXT_01 | changes).items() if v is not None}
    a = MiniMaxArgs.from_dict(raw)
    ref = transformers.MiniMaxConfig(**raw)
    for name in FIELDS:
        want = getattr(ref, name)
        if name == "head_dim" and want is None:
            want = ref.hidden_size // ref.num_attention_heads
        assert getattr(a, name) == want, name
    rope = build_rope({"rope_theta": ROPE_THETA, **raw}, a.head_dim, "config.json", whole_heads="minimax")
    assert rope.rotary_dim == a.head_dim
    assert float(rope.inv_freq[1]) == pytest.approx(ref.rope_parameters["rope_theta"] ** (-2 / a.head_dim), rel=1e-6)


@pytest.mark.parametrize("changes, error, field", [
    # transformers' MiniMax ignores rotary_dim and rotates whole heads; MiniMax's own code rotates 64
    ({"rotary_dim": 64}, UnsupportedModelError, "rotary_dim 64"),
    ({"num_experts_per_tok": 33}, ModelFormatError, "num_experts_per_tok 33 exceeds num_local_experts 32"),
    ({"num_key_value_heads": 7}, ModelFormatError, "num_attention_heads 64 is not a multiple of num_key_value_heads 7"),
    ({"hidden_act": "gelu"}, UnsupportedModelError, "hidden_act 'gelu'"),
    ({"sliding_window": 4096}, UnsupportedModelError, "sliding_window 4096"),
    ({"layer_types": [LINEAR] * 79}, ModelFormatError, "layer_types must list 80"),
    ({"layer_types": ["mamba"] * 80}, ModelFormatError, "layer_types"),
    ({"attn_type_list": [0] * 80}, UnsupportedModelError, "attn_type_list"),
    ({"layernorm_mlp_alpha": 2.0}, UnsupportedModelError, "layernorm_mlp_alpha 2.0 differs from mlp_alpha_factor"),
    ({"shared_intermediate_size": 1024}, UnsupportedModelError, "shared_intermediate_size 1024"),
    ({"postnorm": False}, UnsupportedModelError, "postnorm"),
    ({"block_size": 0}, ModelFormatError, "block_size"),
    ({"mlp_beta_factor": "one"}, ModelFormatError, "mlp_beta_factor"),
])
def test_malformed_or_unsupported_configs_are_refused(changes, error, field):
    with pytest.raises(error, match=field):
        MiniMaxArgs.from_dict({**MINIMAX_TEXT_01, **changes})


def test_partial_rotary_is_refused():
    raw = {**MINIMAX_TEXT_01, "partial_rotary_factor": 0.5}
    with pytest.raises(UnsupportedModelError, match="minimax"):
        build_rope({"rope_theta": ROPE_THETA, **raw}, 128, "config.json", whole_heads="minimax")
