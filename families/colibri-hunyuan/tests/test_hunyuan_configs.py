"""Hunyuan-A13B's config.json in its published spelling (``rope_scaling`` dynamic with
``alpha``, per-layer ``moe_topk`` / ``moe_intermediate_size`` / ``num_shared_expert``
lists, the original code's keys ignored) parses as transformers parses it; malformed and
unsupported ones are refused naming the field."""

import numpy as np
import pytest
import transformers
from transformers.models.hunyuan_v1_moe.modeling_hunyuan_v1_moe import HunYuanMoEV1RotaryEmbedding

from colibri_core.errors import ModelFormatError, UnsupportedModelError
from colibri_hunyuan.model import HunYuanMoeV1, hunyuan_rope

# Hunyuan-A13B(-Instruct)
A13B = {"architectures": ["HunYuanMoEV1ForCausalLM"], "model_type": "hunyuan_v1_moe", "attention_bias": False,
        "attention_dropout": 0.0, "attention_head_dim": 128, "bos_token_id": 1, "cla_share_factor": 2,
        "eod_token_id": 127967, "eos_token_id": 127960, "head_dim": 128, "hidden_act": "silu", "hidden_size": 4096,
        "initializer_range": 0.02, "intermediate_size": 3072, "max_position_embeddings": 32768,
        "moe_drop_tokens": False, "moe_intermediate_size": [3072] * 32, "moe_layer_num_skipped": 0,
        "moe_random_routing_dropped_token": False, "moe_topk": [8] * 32, "num_attention_heads": 32, "num_experts": 64,
        "num_hidden_layers": 32, "num_key_value_heads": 8, "num_shared_expert": [1] * 32, "pad_token_id": 127961,
        "rms_norm_eps": 1e-05,
        "rope_scaling": {"alpha": 1000.0, "beta_fast": 32, "beta_slow": 1, "factor": 1.0, "mscale": 1.0,
                         "mscale_all_dim": 1.0, "type": "dynamic"},
        "rope_theta": 10000.0, "routed_scaling_factor": 1.0, "tie_word_embeddings": True, "use_cla": False,
        "use_mixed_mlp_moe": True, "use_qk_norm": True, "use_rotary_pos_emb": True, "vocab_size": 128167}


def test_published_config_parses_like_transformers():
    a = HunYuanMoeV1.parse(A13B)
    ref = transformers.HunYuanMoEV1Config(**A13B)
    assert (a.num_experts, a.num_key_value_heads, a.head_dim, a.intermediate_size) == (
        ref.num_local_experts, ref.num_key_value_heads, ref.head_dim, ref.intermediate_size)
    assert [a.top_k(i) for i in range(32)] == ref.moe_topk
    # NTK-alpha: the frequencies transformers' rotary embedding computes
    expected = HunYuanMoEV1RotaryEmbedding(ref).inv_freq.numpy()
    np.testing.assert_allclose(hunyuan_rope(A13B, a.head_dim, "config.json").inv_freq, expected, rtol=1e-6)
    assert expected[1] < 10000.0 ** (-2 / 128)  # the stretched base, not rope_theta


def test_transformers_spellings():
    """transformers' attribute names stand in for Hunyuan's own; a scalar moe_topk."""
    raw = {k: v for k, v in A13B.items() if k not in ("num_experts", "moe_topk")}
    a = HunYuanMoeV1.parse({**raw, "num_local_experts": 16, "num_experts_per_tok": 4})
    assert (a.num_experts, a.top_k(0), a.top_k(31)) == (16, 4, 4)


def test_plain_dynamic_rope_is_the_default_schedule():
    """``dynamic`` without alpha changes nothing inside the trained context."""
    raw = {**A13B, "rope_scaling": {"type": "dynamic", "factor": 2.0}}
    ref = transformers.HunYuanMoEV1Config(**raw)
    expected = HunYuanMoEV1RotaryEmbedding(ref).inv_freq.numpy()
    np.testing.assert_allclose(hunyuan_rope(raw, 128, "config.json").inv_freq, expected, rtol=1e-6)
    plain = HunYuanMoEV1RotaryEmbedding(transformers.HunYuanMoEV1Config(**{**raw, "rope_scaling": None})).inv_freq
    assert np.array_equal(expected, plain.numpy())


@pytest.mark.parametrize("changes, error, field", [
    ({"num_experts": [64] * 32}, UnsupportedModelError, "num_experts .*per-layer expert counts are not supported"),
    ({"moe_topk": [8] * 31}, ModelFormatError, "moe_topk .* must list 32 counts within 1..64"),
    ({"moe_topk": [8] * 31 + [65]}, ModelFormatError, "moe_topk"),
    ({"moe_topk": 65}, ModelFormatError, "moe_topk 65 exceeds num_experts 64"),
    ({"moe_intermediate_size": [3072] * 31 + [1536]}, UnsupportedModelError, "moe_intermediate_size .* is not supported"),
    ({"num_shared_expert": 2}, UnsupportedModelError, "num_shared_expert 2 is not supported"),
    ({"num_key_value_heads": 5}, ModelFormatError, "num_attention_heads 32 is not a multiple of num_key_value_heads 5"),
    ({"hidden_act": "gelu"}, UnsupportedModelError, "hidden_act 'gelu'"),
    ({"num_experts": 0}, ModelFormatError, "num_experts"),
])
def test_malformed_configs_are_refused(changes, error, field):
    with pytest.raises(error, match=field):
        HunYuanMoeV1.parse({**A13B, **changes})


@pytest.mark.parametrize("scaling, error, field", [
    ({"type": "dynamic", "alpha": "big"}, ModelFormatError, "rope parameter 'alpha' must be a positive number"),
    ({"type": "longrope", "factor": 2.0}, UnsupportedModelError, "rope_type 'longrope'"),
])
def test_bad_rope_is_refused(scaling, error, field):
    with pytest.raises(error, match=field):
        hunyuan_rope({**A13B, "rope_scaling": scaling}, 128, "config.json")
