"""``nn.Attention``'s ``gate`` (AFMoE's ``gate_proj``): an output gate of its own projection
of the attention's input computes what ``output_gate`` computes from the same rows
interleaved into q_proj (Qwen3-Next's layout, per head [query, gate]), alone and in a
batched step; the two options do not combine."""

from types import SimpleNamespace

import numpy as np
import pytest

from colibri_core.compute.cpu.backend import CpuBackend
from colibri_core.nn import Attention, Cache, Linear, Step, build_rope

HIDDEN, HEADS, KV_HEADS, D = 16, 4, 2, 8


def linear(m):
    return Linear(SimpleNamespace(value=np.ascontiguousarray(m, dtype=np.float32), info=SimpleNamespace(shape=m.shape)))


def attentions():
    rng = np.random.default_rng(0)
    q, g = rng.standard_normal((HEADS * D, HIDDEN)), rng.standard_normal((HEADS * D, HIDDEN))
    k, v = rng.standard_normal((KV_HEADS * D, HIDDEN)), rng.standard_normal((KV_HEADS * D, HIDDEN))
    o = rng.standard_normal((HIDDEN, HEADS * D))
    fused = np.concatenate([q.reshape(HEADS, D, HIDDEN), g.reshape(HEADS, D, HIDDEN)], axis=1).reshape(-1, HIDDEN)
    common = dict(layer=0, k=linear(k), v=linear(v), o=linear(o), n_heads=HEADS, n_kv_heads=KV_HEADS, head_dim=D,
                  rope=build_rope({"rope_theta": 10000.0}, D))
    return Attention(q=linear(q), gate=linear(g), **common), Attention(q=linear(fused), output_gate=True, **common)


def run(attn, x, ops, batched=False):
    caches = [Cache([attn.new_state(ops, 64)]) for _ in range(2 if batched else 1)]
    if not batched:
        return attn(x, Step(ops, np.arange(len(x)), caches[0]))
    half = len(x) // 2
    segments = [Step(ops, np.arange(half), caches[0]), Step(ops, np.arange(len(x) - half), caches[1])]
    return attn.batched(x, Step(ops, np.arange(len(x)), None, segments=segments, rows=[(0, half), (half, len(x))]))


@pytest.mark.parametrize("batched", [False, True], ids=["alone", "batched"])
def test_a_separate_gate_is_the_gate_interleaved_into_q(batched):
    ops = CpuBackend()
    x = np.random.default_rng(1).standard_normal((6, HIDDEN)).astype(np.float32)
    separate, interleaved = attentions()
    np.testing.assert_allclose(run(separate, x, ops, batched), run(interleaved, x, ops, batched), rtol=1e-5, atol=1e-5)


def test_gate_and_output_gate_do_not_combine():
    separate, _ = attentions()
    with pytest.raises(ValueError, match="not both"):
        Attention(layer=0, q=separate.q, k=separate.k, v=separate.v, o=separate.o, n_heads=HEADS, n_kv_heads=KV_HEADS,
                  head_dim=D, rope=None, output_gate=True, gate=separate.gate)
