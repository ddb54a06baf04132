"""Kimi Linear against transformers' KimiLinearForCausalLM: Kimi Delta Attention (per-
channel gated delta rule) layers beside NoPE MLA layers, dense first layers and the
sigmoid MoE; prompts longer than the KDA chunk (64, transformers' fixed default), so
prefill crosses a chunk boundary; tokens and logits under every placement.

Every case has each layer kind: KDA and MLA token mixers, dense and MoE MLPs."""

import json

import numpy as np
import pytest

import colibri_core
from colibri_core.errors import ModelFormatError, UnsupportedModelError
from colibri_core.nn import MLACache, RecurrentState
from colibri_core.testing.deltanet import check_layers_in_pieces
from colibri_core.testing.oracle import FamilyOracleSuite, OracleCase, random_correction_bias
from colibri_core.testing.oracle_cases import prompt

from colibri_kimi.linear import KimiLinearArgs, normalise

VOCAB = 128
BIAS = random_correction_bias()


def kimi_linear(**overrides):
    from transformers import KimiLinearConfig

    base = dict(vocab_size=VOCAB, eos_token_id=None, pad_token_id=0, bos_token_id=1, hidden_size=32,
                intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=4, num_attention_heads=4,
                num_key_value_heads=4, num_local_experts=8, num_experts_per_tok=2, n_shared_experts=1, n_group=2,
                topk_group=1, routed_scaling_factor=2.446, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8,
                v_head_dim=12, linear_head_dim=8, linear_num_heads=2, linear_conv_kernel_dim=4,
                max_position_embeddings=256, initializer_range=0.1)
    base.update(overrides)
    return lambda: KimiLinearConfig(**base)


def as_hub_config(path):
    """Rewrite the saved config.json as the Hub's Kimi-Linear checkpoints write it: layer
    kinds and the KDA sizes in ``linear_attn_config`` (1-indexed layers), dense layers by
    ``first_k_dense_replace``, the fields transformers ignores (``moe_layer_freq``,
    ``mla_use_nope``) present."""
    config = json.loads((path / "config.json").read_text())
    kinds = config.pop("layer_types")
    mlp = config.pop("mlp_layer_types")
    dense = mlp.index("sparse")
    assert set(mlp[:dense]) == {"dense"} and set(mlp[dense:]) == {"sparse"}
    config["first_k_dense_replace"] = dense
    config["linear_attn_config"] = {
        "full_attn_layers": [i + 1 for i, k in enumerate(kinds) if k == "full_attention"],
        "kda_layers": [i + 1 for i, k in enumerate(kinds) if k == "linear_attention"],
        "head_dim": config.pop("linear_head_dim"), "num_heads": config.pop("linear_num_heads"),
        "short_conv_kernel_size": config.pop("linear_conv_kernel_dim")}
    config.update(moe_layer_freq=1, mla_use_nope=True)
    (path / "config.json").write_text(json.dumps(config))


class TestKimiLinearOracle(FamilyOracleSuite):
    model_class = "KimiLinearForCausalLM"
    cases = {
        # layers: KDA (dense MLP), MLA, KDA; two expert groups; a prompt crossing the chunk (64)
        "kda_mla_grouped": OracleCase(
            kimi_linear(num_hidden_layers=3, layer_types=["linear_attention", "full_attention", "linear_attention"]),
            prompt=prompt(80), prepare=BIAS),
        # the Hub's config layout; layers KDA, MLA, KDA, MLA, the first two dense; q LoRA,
        # kernel 2, one group, one KDA head of 12, attention biases, tie_word_embeddings
        # (which transformers' kimi_linear ignores), sharded
        "hub_config_q_lora_sharded": OracleCase(
            kimi_linear(q_lora_rank=24, n_group=1, num_local_experts=6, num_experts_per_tok=3,
                        layer_types=["linear_attention", "full_attention"] * 2,
                        mlp_layer_types=["dense", "dense", "sparse", "sparse"], linear_conv_kernel_dim=2,
                        linear_head_dim=12, linear_num_heads=1, tie_word_embeddings=True, attention_bias=True),
            seed=1, max_shard_size="40KB", prompt=prompt(90, 11), prepare=BIAS, rewrite=as_hub_config),
    }

    def test_kda_layer_in_pieces_matches_at_once(self, case_name, tmp_path_factory):
        """Every KDA layer (a Gated DeltaNet gated per channel) computes the same fed at
        once or in pieces (``check_layers_in_pieces``)."""
        fx = self._fixture(case_name, tmp_path_factory)
        with colibri_core.load(fx.path, history=False) as model:
            kdas = check_layers_in_pieces(model)
        assert all(k.gate_per_channel for k in kdas)


def test_kda_state_is_recurrent_beside_mla_caches(tmp_path_factory):
    """KDA layers keep a fixed-size RecurrentState (conv inputs of q, k, v and a (d, d)
    matrix per head) in the core cache; MLA layers keep latent caches that grow."""
    fx = TestKimiLinearOracle()._fixture("kda_mla_grouped", tmp_path_factory)
    with colibri_core.load(fx.path, history=False) as model:
        lm, ops = model.lm, model.backend
        cache = lm.new_cache(ops)
        assert [type(s).__name__ for s in cache.layers] == ["RecurrentState", "MLACache", "RecurrentState"]
        fixed = (4 - 1) * 3 * 16 * 4 + 2 * 8 * 8 * 4
        kda_states = [s for s in cache.layers if isinstance(s, RecurrentState)]
        assert all(s.nbytes == fixed and s.bytes_per_token() == 0 for s in kda_states)
        lm.forward(np.asarray(fx.prompt), cache, ops)
        assert [s.nbytes for s in kda_states] == [fixed] * 2
        assert isinstance(cache.layers[1], MLACache) and cache.layers[1].length == len(fx.prompt)
        assert cache.bytes_per_token() == (16 + 8) * 4


def test_scalar_decay_would_not_match(tmp_path_factory):
    """The per-channel decay matters: the same model with each head's decay collapsed to
    its first channel's gives other logits (so the oracle cases exercise it)."""
    fx = TestKimiLinearOracle()._fixture("kda_mla_grouped", tmp_path_factory)
    with colibri_core.load(fx.path, history=False) as model:
        ops = model.backend
        original = ops.gated_delta_channel_chunked

        def first_channel(q, k, v, g, beta, state, chunk):
            host = ops.to_host(g)
            return original(q, k, v, ops.asarray(np.repeat(host[..., :1], host.shape[-1], axis=-1)), beta, state, chunk)

        ops.gated_delta_channel_chunked = first_channel
        try:
            wrong = model.logits(fx.prompt + fx.tokens[:-1])
        finally:
            del ops.gated_delta_channel_chunked
    assert np.abs(wrong - fx.full_logits).max() > 1e-2


def base_config(**overrides):
    config = dict(model_type="kimi_linear", vocab_size=128, hidden_size=32, intermediate_size=48,
                  moe_intermediate_size=16, num_hidden_layers=4, num_attention_heads=4, num_experts=8,
                  num_experts_per_token=2)
    config.update(overrides)
    return config


def test_config_defaults_follow_transformers():
    a = KimiLinearArgs.from_config(base_config(), "config.json")
    assert a.layer_types == ["linear_attention"] * 4  # full attention from layer 4 (0-indexed) on
    assert [a.is_moe(i) for i in range(4)] == [False, True, True, True]  # first_k_dense_replace 1
    assert (a.n_routed_experts, a.num_experts_per_tok, a.routed_scaling_factor) == (8, 2, 2.446)
    a = KimiLinearArgs.from_config(base_config(num_hidden_layers=9, first_k_dense_replace=2), "config.json")
    assert [i for i, t in enumerate(a.layer_types) if t == "full_attention"] == [4, 8]
    assert [a.is_moe(i) for i in range(3)] == [False, False, True]


def test_linear_attn_config_is_read():
    config = base_config(linear_attn_config={"full_attn_layers": [2, 4], "kda_layers": [1, 3], "head_dim": 16,
                                             "num_heads": 3, "short_conv_kernel_size": 2}, linear_head_dim=8)
    a = KimiLinearArgs.from_config(config, "config.json")
    assert a.layer_types == ["linear_attention", "full_attention"] * 2
    assert (a.linear_head_dim, a.linear_num_heads, a.linear_conv_kernel_dim) == (16, 3, 2)


@pytest.mark.parametrize("overrides, message", [
    (dict(linear_attn_config={"full_attn_layers": [2], "kda_layers": [1, 3]}), "no kind for layers \\[4\\]"),
    (dict(linear_attn_config={"full_attn_layers": [2, 1], "kda_layers": [1, 3, 4]}), "layer 1 is listed twice"),
    (dict(linear_attn_config={"full_attn_layers": [0], "kda_layers": [1, 2, 3]}), "layer numbers 1..4"),
    (dict(linear_attn_config=[1, 2]), "linear_attn_config must be an object"),
    (dict(linear_attn_config={"head_dim": 0}), "linear_head_dim"),
    (dict(layer_types=["linear_attention", "sliding_attention", "linear_attention", "full_attention"]), "layer_types"),
    (dict(layer_types=["linear_attention"]), "layer_types"),
    (dict(num_experts=8, n_routed_experts=6), "disagree"),
    (dict(num_experts_per_token=9), "num_experts_per_tok"),
    (dict(num_key_value_heads=2), "num_key_value_heads"),
    (dict(mlp_layer_types=["dense", "sparse"]), "mlp_layer_types"),
    (dict(hidden_act="gelu"), "hidden_act"),
])
def test_bad_configs_are_refused_with_one_clear_error(overrides, message):
    with pytest.raises((ModelFormatError, UnsupportedModelError), match=message):
        KimiLinearArgs.from_config(base_config(**overrides), "config.json")


def test_normalise_keeps_unrelated_fields():
    out = normalise(base_config(model_max_length=512, moe_renormalize=False, num_expert_group=2), "config.json")
    assert (out["max_position_embeddings"], out["norm_topk_prob"], out["n_group"]) == (512, False, 2)
