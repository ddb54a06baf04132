"""ERNIE 4.5 MoE's config.json in its published spelling (``moe_num_experts``, ``moe_k``,
top-level ``rope_theta``, ERNIE's own keys such as ``moe_gate`` ignored) parses as
transformers parses it; malformed ones are refused naming the field."""

import pytest
import transformers

from colibri_baidu.model import ROPE_THETA, Ernie4_5Moe
from colibri_core.nn.weights import pairs_to_halves
from colibri_core.errors import ModelFormatError, UnsupportedModelError
from colibri_core.nn import build_rope

# ERNIE-4.5-21B-A3B(-PT)
ERNIE_21B = {"architectures": ["Ernie4_5_MoeForCausalLM"], "model_type": "ernie4_5_moe", "bos_token_id": 1, "eos_token_id": 2,
             "pad_token_id": 0, "hidden_act": "silu", "hidden_size": 2560, "intermediate_size": 12288,
             "max_position_embeddings": 131072, "num_attention_heads": 20, "num_key_value_heads": 4, "num_hidden_layers": 28,
             "rms_norm_eps": 1e-05, "vocab_size": 103424, "rope_theta": 500000, "use_bias": False, "tie_word_embeddings": True,
             "moe_num_experts": 64, "moe_num_shared_experts": 2, "moe_layer_start_index": 1, "moe_layer_end_index": 27,
             "moe_intermediate_size": 1536, "moe_k": 6, "moe_layer_interval": 1, "moe_use_aux_free": True,
             "moe_capacity": [64, 64, 64], "moe_gate": "topk", "use_cache": False}
# ERNIE-4.5-300B-A47B(-PT): no shared experts, three dense layers first
ERNIE_300B = {**ERNIE_21B, "hidden_size": 8192, "intermediate_size": 28672, "num_attention_heads": 64,
              "num_key_value_heads": 8, "num_hidden_layers": 54, "moe_num_shared_experts": 0, "moe_layer_start_index": 3,
              "moe_layer_end_index": 53, "moe_intermediate_size": 3584, "moe_k": 8, "tie_word_embeddings": False}


@pytest.mark.parametrize("raw", [ERNIE_21B, ERNIE_300B], ids=["21b-a3b", "300b-a47b"])
def test_published_configs_parse_like_transformers(raw):
    a = Ernie4_5Moe.parse(raw)
    ref = transformers.Ernie4_5_MoeConfig(**raw)
    assert (a.moe_num_experts, a.moe_k, a.num_key_value_heads, a.head_dim) == (
        ref.num_experts, ref.num_experts_per_tok, ref.num_key_value_heads, ref.hidden_size // ref.num_attention_heads)
    moe = [(i + 1) % ref.moe_layer_interval == 0 and ref.moe_layer_start_index <= i <= ref.moe_layer_end_index
           for i in range(ref.num_hidden_layers)]
    assert [a.is_moe(i) for i in range(a.num_hidden_layers)] == moe
    rope = build_rope({"rope_theta": ROPE_THETA, **raw}, a.head_dim)
    assert float(rope.inv_freq[1]) == pytest.approx(ref.rope_parameters["rope_theta"] ** (-2 / a.head_dim), rel=1e-6)


def test_transformers_spellings_and_defaults():
    """transformers 5 writes num_experts / num_experts_per_tok beside ERNIE's names, and
    moe_layer_end_index -1 for the last layer; absent rope_theta is default_theta."""
    raw = {k: v for k, v in ERNIE_21B.items() if k not in ("moe_num_experts", "moe_k", "rope_theta")}
    raw.update(num_experts=32, num_experts_per_tok=4, moe_layer_end_index=-1)
    a = Ernie4_5Moe.parse(raw)
    ref = transformers.Ernie4_5_MoeConfig(**raw)
    assert (a.moe_num_experts, a.moe_k, a.moe_layer_end_index) == (32, 4, ref.moe_layer_end_index) == (32, 4, 27)
    assert ref.rope_parameters["rope_theta"] == ROPE_THETA


def test_pairs_to_halves_order():
    assert pairs_to_halves(2, 4).tolist() == [0, 2, 1, 3, 4, 6, 5, 7]


@pytest.mark.parametrize("changes, error, field", [
    ({"moe_k": 65}, ModelFormatError, "moe_k 65 exceeds moe_num_experts 64"),
    ({"num_key_value_heads": 3}, ModelFormatError, "num_attention_heads 20 is not a multiple of num_key_value_heads 3"),
    ({"hidden_act": "gelu"}, UnsupportedModelError, "hidden_act 'gelu'"),
    ({"moe_num_experts": 0}, ModelFormatError, "moe_num_experts"),
    ({"moe_layer_interval": 0}, ModelFormatError, "moe_layer_interval"),
    ({"head_dim": 127}, ModelFormatError, "head_dim 127 must be even"),
    ({"use_bias": "no"}, ModelFormatError, "use_bias"),
])
def test_malformed_configs_are_refused(changes, error, field):
    with pytest.raises(error, match=field):
        Ernie4_5Moe.parse({**ERNIE_21B, **changes})
