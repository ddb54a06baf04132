"""Options of the shared blocks that one family needs first, against transformers' own
modules: q/k norms after RoPE (Hunyuan), the sparsemixer router (Phi-MoE) and
``build_decoder``'s LayerNorm decoders (Phi-MoE)."""

import numpy as np
import pytest

from colibri_core.compute.cpu.backend import CpuBackend
from colibri_core.compute.host import sparsemixer_top2
from colibri_core.io.safetensors import write_safetensors
from colibri_core.nn import Attention, Cache, LayerNorm, Linear, RMSNorm, SparseMixerRouter, Step, build_rope
from colibri_core.nn.weights import Param
from colibri_core.testing import memory_param

torch = pytest.importorskip("torch")
ops = CpuBackend()


param = memory_param


def tensor(module_param) -> Param:
    return param(module_param.detach().numpy())


@pytest.mark.parametrize("after", [True, False], ids=["after-rope", "before-rope"])
def test_qk_norm_after_rope_matches_hunyuan_attention(after):
    """Per-head q/k RMSNorms applied after RoPE give transformers' HunYuanMoEV1Attention;
    applied before (the default, Qwen3's order) they do not."""
    from transformers import HunYuanMoEV1Config
    from transformers.models.hunyuan_v1_moe.modeling_hunyuan_v1_moe import (HunYuanMoEV1Attention,
                                                                             HunYuanMoEV1RotaryEmbedding)

    config = HunYuanMoEV1Config(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                attention_bias=True, rms_norm_eps=1e-5)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    reference = HunYuanMoEV1Attention(config, 0).eval()
    with torch.no_grad():
        for p in reference.parameters():
            p.copy_(torch.randn_like(p) * 0.5 + (1.0 if p.dim() == 1 and p.shape[0] == 8 else 0.0))
    t = 7
    x = torch.randn(1, t, 32)
    positions = torch.arange(t)[None]
    cos, sin = HunYuanMoEV1RotaryEmbedding(config)(x, positions)
    mask = torch.triu(torch.full((t, t), float("-inf")), 1)[None, None]
    with torch.no_grad():
        expected = reference(x, (cos, sin), mask)[0][0].numpy()

    def lin(m):
        return Linear(tensor(m.weight), tensor(m.bias))

    ours = Attention(layer=0, q=lin(reference.q_proj), k=lin(reference.k_proj), v=lin(reference.v_proj),
                     o=lin(reference.o_proj), n_heads=4, n_kv_heads=2, head_dim=8,
                     rope=build_rope({"rope_theta": 10000.0}, 8),
                     q_norm=RMSNorm(tensor(reference.query_layernorm.weight), 1e-5),
                     k_norm=RMSNorm(tensor(reference.key_layernorm.weight), 1e-5), qk_norm_per_head=True,
                     qk_norm_after_rope=after)
    step = Step(ops, np.arange(t), Cache([ours.new_state(ops, 16)]))
    got = ours(x[0].numpy(), step)
    if after:
        np.testing.assert_allclose(got, expected, atol=2e-5)
    else:
        assert np.abs(got - expected).max() > 1e-3


def test_qk_norm_after_rope_needs_per_head_norms():
    lin = Linear(param(np.eye(8)))
    with pytest.raises(ValueError, match="qk_norm_after_rope needs per-head"):
        Attention(layer=0, q=lin, k=lin, v=lin, o=lin, n_heads=1, n_kv_heads=1, head_dim=8, rope=None,
                  qk_norm_after_rope=True)


def sparsemixer_reference(scores, eps):
    from transformers.models.phimoe.modeling_phimoe import sparsemixer

    weights, indices = sparsemixer(torch.from_numpy(scores), jitter_eps=eps, training=False)
    return indices.numpy(), weights.numpy()


@pytest.mark.parametrize("eps", [0.0, 0.01, 0.3, 2.0])
def test_sparsemixer_matches_transformers_eval(eps):
    """Random logits, plus rows that probe the threshold: all negative, a zero best
    logit (0 / 0 in the threshold), logits close to the best, a tie for second place."""
    rng = np.random.default_rng(int(eps * 100))
    scores = rng.standard_normal((64, 16)).astype(np.float32) * 2
    scores[0] = -np.abs(scores[0]) - 0.5
    scores[1, :] = -1.0
    scores[1, 3] = 0.0
    scores[1, 5] = 0.0
    scores[2] = 1.0 + np.float32(eps) * np.linspace(-3, 3, 16, dtype=np.float32)
    scores[3, 7] = scores[3, 9] = np.float32(-0.25)
    scores[3, 2] = 4.0
    indices, weights = sparsemixer_top2(scores, eps)
    ref_i, ref_w = sparsemixer_reference(scores, eps)
    np.testing.assert_array_equal(indices, ref_i)
    np.testing.assert_allclose(weights, ref_w, rtol=1e-6, atol=1e-7)
    # the router on the backend: logits from the gate, the same choice
    gate = rng.standard_normal((16, 24)).astype(np.float32)
    x = rng.standard_normal((9, 24)).astype(np.float32)
    got_i, got_w = SparseMixerRouter(Linear(param(gate)), eps)(x, Step(ops, np.arange(9), Cache([])))
    ref_i, ref_w = sparsemixer_reference((torch.from_numpy(x) @ torch.from_numpy(gate).T).numpy(), eps)
    np.testing.assert_array_equal(got_i, ref_i)
    np.testing.assert_allclose(got_w, ref_w, rtol=1e-5)


def test_sparsemixer_router_needs_two_experts():
    with pytest.raises(ValueError, match="chooses 2 experts"):
        SparseMixerRouter(Linear(param(np.ones((1, 4)))), 0.01)


class Zero:
    """A mixer / MLP adding nothing to the residual."""

    def new_state(self, backend, max_len):
        return None

    def __call__(self, x, step):
        return x * 0


def test_build_decoder_layer_norms_with_a_bias(tmp_path):
    """``make_norm`` giving LayerNorms with weight and bias (Phi-MoE's): every norm of the
    decoder (the layers' and the final one) is one."""
    from types import SimpleNamespace

    from colibri_core.io.checkpoint import Checkpoint
    from colibri_core.nn.assembly import build_decoder
    from colibri_core.nn.weights import Weights

    rng = np.random.default_rng(0)
    h, vocab = 8, 16
    t = {"model.embed_tokens.weight": rng.standard_normal((vocab, h)), "lm_head.weight": rng.standard_normal((vocab, h))}
    for p in ("model.layers.0.input_layernorm", "model.layers.0.post_attention_layernorm", "model.norm"):
        t[f"{p}.weight"], t[f"{p}.bias"] = 1 + rng.standard_normal(h) * 0.1, rng.standard_normal(h) * 0.1
    write_safetensors(tmp_path / "model.safetensors", {k: ("F32", v.astype(np.float32)) for k, v in t.items()})
    (tmp_path / "config.json").write_text("{}")
    a = SimpleNamespace(vocab_size=vocab, hidden_size=h, num_hidden_layers=1, max_position_embeddings=32,
                        rms_norm_eps=1e-5, tie_word_embeddings=False)
    with Checkpoint(tmp_path) as ck:
        w = Weights(ck)
        lm = build_decoder(a, w, lambda i, p: Zero(), lambda i, p: Zero(),
                           make_norm=lambda p: LayerNorm(w.param(f"{p}.weight", (h,)), w.param(f"{p}.bias", (h,)), 1e-5))
        assert isinstance(lm.norm, LayerNorm) and isinstance(lm.layers[0].attn_norm, LayerNorm)
        assert set(t) == set(w.params)
        for p in w.params.values():
            p.value = ck.read(p.name).astype(np.float32)
    ids = np.array([3, 5, 1])
    logits = lm.forward(ids, lm.new_cache(ops), ops, all_logits=True)
    normed = torch.nn.functional.layer_norm(torch.from_numpy(t["model.embed_tokens.weight"][ids].astype(np.float32)), (h,),
                                            torch.from_numpy(t["model.norm.weight"].astype(np.float32)),
                                            torch.from_numpy(t["model.norm.bias"].astype(np.float32)), 1e-5).numpy()
    np.testing.assert_allclose(logits, normed @ t["lm_head.weight"].astype(np.float32).T, atol=1e-5)


def test_pairs_to_halves_rotates_as_interleaved_pairs():
    """Rotating the reordered features by halves is rotating the stored ones by pairs
    (transformers' ERNIE 4.5 and Cohere rotary), reordered: ``Weights.halves_linear``."""
    from colibri_core.nn.weights import pairs_to_halves
    from colibri_core.nn import build_rope

    d = 8
    rope = build_rope({"rope_theta": 10000.0}, d)
    cos, sin = rope.cos_sin(np.arange(5))
    x = np.random.default_rng(0).standard_normal((5, d)).astype(np.float32)
    c, s = np.repeat(cos[:, : d // 2], 2, axis=1), np.repeat(sin[:, : d // 2], 2, axis=1)
    rot = np.stack((-x[:, 1::2], x[:, 0::2]), axis=-1).reshape(5, d)
    pairs = x * c + rot * s
    order = pairs_to_halves(1, d)
    h = x[:, order]
    halves = h * cos + np.concatenate((-h[:, d // 2:], h[:, : d // 2]), axis=1) * sin
    np.testing.assert_allclose(halves, pairs[:, order], rtol=1e-6, atol=1e-6)
