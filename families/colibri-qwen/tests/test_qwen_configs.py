"""Published config.json files (pre-transformers-5 spelling included) parse as
transformers parses them: layer kinds, MoE layers, rotary dimension, experts."""

import json

import pytest
import transformers

from colibri_core.errors import ModelFormatError, UnsupportedModelError
from colibri_qwen.model import Qwen2Moe, Qwen3_5Moe, Qwen3Moe, Qwen3Next, Qwen3VLMoe

# the text-model fields of the published configs (vision config abridged)
QWEN1_5_MOE = {"architectures": ["Qwen2MoeForCausalLM"], "model_type": "qwen2_moe", "vocab_size": 151936, "hidden_size": 2048,
               "intermediate_size": 5632, "num_hidden_layers": 24, "num_attention_heads": 16, "num_key_value_heads": 16,
               "max_position_embeddings": 8192, "rope_theta": 1000000.0, "rms_norm_eps": 1e-06, "use_sliding_window": False,
               "sliding_window": 32768, "max_window_layers": 21, "decoder_sparse_step": 1, "moe_intermediate_size": 1408,
               "shared_expert_intermediate_size": 5632, "num_experts_per_tok": 4, "num_experts": 60, "norm_topk_prob": False,
               "tie_word_embeddings": False, "hidden_act": "silu"}
QWEN3_30B = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "vocab_size": 151936, "hidden_size": 2048,
             "intermediate_size": 6144, "num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
             "max_position_embeddings": 40960, "rope_theta": 1000000.0, "rope_scaling": None, "rms_norm_eps": 1e-06,
             "use_sliding_window": False, "sliding_window": None, "max_window_layers": 48, "decoder_sparse_step": 1,
             "moe_intermediate_size": 768, "num_experts_per_tok": 8, "num_experts": 128, "norm_topk_prob": True,
             "mlp_only_layers": [], "attention_bias": False, "tie_word_embeddings": False, "hidden_act": "silu"}
QWEN3_NEXT = {"architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next", "vocab_size": 151936, "hidden_size": 2048,
              "intermediate_size": 5120, "num_hidden_layers": 48, "num_attention_heads": 16, "num_key_value_heads": 2, "head_dim": 256,
              "full_attention_interval": 4, "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128, "linear_num_key_heads": 16,
              "linear_num_value_heads": 32, "linear_value_head_dim": 128, "max_position_embeddings": 262144,
              "partial_rotary_factor": 0.25, "rope_theta": 10000000, "rope_scaling": None, "rms_norm_eps": 1e-06,
              "decoder_sparse_step": 1, "mlp_only_layers": [], "moe_intermediate_size": 512, "shared_expert_intermediate_size": 512,
              "num_experts": 512, "num_experts_per_tok": 10, "norm_topk_prob": True, "attention_bias": False,
              "tie_word_embeddings": False, "hidden_act": "silu"}
QWEN3_5_MOE = {"architectures": ["Qwen3_5MoeForConditionalGeneration"], "model_type": "qwen3_5_moe", "image_token_id": 248056,
               "video_token_id": 248057, "vision_start_token_id": 248053, "vision_end_token_id": 248054, "tie_word_embeddings": False,
               "text_config": {"model_type": "qwen3_5_moe_text", "vocab_size": 248320, "hidden_size": 2048, "num_hidden_layers": 40,
                               "num_attention_heads": 16, "num_key_value_heads": 2, "head_dim": 256, "attention_bias": False,
                               "attn_output_gate": True, "full_attention_interval": 4,
                               "layer_types": (["linear_attention"] * 3 + ["full_attention"]) * 10, "linear_conv_kernel_dim": 4,
                               "linear_key_head_dim": 128, "linear_num_key_heads": 16, "linear_num_value_heads": 32,
                               "linear_value_head_dim": 128, "max_position_embeddings": 262144, "moe_intermediate_size": 512,
                               "shared_expert_intermediate_size": 512, "num_experts": 256, "num_experts_per_tok": 8,
                               "mtp_num_hidden_layers": 1, "rms_norm_eps": 1e-06, "hidden_act": "silu",
                               "rope_parameters": {"mrope_interleaved": True, "mrope_section": [11, 11, 10], "rope_type": "default",
                                                   "rope_theta": 10000000, "partial_rotary_factor": 0.25}},
               "vision_config": {"model_type": "qwen3_5_moe", "depth": 27, "hidden_size": 1152, "num_heads": 16,
                                 "intermediate_size": 4304, "out_hidden_size": 2048}}
# Qwen3-VL-30B-A3B-Instruct (transformers 4.57 spelling: rope_scaling + rope_theta in the text config)
QWEN3_VL_MOE = {"architectures": ["Qwen3VLMoeForConditionalGeneration"], "model_type": "qwen3_vl_moe", "image_token_id": 151655,
                "video_token_id": 151656, "vision_start_token_id": 151652, "vision_end_token_id": 151653,
                "tie_word_embeddings": False,
                "text_config": {"model_type": "qwen3_vl_moe_text", "vocab_size": 151936, "hidden_size": 2048, "num_hidden_layers": 48,
                                "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128, "attention_bias": False,
                                "intermediate_size": 6144, "moe_intermediate_size": 768, "num_experts": 128,
                                "num_experts_per_tok": 8, "decoder_sparse_step": 1, "mlp_only_layers": [], "norm_topk_prob": True,
                                "max_position_embeddings": 262144, "rms_norm_eps": 1e-06, "hidden_act": "silu", "rope_theta": 5000000,
                                "rope_scaling": {"mrope_interleaved": True, "mrope_section": [24, 20, 20], "rope_type": "default"},
                                "tie_word_embeddings": False, "bos_token_id": 151643, "eos_token_id": 151645},
                "vision_config": {"model_type": "qwen3_vl_moe", "depth": 27, "hidden_size": 1152, "num_heads": 16,
                                  "intermediate_size": 4304, "out_hidden_size": 2048, "deepstack_visual_indexes": [8, 16, 24]}}

CASES = [(Qwen2Moe, QWEN1_5_MOE, "Qwen2MoeConfig"), (Qwen3Moe, QWEN3_30B, "Qwen3MoeConfig"),
         (Qwen3Next, QWEN3_NEXT, "Qwen3NextConfig"), (Qwen3_5Moe, QWEN3_5_MOE, "Qwen3_5MoeConfig"),
         (Qwen3VLMoe, QWEN3_VL_MOE, "Qwen3VLMoeConfig")]


@pytest.mark.parametrize("family, raw, config_class", CASES, ids=[c[0].name for c in CASES])
def test_published_configs_parse_like_transformers(family, raw, config_class):
    a, rope = family().parse(json.loads(json.dumps(raw)), "config.json")
    ref = getattr(transformers, config_class)(**raw).get_text_config()
    head_dim = getattr(ref, "head_dim", None) or ref.hidden_size // ref.num_attention_heads
    assert a.head_dim == head_dim
    assert rope.rotary_dim == int(head_dim * ref.rope_parameters.get("partial_rotary_factor", 1.0))
    assert float(rope.inv_freq[1]) == pytest.approx(ref.rope_parameters["rope_theta"] ** (-2 / rope.rotary_dim), rel=1e-6)
    assert (a.num_experts, a.num_experts_per_tok, a.num_key_value_heads) == (ref.num_experts, ref.num_experts_per_tok, ref.num_key_value_heads)
    mlp_only = getattr(ref, "mlp_only_layers", None) or []
    step = getattr(ref, "decoder_sparse_step", 1)
    assert [a.is_moe(i) for i in range(a.num_hidden_layers)] == [
        i not in mlp_only and (i + 1) % step == 0 for i in range(ref.num_hidden_layers)]
    assert a.norm_topk_prob == getattr(ref, "norm_topk_prob", True)
    if hasattr(ref, "linear_num_value_heads"):
        assert a.layer_types == ref.layer_types


def test_refusals_name_the_field():
    with pytest.raises(UnsupportedModelError, match="use_sliding_window"):
        Qwen2Moe().parse({**QWEN1_5_MOE, "use_sliding_window": True}, "config.json")
    with pytest.raises(UnsupportedModelError, match="sliding_attention"):
        Qwen2Moe().parse({**QWEN1_5_MOE, "layer_types": ["sliding_attention"] * 24}, "config.json")
    with pytest.raises(UnsupportedModelError, match="mamba"):
        Qwen3Next().parse({**QWEN3_NEXT, "layer_types": ["mamba"] * 48}, "config.json")
    with pytest.raises(ModelFormatError, match="text_config"):
        Qwen3_5Moe().parse({k: v for k, v in QWEN3_5_MOE.items() if k != "text_config"}, "config.json")
    with pytest.raises(ModelFormatError, match=r"\(text_config\): field 'linear_num_key_heads'"):
        Qwen3_5Moe().parse({**QWEN3_5_MOE, "text_config": {**QWEN3_5_MOE["text_config"], "linear_num_key_heads": 0}}, "config.json")
    with pytest.raises(ModelFormatError, match="not a multiple of linear_num_key_heads"):
        Qwen3Next().parse({**QWEN3_NEXT, "linear_num_value_heads": 24, "linear_num_key_heads": 16}, "config.json")
    with pytest.raises(ModelFormatError, match="mlp_only_layers"):
        Qwen3Moe().parse({**QWEN3_30B, "mlp_only_layers": [48]}, "config.json")
    with pytest.raises(UnsupportedModelError, match="hidden_act"):
        Qwen3Moe().parse({**QWEN3_30B, "hidden_act": "gelu"}, "config.json")


def test_qwen3_vl_moe_spellings():
    """transformers 5 writes ``num_local_experts`` and ``rope_parameters``; a text config
    spelling no theta gets transformers' default_theta (500000); the router always
    renormalises; the media ids come from the top level (or Qwen3-VL's)."""
    text = {k: v for k, v in QWEN3_VL_MOE["text_config"].items() if k not in ("num_experts", "rope_theta", "rope_scaling")}
    raw = {**QWEN3_VL_MOE, "text_config": {**text, "num_local_experts": 128, "norm_topk_prob": False,
                                           "rope_parameters": {"rope_type": "default", "mrope_section": [24, 20, 20],
                                                               "mrope_interleaved": True}}}
    a, rope = Qwen3VLMoe().parse(raw, "config.json")
    ref = transformers.Qwen3VLMoeConfig(**json.loads(json.dumps(raw))).get_text_config()
    assert a.num_experts == ref.num_experts == 128 and a.norm_topk_prob
    assert float(rope.inv_freq[1]) == pytest.approx(ref.rope_parameters["rope_theta"] ** (-2 / 128), rel=1e-6)
    assert ref.rope_parameters["rope_theta"] == 500000.0
    assert Qwen3VLMoe().refused_tokens(QWEN3_VL_MOE) == {
        151655: "image input is not supported: colibri runs the text model of this qwen3_vl_moe checkpoint",
        151656: "video input is not supported: colibri runs the text model of this qwen3_vl_moe checkpoint"}
    assert set(Qwen3VLMoe().refused_tokens({"image_token_id": 7})) == {7, 151656}


@pytest.mark.parametrize("changes, error, field", [
    ({"text_config": None}, ModelFormatError, "qwen3_vl_moe config needs a 'text_config'"),
    ({"text_config": {**QWEN3_VL_MOE["text_config"], "num_experts_per_tok": 129}}, ModelFormatError, "num_experts_per_tok"),
    ({"text_config": {**QWEN3_VL_MOE["text_config"], "mlp_only_layers": [48]}}, ModelFormatError, "mlp_only_layers"),
    ({"text_config": {**QWEN3_VL_MOE["text_config"], "hidden_act": "gelu"}}, UnsupportedModelError, "hidden_act"),
    ({"text_config": {**QWEN3_VL_MOE["text_config"], "rope_scaling": {"rope_type": "mrope2"}}}, UnsupportedModelError,
     "rope_type 'mrope2'"),
    ({"tie_word_embeddings": "no"}, ModelFormatError, "tie_word_embeddings"),
])
def test_qwen3_vl_moe_refusals_name_the_field(changes, error, field):
    with pytest.raises(error, match=field):
        family = Qwen3VLMoe()
        raw = {**QWEN3_VL_MOE, **changes}
        a, _ = family.parse(raw, "config.json")
        family.tied(raw, a)
