"""``SparseMoE``'s ``zero_experts`` (LongCat-Flash's zero-computation experts): router
slots beyond the real experts add the token itself times their weight, on every installed
backend; the store is never asked for them (no read, no slot), a step whose tokens chose
zero experts only reads nothing, and the routing statistics count the real experts only.
The whole models run under every placement in families/colibri-meituan's oracle suite."""

from types import SimpleNamespace

import numpy as np
import pytest

from colibri_core.compute.reference import ReferenceBackend
from colibri_core.experts.tiers import ExpertWeights
from colibri_core.nn import RoutedExperts, SparseMoE, Step
from colibri_core.nn.zero_experts import split_zero_experts
from colibri_core.plugins.discovery import create_backend, get_registry
from colibri_core.testing.backends import backend_params, matrix_beyond_cpu

HIDDEN, INNER, REAL, ZERO = 8, 6, 5, 3


@pytest.fixture(params=[pytest.param("reference", id="reference"), *matrix_beyond_cpu(backend_params())])
def ops(request):
    return ReferenceBackend() if request.param == "reference" else create_backend(get_registry(), request.param)


class CountingStore:
    """The store's interface to ``RoutedExperts``, recording what it is asked."""

    compute, io_window = None, 8

    def __init__(self, ops, matrices):
        self.ops = ops
        self.matrices = [ExpertWeights(m, sum(a.nbytes for a in m.values())).prepared(ops) for m in matrices]
        self.asked: list[int] = []
        self.ended: list[np.ndarray] = []

    def request(self, layer, experts):
        self.asked.extend(int(e) for e in experts)
        return True

    def get(self, layer, e):
        self.asked.append(int(e))
        return self.matrices[e]

    def ready(self, layer, e):
        return True

    def end_layer(self, layer, indices, experts):
        self.ended.append(np.asarray(indices).copy())


def silu(v):
    return v / (1 + np.exp(-v))


def moe_with(ops, indices, weights, seed=0):
    rng = np.random.default_rng(seed)
    matrices = [{"gate": rng.normal(size=(INNER, HIDDEN)).astype(np.float32),
                 "up": rng.normal(size=(INNER, HIDDEN)).astype(np.float32),
                 "down": rng.normal(size=(HIDDEN, INNER)).astype(np.float32)} for _ in range(REAL)]
    experts = RoutedExperts(SimpleNamespace(layer=0, moe_index=0, count=REAL, glu=False, activation=None))
    experts.store = CountingStore(ops, matrices)
    router = lambda x, step: (np.asarray(indices, dtype=np.int64), np.asarray(weights, dtype=np.float32))  # noqa: E731
    return SparseMoE(router, experts, zero_experts=ZERO), matrices


def reference(x, indices, weights, matrices):
    out = np.zeros_like(x, dtype=np.float64)
    for t in range(x.shape[0]):
        for e, w in zip(indices[t], weights[t]):
            if e >= REAL:
                out[t] += w * x[t]
            else:
                m = matrices[e]
                out[t] += w * (m["down"] @ (silu(m["gate"] @ x[t]) * (m["up"] @ x[t])))
    return out


@pytest.mark.parametrize("indices", [
    [[0, 5, 3], [6, 7, 5], [1, 2, 4], [7, 2, 0]],  # mixed, zero only, real only, mixed
    [[5, 6, 7]],  # one token (decode), zero experts only: nothing read
    [[4, 6, 1]],  # one token, mixed
], ids=["mixed-rows", "decode-zero-only", "decode-mixed"])
def test_zero_experts_add_the_token_and_are_never_read(ops, indices):
    indices = np.asarray(indices)
    weights = np.random.default_rng(1).uniform(0.1, 1.0, size=indices.shape).astype(np.float32)
    x = np.random.default_rng(2).normal(size=(indices.shape[0], HIDDEN)).astype(np.float32)
    moe, matrices = moe_with(ops, indices, weights)
    routing: list = []
    step = Step(ops, np.arange(x.shape[0]), None, routing=routing)
    got = ops.to_host(moe(ops.asarray(x), step))
    np.testing.assert_allclose(got, reference(x, indices, weights, matrices), atol=2e-5)
    store = moe.experts.store
    real = indices[indices < REAL]
    assert set(store.asked) == set(real.tolist())  # the real experts only; no zero expert, no pad beyond them
    assert [r.tolist() for r in store.ended] == [real.tolist()] and [r.tolist() for _, r in routing] == [real.tolist()]
    assert moe.zero_slots == int((indices >= REAL).sum())


def test_split_pads_each_token_with_experts_the_step_reads_anyway():
    rng = np.random.default_rng(0)
    for _ in range(50):
        t, k = rng.integers(1, 7), 4
        indices = np.stack([rng.permutation(REAL + ZERO)[:k] for _ in range(t)])
        weights = rng.uniform(size=(t, k)).astype(np.float32)
        padded, padded_weights, counted, identity = split_zero_experts(indices, weights, REAL)
        real = indices < REAL
        assert counted.tolist() == indices[real].tolist()
        np.testing.assert_allclose(identity, np.where(real, 0, weights).sum(1), rtol=1e-6)
        assert padded.shape == (t, real.sum(1).max())
        for row in range(t):
            n = real[row].sum()
            assert padded[row, :n].tolist() == indices[row][real[row]].tolist()
            assert len(set(padded[row].tolist())) == padded.shape[1]  # distinct within the token
            assert set(padded[row].tolist()) <= set(counted.tolist())  # pads: experts read anyway
            assert not padded_weights[row, n:].any()
            np.testing.assert_array_equal(padded_weights[row, :n], weights[row][real[row]])


def test_zero_experts_is_a_plain_option():
    experts = RoutedExperts(SimpleNamespace(layer=0, moe_index=0, count=REAL, glu=False, activation=None))
    with pytest.raises(ValueError, match="zero_experts must be >= 0"):
        SparseMoE(None, experts, zero_experts=-1)
    with pytest.raises(ValueError, match="without weight_inputs"):
        SparseMoE(None, experts, zero_experts=2, weight_inputs=True)
    assert SparseMoE(None, experts).zero_experts == 0
