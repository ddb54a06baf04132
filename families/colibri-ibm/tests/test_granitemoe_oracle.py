"""Granite MoE (granitemoe, granitemoeshared) against transformers: greedy tokens and
logits under every placement, on every installed backend (``COLIBRI_TEST_BACKENDS=cpu``
restricts them).

transformers 5 saves Granite as published on the Hub (``block_sparse_moe.router.layer``,
fused ``block_sparse_moe.input_linear`` / ``output_linear``); each suite also rewrites a
case in the layout transformers keeps in memory (``router``, ``experts.gate_up_proj`` /
``down_proj``), which colibri reads too. Every case but one sets each muP multiplier away
from 1, so that dropping one changes the tokens.
"""


import numpy as np
import pytest
from transformers import GraniteMoeConfig, GraniteMoeSharedConfig

import colibri_core
from colibri_core.errors import UnsupportedModelError
from colibri_core.testing import DELETE, copy_model
from colibri_core.testing.oracle import FamilyOracleSuite, OracleCase, save_in_memory_layout
from colibri_core.testing.oracle_cases import prompt, yarn

MUP = dict(embedding_multiplier=4.0, attention_multiplier=0.25, residual_multiplier=0.5, logits_scaling=3.0)


def config(cls, **overrides):
    base = dict(vocab_size=128, eos_token_id=None, bos_token_id=None, hidden_size=32, intermediate_size=16,
                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, num_local_experts=8,
                num_experts_per_tok=2, max_position_embeddings=128, initializer_range=0.1, **MUP)
    base.update(overrides)
    return lambda: cls(**base)


class InMemoryLayout:
    """Mixed into a suite: ``in_memory_case`` rewritten with transformers' in-memory tensor
    names (its ``state_dict``) loads to the same logits in transformers and in colibri."""

    in_memory_case = ""

    def test_in_memory_layout_matches_transformers(self, backend, tmp_path_factory):
        fx = self._fixture(self.in_memory_case, tmp_path_factory)
        target = tmp_path_factory.mktemp("in-memory") / "model"
        names = save_in_memory_layout(self.model_class, fx.path, target)
        assert "model.layers.0.block_sparse_moe.experts.gate_up_proj" in names
        assert "model.layers.0.block_sparse_moe.router.weight" in names
        self.check_rewritten(fx, target, backend, "the in-memory layout")


class TestGraniteMoeOracle(FamilyOracleSuite, InMemoryLayout):
    model_class = "GraniteMoeForCausalLM"
    in_memory_case = "sharded_bias"
    cases = {
        "base": OracleCase(config(GraniteMoeConfig)),
        "sharded_bias": OracleCase(
            config(GraniteMoeConfig, num_hidden_layers=3, attention_bias=True, num_local_experts=16, num_experts_per_tok=4),
            seed=1, max_shard_size="40KB"),
        "tied_top1_linear_rope": OracleCase(
            config(GraniteMoeConfig, tie_word_embeddings=True, num_local_experts=4, num_experts_per_tok=1,
                   num_key_value_heads=1, rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}),
            seed=2),
        # transformers' defaults: no multiplier (1.0 each), the plain path
        "no_mup_yarn": OracleCase(
            config(GraniteMoeConfig, embedding_multiplier=1.0, attention_multiplier=8 ** -0.5, residual_multiplier=1.0,
                   logits_scaling=1.0, rope_parameters=yarn()), seed=3, prompt=prompt(40, 5)),
    }

    def test_hub_config_spellings(self, tmp_path_factory, tmp_path):
        """Published configs spell the rope as ``rope_theta`` and ``rope_scaling: null``, or
        not at all (10000): the same tokens and logits."""
        fx = self._fixture("base", tmp_path_factory)
        for name, changes in {"rope_theta": dict(rope_parameters=DELETE, rope_theta=10000.0, rope_scaling=None),
                              "no_rope_keys": dict(rope_parameters=DELETE)}.items():
            model_dir = copy_model(fx.path, tmp_path / name, **changes)
            with colibri_core.load(model_dir, history=False) as model:
                result = model.generate(token_ids=fx.prompt, max_tokens=len(fx.tokens), ignore_eos=True,
                                        return_logits=True)
            assert result.token_ids == fx.tokens, name
            worst = float(np.abs(np.stack(result.logits) - fx.step_logits).max())
            assert worst < self.tolerance, f"{name}: logits differ by {worst:.2e}"

    def test_another_activation_is_refused(self, tmp_path_factory, tmp_path):
        fx = self._fixture("base", tmp_path_factory)
        model = copy_model(fx.path, tmp_path / "gelu", hidden_act="gelu")
        with pytest.raises(UnsupportedModelError, match="hidden_act 'gelu'"):
            colibri_core.load(model, history=False)


class TestGraniteMoeSharedOracle(FamilyOracleSuite, InMemoryLayout):
    model_class = "GraniteMoeSharedForCausalLM"
    in_memory_case = "shared"
    cases = {
        "shared": OracleCase(config(GraniteMoeSharedConfig, shared_intermediate_size=24)),
        "shared_sharded_tied_bias": OracleCase(
            config(GraniteMoeSharedConfig, shared_intermediate_size=40, num_hidden_layers=3, tie_word_embeddings=True,
                   attention_bias=True, num_key_value_heads=4, num_local_experts=16, num_experts_per_tok=3),
            seed=1, max_shard_size="40KB", prompt=prompt(24)),
        # shared_intermediate_size 0: no shared expert (transformers' default)
        "no_shared_expert": OracleCase(config(GraniteMoeSharedConfig, shared_intermediate_size=0), seed=2),
    }

    def test_shared_expert_is_declared_only_when_sized(self, tmp_path_factory):
        with colibri_core.load(self._fixture("shared", tmp_path_factory).path, history=False) as model:
            assert all(layer.mlp.shared is not None for layer in model.lm.layers)
        with colibri_core.load(self._fixture("no_shared_expert", tmp_path_factory).path, history=False) as model:
            assert all(layer.mlp.shared is None for layer in model.lm.layers)
