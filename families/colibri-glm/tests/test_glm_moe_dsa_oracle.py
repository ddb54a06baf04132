"""glm_moe_dsa (GLM-5: MLA + DSA, interleaved rope in the indexer, shared indexer layers)
against transformers' GlmMoeDsaForCausalLM, under every placement: 7 prompt tokens and 32
generated, 39 positions (``glm_moe_dsa`` in glm_configs.py has the indexers' sizes)."""

from colibri_core.testing.fp8 import fp8_rewrite
from colibri_core.testing.oracle import FamilyOracleSuite, OracleCase, random_correction_bias
from colibri_core.testing.oracle_cases import yarn

from glm_configs import glm_moe_dsa

BIAS = random_correction_bias()
YARN = yarn(mscale=1.0, mscale_all_dim=1.0)


class TestGlmMoeDsaOracle(FamilyOracleSuite):
    model_class = "GlmMoeDsaForCausalLM"
    cases = {
        # every layer runs its own indexer (transformers' default schedule); each query sees
        # only its 4 best keys from the 5th position on; one dense layer first
        "full_top4": OracleCase(glm_moe_dsa(), prepare=BIAS),
        # "shared" layers reuse the previous full layer's top-4 (two in a row at the end)
        "shared_top4": OracleCase(
            glm_moe_dsa(num_hidden_layers=4, indexer_types=["full", "shared", "full", "shared"]),
            seed=1, prepare=BIAS),
        # 32 indexer heads of 24 dims, top-8, shared layers, yarn with mscale, explicit
        # mlp_layer_types, 3 groups of 4 experts (2 chosen), top-3, several shards
        "shared_top8_yarn_sharded": OracleCase(
            glm_moe_dsa(num_hidden_layers=4, indexer_types=["full", "shared", "shared", "full"], index_topk=8,
                        index_n_heads=32, index_head_dim=24, rope_parameters=YARN, n_routed_experts=12, n_group=3,
                        topk_group=2, num_experts_per_tok=3, mlp_layer_types=["dense", "sparse", "dense", "sparse"]),
            seed=2, max_shard_size="40KB", prepare=BIAS),
        # index_topk covers the whole sequence: every key is selected, i.e. dense attention,
        # in full and shared layers alike
        "topk_covers_sequence": OracleCase(
            glm_moe_dsa(index_topk=64, indexer_types=["full", "shared", "full"]), seed=3, prepare=BIAS),
    }


class TestGlmMoeDsaFp8Oracle(FamilyOracleSuite):
    """GLM-5 as shipped in fp8: linear weights (indexer wq_b / wk included) as float8 e4m3
    with 32x32 block scales, against transformers on the dequantised weights."""

    model_class = "GlmMoeDsaForCausalLM"
    cases = {
        "fp8_b32_shared": OracleCase(glm_moe_dsa(index_topk=6, indexer_types=["full", "shared", "full"]), seed=4,
                                     prepare=BIAS, rewrite=fp8_rewrite((32, 32))),
    }
