"""Phi-MoE against transformers' PhimoeForCausalLM: greedy tokens and logits under every
placement, on every installed backend (``COLIBRI_TEST_BACKENDS=cpu`` restricts them).

The sparsemixer's thresholds (2 x ``router_jitter_noise``, relative) decide how many
experts share the softmax each chosen expert is weighted by: the cases run it with
transformers' default 0.01 (mostly the chosen expert alone), 0.3 and 1.0 (many). They
cover LayerNorm decoders, attention and LM-head biases, LongRoPE past its original
context (32 positions here), a sliding window, tied embeddings, sharded saves, and the
layout transformers keeps in memory.
"""

import numpy as np
import pytest
from transformers import PhimoeConfig

import colibri_core
from colibri_core.errors import UnsupportedModelError
from colibri_core.nn import LayerNorm, SparseMixerRouter
from colibri_core.testing import copy_model
from colibri_core.testing.oracle import FamilyOracleSuite, OracleCase, save_in_memory_layout
from colibri_core.testing.oracle_cases import prompt


def longrope(head_dim: int, **changes) -> dict:
    """LongRoPE at the tiny models' scale: 32 original positions (prompt and generation
    run past them), short and long factors of their own, Phi-3.5-MoE's mscale."""
    half = head_dim // 2
    return {"rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": 32,
            "short_factor": np.linspace(1.0, 1.6, half).tolist(), "long_factor": np.linspace(2.0, 9.0, half).tolist(),
            "short_mscale": 1.243163121016122, "long_mscale": 1.243163121016122, **changes}


def config(**overrides):
    base = dict(vocab_size=128, eos_token_id=None, bos_token_id=None, hidden_size=32, intermediate_size=16,
                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, num_local_experts=8,
                max_position_embeddings=256, initializer_range=0.1)
    base.update(overrides)
    return lambda: PhimoeConfig(**base)


class TestPhiMoeOracle(FamilyOracleSuite):
    model_class = "PhimoeForCausalLM"
    cases = {
        "base": OracleCase(config(), prompt=prompt(30)),
        # LongRoPE, q/k/v/o and LM-head biases, 16 experts, wider thresholds
        "longrope_biases_sharded": OracleCase(
            config(num_hidden_layers=3, num_local_experts=16, attention_bias=True, lm_head_bias=True,
                   router_jitter_noise=0.3, rope_parameters=longrope(8)),
            seed=1, max_shard_size="40KB", prompt=prompt(40, 5)),
        # tied (with a head bias), MHA, a window of 9 positions, thresholds letting most experts in
        "tied_window_wide_threshold": OracleCase(
            config(tie_word_embeddings=True, lm_head_bias=True, num_key_value_heads=4, sliding_window=9,
                   router_jitter_noise=1.0, rope_parameters=longrope(8, rope_theta=500.0)),
            seed=2, prompt=prompt(45, 3)),
    }

    def test_blocks(self, tmp_path_factory):
        fx = self._fixture("tied_window_wide_threshold", tmp_path_factory)
        with colibri_core.load(fx.path, history=False) as model:
            lm = model.lm
            assert isinstance(lm.norm, LayerNorm) and all(isinstance(layer.attn_norm, LayerNorm) for layer in lm.layers)
            assert all(isinstance(layer.mlp.router, SparseMixerRouter) and layer.attn.window == 9 for layer in lm.layers)
            assert lm.lm_head.weight is lm.embed.weight and lm.lm_head.bias is not None

    def test_in_memory_layout_matches_transformers(self, backend, tmp_path_factory):
        """A case rewritten as transformers keeps Phi-MoE in memory (``mlp.router``, fused
        ``mlp.experts.gate_up_proj`` / ``down_proj``): transformers reads it to the same
        logits, and colibri, streaming one cached expert per layer, gives its tokens and
        logits."""
        fx = self._fixture("longrope_biases_sharded", tmp_path_factory)
        fused = tmp_path_factory.mktemp("in-memory") / "model"
        names = save_in_memory_layout(self.model_class, fx.path, fused)
        assert "model.layers.0.mlp.experts.gate_up_proj" in names and not any("block_sparse_moe" in k for k in names)

        def reads_the_in_memory_names(model):
            assert model.lm.layers[0].mlp.router.gate.weight.name == "model.layers.0.mlp.router.weight"

        self.check_rewritten(fx, fused, backend, "the in-memory layout", reads_the_in_memory_names)

    def test_unequal_mscales_are_refused(self, tmp_path_factory, tmp_path):
        fx = self._fixture("longrope_biases_sharded", tmp_path_factory)
        model = copy_model(fx.path, tmp_path / "mscales", rope_parameters=longrope(8, long_mscale=1.5))
        with pytest.raises(UnsupportedModelError, match="'long_mscale' 1.5 differs from 'short_mscale'"):
            colibri_core.load(model, history=False)
