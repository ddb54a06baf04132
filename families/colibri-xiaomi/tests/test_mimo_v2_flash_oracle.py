"""MiMo-V2-Flash against transformers' MiMoV2FlashForCausalLM: greedy tokens and logits
under every placement, on every installed backend (``COLIBRI_TEST_BACKENDS=cpu``
restricts them).

Every router gets a random ``e_score_correction_bias`` (a buffer the perturbation leaves
at zero), so that choosing with it and weighting without it is tested. The cases cover
value heads narrower than the q/k heads with a value scale, partial RoPE of a theta per
layer type (default and yarn), sliding layers with twice the KV heads and attention sinks
beside full layers (prompts longer than the window and than the prefill chunk), the
schedules by default and by ``layer_types`` / ``mlp_layer_types``, a dense first layer,
group-limited routing without renormalisation and with a scaling factor, q/k/v biases,
tied embeddings and sharded checkpoints; besides the layout transformers saves (the
published one: ``attention_sink_bias``, one tensor per expert), the layout it keeps in
memory (``sinks``, fused experts) and the published config.json's own spelling of the
schedule (``hybrid_layer_pattern``, ``swa_rope_theta``, ``sliding_window_size``, ...).
"""

import json
import shutil

from transformers import MiMoV2FlashConfig

import colibri_core
from colibri_core.testing.oracle import FamilyOracleSuite, OracleCase, random_correction_bias, save_in_memory_layout
from colibri_core.testing.oracle_cases import prompt, yarn


def config(**overrides):
    base = dict(vocab_size=128, eos_token_id=None, bos_token_id=None, pad_token_id=None, hidden_size=32,
                intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=3, num_attention_heads=4,
                num_key_value_heads=1, head_dim=24, v_head_dim=16, n_routed_experts=8, num_experts_per_tok=2,
                sliding_window=8, max_position_embeddings=256, initializer_range=0.1)
    base.update(overrides)
    return lambda: MiMoV2FlashConfig(**base)


def published_spelling(src, dst):
    """``src`` copied to ``dst`` with config.json in the published checkpoint's spelling:
    Xiaomi's fields for the schedule, the rope and the norms, none of transformers' own
    (the "defaults" case leaves transformers' defaults, which equal the published values)."""
    shutil.copytree(src, dst)
    path = dst / "config.json"
    c = json.loads(path.read_text())
    n = c["num_hidden_layers"]
    rope = c.pop("rope_parameters")
    c["hybrid_layer_pattern"] = [int(t == "sliding_attention") for t in c.pop("layer_types")]
    c["moe_layer_freq"] = [int(t == "sparse") for t in c.pop("mlp_layer_types")]
    assert len(c["hybrid_layer_pattern"]) == len(c["moe_layer_freq"]) == n
    c.update(rope_theta=rope["full_attention"]["rope_theta"], swa_rope_theta=rope["sliding_attention"]["rope_theta"],
             partial_rotary_factor=rope["full_attention"]["partial_rotary_factor"],
             layernorm_epsilon=c.pop("rms_norm_eps"), sliding_window_size=c["sliding_window"] - 1,
             swa_num_attention_heads=c["num_attention_heads"], swa_num_key_value_heads=2 * c["num_key_value_heads"],
             swa_head_dim=c["head_dim"], swa_v_head_dim=c["v_head_dim"], add_swa_attention_sink_bias=True,
             add_full_attention_sink_bias=False, scoring_func="sigmoid", topk_method="noaux_tc", n_shared_experts=None,
             routed_scaling_factor=None, attention_projection_layout="split")
    path.write_text(json.dumps(c))


class TestMiMoV2FlashOracle(FamilyOracleSuite):
    model_class = "MiMoV2FlashForCausalLM"
    cases = {
        # transformers' default schedules (full, sliding, sliding; dense, sparse, sparse) and
        # ropes (theta 5e6 full, 1e4 sliding, 0.334 of each 24-wide q/k head: 8 features);
        # 16-wide value heads scaled by 0.707; 1 KV head on the full layer, 2 on the sliding
        # ones (8 positions, sinks); 8 experts top-2; several shards
        "defaults_sharded": OracleCase(config(), max_shard_size="40KB", prompt=prompt(30),
                                       prepare=random_correction_bias(0.2)),
        # layer_types sliding (5 positions) then full; every layer sparse; yarn on the full
        # layer, theta 1e4 on the sliding one, half of each 16-wide head rotated; 8-wide value
        # heads scaled by 0.5; MHA on the sliding layer; q/k/v biases; 16 experts in 4 groups,
        # the best 2 groups compete, top-4 not renormalised, times 2.5; tied embeddings
        "yarn_groups_tied": OracleCase(
            config(num_hidden_layers=2, layer_types=["sliding_attention", "full_attention"],
                   mlp_layer_types=["sparse", "sparse"], sliding_window=5, head_dim=16, v_head_dim=8,
                   num_key_value_heads=2, attention_value_scale=0.5, attention_bias=True,
                   rope_parameters={"full_attention": yarn(partial_rotary_factor=0.5),
                                    "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0,
                                                          "partial_rotary_factor": 0.5}},
                   n_routed_experts=16, num_experts_per_tok=4, n_group=4, topk_group=2, norm_topk_prob=False,
                   routed_scaling_factor=2.5, tie_word_embeddings=True),
            seed=1, prompt=prompt(40, 5), prepare=random_correction_bias(0.1, 7)),
    }

    def test_layers(self, tmp_path_factory):
        fx = self._fixture("defaults_sharded", tmp_path_factory)
        with colibri_core.load(fx.path, history=False) as model:
            layers = model.lm.layers
        attn = [(layer.attn.window, layer.attn.n_kv_heads, layer.attn.v_head_dim, layer.attn.rope.rotary_dim,
                 layer.attn.sinks is not None) for layer in layers]
        assert attn == [(None, 1, 16, 8, False), (8, 2, 16, 8, True), (8, 2, 16, 8, True)]
        assert [layer.attn.value_scale for layer in layers] == [0.707] * 3
        assert layers[0].attn.rope.inv_freq[1] != layers[1].attn.rope.inv_freq[1]  # a theta per layer type
        assert [type(layer.mlp).__name__ for layer in layers] == ["SwiGLU", "SparseMoE", "SparseMoE"]
        assert layers[1].attn.sinks.name == "model.layers.1.self_attn.attention_sink_bias"
        assert layers[1].mlp.router.bias.name == "model.layers.1.mlp.gate.e_score_correction_bias"

    def test_in_memory_layout_matches_transformers(self, backend, tmp_path_factory):
        """A case rewritten as transformers 5 keeps MiMo-V2-Flash in memory (``self_attn.sinks``,
        fused ``mlp.experts.gate_up_proj`` / ``down_proj``): transformers reads it to the
        same logits, and colibri, streaming one cached expert per layer, gives its tokens
        and logits."""
        fx = self._fixture("defaults_sharded", tmp_path_factory)
        fused = tmp_path_factory.mktemp("in-memory") / "model"
        names = save_in_memory_layout(self.model_class, fx.path, fused)
        assert "model.layers.1.mlp.experts.gate_up_proj" in names and "model.layers.1.self_attn.sinks" in names

        def reads_the_in_memory_names(model):
            assert model.lm.layers[1].attn.sinks.name == "model.layers.1.self_attn.sinks"

        self.check_rewritten(fx, fused, backend, "the in-memory layout", reads_the_in_memory_names)

    def test_published_config_spelling_matches_transformers(self, backend, tmp_path_factory):
        """The default case's config.json in the published spelling (``hybrid_layer_pattern``,
        ``moe_layer_freq``, ``rope_theta`` / ``swa_rope_theta`` / ``partial_rotary_factor``,
        ``layernorm_epsilon``, ``sliding_window_size``, the ``swa_*`` sizes, the sink flags, a
        null ``routed_scaling_factor``): transformers reads it to the same logits (its defaults
        are the published values), and so does colibri, reading Xiaomi's fields."""
        fx = self._fixture("defaults_sharded", tmp_path_factory)
        published = tmp_path_factory.mktemp("published") / "model"
        published_spelling(fx.path, published)
        self.check_rewritten(fx, published, backend, "the published config.json")
