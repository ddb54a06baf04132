"""LongCat-Flash's config.json as published (Meituan's own fields for what transformers'
model always does: the MLA LoRA scales, identity zero experts) parses as transformers
parses it, its attribute_map aliases included; fields asking for another model are
refused as unsupported, malformed ones as malformed, each naming the field."""

import pytest
import transformers

from colibri_core.errors import ModelFormatError, UnsupportedModelError
from colibri_meituan.model import LongcatFlash

# meituan-longcat/LongCat-Flash-Chat (its auto_map left out)
LONGCAT_FLASH = {
    "architectures": ["LongcatFlashForCausalLM"], "model_type": "longcat_flash", "attention_method": "MLA",
    "vocab_size": 131072, "hidden_size": 6144, "ffn_hidden_size": 12288, "expert_ffn_hidden_size": 2048,
    "num_layers": 28, "num_attention_heads": 64, "kv_lora_rank": 512, "q_lora_rank": 1536, "qk_rope_head_dim": 64,
    "qk_nope_head_dim": 128, "v_head_dim": 128, "mla_scale_q_lora": True, "mla_scale_kv_lora": True,
    "n_routed_experts": 512, "zero_expert_num": 256, "zero_expert_type": "identity", "moe_topk": 12,
    "routed_scaling_factor": 6.0, "router_bias": False, "rope_theta": 10000000.0, "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-5, "tie_word_embeddings": False, "attention_bias": False, "bos_token_id": 1, "eos_token_id": 2,
}


def view(a):
    return (a.num_layers, a.num_hidden_layers, a.n_routed_experts, a.zero_expert_num, a.moe_topk, a.ffn_hidden_size,
            a.expert_ffn_hidden_size, a.qk_head_dim, a.routed_scaling_factor, a.rms_norm_eps)


def transformers_view(raw):
    ref = transformers.LongcatFlashConfig(**{k: v for k, v in raw.items() if k != "num_hidden_layers"})
    if "num_hidden_layers" in raw:
        ref.num_hidden_layers = raw["num_hidden_layers"]
    return (ref.num_layers, ref.num_hidden_layers, ref.n_routed_experts, ref.zero_expert_num or 0, ref.moe_topk,
            ref.ffn_hidden_size, ref.expert_ffn_hidden_size, ref.qk_head_dim, ref.routed_scaling_factor, ref.rms_norm_eps)


@pytest.mark.parametrize("changes", [
    {}, {"zero_expert_num": 0}, {"num_layers": None, "num_hidden_layers": 8},
    {"num_local_experts": 64, "num_experts_per_tok": 4, "intermediate_size": 1024, "moe_intermediate_size": 256},
], ids=["published", "no-zero-experts", "num-hidden-layers", "aliases"])
def test_config_parses_like_transformers(changes):
    raw = {k: v for k, v in (LONGCAT_FLASH | changes).items() if v is not None}
    assert view(LongcatFlash.parse(raw)) == transformers_view(raw)


@pytest.mark.parametrize("changes, error, field", [
    ({"moe_topk": 769}, ModelFormatError, "moe_topk 769 exceeds the 768 router slots"),
    ({"num_key_value_heads": 8}, ModelFormatError, "num_key_value_heads 8 must equal num_attention_heads"),
    ({"head_dim": 128}, ModelFormatError, "head_dim 128 .* must equal qk_rope_head_dim 64"),
    ({"qk_head_dim": 200}, ModelFormatError, "qk_head_dim 200 must be"),
    ({"num_hidden_layers": 7}, ModelFormatError, "'num_hidden_layers' must be an even int"),
    ({"num_hidden_layers": 8}, ModelFormatError, "num_hidden_layers 8 must be 2 x num_layers 28"),
    ({"zero_expert_num": -1}, ModelFormatError, "zero_expert_num"),
    ({"zero_expert_num": None}, ModelFormatError, "'zero_expert_num' must be int"),
    ({"kv_lora_rank": None, "q_lora_rank": 0}, ModelFormatError, "q_lora_rank"),
    ({"hidden_act": "gelu"}, UnsupportedModelError, "hidden_act 'gelu'"),
    ({"zero_expert_type": "const"}, UnsupportedModelError, "zero_expert_type 'const'"),
    ({"attention_method": "GQA"}, UnsupportedModelError, "attention_method 'GQA'"),
    ({"mla_scale_q_lora": False}, UnsupportedModelError, "mla_scale_q_lora False"),
    ({"mla_scale_kv_lora": False}, UnsupportedModelError, "mla_scale_kv_lora False"),
    ({"router_bias": True}, UnsupportedModelError, "router_bias True"),
])
def test_malformed_or_unsupported_configs_are_refused(changes, error, field):
    with pytest.raises(error, match=field):
        LongcatFlash.parse({**LONGCAT_FLASH, **changes})
