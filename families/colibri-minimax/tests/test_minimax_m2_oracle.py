"""MiniMax-M2 against transformers' MiniMaxM2ForCausalLM: greedy tokens and logits under
every placement, on every installed backend (``COLIBRI_TEST_BACKENDS=cpu`` restricts them).

Every router gets a random ``e_score_correction_bias`` (a buffer the perturbation leaves
at zero), so that choosing with it and weighting without it is tested; the cases cover
partial and whole-head rotary, q/k norms over the whole projection with grouped KV
heads, tied embeddings, yarn, sharded checkpoints, and the layout transformers keeps in
memory besides the published one it saves.
"""

from transformers import MiniMaxM2Config

import colibri_core
from colibri_core.nn import SigmoidGroupedTopKRouter
from colibri_core.testing.oracle import FamilyOracleSuite, OracleCase, random_correction_bias, save_in_memory_layout
from colibri_core.testing.oracle_cases import prompt, yarn


def config(**overrides):
    base = dict(vocab_size=128, eos_token_id=None, bos_token_id=None, pad_token_id=None, hidden_size=32, intermediate_size=16,
                num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=8,
                num_experts_per_tok=2, rotary_dim=8, max_position_embeddings=256, initializer_range=0.1)
    base.update(overrides)
    return lambda: MiniMaxM2Config(**base)


class TestMiniMaxM2Oracle(FamilyOracleSuite):
    model_class = "MiniMaxM2ForCausalLM"
    cases = {
        # half of each 16-wide head rotated (rotary_dim 8), grouped KV heads, 8 experts top-2,
        # several shards
        "partial_rotary_sharded": OracleCase(config(), max_shard_size="40KB", prompt=prompt(30),
                                             prepare=random_correction_bias(0.2)),
        # whole heads rotated with yarn, MHA of 8-wide heads, 16 experts top-4, tied embeddings
        "yarn_tied_top4": OracleCase(
            config(rotary_dim=None, head_dim=8, num_key_value_heads=4, num_local_experts=16, num_experts_per_tok=4,
                   tie_word_embeddings=True, rope_parameters=yarn(), num_hidden_layers=2),
            seed=1, prompt=prompt(40, 5), prepare=random_correction_bias(0.1, 7)),
    }

    def test_published_layout_and_router(self, tmp_path_factory):
        fx = self._fixture("partial_rotary_sharded", tmp_path_factory)
        with colibri_core.load(fx.path, history=False) as model:
            layer = model.lm.layers[1]
        router = layer.mlp.router
        assert isinstance(router, SigmoidGroupedTopKRouter) and router.norm_topk_prob and router.n_group == 1
        assert router.bias.name == "model.layers.1.block_sparse_moe.e_score_correction_bias"
        assert layer.attn.rope.rotary_dim == 8 and not layer.attn.qk_norm_per_head

    def test_in_memory_layout_matches_transformers(self, backend, tmp_path_factory):
        """A case rewritten as transformers 5 keeps MiniMax-M2 in memory (``mlp.gate``,
        ``mlp.e_score_correction_bias``, fused ``mlp.experts.gate_up_proj`` / ``down_proj``):
        transformers reads it to the same logits, and colibri, streaming one cached expert
        per layer, gives its tokens and logits."""
        fx = self._fixture("partial_rotary_sharded", tmp_path_factory)
        fused = tmp_path_factory.mktemp("in-memory") / "model"
        names = save_in_memory_layout(self.model_class, fx.path, fused)
        assert "model.layers.0.mlp.experts.gate_up_proj" in names and not any("block_sparse_moe" in k for k in names)

        def reads_the_in_memory_names(model):
            router = model.lm.layers[0].mlp.router
            assert router.bias.name == "model.layers.0.mlp.e_score_correction_bias"

        self.check_rewritten(fx, fused, backend, "the in-memory layout", reads_the_in_memory_names)
