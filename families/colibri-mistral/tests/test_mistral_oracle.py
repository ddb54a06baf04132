"""Mixtral against transformers' MixtralForCausalLM: greedy tokens and logits under every
placement, on every installed backend (``COLIBRI_TEST_BACKENDS=cpu`` restricts them).

transformers 5 saves Mixtral as published on the Hub (``block_sparse_moe.gate``,
``block_sparse_moe.experts.{e}.w1/w2/w3``): the suite's cases load that layout; the last
test rewrites a case in the layout transformers keeps in memory (``mlp.gate``,
``mlp.experts.gate_up_proj`` / ``down_proj``), which colibri reads too.
"""

import json

import numpy as np
import pytest
from transformers import MixtralConfig

import colibri_core
from colibri_core.errors import UnsupportedModelError
from colibri_core.testing import DELETE, copy_model
from colibri_core.testing.oracle import FamilyOracleSuite, OracleCase, save_in_memory_layout
from colibri_core.testing.oracle_cases import prompt, yarn


def config(**overrides):
    base = dict(vocab_size=128, eos_token_id=None, bos_token_id=None, hidden_size=32, intermediate_size=16,
                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, num_local_experts=8,
                num_experts_per_tok=2, max_position_embeddings=128, initializer_range=0.1)
    base.update(overrides)
    return lambda: MixtralConfig(**base)


class TestMixtralOracle(FamilyOracleSuite):
    model_class = "MixtralForCausalLM"
    cases = {
        "base": OracleCase(config()),
        # a window of 6 positions, a 20-token prompt and 32 generated: the window slides
        # within the prompt, across prefill chunks and through decoding
        "sliding_window_sharded": OracleCase(
            config(num_hidden_layers=3, sliding_window=6, num_local_experts=16, num_experts_per_tok=4),
            seed=1, prompt=prompt(20), max_shard_size="40KB"),
        "head_dim_top1_linear_rope": OracleCase(
            config(head_dim=16, num_local_experts=4, num_experts_per_tok=1, num_key_value_heads=1,
                   rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}), seed=2),
        "tied_yarn_mha_window": OracleCase(
            # (transformers' yarn needs head_dim spelled out)
            config(tie_word_embeddings=True, num_key_value_heads=4, head_dim=8, sliding_window=9, rope_parameters=yarn()),
            seed=3, prompt=prompt(30, 5)),
    }

    def test_in_memory_layout_matches_transformers(self, backend, tmp_path_factory):
        """A case rewritten as transformers 5 keeps Mixtral in memory (``mlp.gate``,
        fused ``mlp.experts.gate_up_proj`` / ``down_proj``): transformers reads it to the
        same logits, and colibri, streaming one cached expert per layer, gives its tokens
        and logits."""
        fx = self._fixture("sliding_window_sharded", tmp_path_factory)
        fused = tmp_path_factory.mktemp("in-memory") / "model"
        names = save_in_memory_layout(self.model_class, fx.path, fused)
        assert "model.layers.0.mlp.experts.gate_up_proj" in names and not any("block_sparse_moe" in k for k in names)

        def reads_the_in_memory_names(model):
            assert model.lm.layers[0].mlp.router.gate.weight.name == "model.layers.0.mlp.gate.weight"

        self.check_rewritten(fx, fused, backend, "the in-memory layout", reads_the_in_memory_names)

    def test_sliding_window_bounds_the_cache(self, tmp_path_factory):
        """With ``sliding_window`` every layer's cache keeps only the window."""
        fx = self._fixture("sliding_window_sharded", tmp_path_factory)
        with colibri_core.load(fx.path, history=False) as model:
            assert {layer.attn.window for layer in model.lm.layers} == {6}
        base = self._fixture("base", tmp_path_factory)
        with colibri_core.load(base.path, history=False) as model:
            assert {layer.attn.window for layer in model.lm.layers} == {None}

    def test_another_activation_is_refused(self, tmp_path_factory, tmp_path):
        fx = self._fixture("base", tmp_path_factory)
        model = copy_model(fx.path, tmp_path / "gelu", hidden_act="gelu")
        with pytest.raises(UnsupportedModelError, match="hidden_act 'gelu'"):
            colibri_core.load(model, history=False)

    def test_hub_config_spellings(self, tmp_path_factory, tmp_path):
        """Published configs spell the rope as ``rope_theta`` (Mixtral's 1e6, the base
        case's), or older ones not at all: the same tokens and logits."""
        fx = self._fixture("base", tmp_path_factory)
        for name, changes in {"rope_theta": dict(rope_parameters=DELETE, rope_theta=1e6),
                              "no_rope_keys": dict(rope_parameters=DELETE)}.items():
            model_dir = copy_model(fx.path, tmp_path / name, **changes)
            with colibri_core.load(model_dir, history=False) as model:
                result = model.generate(token_ids=fx.prompt, max_tokens=len(fx.tokens), ignore_eos=True,
                                        return_logits=True)
            assert result.token_ids == fx.tokens, name
            worst = float(np.abs(np.stack(result.logits) - fx.step_logits).max())
            assert worst < self.tolerance, f"{name}: logits differ by {worst:.2e}"
