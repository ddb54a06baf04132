"""glm4_moe (GLM-4.5 / 4.6) against transformers' Glm4MoeForCausalLM: tokens and logits
under every placement (all experts resident, one cached expert per layer, half of them)."""

from colibri_core.testing.oracle import FamilyOracleSuite, OracleCase, random_correction_bias
from colibri_core.testing.oracle_cases import yarn

from glm_configs import glm4_moe

BIAS = random_correction_bias()
YARN_QUARTER = yarn(partial_rotary_factor=0.25)


class TestGlm4MoeOracle(FamilyOracleSuite):
    model_class = "Glm4MoeForCausalLM"
    cases = {
        # per-head q/k norm, q/k/v biases, 4 query heads on 2 KV heads of 16 dims (head_dim
        # given, not hidden/heads), partial rotary 0.5 (GLM's default), one dense layer
        # first, 2 groups of 4 experts (1 chosen), a shared expert
        "qk_norm_bias_gqa": OracleCase(glm4_moe(), prepare=BIAS),
        # no q/k norm, no biases, full rotary, head_dim from hidden/heads, two dense layers,
        # no grouping, 2 shared experts, no renormalisation, several shards
        "plain_full_rotary_sharded": OracleCase(
            glm4_moe(use_qk_norm=False, attention_bias=False, partial_rotary_factor=1.0, head_dim=None,
                     num_key_value_heads=4, first_k_dense_replace=2, n_group=1, n_shared_experts=2,
                     norm_topk_prob=False, routed_scaling_factor=1.0),
            seed=1, max_shard_size="40KB", prepare=BIAS),
        # yarn, a quarter of each head rotated, one KV head, 4 groups of 4 experts (2
        # chosen), top-3, every layer MoE, tied embeddings, a long prompt
        "yarn_quarter_rotary_mqa_tied": OracleCase(
            glm4_moe(rope_parameters=YARN_QUARTER, num_key_value_heads=1, n_routed_experts=16, n_group=4, topk_group=2,
                     num_experts_per_tok=3, first_k_dense_replace=0, tie_word_embeddings=True, routed_scaling_factor=1.5),
            seed=2, prompt=tuple(range(3, 60, 2)), prepare=BIAS),
    }
