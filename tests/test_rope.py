"""Our RoPE frequency schedules equal transformers' for every supported rope_type."""

import numpy as np
import pytest

from colibri_core.errors import UnsupportedModelError
from colibri_core.nn.rope import build_rope

CASES = {
    "default": {"rope_type": "default", "rope_theta": 10000.0},
    "linear": {"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0},
    "dynamic": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64, "rope_theta": 500000.0},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "rope_theta": 10000.0},
    "yarn_mscale": {"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 64, "rope_theta": 10000.0,
                    "mscale": 1.0, "mscale_all_dim": 0.707, "beta_fast": 32, "beta_slow": 1},
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_inverse_frequencies_match_transformers(name):
    import torch
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    params = CASES[name]
    config = LlamaConfig(hidden_size=64, num_attention_heads=4, max_position_embeddings=256, rope_parameters=dict(params))
    reference = LlamaRotaryEmbedding(config)
    rope = build_rope({"rope_parameters": dict(params), "max_position_embeddings": 256}, head_dim=16)
    np.testing.assert_allclose(rope.inv_freq, reference.inv_freq.numpy(), rtol=1e-6)
    assert rope.attention_scaling == pytest.approx(reference.attention_scaling, rel=1e-6)
    positions = np.arange(0, 200, 7)
    cos, sin = reference(torch.zeros(1, dtype=torch.float32), torch.tensor(positions)[None])
    ours_cos, ours_sin = rope.cos_sin(positions)
    np.testing.assert_allclose(ours_cos, cos[0].numpy(), atol=2e-5)
    np.testing.assert_allclose(ours_sin, sin[0].numpy(), atol=2e-5)


def test_old_style_rope_scaling_spelling_is_read():
    old = build_rope({"rope_theta": 5000.0, "rope_scaling": {"type": "linear", "factor": 2.0}}, head_dim=8)
    new = build_rope({"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 5000.0}}, head_dim=8)
    np.testing.assert_array_equal(old.inv_freq, new.inv_freq)


def test_unknown_rope_type_is_refused_by_name():
    with pytest.raises(UnsupportedModelError, match="longrope"):
        build_rope({"rope_parameters": {"rope_type": "longrope", "rope_theta": 10000.0}}, head_dim=8)


def test_a_family_rotating_whole_heads_refuses_a_partial_factor():
    assert build_rope({"rope_theta": 1e4}, 8, whole_heads="dots1").rotary_dim == 8
    with pytest.raises(UnsupportedModelError, match="partial_rotary_factor is not supported by the dots1 family"):
        build_rope({"rope_theta": 1e4, "partial_rotary_factor": 0.5}, 8, "c.json", whole_heads="dots1")
