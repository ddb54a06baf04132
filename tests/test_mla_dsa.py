"""The MLA, DSA and sigmoid-router blocks against transformers' own modules, and the
absorbed (decode) form of MLA against the expanded (prefill) form."""

import numpy as np
import pytest

from colibri_core.compute.cpu.backend import CpuBackend
from colibri_core.nn import (
    Cache, LayerNorm, LightningIndexer, Linear, MLACache, MLAttention, RMSNorm, SharedIndexer, SigmoidGroupedTopKRouter,
    Step, build_rope,
)
from colibri_core.testing import memory_param

torch = pytest.importorskip("torch")
ops = CpuBackend()


param = memory_param


def linear(rng, out, inp, scale=0.3):
    return Linear(param(rng.standard_normal((out, inp)) * scale))


def test_interleaved_rope_matches_transformers():
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import apply_rotary_pos_emb_interleave

    rng = np.random.default_rng(0)
    rope = build_rope({"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}, 8)
    positions = np.arange(3, 8)
    cos, sin = rope.cos_sin(positions)
    q = rng.standard_normal((5, 4, 8)).astype(np.float32)
    k = rng.standard_normal((5, 1, 8)).astype(np.float32)
    tq, tk = apply_rotary_pos_emb_interleave(torch.from_numpy(q).transpose(0, 1), torch.from_numpy(k).transpose(0, 1),
                                             torch.from_numpy(cos), torch.from_numpy(sin), unsqueeze_dim=0)
    np.testing.assert_allclose(ops.rope_interleaved(q, cos, sin, 8), tq.transpose(0, 1).numpy(), atol=1e-6)
    np.testing.assert_allclose(ops.rope_interleaved(k, cos, sin, 8), tk.transpose(0, 1).numpy(), atol=1e-6)
    # a rotary part shorter than the head: the rest passes through untouched
    wide = rng.standard_normal((5, 2, 12)).astype(np.float32)
    out = ops.rope_interleaved(wide, cos, sin, 8)
    np.testing.assert_array_equal(out[..., 8:], wide[..., 8:])
    np.testing.assert_array_equal(out[..., :8], ops.rope_interleaved(wide[..., :8], cos, sin, 8))


def test_layer_norm_matches_torch():
    rng = np.random.default_rng(1)
    x = rng.standard_normal((6, 16)).astype(np.float32) * 3 + 1
    w, b = rng.standard_normal(16).astype(np.float32), rng.standard_normal(16).astype(np.float32)
    expected = torch.nn.functional.layer_norm(torch.from_numpy(x), (16,), torch.from_numpy(w), torch.from_numpy(b), 1e-6)
    np.testing.assert_allclose(ops.layer_norm(x, w, b, 1e-6), expected.numpy(), atol=2e-6)


def test_sigmoid_grouped_router_matches_transformers():
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    for n_group, topk_group, top_k, norm in ((4, 2, 3, True), (1, 1, 2, False), (8, 3, 5, True)):
        config = DeepseekV3Config(hidden_size=24, n_routed_experts=32, num_experts_per_tok=top_k, n_group=n_group,
                                  topk_group=topk_group, norm_topk_prob=norm, routed_scaling_factor=2.5)
        reference = DeepseekV3TopkRouter(config)
        g = torch.Generator().manual_seed(n_group)
        with torch.no_grad():
            reference.weight.copy_(torch.randn(32, 24, generator=g))
            reference.e_score_correction_bias.copy_(torch.randn(32, generator=g) * 0.5)
        x = torch.randn(64, 24, generator=g)
        _, weights, indices = reference(x)
        router = SigmoidGroupedTopKRouter(Linear(param(reference.weight.detach().numpy())), top_k,
                                          bias=param(reference.e_score_correction_bias.numpy()), n_group=n_group,
                                          topk_group=topk_group, norm_topk_prob=norm, routed_scaling_factor=2.5)
        step = Step(ops, np.arange(64), Cache([]))
        ours_i, ours_w = router(x.numpy(), step)
        order = np.argsort(indices.numpy(), axis=-1)
        ref_i = np.take_along_axis(indices.numpy(), order, -1)
        ref_w = np.take_along_axis(weights.detach().numpy(), order, -1)
        mine = np.argsort(ours_i, axis=-1)
        np.testing.assert_array_equal(np.take_along_axis(ours_i, mine, -1), ref_i)
        np.testing.assert_allclose(np.take_along_axis(ours_w, mine, -1), ref_w, rtol=1e-6)
        # the correction bias chose experts, but the weights are the unbiased scores
        unbiased = SigmoidGroupedTopKRouter(router.gate, top_k, n_group=n_group, topk_group=topk_group,
                                            norm_topk_prob=norm, routed_scaling_factor=2.5)(x.numpy(), step)[0]
        assert not np.array_equal(np.sort(unbiased, -1), np.sort(ours_i, -1))


def make_mla(rng, *, indexer=None, q_lora=12, heads=4, rank=16, dn=8, dr=8, dv=6, hidden=24, interleave=True):
    rope = build_rope({"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}, dr)
    q = (dict(q_a=linear(rng, q_lora, hidden), q_a_norm=RMSNorm(param(1 + 0.1 * rng.standard_normal(q_lora)), 1e-6),
              q_b=linear(rng, heads * (dn + dr), q_lora))
         if q_lora else dict(q=linear(rng, heads * (dn + dr), hidden)))
    return MLAttention(layer=0, **q, kv_a=linear(rng, rank + dr, hidden),
                       kv_a_norm=RMSNorm(param(1 + 0.1 * rng.standard_normal(rank)), 1e-6),
                       kv_b=linear(rng, heads * (dn + dv), rank), o=linear(rng, hidden, heads * dv), n_heads=heads,
                       kv_lora_rank=rank, nope_dim=dn, rope_dim=dr, v_dim=dv, rope=rope, scale=(dn + dr) ** -0.5,
                       rope_interleave=interleave, indexer=indexer)


def make_indexer(rng, *, n_heads=16, d=16, dr=8, topk=4, hidden=24, q_lora=12):
    rope = build_rope({"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}, dr)
    return LightningIndexer(wq_b=linear(rng, n_heads * d, q_lora), wk=linear(rng, d, hidden),
                            k_norm=LayerNorm(param(1 + 0.1 * rng.standard_normal(d)), param(0.1 * rng.standard_normal(d)), 1e-6),
                            weights_proj=linear(rng, n_heads, hidden), n_heads=n_heads, head_dim=d, rope_dim=dr, rope=rope,
                            topk=topk)


def run(attn, chunks, absorb_max_tokens):
    """Feed chunks of hidden states through one MLA layer; return the outputs."""
    attn.absorb_max_tokens = absorb_max_tokens
    cache = Cache([attn.new_state(ops, 64)])
    outs = []
    for x in chunks:
        step = Step(ops, np.arange(cache.length, cache.length + len(x)), cache)
        outs.append(attn(x, step))
        cache.length += len(x)
    return outs, cache


@pytest.mark.parametrize("variant", ["q_lora", "no_q_lora", "half_split_rope", "dsa"])
def test_absorbed_decode_equals_expanded_attention(variant):
    rng = np.random.default_rng(2)
    indexer = make_indexer(rng) if variant == "dsa" else None
    attn = make_mla(rng, q_lora=0 if variant == "no_q_lora" else 12, interleave=variant != "half_split_rope",
                    indexer=indexer)
    chunks = [rng.standard_normal((n, 24)).astype(np.float32) for n in (6, 1, 1, 3, 1)]
    expanded, _ = run(attn, chunks, absorb_max_tokens=0)  # always expand
    absorbed, cache = run(attn, chunks, absorb_max_tokens=8)  # prefill expands, the rest absorbs
    for e, a in zip(expanded, absorbed):
        np.testing.assert_allclose(a, e, atol=2e-5, rtol=1e-4)
    state = cache.layers[0]
    assert state.length == 12
    assert state.bytes_per_token() == (16 + 8 + (16 if indexer else 0)) * 4


def test_mla_cache_holds_the_latent_not_expanded_keys():
    cache = MLACache(ops, kv_lora_rank=512, rope_dim=64, max_len=4096)
    assert cache.bytes_per_token() == (512 + 64) * 4  # DeepSeek-V3: 576 floats, against 128 x 320 expanded
    cache.append(np.zeros((3, 512), np.float32), np.zeros((3, 64), np.float32))
    assert cache.nbytes == 64 * (512 + 64) * 4  # first growth holds 64 positions
    dsa = MLACache(ops, 512, 64, 4096, index_dim=128)
    assert dsa.bytes_per_token() == (512 + 64 + 128) * 4
    assert Cache([cache, dsa]).bytes_per_token() == (576 + 704) * 4


def test_indexer_selects_what_transformers_selects():
    from transformers import DeepseekV32Config
    from transformers.models.deepseek_v32.modeling_deepseek_v32 import DeepseekV32Indexer, DeepseekV32RotaryEmbedding

    config = DeepseekV32Config(hidden_size=24, q_lora_rank=12, qk_rope_head_dim=8, index_n_heads=16, index_head_dim=16,
                               index_topk=5, max_position_embeddings=64)
    reference = DeepseekV32Indexer(config, 0).eval()
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in reference.named_parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3 + (1.0 if name == "k_norm.weight" else 0.0))
    t = 12
    x, q_resid = torch.randn(1, t, 24, generator=g), torch.randn(1, t, 12, generator=g)
    cos, sin = DeepseekV32RotaryEmbedding(config)(x, torch.arange(t)[None])
    mask = torch.tril(torch.ones(t, t, dtype=torch.bool))[None]
    expected = reference(x, q_resid, (cos, sin), mask, None).numpy()[0]

    sd = {k: param(v.detach().numpy()) for k, v in reference.state_dict().items()}
    rope = build_rope({"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}, 8)
    ours = LightningIndexer(wq_b=Linear(sd["wq_b.weight"]), wk=Linear(sd["wk.weight"]),
                            k_norm=LayerNorm(sd["k_norm.weight"], sd["k_norm.bias"], 1e-6),
                            weights_proj=Linear(sd["weights_proj.weight"]), n_heads=16, head_dim=16, rope_dim=8,
                            rope=rope, topk=5)
    state = MLACache(ops, 4, 4, 64, index_dim=16)
    step = Step(ops, np.arange(t), Cache([state]))
    selected = ours(x[0].numpy(), q_resid[0].numpy(), state, step)
    for row in range(t):
        visible = min(row + 1, 5)  # beyond what a query sees, both pick masked keys: irrelevant
        assert set(selected[row][:visible]) == set(expected[row][:visible]), row
    # a shared layer reuses the selection; without one before it, it is refused
    assert SharedIndexer()(None, None, state, step) is selected
    with pytest.raises(ValueError, match="earlier layer"):
        SharedIndexer()(None, None, state, Step(ops, np.arange(t), Cache([state])))


def test_indexer_covering_every_key_selects_all():
    rng = np.random.default_rng(4)
    indexer = make_indexer(rng, topk=8)
    state = MLACache(ops, 4, 4, 64, index_dim=16)
    step = Step(ops, np.arange(8), Cache([state]))
    assert indexer(rng.standard_normal((8, 24)).astype(np.float32), rng.standard_normal((8, 12)).astype(np.float32),
                   state, step) is None  # all 8 keys: dense attention
    assert state.index_keys.length == 8
