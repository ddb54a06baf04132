"""Llama 4's config.json as published (Scout: every layer MoE, q/k norm, llama3 rope with
equal frequency factors; Maverick: MoE every second layer, no q/k norm, no rope scaling;
both the multimodal ``llama4`` config with the text model under ``text_config``) parses
to the layers its checkpoints have; malformed ones are refused naming the field,
features colibri does not run refused as unsupported."""

import pytest

from colibri_core.errors import ModelFormatError, UnsupportedModelError
from colibri_llama.model import Llama4, Llama4Text

NO_ROPE = [int((i + 1) % 4 != 0) for i in range(48)]
SCOUT_TEXT = {
    "model_type": "llama4_text", "attention_bias": False, "attention_chunk_size": 8192, "attention_dropout": 0.0,
    "attn_scale": 0.1, "attn_temperature_tuning": 4, "bos_token_id": 200000, "eos_token_id": [200001, 200007, 200008],
    "floor_scale": 8192, "head_dim": 128, "hidden_act": "silu", "hidden_size": 5120, "interleave_moe_layer_step": 1,
    "intermediate_size": 8192, "intermediate_size_mlp": 16384, "max_position_embeddings": 10485760,
    "no_rope_layers": NO_ROPE, "num_attention_heads": 40, "num_experts_per_tok": 1, "num_hidden_layers": 48,
    "num_key_value_heads": 8, "num_local_experts": 16, "pad_token_id": 200018, "rms_norm_eps": 1e-05,
    "rope_scaling": {"factor": 16.0, "high_freq_factor": 1.0, "low_freq_factor": 1.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "rope_theta": 500000.0, "router_aux_loss_coef": 0.001, "router_jitter_noise": 0.0, "use_qk_norm": True,
    "vocab_size": 202048}
MAVERICK_TEXT = {**SCOUT_TEXT, "interleave_moe_layer_step": 2, "num_local_experts": 128, "use_qk_norm": False,
                 "rope_scaling": None, "attn_temperature_tuning": True}


def multimodal(text: dict, **top) -> dict:
    return {"architectures": ["Llama4ForConditionalGeneration"], "model_type": "llama4", "boi_token_index": 200080,
            "eoi_token_index": 200081, "image_token_index": 200092, "text_config": text,
            "vision_config": {"model_type": "llama4_vision_model", "hidden_size": 1408}, **top}


def test_scout():
    a, rope = Llama4().parse(multimodal(SCOUT_TEXT))
    assert a.moe_layers == list(range(48)) and a.use_qk_norm and a.attn_temperature_tuning
    assert [a.rope(i) for i in range(8)] == [True, True, True, False] * 2
    assert [a.chunked(i) for i in range(4)] == [True, True, True, False] and a.attention_chunk_size == 8192
    # equal frequency factors: wavelengths beyond 8192 positions slowed 16x, the others as they are
    assert rope.inv_freq[0] == 1.0 and rope.inv_freq[-1] == pytest.approx(500000.0 ** (-126 / 128) / 16, rel=1e-5)
    assert Llama4().refused_tokens(multimodal(SCOUT_TEXT)) == {
        200092: "image input is not supported: colibri runs the text model of this llama4 checkpoint"}


def test_maverick():
    a, rope = Llama4Text().parse(MAVERICK_TEXT)
    assert a.moe_layers == list(range(1, 48, 2)) and not a.use_qk_norm and a.num_local_experts == 128
    assert rope.inv_freq[-1] == pytest.approx(500000.0 ** (-126 / 128), rel=1e-5)


def test_defaults_follow_transformers():
    """Fields a config omits (or spells null where null is the default) take transformers'
    defaults: every 4th layer NoPE and full, the others RoPE and chunked, every layer MoE,
    rope_theta 500000, head_dim 128."""
    a, rope = Llama4Text().parse({"num_hidden_layers": 8, "no_rope_layers": None, "moe_layers": None, "head_dim": None,
                                  "hidden_size": 5120, "num_attention_heads": 40})
    assert a.layer_types == ["chunked_attention"] * 3 + ["full_attention"] + ["chunked_attention"] * 3 + ["full_attention"]
    assert a.moe_layers == list(range(8)) and a.head_dim == 128 and a.attention_chunk_size == 8192
    assert rope.inv_freq[1] == pytest.approx(500000.0 ** (-2 / 128), rel=1e-6)


@pytest.mark.parametrize("changes, field", [
    ({"num_experts_per_tok": 17}, "num_experts_per_tok"),
    ({"num_key_value_heads": 7}, "num_key_value_heads"),
    ({"attention_chunk_size": 0}, "attention_chunk_size"),
    ({"attention_chunk_size": None}, "attention_chunk_size"),
    ({"floor_scale": None}, "floor_scale"),
    ({"floor_scale": 0}, "floor_scale"),
    ({"attn_temperature_tuning": "yes"}, "attn_temperature_tuning"),
    ({"no_rope_layers": [1, 0]}, "no_rope_layers"),
    ({"no_rope_layers": [2] * 48}, "no_rope_layers"),
    ({"moe_layers": [0, 48]}, "moe_layers"),
    ({"interleave_moe_layer_step": 0}, "interleave_moe_layer_step"),
    ({"layer_types": ["sliding_attention"] * 48}, "layer_types"),
    ({"layer_types": ["full_attention"]}, "layer_types"),
    ({"num_local_experts": "16"}, "num_local_experts"),
    ({"use_qk_norm": 1}, "use_qk_norm"),
])
def test_malformed_configs_are_refused(changes, field):
    with pytest.raises(ModelFormatError, match=field):
        Llama4Text().parse({**SCOUT_TEXT, **changes})
    with pytest.raises(ModelFormatError, match=field):
        Llama4().parse(multimodal({**SCOUT_TEXT, **changes}))


def test_a_multimodal_config_needs_its_text_config():
    with pytest.raises(ModelFormatError, match="text_config"):
        Llama4().parse({"model_type": "llama4"})
    with pytest.raises(ModelFormatError, match="image_token_index"):
        Llama4().refused_tokens(multimodal(SCOUT_TEXT, image_token_index="x"))


@pytest.mark.parametrize("changes, field", [
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"partial_rotary_factor": 0.5}, "partial_rotary_factor"),
    ({"rope_scaling": {"rope_type": "longrope", "factor": 2.0}}, "rope_type"),
])
def test_what_colibri_does_not_run_is_refused(changes, field):
    with pytest.raises(UnsupportedModelError, match=field):
        Llama4Text().parse({**SCOUT_TEXT, **changes})
