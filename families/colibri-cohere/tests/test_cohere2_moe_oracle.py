"""Cohere 2 MoE against transformers' Cohere2MoeForCausalLM: greedy tokens and logits under
every placement, on every installed backend (``COLIBRI_TEST_BACKENDS=cpu`` restricts them).

The cases cover parallel layers on a LayerNorm or an RMSNorm, sliding layers with
interleaved-pair RoPE beside global NoPE layers (prompts longer than the window), a dense
first layer that rotates (``prefix_dense_sliding_window_pattern`` 1), softmax and sigmoid
routing, shared experts averaged and summed, q/k/v/o biases, tied and untied heads with
two logit scales, yarn and sharded checkpoints.
"""

import numpy as np
from transformers import Cohere2MoeConfig

import colibri_core
from colibri_core.testing.oracle import FamilyOracleSuite, OracleCase
from colibri_core.testing.oracle_cases import prompt, yarn


def config(**overrides):
    base = dict(vocab_size=128, eos_token_id=None, bos_token_id=None, pad_token_id=None, hidden_size=32, intermediate_size=16,
                num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8,
                num_experts_per_tok=2, num_shared_experts=1, sliding_window=8, sliding_window_pattern=2,
                max_position_embeddings=256, initializer_range=0.1)
    base.update(overrides)
    return lambda: Cohere2MoeConfig(**base)


class TestCohere2MoeOracle(FamilyOracleSuite):
    model_class = "Cohere2MoeForCausalLM"
    cases = {
        # LayerNorms; a dense first layer (24 wide) that is global but rotates, then a sliding
        # layer (8 positions) and a global NoPE one; softmax routing, one shared expert
        # averaged in; q/k/v/o biases; tied embeddings, logits times 1/16
        "layernorm_dense_first_average": OracleCase(
            config(first_k_dense_replace=1, prefix_dense_intermediate_size=24, attention_bias=True),
            prompt=prompt(30)),
        # RMSNorms; layer_types global, sliding (6 positions, yarn), global; sigmoid routing
        # not renormalised, 16 experts top-4, 2 shared experts summed; untied, logits times
        # 1/4; MHA; several shards
        "rmsnorm_sigmoid_sum_sharded": OracleCase(
            config(rms_norm_eps=1e-5, layer_types=["full_attention", "sliding_attention", "full_attention"],
                   sliding_window=6, rope_parameters=yarn(), expert_selection_fn="sigmoid", norm_topk_prob=False,
                   num_experts=16, num_experts_per_tok=4, num_shared_experts=2, shared_expert_combination_strategy="sum",
                   tie_word_embeddings=False, logit_scale=0.25, num_key_value_heads=4),
            seed=1, max_shard_size="40KB", prompt=prompt(40, 5)),
    }

    def test_layers(self, tmp_path_factory):
        fx = self._fixture("layernorm_dense_first_average", tmp_path_factory)
        with colibri_core.load(fx.path, history=False) as model:
            layers = model.lm.layers
        assert {type(layer).__name__ for layer in layers} == {"ParallelDecoderLayer"}
        assert [(layer.attn.window, layer.attn.rope is not None) for layer in layers] == [(None, True), (8, True), (None, False)]
        assert [type(layer.mlp).__name__ for layer in layers] == ["SwiGLU", "SparseMoE", "SparseMoE"]
        assert layers[1].mlp.router.routed_scaling_factor == 0.5  # averaged with the shared expert
