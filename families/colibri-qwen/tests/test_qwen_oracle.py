"""The Qwen families against transformers: tokens and logits under every placement,
prompts that cross the Gated DeltaNet chunk size (64), prompts fed in pieces.

Every case has each layer kind of its model type: dense (mlp_only_layers /
decoder_sparse_step) and MoE layers, shared experts, and for the hybrids linear
(Gated DeltaNet) and gated full-attention layers.
"""

import shutil

import numpy as np
import pytest
from transformers import (Qwen2MoeConfig, Qwen3_5MoeConfig, Qwen3_5MoeTextConfig, Qwen3MoeConfig, Qwen3NextConfig,
                          Qwen3VLMoeConfig)

import colibri_core
from colibri_core.errors import UnsupportedModelError
from colibri_core.nn import GatedDeltaNet, RecurrentState
from colibri_core.io.safetensors import write_safetensors
from colibri_core.testing.backends import backend_params, matrix_beyond_cpu
from colibri_core.testing.deltanet import check_layers_in_pieces
from colibri_core.testing.oracle import FamilyOracleSuite, FusedLayoutCheck, OracleCase
from colibri_core.testing.oracle_cases import prompt, yarn

VOCAB = 128


LONG = prompt(100)  # crosses the DeltaNet chunk size (64) in one prefill pass
COMMON = dict(vocab_size=VOCAB, eos_token_id=None, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
              num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16, max_position_embeddings=256,
              initializer_range=0.1)


def config(cls, **overrides):
    return lambda: cls(**{**COMMON, **overrides})


class TestQwen2MoeOracle(FamilyOracleSuite, FusedLayoutCheck):
    model_class = "Qwen2MoeForCausalLM"
    fused_case = "dense_layer_shared_expert"
    base = dict(intermediate_size=48, shared_expert_intermediate_size=24, num_hidden_layers=3)
    cases = {
        "dense_layer_shared_expert": OracleCase(config(Qwen2MoeConfig, **base, mlp_only_layers=[1]), prompt=LONG),
        "sharded_sparse_step_norm_topk": OracleCase(
            config(Qwen2MoeConfig, **{**base, "num_hidden_layers": 4}, decoder_sparse_step=2, norm_topk_prob=True,
                   num_experts=16, num_experts_per_tok=4), seed=1, max_shard_size="40KB"),
        "mha_no_bias_tied_yarn": OracleCase(
            config(Qwen2MoeConfig, **base, num_key_value_heads=4, qkv_bias=False, tie_word_embeddings=True, mlp_only_layers=[0],
                   rope_parameters=yarn(original_max_position_embeddings=64)),
            seed=2, prompt=prompt(70, 5)),
    }


class TestQwen3MoeOracle(FamilyOracleSuite, FusedLayoutCheck):
    model_class = "Qwen3MoeForCausalLM"
    fused_case = "dense_layer_head_dim"
    base = dict(intermediate_size=48, num_hidden_layers=3, head_dim=16)
    cases = {
        "dense_layer_head_dim": OracleCase(config(Qwen3MoeConfig, **base, mlp_only_layers=[1]), prompt=LONG),
        "sharded_bias_norm_topk": OracleCase(
            config(Qwen3MoeConfig, **base, attention_bias=True, norm_topk_prob=True, decoder_sparse_step=2),
            seed=1, max_shard_size="40KB"),
        "top1_tied_linear_rope": OracleCase(
            config(Qwen3MoeConfig, **base, num_experts_per_tok=1, tie_word_embeddings=True, mlp_only_layers=[0, 2],
                   rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}), seed=2, prompt=prompt(80, 3)),
    }


HYBRID = dict(head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=16,
              shared_expert_intermediate_size=24)


class HybridSuite(FamilyOracleSuite):
    # Whole-model logits in pieces vs at once: the Gated DeltaNet's chunked and stepwise
    # forms agree to ~1e-8 (relative 1e-7), but the gated RMSNorm divides each head's
    # output by its rms (~1e-3 in these tiny random models) and later layers amplify
    # further: transformers itself differs by 1.5e-5 .. 2.6e-5 between its generate
    # (chunked prefill + recurrent decode) and one pass over the same tokens. Whole-model
    # pieces are held to the oracle tolerance; the layer itself to 1e-5 (below).
    pieces_tolerance = 1e-4

    def test_deltanet_layer_in_pieces_matches_at_once(self, case_name, tmp_path_factory):
        """Every Gated DeltaNet layer computes the same fed at once or in pieces
        (``check_layers_in_pieces``)."""
        fx = self._fixture(case_name, tmp_path_factory)
        with colibri_core.load(fx.path) as model:
            check_layers_in_pieces(model)


class TestQwen3NextOracle(HybridSuite, FusedLayoutCheck):
    model_class = "Qwen3NextForCausalLM"
    fused_case = "hybrid_dense_layer"
    cases = {
        # layers: linear (dense MLP), linear, linear, full
        "hybrid_dense_layer": OracleCase(
            config(Qwen3NextConfig, **HYBRID, num_hidden_layers=4, intermediate_size=48, mlp_only_layers=[0]), prompt=LONG),
        # layers: linear, full, linear, full, linear; kernel 3, value heads = key heads, half rotary
        "sharded_interval2_sparse_step": OracleCase(
            config(Qwen3NextConfig, **{**HYBRID, "linear_num_value_heads": 2, "linear_value_head_dim": 8}, num_hidden_layers=5,
                   layer_types=["linear_attention", "full_attention"] * 2 + ["linear_attention"], linear_conv_kernel_dim=3,
                   intermediate_size=40, decoder_sparse_step=2, norm_topk_prob=False,
                   rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}),
            seed=1, max_shard_size="40KB", prompt=prompt(90, 11)),
        # a prompt crossing two chunk boundaries (64, 128); one key head serving 3 value heads
        "long_prompt_one_key_head": OracleCase(
            config(Qwen3NextConfig, **{**HYBRID, "linear_num_key_heads": 1, "linear_num_value_heads": 3, "linear_key_head_dim": 12,
                                       "linear_value_head_dim": 8}, num_hidden_layers=4, intermediate_size=48, mlp_only_layers=[3],
                   attention_bias=True, num_key_value_heads=1, tie_word_embeddings=True),
            seed=2, prompt=prompt(150, 13)),
    }


def vl_config(**text):
    text = {**COMMON, **HYBRID, "num_hidden_layers": 4, **text}
    top = {k: text.pop(k) for k in ("tie_word_embeddings", "image_token_id") if k in text}
    vision = dict(depth=1, hidden_size=16, intermediate_size=16, num_heads=2, out_hidden_size=text["hidden_size"])
    return lambda: Qwen3_5MoeConfig(text_config=text, vision_config=vision, **top)


class TestQwen3_5MoeOracle(HybridSuite, FusedLayoutCheck):
    model_class = "Qwen3_5MoeForConditionalGeneration"
    fused_case = "hybrid"  # Qwen3.5/3.6-35B-A3B ship fused experts.gate_up_proj / down_proj
    cases = {
        "hybrid": OracleCase(vl_config(), prompt=LONG),
        "sharded_tied_interval2": OracleCase(
            vl_config(num_hidden_layers=6, layer_types=["linear_attention", "full_attention"] * 3, tie_word_embeddings=True,
                      num_experts=16, num_experts_per_tok=4),
            seed=1, max_shard_size="40KB", prompt=prompt(75, 9)),
        "long_prompt_one_key_head": OracleCase(
            vl_config(linear_num_key_heads=1, linear_num_value_heads=3, linear_key_head_dim=12, linear_value_head_dim=8,
                      num_key_value_heads=1, linear_conv_kernel_dim=2),
            seed=2, prompt=prompt(140, 5)),
    }

    def test_only_the_text_model_is_loaded_and_mtp_is_ignored(self, tmp_path_factory):
        """Dense bytes are those of the language model; vision and MTP tensors are never
        read, and an MTP head next to the weights changes nothing."""
        fx = self._fixture("hybrid", tmp_path_factory)
        copy = tmp_path_factory.mktemp("qwen3_5_mtp") / "model"
        shutil.copytree(fx.path, copy)
        write_safetensors(copy / "mtp.safetensors", {"mtp.fc.weight": np.ones((32, 64), np.float32),
                                                     "mtp.layers.0.mlp.experts.0.up_proj.weight": np.ones((16, 32), np.float32)})
        with colibri_core.load(copy) as model:
            infos = model.checkpoint.tensors
            text = [i for n, i in infos.items() if n.startswith("model.language_model.") or n == "lm_head.weight"]
            assert any(n.startswith("model.visual.") for n in infos) and "mtp.fc.weight" in infos
            dense = sum(i.numel for i in text if ".mlp.experts." not in i.name)
            assert model.placement.dense_bytes == 4 * dense
            assert model.generate(token_ids=fx.prompt, max_tokens=8, ignore_eos=True).token_ids == fx.tokens[:8]

    def test_image_placeholder_in_prompt_is_refused(self, tmp_path_factory):
        case = OracleCase(vl_config(image_token_id=100), new_tokens=2)
        from colibri_core.testing.oracle import build_oracle

        path = tmp_path_factory.mktemp("qwen3_5_image")
        build_oracle(case, self.model_class, path)
        with colibri_core.load(path) as model:
            with pytest.raises(UnsupportedModelError, match="image input is not supported"):
                model.generate(token_ids=[5, 100, 7], max_tokens=2)
            with pytest.raises(UnsupportedModelError, match="image input"):
                model.logits([100])
            assert len(model.generate(token_ids=[5, 99, 7], max_tokens=2).token_ids) == 2



def text_config(**text):
    return lambda: Qwen3_5MoeTextConfig(**{**COMMON, **HYBRID, "num_hidden_layers": 4, **text})


class TestQwen3_5MoeTextOracle(HybridSuite, FusedLayoutCheck):
    """Qwen3.5 MoE's text model saved on its own (``qwen3_5_moe_text``): flat config,
    weights under ``model.*``."""

    model_class = "Qwen3_5MoeForCausalLM"
    fused_case = "hybrid"
    cases = {
        "hybrid": OracleCase(text_config(), prompt=LONG),
        "sharded_tied_interval2": OracleCase(
            text_config(num_hidden_layers=6, layer_types=["linear_attention", "full_attention"] * 3, tie_word_embeddings=True,
                        num_experts=16, num_experts_per_tok=4),
            seed=1, max_shard_size="40KB", prompt=prompt(75, 9)),
    }

    def test_flat_config_and_names(self, tmp_path_factory):
        fx = self._fixture("sharded_tied_interval2", tmp_path_factory)
        with colibri_core.load(fx.path) as model:
            assert model.lm.embed.weight.name == "model.embed_tokens.weight" and model.lm.lm_head.weight is model.lm.embed.weight
            assert [type(layer.attn).__name__ for layer in model.lm.layers] == ["GatedDeltaNet", "Attention"] * 3


def qwen3_vl_config(**text):
    """A tiny Qwen3-VL MoE: the text model under test, a one-block vision tower (never
    run: the prompts are text). moe_intermediate_size 24: 2 x 24 != hidden 32, so the
    published and in-memory expert layouts cannot be mistaken for each other."""
    text = {**COMMON, "moe_intermediate_size": 24, "intermediate_size": 48, "num_hidden_layers": 3, "head_dim": 16,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3],
                                "mrope_interleaved": True}, **text}
    top = {k: text.pop(k) for k in ("tie_word_embeddings", "image_token_id", "video_token_id") if k in text}
    vision = dict(depth=1, hidden_size=16, intermediate_size=16, num_heads=2, out_hidden_size=text["hidden_size"],
                  deepstack_visual_indexes=[0])
    return lambda: Qwen3VLMoeConfig(text_config=text, vision_config=vision, **top)


class TestQwen3VLMoeOracle(FamilyOracleSuite):
    """Text-only prompts: transformers' generate builds the (text, t, h, w) position ids
    itself, equal for text, so its interleaved MRoPE rotates as plain RoPE."""

    model_class = "Qwen3VLMoeForConditionalGeneration"
    cases = {
        "dense_layer": OracleCase(qwen3_vl_config(mlp_only_layers=[1]), prompt=prompt(40)),
        "sharded_bias_sparse_step_yarn": OracleCase(
            qwen3_vl_config(num_hidden_layers=4, attention_bias=True, decoder_sparse_step=2, num_experts=16,
                            num_experts_per_tok=4,
                            rope_parameters={**yarn(), "mrope_section": [2, 3, 3], "mrope_interleaved": True}),
            seed=1, max_shard_size="40KB", prompt=prompt(50, 5)),
        "top1_tied_mha": OracleCase(
            qwen3_vl_config(num_experts_per_tok=1, tie_word_embeddings=True, num_key_value_heads=4, mlp_only_layers=[0]),
            seed=2),
    }

    def test_published_expert_layout_matches_transformers(self, backend, tmp_path_factory):
        """A case rewritten with the experts as the Hub's checkpoints store them
        (``gate_up_proj`` (E, hidden, 2 x inter), ``down_proj`` (E, inter, hidden)):
        transformers reads it to the same logits, and so does colibri."""
        from colibri_core.io.checkpoint import Checkpoint

        fx = self._fixture("sharded_bias_sparse_step_yarn", tmp_path_factory)
        published = tmp_path_factory.mktemp("qwen3_vl_published") / "model"
        published.mkdir()
        with Checkpoint(fx.path) as ck:
            tensors = {name: ck.read(name) for name in ck.tensors}
        transposed = {n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))}
        assert len(transposed) == 4  # the two MoE layers of four
        tensors = {n: np.ascontiguousarray(t.transpose(0, 2, 1)) if n in transposed else t for n, t in tensors.items()}
        write_safetensors(published / "model.safetensors", tensors, {"format": "pt"})
        shutil.copy(fx.path / "config.json", published / "config.json")
        self.check_rewritten(fx, published, backend, "the published layout")

    def test_only_the_text_model_is_loaded(self, tmp_path_factory):
        fx = self._fixture("dense_layer", tmp_path_factory)
        with colibri_core.load(fx.path, history=False) as model:
            infos = model.checkpoint.tensors
            assert any(n.startswith("model.visual.") for n in infos)
            text = [i for n, i in infos.items() if n.startswith("model.language_model.") or n == "lm_head.weight"]
            assert model.placement.dense_bytes == 4 * sum(i.numel for i in text if ".mlp.experts." not in i.name)

    def test_media_placeholders_in_prompt_are_refused(self, tmp_path_factory):
        case = OracleCase(qwen3_vl_config(image_token_id=100, video_token_id=101), new_tokens=2)
        from colibri_core.testing.oracle import build_oracle

        path = tmp_path_factory.mktemp("qwen3_vl_media")
        build_oracle(case, self.model_class, path)
        with colibri_core.load(path, history=False) as model:
            with pytest.raises(UnsupportedModelError, match="image input is not supported.*qwen3_vl_moe"):
                model.generate(token_ids=[5, 100, 7], max_tokens=2)
            with pytest.raises(UnsupportedModelError, match="video input"):
                model.logits([101])
            assert len(model.generate(token_ids=[5, 99, 7], max_tokens=2).token_ids) == 2


def test_recurrent_state_has_a_fixed_size(tmp_path_factory):
    """A DeltaNet layer's state is a RecurrentState: conv inputs + a matrix per value
    head, 0 bytes per token; attention layers keep growing KV caches beside it."""
    suite = TestQwen3NextOracle()
    fx = suite._fixture("hybrid_dense_layer", tmp_path_factory)
    with colibri_core.load(fx.path) as model:
        lm, ops = model.lm, model.backend
        cache = lm.new_cache(ops)
        kinds = [type(state).__name__ for state in cache.layers]
        assert kinds == ["RecurrentState"] * 3 + ["KVCache"]
        delta = lm.layers[0].attn
        assert isinstance(delta, GatedDeltaNet)
        fixed = (delta.conv_kernel - 1) * delta.conv_dim * 4 + 4 * 8 * 16 * 4
        assert all(isinstance(s, RecurrentState) and s.nbytes == fixed and s.bytes_per_token() == 0 for s in cache.layers[:3])
        lm.forward(np.asarray(fx.prompt), cache, ops)
        assert [s.nbytes for s in cache.layers[:3]] == [fixed] * 3
        assert cache.bytes_per_token() == cache.layers[3].bytes_per_token() > 0
        result = model.generate(token_ids=fx.prompt, max_tokens=4, ignore_eos=True)
        assert result.stats.kv_bytes >= 3 * fixed


@pytest.mark.parametrize("backend", matrix_beyond_cpu(backend_params()))
@pytest.mark.parametrize("suite, case", [(TestQwen3NextOracle, "hybrid_dense_layer"),
                                         (TestQwen3NextOracle, "sharded_interval2_sparse_step"),
                                         (TestQwen3_5MoeTextOracle, "sharded_tied_interval2")])
def test_qwen3_next_mtp_layer_matches_the_torch_reference(backend, suite, case, tmp_path_factory, tmp_path):
    """Qwen3-Next's and Qwen3.5's MTP layer (mtp.fc, mtp.pre_fc_norm_*, mtp.layers.0,
    mtp.norm) against a torch implementation written from vLLM's qwen3_next_mtp; in the
    second case layer index 0 is not an MoE layer (decoder_sparse_step 2), so the MTP
    layer is dense; the third is Qwen3.5's text model (tied embeddings, sharded)."""
    from colibri_core.testing.mtp import check_mtp_layer_matches_reference

    fx = suite()._fixture(case, tmp_path_factory)
    check_mtp_layer_matches_reference(fx.path, tmp_path, fx.prompt, backend, layout="qwen")
