"""glm4_moe_lite (GLM-4.7-Flash: DeepSeek-V3's MLA with the GLM router) against
transformers' Glm4MoeLiteForCausalLM, under every placement."""

from colibri_core.testing.oracle import FamilyOracleSuite, OracleCase, random_correction_bias
from colibri_core.testing.oracle_cases import yarn

from glm_configs import glm4_moe_lite

BIAS = random_correction_bias()
YARN = yarn(mscale=1.0, mscale_all_dim=0.8)


class TestGlm4MoeLiteOracle(FamilyOracleSuite):
    model_class = "Glm4MoeLiteForCausalLM"
    cases = {
        # q LoRA, interleaved rope, the default layer kinds (one dense, then MoE), 2 groups
        # of 4 experts (1 chosen), a shared expert
        "q_lora_interleaved": OracleCase(glm4_moe_lite(), prepare=BIAS),
        # no q LoRA, half-split rope, attention biases, no grouping, 2 shared experts, no
        # renormalisation, several shards
        "no_q_lora_half_split_sharded": OracleCase(
            glm4_moe_lite(q_lora_rank=None, rope_interleave=False, attention_bias=True, n_group=1, n_shared_experts=2,
                          norm_topk_prob=False, routed_scaling_factor=1.0),
            seed=1, max_shard_size="40KB", prepare=BIAS),
        # yarn with mscale_all_dim (scales rope tables and softmax), explicit mlp_layer_types
        # with the dense layer in the middle, 4 groups of 4 (2 chosen), top-3, tied embeddings
        "yarn_layer_types_tied": OracleCase(
            glm4_moe_lite(rope_parameters=YARN, mlp_layer_types=["sparse", "dense", "sparse"], n_routed_experts=16,
                          n_group=4, topk_group=2, num_experts_per_tok=3, tie_word_embeddings=True),
            seed=2, prompt=tuple(range(3, 60, 2)), prepare=BIAS),
    }
