"""The shared-block options Llama 4 needs first, against transformers' own modules, on
every installed backend: ``SparseMoE(weight_inputs=True)`` with ``SigmoidTopKRouter`` (the
router's sigmoid weights scale the experts' inputs: ``Llama4TextMoe``), and
``Attention``'s ``chunk`` (chunked attention) and ``query_scale`` (the NoPE layers'
temperature tuning) against ``Llama4TextAttention``, a sequence fed at once and in pieces
across chunk boundaries (nn/chunked.py)."""

import numpy as np
import pytest

from colibri_core.compute.reference import ReferenceBackend
from colibri_core.experts.tiers import ExpertWeights
from colibri_core.nn import (Attention, Cache, Linear, RMSNorm, SigmoidTopKRouter, SparseMoE, Step, SwiGLU, build_rope,
                             temperature_tuning)
from colibri_core.nn.chunked import chunk_pieces
from colibri_core.nn.weights import Param, pairs_to_halves
from colibri_core.plugins.discovery import create_backend, get_registry
from colibri_core.testing.backends import backend_params, matrix_beyond_cpu
from colibri_core.testing import memory_param

torch = pytest.importorskip("torch")
TOLERANCE = 2e-5


@pytest.fixture(params=[pytest.param("reference", id="reference"), *matrix_beyond_cpu(backend_params())])
def ops(request):
    return ReferenceBackend() if request.param == "reference" else create_backend(get_registry(), request.param)


def param(ops, value, use: str = "linear") -> Param:
    return memory_param(value, (lambda v: ops.prepare_weight(v, use)) if use == "linear" else ops.asarray)


def linear(ops, module, rows=None) -> Linear:
    w = module.weight.detach().numpy()
    b = None if module.bias is None else module.bias.detach().numpy()
    if rows is not None:
        w, b = w[rows], None if b is None else b[rows]
    return Linear(param(ops, w), None if b is None else param(ops, b, "array"))


class FusedExperts:
    """Llama 4's fused experts (gate_up (E, hidden, 2 x inter), down (E, inter, hidden)) as
    the store hands them to ``ops.routed_experts``: one expert's (out, in) matrices."""

    def __init__(self, ops, module):
        gate_up, down = module.gate_up_proj.detach().numpy(), module.down_proj.detach().numpy()
        inter = down.shape[1]
        self.prepared = [ExpertWeights({"gate": np.ascontiguousarray(gate_up[e][:, :inter].T),
                                        "up": np.ascontiguousarray(gate_up[e][:, inter:].T),
                                        "down": np.ascontiguousarray(down[e].T)}, 0).prepared(ops)
                         for e in range(len(gate_up))]

    def __call__(self, x, indices, weights, step):
        return step.ops.routed_experts(x, indices, weights, lambda e: self.prepared[e])


@pytest.mark.parametrize("top_k", [1, 2, 3])
def test_input_weighted_moe_matches_llama4_moe(ops, top_k):
    """``SparseMoE(weight_inputs=True)`` over ``SigmoidTopKRouter`` gives transformers'
    Llama4TextMoe (routed and shared experts); weighting the outputs instead does not."""
    from transformers import Llama4TextConfig
    from transformers.models.llama4.modeling_llama4 import Llama4TextMoe

    config = Llama4TextConfig(hidden_size=32, intermediate_size=16, num_local_experts=8, num_experts_per_tok=top_k)
    torch.manual_seed(top_k)
    reference = Llama4TextMoe(config).eval()
    with torch.no_grad():
        for p in reference.parameters():
            p.copy_(torch.randn_like(p) * 0.3)
        x = torch.randn(9, 32)
        expected = reference(x)[0].numpy()
    shared = reference.shared_expert

    def moe(weight_inputs):
        return SparseMoE(SigmoidTopKRouter(linear(ops, reference.router), top_k), FusedExperts(ops, reference.experts),
                         shared=SwiGLU(linear(ops, shared.gate_proj), linear(ops, shared.up_proj), linear(ops, shared.down_proj)),
                         weight_inputs=weight_inputs)

    step = Step(ops, np.arange(9), None)
    got = ops.to_host(moe(True)(ops.asarray(x.numpy()), step))
    np.testing.assert_allclose(got, expected, atol=TOLERANCE)
    weighted_outputs = ops.to_host(moe(False)(ops.asarray(x.numpy()), step))
    assert np.abs(weighted_outputs - expected).max() > 1e-3


def test_sigmoid_top_k_router_weights():
    ops = ReferenceBackend()
    gate = np.array([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]], dtype=np.float32)
    router = SigmoidTopKRouter(Linear(param(ops, gate)), 2)
    indices, weights = router(np.array([[2.0, -1.0]], dtype=np.float32), Step(ops, np.arange(1), None))
    assert indices.tolist() == [[0, 2]]
    np.testing.assert_allclose(weights, 1 / (1 + np.exp(-np.array([[2.0, 1.0]]))), rtol=1e-6)
    with pytest.raises(ValueError, match="top_k 4"):
        SigmoidTopKRouter(Linear(param(ops, gate)), 4)


def test_chunk_pieces_cut_where_chunks_begin():
    assert chunk_pieces(0, 10, 4) == [(0, 4, 0), (4, 8, 4), (8, 10, 8)]
    assert chunk_pieces(6, 3, 4) == [(0, 2, 4), (2, 3, 8)]
    assert chunk_pieces(9, 1, 4) == [(0, 1, 8)]


def test_chunk_goes_without_window_or_sinks():
    lin = Linear(param(ReferenceBackend(), np.eye(8)))
    with pytest.raises(ValueError, match="chunk"):
        Attention(layer=0, q=lin, k=lin, v=lin, o=lin, n_heads=1, n_kv_heads=1, head_dim=8, rope=None, chunk=4, window=4)
    with pytest.raises(ValueError, match="chunk"):
        Attention(layer=0, q=lin, k=lin, v=lin, o=lin, n_heads=1, n_kv_heads=1, head_dim=8, rope=None, chunk=0)


POSITIONS, CHUNK = 23, 6
CUTS = [4, 5, 6, 7, 13, 14, 19, POSITIONS]  # in pieces: across chunk starts, single tokens, chunks


@pytest.mark.parametrize("rope", [True, False], ids=["rope-chunked-qknorm", "nope-temperature"])
def test_chunked_attention_matches_llama4_attention(ops, rope):
    """A RoPE layer (interleaved pairs read as halves, L2 q/k norm after RoPE, chunks of 6)
    and a NoPE layer (full attention, temperature tuning from position 1) against
    transformers' Llama4TextAttention under the chunked / causal mask, fed at once and in
    pieces; the chunked cache holds the chunk only."""
    from transformers import Llama4TextConfig
    from transformers.models.llama4.modeling_llama4 import Llama4TextAttention, Llama4TextRotaryEmbedding

    config = Llama4TextConfig(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                              num_hidden_layers=1, no_rope_layers=[int(rope)], attention_chunk_size=CHUNK, floor_scale=2,
                              attn_scale=0.5, attention_bias=True, rope_parameters={"rope_type": "default",
                                                                                     "rope_theta": 10000.0})
    config._attn_implementation = "eager"
    torch.manual_seed(int(rope))
    reference = Llama4TextAttention(config, 0).eval()
    with torch.no_grad():
        for p in reference.parameters():
            p.copy_(torch.randn_like(p) * 0.3)
    x = torch.randn(1, POSITIONS, 32)
    positions = torch.arange(POSITIONS)
    q_pos, k_pos = positions[:, None], positions[None, :]
    visible = (k_pos <= q_pos) & ((k_pos // CHUNK == q_pos // CHUNK) if rope else True)
    mask = torch.where(visible, 0.0, float("-inf"))[None, None]
    with torch.no_grad():
        expected = reference(x, Llama4TextRotaryEmbedding(config)(x, positions[None]), mask)[0][0].numpy()

    halves = (pairs_to_halves(4, 8), pairs_to_halves(2, 8)) if rope else (None, None)
    norm = RMSNorm(None, config.rms_norm_eps)
    ours = Attention(layer=0, q=linear(ops, reference.q_proj, halves[0]), k=linear(ops, reference.k_proj, halves[1]),
                     v=linear(ops, reference.v_proj), o=linear(ops, reference.o_proj), n_heads=4, n_kv_heads=2, head_dim=8,
                     rope=build_rope({"rope_theta": 10000.0}, 8) if rope else None,
                     **(dict(q_norm=norm, k_norm=norm, qk_norm_per_head=True, qk_norm_after_rope=True) if rope else {}),
                     chunk=CHUNK if rope else None, query_scale=None if rope else temperature_tuning(2, 0.5))
    rows = x[0].numpy()
    for cuts in ([POSITIONS], CUTS):
        cache, start, outs = Cache([ours.new_state(ops, 256)]), 0, []
        assert type(cache.layers[0]).__name__ == ("SlidingKVCache" if rope else "KVCache")
        for end in cuts:
            step = Step(ops, np.arange(start, end), cache)
            outs.append(ops.to_host(ours(ops.asarray(rows[start:end]), step)))
            start = end
        np.testing.assert_allclose(np.concatenate(outs), expected, atol=TOLERANCE, err_msg=f"cuts {cuts}")
