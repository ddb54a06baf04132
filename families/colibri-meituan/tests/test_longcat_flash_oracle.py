"""LongCat-Flash against transformers' LongcatFlashForCausalLM: greedy tokens and logits
under every placement, on every installed backend (``COLIBRI_TEST_BACKENDS=cpu``
restricts them).

Every router gets a random ``e_score_correction_bias`` over its real and zero-computation
slots (a buffer the perturbation leaves at zero), so that choosing with it and weighting
without it is tested and tokens mix real and zero experts (some with fewer real experts
than others: the padded slots). The cases cover the two MLA sublayers per layer with their
dense MLPs and the shortcut MoE joining after the second, the q/kv LoRA scales, the
interleaved rotary features (default and yarn with ``mscale_all_dim``, which also scales
the softmax), attention biases, tied embeddings, sharded checkpoints, and a layer whose
router gives every slot of every token to zero experts (no expert read at all).
"""

import numpy as np
from transformers import LongcatFlashConfig

import colibri_core
from colibri_core.nn import SoftmaxGroupedTopKRouter, SparseMoE
from colibri_core.testing.oracle import FamilyOracleSuite, OracleCase
from colibri_core.testing.oracle_cases import prompt, yarn


def config(**overrides):
    base = dict(vocab_size=128, eos_token_id=None, bos_token_id=None, pad_token_id=None, hidden_size=32, num_layers=2,
                num_attention_heads=4, ffn_hidden_size=48, q_lora_rank=16, kv_lora_rank=8, qk_nope_head_dim=8,
                qk_rope_head_dim=4, head_dim=4, v_head_dim=8, moe_topk=3, n_routed_experts=8, zero_expert_num=4,
                expert_ffn_hidden_size=16, routed_scaling_factor=2.0, max_position_embeddings=256,
                initializer_range=0.1)
    base.update(overrides)
    return lambda: LongcatFlashConfig(**base)


def correction_bias(scale: float, seed: int, zero_only_layer: int | None = None):
    """A random ``e_score_correction_bias`` per router; in ``zero_only_layer`` the zero
    experts' slots far ahead, so every token chooses zero experts only there."""

    def prepare(model):
        import torch

        g = torch.Generator().manual_seed(seed)
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.copy_(torch.randn(buffer.shape, generator=g) * scale)
                if zero_only_layer is not None and name.startswith(f"model.layers.{zero_only_layer}."):
                    buffer[model.config.n_routed_experts:] += 10.0

    return prepare


class TestLongcatFlashOracle(FamilyOracleSuite):
    model_class = "LongcatFlashForCausalLM"
    cases = {
        # two layers (four MLA sublayers); 8 real experts and 4 zero experts, top-3 times 2.0;
        # several shards
        "zero_experts_sharded": OracleCase(config(), max_shard_size="40KB", prompt=prompt(30),
                                           prepare=correction_bias(0.2, 1)),
        # yarn (mscale_all_dim: the softmax scaled too); q/kv/o biases; tied embeddings; 4 real
        # and 6 zero experts, top-4; layer 1 routes every slot to zero experts
        "yarn_tied_zero_only_layer": OracleCase(
            config(rope_parameters=yarn(rope_theta=10000.0, mscale_all_dim=1.0), attention_bias=True,
                   tie_word_embeddings=True, n_routed_experts=4, zero_expert_num=6, moe_topk=4,
                   routed_scaling_factor=1.5, qk_rope_head_dim=8, head_dim=8),
            seed=1, prompt=prompt(40, 5), prepare=correction_bias(0.1, 7, zero_only_layer=1)),
    }

    def test_layers(self, tmp_path_factory):
        fx = self._fixture("zero_experts_sharded", tmp_path_factory)
        with colibri_core.load(fx.path, history=False) as model:
            layers = model.lm.layers
        assert [type(layer).__name__ for layer in layers] == ["ShortcutLayer", "JoinLayer"] * 2
        assert [layer.attn.layer for layer in layers] == [0, 1, 2, 3]  # transformers' cache numbering
        moe = layers[2].mlp
        assert isinstance(moe, SparseMoE) and moe.zero_experts == 4 and moe.experts.decl.count == 8
        assert isinstance(moe.router, SoftmaxGroupedTopKRouter) and not moe.router.renormalise
        assert moe.router.bias.name == "model.layers.1.mlp.router.e_score_correction_bias"
        assert layers[3].mlp_norm.weight.name == "model.layers.1.post_attention_layernorm.1.weight"
        assert layers[1].attn.q_a_norm.weight.name == "model.layers.0.self_attn.1.q_a_layernorm.weight"

    def test_zero_experts_are_never_read_and_counted_apart(self, backend, case_name, tmp_path_factory):
        """Streaming one cached expert per layer, the store is asked for real experts only
        (ids below ``n_routed_experts``): the zero experts are neither read nor given a slot;
        the routing history counts exactly the real experts the routers chose, the
        ``zero_slots`` the rest."""
        fx = self._fixture(case_name, tmp_path_factory)
        with colibri_core.load(fx.path, cap=1, history=False, backend=backend) as model:
            store, moes = model.store, [layer.mlp for layer in model.lm.layers if isinstance(layer.mlp, SparseMoE)]
            real = moes[0].experts.decl.count
            asked: list[int] = []
            request, get = store.request, store.get
            store.request = lambda layer, experts: asked.extend(int(e) for e in experts) or request(layer, experts)
            store.get = lambda layer, e: asked.append(int(e)) or get(layer, e)
            routing: list = []
            ids = np.asarray(fx.prompt)
            model.lm.forward(ids, model.lm.new_cache(model.backend), model.backend, routing=routing)
        assert asked and max(asked) < real
        top_k = moes[0].router.top_k
        counted = sum(np.asarray(indices).size for _, indices in routing)
        zero = sum(m.zero_slots for m in moes)
        assert zero > 0 and counted + zero == len(moes) * len(ids) * top_k
        assert all(np.asarray(indices).max(initial=-1) < real for _, indices in routing)
        if case_name == "yarn_tied_zero_only_layer":
            assert [np.asarray(indices).size for _, indices in routing][1] == 0  # layer 1: zero experts only
