"""MiniMax-Text-01 / M1 against transformers' MiniMaxForCausalLM: greedy tokens and logits
under every placement, on every installed backend (``COLIBRI_TEST_BACKENDS=cpu`` restricts
them).

The cases cover both layer kinds (lightning attention, GQA softmax attention) in a given
order and in transformers' default alternation, lightning blocks of 8 and 5 positions with
prompts of several blocks (and, in the suite's small-prefill test, chunks of 5 that start
mid-block), decay rates differing by depth, every residual scaling away from 1, the
softmax top-k router renormalised over 8 experts top-2 and 16 top-4, MHA and grouped KV
heads, tied embeddings, sharded checkpoints, and the tensors as transformers keeps them
in memory (``mlp``, fused experts).
"""

import numpy as np
from transformers import MiniMaxConfig

import colibri_core
from colibri_core.nn import Attention, LightningAttention, SoftmaxTopKRouter
from colibri_core.testing.lightning import LightningChecks
from colibri_core.testing.oracle import FamilyOracleSuite, OracleCase, save_in_memory_layout
from colibri_core.testing.oracle_cases import prompt

L, F = "linear_attention", "full_attention"


def config(**overrides):
    base = dict(vocab_size=128, eos_token_id=None, bos_token_id=None, pad_token_id=None, hidden_size=32,
                intermediate_size=16, num_hidden_layers=4, layer_types=[L, F, L, L], num_attention_heads=4,
                num_key_value_heads=2, head_dim=8, num_local_experts=8, num_experts_per_tok=2, block_size=8,
                max_position_embeddings=256, initializer_range=0.1,
                full_attn_alpha_factor=1.5, full_attn_beta_factor=0.8, linear_attn_alpha_factor=0.7,
                linear_attn_beta_factor=1.25, mlp_alpha_factor=1.3, mlp_beta_factor=0.9)
    base.update(overrides)
    return lambda: MiniMaxConfig(**base)


class TestMiniMaxOracle(LightningChecks, FamilyOracleSuite):
    model_class = "MiniMaxForCausalLM"
    cases = {
        # lightning, softmax, lightning, lightning; blocks of 8 (a 30-token prompt: 4 blocks);
        # GQA; every residual scaled; 8 experts top-2; several shards
        "both_kinds_scaled_sharded": OracleCase(config(), max_shard_size="40KB", prompt=prompt(30)),
        # transformers' default pattern (softmax at even layers), blocks of 5, MHA of 8 wide
        # heads, 16 experts top-4, tied embeddings, the residual scalings left at 1
        "default_pattern_tied_top4": OracleCase(
            config(layer_types=None, num_hidden_layers=3, block_size=5, num_attention_heads=8, num_key_value_heads=8,
                   head_dim=4, num_local_experts=16, num_experts_per_tok=4, tie_word_embeddings=True,
                   full_attn_alpha_factor=1, full_attn_beta_factor=1, linear_attn_alpha_factor=1,
                   linear_attn_beta_factor=1, mlp_alpha_factor=1, mlp_beta_factor=1),
            seed=1, prompt=prompt(40, 5)),
    }

    def test_layers(self, tmp_path_factory):
        """Each layer's mixer is the kind layer_types names, with transformers' decay rates
        and block size; the router renormalises; the scalings are read."""
        import torch
        import transformers

        fx = self._fixture("both_kinds_scaled_sharded", tmp_path_factory)
        theirs = transformers.MiniMaxForCausalLM.from_pretrained(fx.path, dtype=torch.float32)
        with colibri_core.load(fx.path, history=False) as model:
            layers = model.lm.layers
            assert model.lm.new_cache(model.backend).layers[0]["kv"].shape == (4, 8, 8)
        assert [type(layer.attn) for layer in layers] == [LightningAttention, Attention, LightningAttention,
                                                          LightningAttention]
        for i in (0, 2, 3):
            want = theirs.model.layers[i].self_attn.slope_rate.reshape(-1).numpy()
            assert np.array_equal(layers[i].attn.slopes, want) and layers[i].attn.block_size == 8
        assert [layer.attn_scales for layer in layers] == [(0.7, 1.25), (1.5, 0.8), (0.7, 1.25), (0.7, 1.25)]
        assert all(layer.mlp_scales == (1.3, 0.9) for layer in layers)
        router = layers[0].mlp.router
        assert isinstance(router, SoftmaxTopKRouter) and router.norm_topk_prob
        assert router.gate.weight.name == "model.layers.0.block_sparse_moe.gate.weight"

    def test_in_memory_layout_matches_transformers(self, backend, tmp_path_factory):
        """A case rewritten as transformers 5 keeps MiniMax in memory (``mlp.gate``, fused
        ``mlp.experts.gate_up_proj`` / ``down_proj``): transformers reads it to the same
        logits, and colibri, streaming one cached expert per layer, gives its tokens and
        logits."""
        fx = self._fixture("both_kinds_scaled_sharded", tmp_path_factory)
        fused = tmp_path_factory.mktemp("in-memory") / "model"
        names = save_in_memory_layout(self.model_class, fx.path, fused)
        assert "model.layers.0.mlp.experts.gate_up_proj" in names and not any("block_sparse_moe" in k for k in names)

        def reads_the_in_memory_names(model):
            assert model.lm.layers[0].mlp.router.gate.weight.name == "model.layers.0.mlp.gate.weight"

        self.check_rewritten(fx, fused, backend, "the in-memory layout", reads_the_in_memory_names)
