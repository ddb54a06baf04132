"""``host.group_by_expert``: the fixed reduction order of the routed experts (ascending
experts, each one's tokens in token order). Few pairs are grouped in Python (a
verification's or a batched step's rows), more by numpy; both must give numpy's
stable argsort and unique exactly, or a batched row would sum its experts in another
order than the same row alone."""

import numpy as np
import pytest

from colibri_core.compute import host


def _numpy_groups(indices):
    flat = indices.ravel()
    order = np.argsort(flat, kind="stable")
    experts, starts, counts = np.unique(flat[order], return_index=True, return_counts=True)
    return order, experts.tolist(), starts.tolist(), counts.tolist()


@pytest.mark.parametrize("tokens, k, experts", [(1, 6, 64), (2, 6, 64), (4, 8, 8), (8, 8, 64), (9, 8, 16),
                                                (16, 4, 4), (64, 8, 128), (3, 1, 2)])
def test_grouping_is_numpys_stable_order_on_either_side_of_the_threshold(tokens, k, experts):
    rng = np.random.default_rng(tokens * 100 + k)
    for _ in range(20):
        indices = np.stack([rng.choice(experts, k, replace=False) for _ in range(tokens)]).astype(np.int64)
        order, ids, starts, counts = host.group_by_expert(indices)
        want = _numpy_groups(indices)
        np.testing.assert_array_equal(order, want[0])
        assert (ids, starts, counts) == want[1:]
        assert all(isinstance(v, int) for v in ids + starts + counts)


def test_expert_groups_give_each_experts_rows_and_weights():
    indices = np.array([[5, 1], [1, 7], [5, 2]], dtype=np.int64)
    weights = np.array([[0.6, 0.4], [0.3, 0.7], [0.9, 0.1]], dtype=np.float32)
    got = [(e, rows.tolist(), scale.tolist()) for e, rows, scale in host.expert_groups(indices, weights)]
    assert got == [(1, [0, 1], pytest.approx([0.4, 0.3])), (2, [2], pytest.approx([0.1])),
                   (5, [0, 2], pytest.approx([0.6, 0.9])), (7, [1], pytest.approx([0.7]))]
