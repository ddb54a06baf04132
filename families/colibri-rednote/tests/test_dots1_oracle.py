"""dots.llm1 against transformers' Dots1ForCausalLM: greedy tokens and logits under every
placement, on every installed backend (``COLIBRI_TEST_BACKENDS=cpu`` restricts them).

Every router gets a random ``e_score_correction_bias`` (a buffer the perturbation leaves
at zero), so that choosing with it and weighting without it is tested; the cases cover
dense and MoE layers, full and sliding layers (prompts longer than the window), grouped
and ungrouped routing, renormalised or not, biases, tied embeddings and yarn.
"""

from transformers import Dots1Config

import colibri_core
from colibri_core.nn import SigmoidGroupedTopKRouter
from colibri_core.testing.oracle import FamilyOracleSuite, OracleCase, random_correction_bias
from colibri_core.testing.oracle_cases import prompt, yarn


def config(**overrides):
    base = dict(vocab_size=128, eos_token_id=None, bos_token_id=None, pad_token_id=None, hidden_size=32, intermediate_size=48,
                moe_intermediate_size=16, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, n_group=2, topk_group=1,
                first_k_dense_replace=1, norm_topk_prob=True, routed_scaling_factor=2.5, sliding_window=None,
                max_position_embeddings=256, initializer_range=0.1)
    base.update(overrides)
    if base["head_dim"] is None:  # hidden_size / num_attention_heads
        del base["head_dim"]
    return lambda: Dots1Config(**base)


class TestDots1Oracle(FamilyOracleSuite):
    model_class = "Dots1ForCausalLM"
    cases = {
        # one dense layer, then MoE: 2 groups of 4 experts (1 chosen), top-2 renormalised and
        # scaled, a shared expert; the last layer slides over 8 positions (max_window_layers 2)
        "grouped_sliding_last": OracleCase(config(sliding_window=8, max_window_layers=2), prompt=prompt(30),
                                           prepare=random_correction_bias()),
        # q/k/v/o biases, every layer MoE, no grouping, 16 experts top-4 not renormalised, 2
        # shared experts, MHA, tied embeddings, yarn, layer_types spelled out (sliding first),
        # several shards
        "biases_tied_yarn_sharded": OracleCase(
            config(attention_bias=True, first_k_dense_replace=0, n_group=1, n_routed_experts=16, num_experts_per_tok=4,
                   norm_topk_prob=False, routed_scaling_factor=1.0, n_shared_experts=2, num_key_value_heads=4,
                   head_dim=None, tie_word_embeddings=True, rope_parameters=yarn(), sliding_window=6,
                   layer_types=["sliding_attention", "full_attention", "sliding_attention"]),
            seed=1, max_shard_size="40KB", prompt=prompt(40, 5), prepare=random_correction_bias(0.2, 7)),
    }

    def test_layers_and_routers(self, tmp_path_factory):
        fx = self._fixture("grouped_sliding_last", tmp_path_factory)
        with colibri_core.load(fx.path, history=False) as model:
            layers = model.lm.layers
            kinds = [type(layer.mlp).__name__ for layer in layers]
            windows = [layer.attn.window for layer in layers]
            router = layers[1].mlp.router
        assert kinds == ["SwiGLU", "SparseMoE", "SparseMoE"] and windows == [None, None, 8]
        assert isinstance(router, SigmoidGroupedTopKRouter) and router.bias is not None
        assert (router.n_group, router.topk_group, router.routed_scaling_factor) == (2, 1, 2.5)
