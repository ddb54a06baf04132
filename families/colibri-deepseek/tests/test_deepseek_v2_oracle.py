"""DeepSeek-V2 against transformers' DeepseekV2ForCausalLM: tokens and logits under every
placement. Its router is a softmax over all experts, ``greedy`` or
``group_limited_greedy`` (only the experts of the ``topk_group`` groups with the best
single probability compete), the chosen probabilities scaled by
``routed_scaling_factor`` and never renormalised; MLA rotates interleaved pairs."""

import numpy as np
import pytest

import colibri_core
from colibri_core.compute import host
from colibri_core.errors import UnsupportedModelError
from colibri_core.nn import SoftmaxGroupedTopKRouter
from colibri_core.testing import copy_model
from colibri_core.testing.oracle import FamilyOracleSuite, FusedLayoutCheck, OracleCase
from colibri_core.testing.oracle_cases import prompt, yarn

from ds_configs import v2

# DeepSeek-V2's published yarn: mscale == mscale_all_dim (the rope tables unscaled, the softmax scaled)
V2_YARN = yarn(mscale=0.707, mscale_all_dim=0.707, beta_fast=32, beta_slow=1)


class TestDeepseekV2Oracle(FamilyOracleSuite, FusedLayoutCheck):
    model_class = "DeepseekV2ForCausalLM"
    fused_case = "group_limited_scaled_sharded"  # transformers 5's in-memory experts.gate_up_proj / down_proj
    cases = {
        # V2-Lite's shape: no q LoRA, greedy top-2 of 8, one dense layer first, 2 shared experts
        "lite_greedy": OracleCase(v2(q_lora_rank=None, first_k_dense_replace=1), prompt=prompt(30)),
        # V2's: q LoRA, group_limited_greedy over 4 groups of 4 (2 kept), top-3, scaled,
        # attention biases, several shards
        "group_limited_scaled_sharded": OracleCase(
            v2(topk_method="group_limited_greedy", n_routed_experts=16, n_group=4, topk_group=2, num_experts_per_tok=3,
               routed_scaling_factor=2.5, attention_bias=True, num_hidden_layers=4, first_k_dense_replace=1),
            seed=1, max_shard_size="40KB", prompt=prompt(40, 5)),
        # V2's yarn (softmax scaled by mscale_all_dim), every layer MoE, one shared expert,
        # all three experts from the one group (of two) holding the best expert, tied embeddings
        "yarn_one_group_tied": OracleCase(
            v2(q_lora_rank=None, topk_method="group_limited_greedy", n_group=2, topk_group=1, num_experts_per_tok=3,
               routed_scaling_factor=1.5, first_k_dense_replace=0, n_shared_experts=1, tie_word_embeddings=True,
               rope_parameters=V2_YARN),
            seed=2, prompt=prompt(45, 3)),
    }

    def test_router_is_the_softmax_grouped_one(self, tmp_path_factory):
        fx = self._fixture("group_limited_scaled_sharded", tmp_path_factory)
        with colibri_core.load(fx.path, history=False) as model:
            routers = [layer.mlp.router for layer in model.lm.layers[1:]]
            assert model.lm.layers[0].mlp.__class__.__name__ == "SwiGLU"
        assert all(isinstance(r, SoftmaxGroupedTopKRouter) for r in routers)
        assert {(r.n_group, r.topk_group, r.top_k, r.routed_scaling_factor) for r in routers} == {(4, 2, 3, 2.5)}

    @pytest.mark.parametrize("changes, field", [
        ({"topk_method": "noaux_tc"}, "topk_method 'noaux_tc'"),
        ({"scoring_func": "sigmoid"}, "scoring_func 'sigmoid'"),
        ({"norm_topk_prob": True}, "norm_topk_prob"),
    ])
    def test_other_routers_are_refused(self, tmp_path_factory, tmp_path, changes, field):
        fx = self._fixture("lite_greedy", tmp_path_factory)
        model = copy_model(fx.path, tmp_path / "changed", **changes)
        with pytest.raises(UnsupportedModelError, match=field):
            colibri_core.load(model, history=False)


@pytest.mark.parametrize("method, n_group, topk_group, k", [("greedy", None, None, 6), ("group_limited_greedy", 8, 3, 6),
                                                            ("group_limited_greedy", 4, 1, 2)])
def test_host_router_matches_transformers(method, n_group, topk_group, k):
    """``host.softmax_grouped_top_k`` (the reference of ``SoftmaxGroupedTopKRouter``)
    chooses transformers' experts with its weights, on 64 tokens of 64 experts."""
    import torch
    from transformers import DeepseekV2Config
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2TopkRouter

    config = DeepseekV2Config(hidden_size=16, num_attention_heads=4, n_routed_experts=64, num_experts_per_tok=k,
                              topk_method=method, n_group=n_group, topk_group=topk_group, routed_scaling_factor=16.0)
    router = DeepseekV2TopkRouter(config)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        router.weight.copy_(torch.randn(router.weight.shape, generator=g))
        x = torch.randn(64, 16, generator=g)
        logits, weights, indices = router(x)
    ours_i, ours_w = host.softmax_grouped_top_k(logits.numpy(), k, n_group or 1, topk_group or 1, 16.0)
    order = np.argsort(-weights.numpy(), axis=-1, kind="stable")  # transformers' top-k is unsorted
    np.testing.assert_array_equal(ours_i, np.take_along_axis(indices.numpy(), order, axis=-1))
    np.testing.assert_allclose(ours_w, np.take_along_axis(weights.numpy(), order, axis=-1), rtol=1e-6)
    if method == "group_limited_greedy":  # the groups matter here
        assert not np.array_equal(ours_i, host.softmax_grouped_top_k(logits.numpy(), k, 1, 1, 16.0)[0])
