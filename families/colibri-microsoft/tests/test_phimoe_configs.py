"""Phi-3.5-MoE's config.json in its published spelling (``rope_scaling`` longrope with
short and long factors and mscales, ``sliding_window`` as long as the context, the
remote code's keys ignored) parses as transformers parses it; malformed and unsupported
ones are refused naming the field."""

import copy

import numpy as np
import pytest
import torch
import transformers
from transformers.models.phimoe.modeling_phimoe import PhimoeRotaryEmbedding

from colibri_core.errors import ModelFormatError, UnsupportedModelError
from colibri_microsoft.model import PhiMoe, PhiMoeArgs, phimoe_rope

# Phi-3.5-MoE-instruct (its 64-entry factor lists replaced by ramps of the same range)
LONGROPE = {"long_factor": np.linspace(1.0, 60.0, 64).tolist(), "long_mscale": 1.243163121016122,
            "original_max_position_embeddings": 4096, "short_factor": np.linspace(1.0, 1.3, 64).tolist(),
            "short_mscale": 1.243163121016122, "type": "longrope"}
PHI_35_MOE = {"architectures": ["PhiMoEForCausalLM"], "model_type": "phimoe", "attention_bias": True,
              "attention_dropout": 0.0, "bos_token_id": 1, "eos_token_id": 32000, "hidden_act": "silu",
              "hidden_dropout": 0.0, "hidden_size": 4096, "initializer_range": 0.02, "input_jitter_noise": 0.01,
              "intermediate_size": 6400, "lm_head_bias": True, "max_position_embeddings": 131072,
              "num_attention_heads": 32, "num_experts_per_tok": 2, "num_hidden_layers": 32, "num_key_value_heads": 8,
              "num_local_experts": 16, "original_max_position_embeddings": 4096, "output_router_logits": False,
              "rms_norm_eps": 1e-05, "rope_scaling": LONGROPE, "rope_theta": 10000.0, "router_aux_loss_coef": 0.0,
              "router_jitter_noise": 0.01, "sliding_window": 131072, "tie_word_embeddings": False,
              "torch_dtype": "bfloat16", "use_cache": True, "vocab_size": 32064}


def reference_config(raw: dict):
    # a copy: transformers standardises the rope dict it is given in place
    return transformers.PhimoeConfig(**copy.deepcopy({k: v for k, v in raw.items() if k != "hidden_dropout"}))


def test_published_config_parses_like_transformers():
    a = PhiMoeArgs.from_dict(PHI_35_MOE)
    ref = reference_config(PHI_35_MOE)
    assert (a.num_local_experts, a.num_key_value_heads, a.head_dim, a.router_jitter_noise, a.lm_head_bias) == (
        ref.num_local_experts, ref.num_key_value_heads, ref.hidden_size // ref.num_attention_heads,
        ref.router_jitter_noise, ref.lm_head_bias)
    rope = phimoe_rope(PHI_35_MOE, a.head_dim, "config.json")
    np.testing.assert_allclose(rope.inv_freq, PhimoeRotaryEmbedding(ref).inv_freq.numpy(), rtol=1e-6)
    assert rope.attention_scaling == LONGROPE["short_mscale"]


def test_longrope_cos_sin_before_and_past_the_original_context():
    """cos and sin as transformers' forward computes them, for a pass ending before the
    original context (64 positions here) and for one ending past it: the short factors
    and the same scale throughout."""
    raw = {**PHI_35_MOE, "hidden_size": 256, "max_position_embeddings": 512, "original_max_position_embeddings": 64,
           "rope_scaling": {**LONGROPE, "original_max_position_embeddings": 64, "short_factor": LONGROPE["short_factor"][:4],
                            "long_factor": LONGROPE["long_factor"][:4]}}
    rope, reference = phimoe_rope(raw, 8, "config.json"), PhimoeRotaryEmbedding(reference_config(raw))
    for positions in (np.arange(0, 60, 3), np.arange(40, 200, 7)):
        cos, sin = reference(torch.zeros(1), torch.from_numpy(positions)[None])
        ours_cos, ours_sin = rope.cos_sin(positions)
        np.testing.assert_allclose(ours_cos, cos[0].numpy(), atol=2e-5)
        np.testing.assert_allclose(ours_sin, sin[0].numpy(), atol=2e-5)


def test_default_rope_theta_is_transformers():
    raw = {k: v for k, v in PHI_35_MOE.items() if k not in ("rope_scaling", "rope_theta")}
    ref = reference_config(raw)
    np.testing.assert_allclose(phimoe_rope(raw, 128, "config.json").inv_freq, PhimoeRotaryEmbedding(ref).inv_freq.numpy(),
                               rtol=1e-6)


@pytest.mark.parametrize("changes, error, field", [
    ({"num_experts_per_tok": 1}, UnsupportedModelError, "num_experts_per_tok 1 is not supported"),
    ({"num_local_experts": 1}, ModelFormatError, "num_local_experts"),
    ({"num_key_value_heads": 5}, ModelFormatError, "num_attention_heads 32 is not a multiple of num_key_value_heads 5"),
    ({"hidden_act": "gelu"}, UnsupportedModelError, "hidden_act 'gelu'"),
    ({"router_jitter_noise": -1}, ModelFormatError, "router_jitter_noise"),
    ({"lm_head_bias": "yes"}, ModelFormatError, "lm_head_bias"),
])
def test_malformed_configs_are_refused(changes, error, field):
    with pytest.raises(error, match=field):
        PhiMoeArgs.from_dict({**PHI_35_MOE, **changes})


@pytest.mark.parametrize("changes, error, field", [
    ({"long_mscale": 1.5}, UnsupportedModelError, "'long_mscale' 1.5 differs from 'short_mscale'"),
    ({"short_factor": [1.0] * 63}, ModelFormatError, "'short_factor' must list 64 positive numbers"),
    ({"short_mscale": None}, ModelFormatError, "'short_mscale' must be a number"),
    ({"type": "yarn", "factor": 4.0}, UnsupportedModelError, "rope_type 'yarn' is not supported by the phimoe family"),
])
def test_bad_rope_is_refused(changes, error, field):
    with pytest.raises(error, match=field):
        phimoe_rope({**PHI_35_MOE, "rope_scaling": {**LONGROPE, **changes}}, 128, "config.json")


def test_family_refuses_through_build(tmp_path):
    """The refusal reaches ``colibri run``'s loader as one error naming the field."""
    with pytest.raises(UnsupportedModelError, match="long_mscale"):
        PhiMoe().build({**PHI_35_MOE, "rope_scaling": {**LONGROPE, "long_mscale": 2.0}},
                       type("W", (), {"config_source": "config.json"})())
