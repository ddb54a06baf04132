"""Hy3 against transformers' HYV3ForCausalLM: greedy tokens and logits under every
placement, on every installed backend (``COLIBRI_TEST_BACKENDS=cpu`` restricts them).

Every router gets a random ``e_score_correction_bias`` (a buffer the perturbation leaves
at zero), so that choosing with it and weighting without it is tested; the cases cover
q/k norms before RoPE with and without attention biases, the default dense-then-sparse
layers and ``mlp_layer_types`` spelled out, one and two shared experts' widths, router
scaling, tied and untied embeddings, MHA and GQA, YaRN, single-file and sharded saves
(the checkpoint's names, per-expert tensors, as transformers saves them), the fused
expert layout, and transformers' in-memory names.
"""

import pytest
from transformers import HYV3Config

import colibri_core
from colibri_core.errors import UnsupportedModelError
from colibri_core.nn import SigmoidGroupedTopKRouter
from colibri_core.testing import copy_model
from colibri_core.testing.oracle import (FamilyOracleSuite, FusedLayoutCheck, OracleCase, random_correction_bias,
                                         save_in_memory_layout)
from colibri_core.testing.oracle_cases import prompt, yarn


def config(**overrides):
    # (transformers' HYV3Config defaults head_dim to 128: spelled out)
    base = dict(vocab_size=128, eos_token_id=None, bos_token_id=None, pad_token_id=None, hidden_size=32,
                intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=3, num_attention_heads=4,
                num_key_value_heads=2, head_dim=8, num_experts=8, num_experts_per_tok=2, num_shared_experts=1,
                router_scaling_factor=2.826, max_position_embeddings=256, initializer_range=0.1)
    base.update(overrides)
    return lambda: HYV3Config(**base)


class TestHYV3Oracle(FamilyOracleSuite, FusedLayoutCheck):
    model_class = "HYV3ForCausalLM"
    fused_case = "biases_layer_types_sharded"  # transformers 5's in-memory experts.gate_up_proj / down_proj
    cases = {
        # the first layer dense, then MoE: 8 experts top-2, renormalised and scaled, one shared MLP
        "base": OracleCase(config(), prompt=prompt(30), prepare=random_correction_bias()),
        # q/k/v/o biases, mlp_layer_types spelled out (sparse, dense, sparse), 16 experts top-4
        # unscaled, two shared experts' width, several shards
        "biases_layer_types_sharded": OracleCase(
            config(attention_bias=True, mlp_layer_types=["sparse", "dense", "sparse"], num_experts=16,
                   num_experts_per_tok=4, num_shared_experts=2, router_scaling_factor=1.0),
            seed=1, max_shard_size="40KB", prompt=prompt(40, 5), prepare=random_correction_bias(0.2, 7)),
        # tied, MHA, a wider head, YaRN
        "tied_mha_yarn": OracleCase(
            config(tie_word_embeddings=True, num_key_value_heads=4, head_dim=16, rope_parameters=yarn()),
            seed=2, prompt=prompt(45, 3), prepare=random_correction_bias(0.3, 11)),
    }

    def test_layers_and_routers(self, tmp_path_factory):
        fx = self._fixture("biases_layer_types_sharded", tmp_path_factory)
        with colibri_core.load(fx.path, history=False) as model:
            layers = model.lm.layers
            kinds = [type(layer.mlp).__name__ for layer in layers]
            router = layers[0].mlp.router
            assert not any(layer.attn.qk_norm_after_rope for layer in layers)
            assert kinds == ["SparseMoE", "SwiGLU", "SparseMoE"]
            assert isinstance(router, SigmoidGroupedTopKRouter) and router.bias is not None
            assert (router.top_k, router.n_group, router.norm_topk_prob, router.routed_scaling_factor) == (4, 1, True, 1.0)
            assert layers[0].mlp.shared is not None

    def test_in_memory_names_match_transformers(self, backend, tmp_path_factory):
        """transformers' state-dict names (``mlp.gate``, ``mlp.e_score_correction_bias``,
        ``mlp.shared_experts``, fused experts) read as the checkpoint's."""
        fx = self._fixture("base", tmp_path_factory)
        dst = tmp_path_factory.mktemp("in_memory") / "model"
        names = save_in_memory_layout(self.model_class, fx.path, dst)
        assert "model.layers.1.mlp.e_score_correction_bias" in names and "model.layers.1.mlp.gate.weight" in names
        self.check_rewritten(fx, dst, backend, "the in-memory names")

    def test_zero_shared_experts_are_refused(self, tmp_path_factory, tmp_path):
        fx = self._fixture("base", tmp_path_factory)
        model = copy_model(fx.path, tmp_path / "unshared", num_shared_experts=0)
        with pytest.raises(UnsupportedModelError, match="num_shared_experts 0 is not supported"):
            colibri_core.load(model, history=False)
