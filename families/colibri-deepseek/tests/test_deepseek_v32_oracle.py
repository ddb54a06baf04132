"""DeepSeek-V3.2 (MLA + DSA) against transformers' DeepseekV32ForCausalLM: 7 prompt
tokens and 32 generated, 39 positions (``v32`` in ds_configs.py has the indexers' sizes)."""

from colibri_core.testing.oracle import FamilyOracleSuite, OracleCase, random_correction_bias
from colibri_core.testing.oracle_cases import yarn

from ds_configs import v32

BIAS = random_correction_bias()
YARN = yarn(mscale=1.0, mscale_all_dim=1.0)


class TestDeepseekV32Oracle(FamilyOracleSuite):
    model_class = "DeepseekV32ForCausalLM"
    cases = {
        # each query sees only its 4 best keys, from the 5th position on
        "sparse_top4": OracleCase(v32(index_topk=4), prepare=BIAS),
        # 32 indexer heads of 24 dims, top-8, yarn with mscale, explicit mlp_layer_types,
        # 3 groups of 4 experts, several shards
        "sparse_top8_yarn_sharded": OracleCase(
            v32(index_topk=8, index_n_heads=32, index_head_dim=24, rope_parameters=YARN, n_routed_experts=12,
                n_group=3, topk_group=2, num_experts_per_tok=3, mlp_layer_types=["sparse", "dense", "sparse"]),
            seed=1, max_shard_size="40KB", prepare=BIAS),
        # index_topk covers the whole sequence: every key is selected, i.e. dense attention
        # (test_dsa_dense.py also checks this equals the DeepSeek-V3 path)
        "topk_covers_sequence": OracleCase(v32(index_topk=64), seed=2, prepare=BIAS),
    }
