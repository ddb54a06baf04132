"""Nemotron-H against transformers' NemotronHForCausalLM: greedy tokens and logits under
every placement, on every installed backend (``COLIBRI_TEST_BACKENDS=cpu`` restricts them).

The cases cover every layer kind (Mamba-2, NoPE attention, squared-ReLU MLP, MoE with a
shared expert), Mamba-2 layers with grouped and single B/C groups, conv biases or none,
biased projections, prompts spanning several Mamba chunks (their state carried across
prefill chunks, decode steps, batched and drafted steps), dt floored at time_step_min,
the router with a random correction bias, renormalised and scaled, or group-limited
without renormalisation, tied and untied embeddings, sharded checkpoints, and the
tensors as transformers keeps them in memory (``model.``, fused experts).
"""

import colibri_core
from colibri_core.nn import UngatedMLP
from colibri_core.testing.mamba import Mamba2Checks
from colibri_core.testing.oracle import FamilyOracleSuite, OracleCase, random_correction_bias, save_in_memory_layout
from colibri_core.testing.oracle_cases import prompt
from transformers import NemotronHConfig

M, A, D, E = "linear_attention", "full_attention", "mlp", "moe"


def config(**overrides):
    base = dict(vocab_size=128, eos_token_id=None, bos_token_id=None, pad_token_id=None, hidden_size=32,
                layers_block_type=[M, E, A, D, M, E], num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                intermediate_size=48, mamba_num_heads=4, mamba_head_dim=8, n_groups=2, ssm_state_size=16,
                conv_kernel=4, chunk_size=8, n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=16,
                moe_shared_expert_intermediate_size=24, routed_scaling_factor=2.5, max_position_embeddings=256,
                initializer_range=0.1)
    base.update(overrides)
    return lambda: NemotronHConfig(**base)


class TestNemotronHOracle(Mamba2Checks, FamilyOracleSuite):
    model_class = "NemotronHForCausalLM"
    cases = {
        # Mamba (2 groups of 2 heads), MoE, attention, MLP, Mamba, MoE; 8 experts top-2 chosen
        # with a random correction bias, renormalised, times 2.5; GQA; untied; chunks of 8
        "every_layer_kind": OracleCase(config(), prompt=prompt(30), prepare=random_correction_bias()),
        # attention, Mamba (1 group, kernel 3, no conv bias, biased in/out projections, dt
        # floored at 0.01, which binds), MoE (16 experts in 4 groups, the best 2 groups, top-4, not
        # renormalised), Mamba, MLP with biases; MHA; tie_word_embeddings (which transformers
        # ignores: its lm_head stays a tensor of its own); chunks of 5; several shards. A prompt
        # of 27: no prefill chunk of the suite's small-chunk test (5) is a lone token, which
        # takes the stepwise form without the floor, as a one-token transformers forward does
        "grouped_router_biases_tied_sharded": OracleCase(
            config(layers_block_type=[A, M, E, M, D], n_groups=1, mamba_num_heads=2, mamba_head_dim=16, ssm_state_size=8,
                   conv_kernel=3, chunk_size=5, use_conv_bias=False, use_bias=True, mlp_bias=True, time_step_min=0.01,
                   n_routed_experts=16, num_experts_per_tok=4, n_group=4, topk_group=2, norm_topk_prob=False,
                   routed_scaling_factor=1.0, num_key_value_heads=4, tie_word_embeddings=True),
            seed=1, max_shard_size="40KB", prompt=prompt(27, 5), prepare=random_correction_bias(seed=7)),
    }

    def test_layers(self, tmp_path_factory):
        fx = self._fixture("every_layer_kind", tmp_path_factory)
        with colibri_core.load(fx.path, history=False) as model:
            layers = model.lm.layers
            assert [type(layer.attn).__name__ for layer in layers] == ["Mamba2Mixer", "NoneType", "Attention", "NoneType",
                                                                        "Mamba2Mixer", "NoneType"]
            assert [type(layer.mlp).__name__ for layer in layers] == ["NoneType", "SparseMoE", "NoneType", "UngatedMLP",
                                                                       "NoneType", "SparseMoE"]
            assert layers[0].attn_norm.weight.name == "backbone.layers.0.norm.weight" and layers[0].mlp_norm is None
            assert layers[1].mlp_norm.weight.name == "backbone.layers.1.norm.weight" and layers[1].attn_norm is None
            assert isinstance(layers[1].mlp.shared, UngatedMLP)
            assert model.lm.norm.weight.name == "backbone.norm_f.weight"
            assert layers[0].attn.dt_limit == (0.001, float("inf"))
            cache = model.lm.new_cache(model.backend)
            assert [type(s).__name__ for s in cache.layers] == ["RecurrentState", "NoneType", "KVCache", "NoneType",
                                                                 "RecurrentState", "NoneType"]

    def test_in_memory_layout_matches_transformers(self, backend, tmp_path_factory):
        """The checkpoint as transformers keeps it in memory (``model.`` names, experts fused
        as ``experts.up_proj`` (E, I, H) / ``experts.down_proj``): the same tokens and logits."""
        fx = self._fixture("every_layer_kind", tmp_path_factory)
        path = tmp_path_factory.mktemp("in-memory") / "model"
        names = save_in_memory_layout(self.model_class, fx.path, path)
        assert "model.layers.1.mixer.experts.up_proj" in names and "model.embeddings.weight" in names

        def fused(model):
            assert model.lm.layers[1].mlp.experts.decl.matrices[0]["up"].name == "model.layers.1.mixer.experts.up_proj[0]"

        self.check_rewritten(fx, path, backend, "the in-memory checkpoint", fused)
