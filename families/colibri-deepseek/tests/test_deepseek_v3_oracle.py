"""DeepSeek-V3 against transformers' DeepseekV3ForCausalLM: tokens and logits under every
placement (all experts resident, one cached expert per layer, half of them)."""

from colibri_core.testing.oracle import FamilyOracleSuite, OracleCase, random_correction_bias
from colibri_core.testing.oracle_cases import yarn

from ds_configs import v3

BIAS = random_correction_bias()
YARN = yarn(mscale=1.0, mscale_all_dim=0.8, beta_fast=32, beta_slow=1)


class TestDeepseekV3Oracle(FamilyOracleSuite):
    model_class = "DeepseekV3ForCausalLM"
    cases = {
        # q LoRA, one dense layer first, 2 groups of 4 experts (1 chosen), a shared expert
        "base": OracleCase(v3(), prepare=BIAS),
        # no q LoRA, no grouping, 2 shared experts, no renormalisation, half-split rope,
        # attention biases, several shards
        "no_q_lora_sharded": OracleCase(
            v3(q_lora_rank=None, n_group=1, topk_group=1, n_shared_experts=2, norm_topk_prob=False,
               rope_interleave=False, attention_bias=True, routed_scaling_factor=1.0),
            seed=1, max_shard_size="40KB", prepare=BIAS),
        # yarn with mscale / mscale_all_dim (scales both the rope tables and the softmax),
        # 4 groups of 4 (2 chosen), top-3, every layer MoE, a long prompt
        "yarn_mscale_grouped": OracleCase(
            v3(n_routed_experts=16, num_experts_per_tok=3, n_group=4, topk_group=2, first_k_dense_replace=0,
               routed_scaling_factor=1.5, rope_parameters=YARN),
            seed=2, prompt=tuple(range(3, 60, 2)), prepare=BIAS),
        # two dense layers of three, tied embeddings, wider heads
        "dense_first_tied": OracleCase(
            v3(first_k_dense_replace=2, tie_word_embeddings=True, num_attention_heads=8, kv_lora_rank=32,
               qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=16),
            seed=3, prepare=BIAS),
    }
