"""Published config.json files (pre-transformers-5 spelling included) parse as
transformers parses them: layer kinds, MoE layers, rotary dimension, experts."""

import json

import pytest
import transformers

from colibri_core.errors import ModelFormatError, UnsupportedModelError
from colibri_qwen.model import Qwen2Moe, Qwen3_5Moe, Qwen3Moe, Qwen3Next

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

CASES = [(Qwen2Moe, QWEN1_5_MOE, "Qwen2MoeConfig"), (Qwen3Moe, QWEN3_30B, "Qwen3MoeConfig"),
         (Qwen3Next, QWEN3_NEXT, "Qwen3NextConfig"), (Qwen3_5Moe, QWEN3_5_MOE, "Qwen3_5MoeConfig")]


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
