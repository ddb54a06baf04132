"""Routers and routed experts on MLX: the same choices as the reference, ties included
(of equal scores the lower index first), and each expert fetched once, in ascending
order, for all the tokens that use it."""

import mlx.core as mx
import numpy as np
import pytest

from colibri_core.formats.base import QuantTensor, f32_to_bf16
from mlx_checks import assert_close, host, mlx_backend, reference, rng  # noqa: F401 (fixtures)


def router_weight(rng, n_experts, hidden, duplicates):
    """Random router rows, where each (a, b) in ``duplicates`` gives expert b expert a's
    row: the two always score the same."""
    w = rng.standard_normal((n_experts, hidden)).astype(np.float32)
    for a, b in duplicates:
        w[b] = w[a]
    return w


# ties between experts in the first SIMD lanes, across lanes, and in the tail of a row
# whose length is no multiple of a vector width
DUPLICATES = [(0, 1), (5, 40), (57, 58), (2, 59)]


@pytest.mark.parametrize("t", [1, 9])
@pytest.mark.parametrize("renormalise", [True, False])
def test_softmax_top_k_with_ties(mlx_backend, reference, rng, t, renormalise):
    w = router_weight(rng, 60, 32, DUPLICATES)
    x = rng.standard_normal((t, 32)).astype(np.float32)
    bias = rng.standard_normal(60).astype(np.float32) * 0.1
    bias[1], bias[40], bias[58], bias[59] = bias[0], bias[5], bias[57], bias[2]
    x[0] = w[0] * 3  # token 0 prefers the tied pair (0, 1) clearly
    for b in (None, bias):
        expected = reference.softmax_top_k(x, w, 8, renormalise, b)
        syncs = mlx_backend.host_syncs
        indices, weights = mlx_backend.softmax_top_k(mlx_backend.asarray(x), mlx_backend.prepare_weight(w), 8, renormalise,
                                                     None if b is None else mlx_backend.asarray(b))
        assert mlx_backend.host_syncs == syncs + 1  # indices and weights come back at one synchronisation
        assert isinstance(indices, np.ndarray) and indices.dtype == np.int64
        np.testing.assert_array_equal(indices, expected[0])
        assert indices[0, 0] == 0 and indices[0, 1] == 1  # the tie: the lower index first
        assert weights.dtype == np.float32
        np.testing.assert_allclose(weights, expected[1], rtol=1e-5, atol=1e-7)


def test_top_k_ties_stay_on_the_device(mlx_backend, reference, rng):
    scores = rng.integers(0, 4, (6, 300)).astype(np.float32)  # many equal scores in each row
    scores[1, :] = 1.0
    scores[2, 7] = -np.inf
    selected = mlx_backend.top_k(mlx_backend.asarray(scores), 17)
    assert isinstance(selected, mx.array) and selected.dtype == mx.int64
    np.testing.assert_array_equal(host(mlx_backend, selected), reference.top_k(scores, 17))
    np.testing.assert_array_equal(host(mlx_backend, selected)[1], np.arange(17))


@pytest.mark.parametrize("n_group,topk_group", [(1, 1), (4, 2), (8, 3)])
@pytest.mark.parametrize("renormalise", [True, False])
def test_sigmoid_grouped_top_k(mlx_backend, reference, rng, n_group, topk_group, renormalise):
    w = router_weight(rng, 64, 24, [(0, 1), (8, 9), (3, 60)])
    x = rng.standard_normal((7, 24)).astype(np.float32)
    bias = (rng.standard_normal(64) * 0.3).astype(np.float32)
    bias[1], bias[9], bias[60] = bias[0], bias[8], bias[3]
    for b in (None, bias):
        expected = reference.sigmoid_grouped_top_k(x, w, b, 6, n_group, topk_group, renormalise, 2.5)
        indices, weights = mlx_backend.sigmoid_grouped_top_k(mlx_backend.asarray(x), mlx_backend.prepare_weight(w), b, 6,
                                                             n_group, topk_group, renormalise, 2.5)
        np.testing.assert_array_equal(indices, expected[0])
        np.testing.assert_allclose(weights, expected[1], rtol=1e-5, atol=1e-7)


def experts(rng, count, hidden, inter, packed):
    """Host matrices of ``count`` SwiGLU experts: float32 arrays, or int4 with bfloat16 scales."""
    out = []
    for _ in range(count):
        mats = {}
        for role, shape in (("gate", (inter, hidden)), ("up", (inter, hidden)), ("down", (hidden, inter))):
            if packed:
                g = shape[1] // 64
                scales = f32_to_bf16((rng.random((shape[0], g)) * 0.02).astype(np.float32))
                mats[role] = QuantTensor("q4", rng.integers(0, 256, (shape[0], g * 32), dtype=np.uint8), scales, shape)
            else:
                mats[role] = (rng.standard_normal(shape) * 0.1).astype(np.float32)
        out.append(mats)
    return out


@pytest.mark.parametrize("packed", [False, True], ids=["float32", "int4"])
@pytest.mark.parametrize("t,window", [(1, 8), (6, 8), (6, 2)])
def test_routed_experts(mlx_backend, reference, rng, packed, t, window):
    hidden, inter, k, count = 64, 128, 3, 10
    host_experts = experts(rng, count, hidden, inter, packed)
    prepared = [{r: mlx_backend.prepare_weight(m) for r, m in e.items()} for e in host_experts]
    as_reference = [{r: reference.prepare_weight(m) for r, m in e.items()} for e in host_experts]
    x = rng.standard_normal((t, hidden)).astype(np.float32)
    indices = np.stack([rng.permutation(count)[:k] for _ in range(t)])
    weights = rng.random((t, k)).astype(np.float32)
    fetched, asked = [], []

    def fetch(e):
        fetched.append(e)
        return prepared[e]

    def ready(e):
        asked.append(e)
        return e % 2 == 0  # odd experts are "still being read"

    out = mlx_backend.routed_experts(mlx_backend.asarray(x), indices, weights, fetch, window, ready)
    expected = reference.routed_experts(x, indices, weights, lambda e: as_reference[e])
    assert_close(mlx_backend, out, expected, tol=1e-5)
    used = sorted(set(indices.ravel().tolist()))
    assert fetched == used  # each expert once (batch-union), in ascending order
    assert set(asked) <= set(used)
    one = prepared[used[0]]
    assert_close(mlx_backend, mlx_backend.swiglu_expert(mlx_backend.asarray(x), one["gate"], one["up"], one["down"]),
                 reference.swiglu_expert(x, *(as_reference[used[0]][r] for r in ("gate", "up", "down"))), tol=1e-5)


def test_routed_experts_reduction_order_is_fixed(mlx_backend, rng):
    """The same tokens and experts, fetched with different readiness (as different
    placements would), give bit-identical outputs."""
    host_experts = experts(rng, 6, 64, 64, False)
    prepared = [{r: mlx_backend.prepare_weight(m) for r, m in e.items()} for e in host_experts]
    x = mlx_backend.asarray(rng.standard_normal((5, 64)).astype(np.float32))
    indices = np.stack([rng.permutation(6)[:4] for _ in range(5)])
    weights = rng.random((5, 4)).astype(np.float32)
    outs = [host(mlx_backend, mlx_backend.routed_experts(x, indices, weights, prepared.__getitem__, window, ready))
            for window, ready in ((8, None), (1, lambda e: False), (3, lambda e: e > 2))]
    for other in outs[1:]:
        np.testing.assert_array_equal(other, outs[0])
