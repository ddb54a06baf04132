"""OLMoE against transformers' OlmoeForCausalLM: tokens and logits under every placement."""

from colibri_core.testing.oracle import FamilyOracleSuite, FusedLayoutCheck, OracleCase
from transformers import OlmoeConfig


def config(**overrides):
    base = dict(vocab_size=128, eos_token_id=None, hidden_size=32, intermediate_size=16, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=4, num_experts=8, num_experts_per_tok=2, max_position_embeddings=128,
                initializer_range=0.1)
    base.update(overrides)
    return lambda: OlmoeConfig(**base)


class TestOlmoeOracle(FamilyOracleSuite, FusedLayoutCheck):
    model_class = "OlmoeForCausalLM"
    fused_case = "sharded_gqa_norm_topk"
    cases = {
        "base": OracleCase(config()),
        "sharded_gqa_norm_topk": OracleCase(
            config(num_hidden_layers=3, num_experts=16, num_experts_per_tok=4, num_key_value_heads=2, norm_topk_prob=True),
            seed=1, max_shard_size="40KB"),
        "top1_clip_linear_rope": OracleCase(
            config(num_experts=4, num_experts_per_tok=1, clip_qkv=0.8,
                   rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}), seed=2),
        "llama3_rope_one_layer": OracleCase(
            config(num_hidden_layers=1, num_experts=6, num_experts_per_tok=3, rope_parameters={
                "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32, "rope_theta": 500000.0}), seed=3),
        "yarn_rope_tied_embeddings": OracleCase(
            config(tie_word_embeddings=True, norm_topk_prob=True, rope_parameters={
                "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32, "rope_theta": 10000.0}),
            seed=4, prompt=tuple(range(3, 60, 2))),
        "wide_dynamic_rope": OracleCase(
            config(hidden_size=64, num_attention_heads=8, num_key_value_heads=8, num_experts=32, num_experts_per_tok=8,
                   intermediate_size=24, rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}),
            seed=5),
    }
