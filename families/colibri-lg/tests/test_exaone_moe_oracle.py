"""K-EXAONE against transformers' ExaoneMoeForCausalLM: greedy tokens and logits under every
placement, on every installed backend (``COLIBRI_TEST_BACKENDS=cpu`` restricts them).

Every router gets a random ``e_score_correction_bias`` (a buffer the perturbation leaves
at zero), so that choosing with it and weighting without it is tested; the cases cover
sliding layers with RoPE beside global NoPE layers (prompts longer than the window), the
schedule by ``sliding_window_pattern`` and by ``layer_types``, dense layers by
``first_k_dense_replace`` and by
``mlp_layer_types``, grouped and ungrouped routing, tied embeddings, yarn and sharded
checkpoints, and the layout transformers keeps in memory besides the one it saves.
"""

from transformers import ExaoneMoeConfig

import colibri_core
from colibri_core.testing.oracle import FamilyOracleSuite, OracleCase, random_correction_bias, save_in_memory_layout
from colibri_core.testing.oracle_cases import prompt, yarn


def config(**overrides):
    base = dict(vocab_size=128, eos_token_id=None, bos_token_id=None, pad_token_id=None, hidden_size=32, intermediate_size=48,
                moe_intermediate_size=16, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                num_experts=8, num_experts_per_tok=2, num_shared_experts=1, n_group=2, topk_group=1, norm_topk_prob=True,
                routed_scaling_factor=2.5, first_k_dense_replace=1, sliding_window=8, sliding_window_pattern=2,
                max_position_embeddings=256, initializer_range=0.1)
    base.update(overrides)
    if base["head_dim"] is None:  # hidden_size / num_attention_heads
        del base["head_dim"]
    return lambda: ExaoneMoeConfig(**base)


class TestExaoneMoeOracle(FamilyOracleSuite):
    model_class = "ExaoneMoeForCausalLM"
    cases = {
        # layers sliding (8 positions, RoPE), global (NoPE), sliding; one dense layer first;
        # 2 groups of 4 experts (1 chosen), top-2 renormalised and scaled, a shared expert,
        # tied embeddings
        "sliding_nope_grouped_tied": OracleCase(config(tie_word_embeddings=True), prompt=prompt(30),
                                                prepare=random_correction_bias()),
        # layer_types: global (NoPE), then two sliding layers (6 positions, yarn RoPE);
        # mlp_layer_types puts the dense layer in the middle; no grouping, 16 experts top-4
        # not renormalised, 2 shared experts, MHA of 8-dim heads (implied), several shards
        "layer_types_yarn_sharded": OracleCase(
            config(sliding_window=6, layer_types=["full_attention", "sliding_attention", "sliding_attention"],
                   mlp_layer_types=["sparse", "dense", "sparse"],
                   n_group=1, num_experts=16, num_experts_per_tok=4, norm_topk_prob=False, routed_scaling_factor=1.0,
                   num_shared_experts=2, num_key_value_heads=4, head_dim=None, rope_parameters=yarn()),
            seed=1, max_shard_size="40KB", prompt=prompt(40, 5), prepare=random_correction_bias(0.2, 7)),
    }

    def test_sliding_layers_rotate_and_global_ones_do_not(self, tmp_path_factory):
        fx = self._fixture("sliding_nope_grouped_tied", tmp_path_factory)
        with colibri_core.load(fx.path, history=False) as model:
            layers = model.lm.layers
        assert [(layer.attn.window, layer.attn.rope is not None) for layer in layers] == [(8, True), (None, False), (8, True)]
        assert [type(layer.mlp).__name__ for layer in layers] == ["SwiGLU", "SparseMoE", "SparseMoE"]
        assert layers[1].mlp.router.bias.name == "model.layers.1.mlp.e_score_correction_bias"

    def test_in_memory_layout_matches_transformers(self, backend, tmp_path_factory):
        """A case rewritten as transformers 5 keeps it in memory (the bias inside the gate,
        ``mlp.gate.e_score_correction_bias``; fused ``mlp.experts.gate_up_proj`` /
        ``down_proj``): transformers reads it to the same logits, and colibri, streaming one
        cached expert per layer, gives its tokens and logits."""
        fx = self._fixture("layer_types_yarn_sharded", tmp_path_factory)
        fused = tmp_path_factory.mktemp("in-memory") / "model"
        names = save_in_memory_layout(self.model_class, fx.path, fused)
        assert "model.layers.0.mlp.experts.gate_up_proj" in names

        def reads_the_in_memory_names(model):
            assert model.lm.layers[0].mlp.router.bias.name == "model.layers.0.mlp.gate.e_score_correction_bias"

        self.check_rewritten(fx, fused, backend, "the in-memory layout", reads_the_in_memory_names)
