"""DeepSeek-V4 against transformers' DeepseekV4ForCausalLM: hyper-connections, sliding
window attention with sinks, CSA (overlapping compressor + indexer) and HCA layers,
grouped output projection, hash-routed and sqrt-softplus / sigmoid routed MoE with
clamped SwiGLU experts.

Prompts of 21 tokens plus 32 generated: 53 positions, past the window (8) and many
compression windows (4 and 8 / 16 tokens), so entries are emitted both in the prompt and
while decoding, and the indexer (16+ heads, top-2 / top-3 of up to 13 entries) chooses.
"""

from colibri_core.testing.oracle import FamilyOracleSuite, OracleCase

from ds_configs import v4, v4_buffers

PROMPT = (5, 17, 90, 3, 42, 7, 64, 11, 2, 33, 21, 8, 19, 50, 4, 6, 13, 27, 31, 44, 70)

YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "beta_fast": 32, "beta_slow": 1}


class TestDeepseekV4Oracle(FamilyOracleSuite):
    model_class = "DeepseekV4ForCausalLM"
    cases = {
        # one layer of each kind, two hash-routed layers, sqrt-softplus scores
        "mixed": OracleCase(v4(), prompt=PROMPT, prepare=v4_buffers()),
        # HCA first, CSA with top-3 and 32 indexer heads, yarn on the compressed layers'
        # rope, 2 streams, 4 output groups, sigmoid scores, one hash layer, 3 of 12
        # experts, a tighter clamp, several shards
        "yarn_sigmoid_sharded": OracleCase(
            v4(layer_types=["heavily_compressed_attention", "compressed_sparse_attention", "sliding_attention",
                            "compressed_sparse_attention", "heavily_compressed_attention"],
               mlp_layer_types=["hash_moe", "moe", "moe", "moe", "moe"], num_hidden_layers=5, hc_mult=2, o_groups=4,
               o_lora_rank=8, index_topk=3, index_n_heads=32, index_head_dim=24, scoring_func="sigmoid",
               n_routed_experts=12, num_experts_per_tok=3, swiglu_limit=0.5, rope_parameters=YARN,
               compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 16},
               sliding_window=6, routed_scaling_factor=2.0),
            seed=1, prompt=PROMPT, max_shard_size="60KB", prepare=v4_buffers(seed=8)),
    }
