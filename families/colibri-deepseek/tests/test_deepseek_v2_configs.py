"""DeepSeek-V2's config.json as published (DeepSeek-V2 and V2-Lite: ``rope_scaling`` with
``type: yarn``, ``n_group``/``topk_group``, ``q_lora_rank: null``) parses as transformers
parses it; other routers and malformed groups are refused naming the field."""

import pytest
import transformers

from colibri_core.errors import ModelFormatError, UnsupportedModelError
from colibri_core.nn import build_rope, mla_softmax_scale
from colibri_deepseek.model import DeepseekV2

YARN = {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 0.707, "mscale_all_dim": 0.707,
        "original_max_position_embeddings": 4096, "type": "yarn"}
COMMON = {"model_type": "deepseek_v2", "vocab_size": 102400, "max_position_embeddings": 163840, "rms_norm_eps": 1e-06,
          "rope_theta": 10000, "rope_scaling": YARN, "kv_lora_rank": 512, "qk_rope_head_dim": 64, "qk_nope_head_dim": 128,
          "v_head_dim": 128, "n_shared_experts": 2, "moe_layer_freq": 1, "first_k_dense_replace": 1, "scoring_func": "softmax",
          "norm_topk_prob": False, "hidden_act": "silu", "attention_bias": False, "tie_word_embeddings": False,
          "aux_loss_alpha": 0.001, "seq_aux": True, "ep_size": 1, "bos_token_id": 100000, "eos_token_id": 100001}
V2_LITE = {**COMMON, "architectures": ["DeepseekV2ForCausalLM"], "hidden_size": 2048, "intermediate_size": 10944,
           "moe_intermediate_size": 1408, "num_hidden_layers": 27, "num_attention_heads": 16, "num_key_value_heads": 16,
           "n_routed_experts": 64, "num_experts_per_tok": 6, "q_lora_rank": None, "routed_scaling_factor": 1.0,
           "topk_method": "greedy", "n_group": 1, "topk_group": 1}
V2 = {**COMMON, "architectures": ["DeepseekV2ForCausalLM"], "hidden_size": 5120, "intermediate_size": 12288,
      "moe_intermediate_size": 1536, "num_hidden_layers": 60, "num_attention_heads": 128, "num_key_value_heads": 128,
      "n_routed_experts": 160, "num_experts_per_tok": 6, "q_lora_rank": 1536, "routed_scaling_factor": 16.0,
      "topk_method": "group_limited_greedy", "n_group": 8, "topk_group": 3}


@pytest.mark.parametrize("raw", [V2_LITE, V2], ids=["v2-lite", "v2"])
def test_published_configs_parse_like_transformers(raw):
    a = DeepseekV2.parse(raw)
    ref = transformers.DeepseekV2Config(**raw)
    assert (a.q_lora_rank, a.kv_lora_rank, a.n_routed_experts, a.num_experts_per_tok, a.n_shared_experts) == (
        ref.q_lora_rank, ref.kv_lora_rank, ref.n_routed_experts, ref.num_experts_per_tok, ref.n_shared_experts)
    assert (a.groups, a.topk_group, a.routed_scaling_factor) == (ref.n_group if ref.topk_method != "greedy" else 1,
                                                                   ref.topk_group, ref.routed_scaling_factor)
    assert [a.is_moe(i) for i in range(a.num_hidden_layers)] == [i >= ref.first_k_dense_replace for i in range(60)][:a.num_hidden_layers]
    rope = build_rope(raw, a.qk_rope_head_dim)
    assert rope.rotary_dim == ref.qk_rope_head_dim and rope.attention_scaling == pytest.approx(1.0)  # mscale == mscale_all_dim
    m = 0.1 * 0.707 * __import__("math").log(40) + 1
    assert mla_softmax_scale(raw, 192) == pytest.approx(192 ** -0.5 * m * m, rel=1e-6)


def test_transformers_defaults_fill_absent_keys():
    """An absent q_lora_rank is transformers' 1536 (null is no q LoRA); absent router keys
    are greedy, softmax, not renormalised, 2 shared experts, every layer MoE."""
    raw = {k: v for k, v in V2_LITE.items() if k not in ("q_lora_rank", "topk_method", "n_group", "topk_group",
                                                          "scoring_func", "norm_topk_prob", "n_shared_experts",
                                                          "first_k_dense_replace", "routed_scaling_factor")}
    a, ref = DeepseekV2.parse(raw), transformers.DeepseekV2Config(**raw)
    assert a.q_lora_rank == ref.q_lora_rank == 1536
    assert (a.topk_method, a.groups, a.norm_topk_prob, a.n_shared_experts, a.first_k_dense_replace, a.routed_scaling_factor) == (
        ref.topk_method, 1, ref.norm_topk_prob, ref.n_shared_experts, ref.first_k_dense_replace, ref.routed_scaling_factor)


@pytest.mark.parametrize("changes, error, field", [
    ({"topk_method": "noaux_tc"}, UnsupportedModelError, "topk_method 'noaux_tc'"),
    ({"scoring_func": "sigmoid"}, UnsupportedModelError, "scoring_func 'sigmoid'"),
    ({"norm_topk_prob": True}, UnsupportedModelError, "norm_topk_prob"),
    ({"moe_layer_freq": 2}, UnsupportedModelError, "moe_layer_freq"),
    ({"mlp_bias": True}, UnsupportedModelError, "mlp_bias"),
    ({"hidden_act": "gelu"}, UnsupportedModelError, "hidden_act"),
    ({"n_group": 7}, ModelFormatError, "n_routed_experts 160 is not divisible by n_group 7"),
    ({"topk_group": 9}, ModelFormatError, "topk_group 9 exceeds n_group 8"),
    ({"num_experts_per_tok": 61}, ModelFormatError, "num_experts_per_tok 61"),
    ({"num_key_value_heads": 8}, ModelFormatError, "num_key_value_heads"),
    ({"routed_scaling_factor": -1.0}, ModelFormatError, "routed_scaling_factor"),
    ({"rope_scaling": {**YARN, "type": "longrope"}}, UnsupportedModelError, "rope_type 'longrope'"),
])
def test_refusals_name_the_field(changes, error, field):
    raw = {**V2, **changes}
    with pytest.raises(error, match=field):
        a = DeepseekV2.parse(raw)
        build_rope(raw, a.qk_rope_head_dim)


def test_greedy_ignores_group_fields():
    """V2-Lite spells n_group / topk_group 1 with greedy; any other values are unused
    by a greedy router (transformers reads them only for group_limited_greedy)."""
    assert DeepseekV2.parse({**V2_LITE, "n_group": 3, "topk_group": 2}).groups == 1
