"""``SigmoidGroupedTopKRouter``'s ``norm_eps`` (LFM2's router divides the chosen scores by
their sum + 1e-6, DeepSeek's by their sum + 1e-20): the same choice, the weights
renormalised with that floor and scaled, against numpy."""

from types import SimpleNamespace

import numpy as np
import pytest

from colibri_core.compute.cpu.backend import CpuBackend
from colibri_core.nn import Linear, SigmoidGroupedTopKRouter, Step


@pytest.mark.parametrize("norm_eps", [1e-6, 1e-20, 0.5])
def test_the_floor_is_added_to_the_sum(norm_eps):
    rng = np.random.default_rng(0)
    gate = rng.standard_normal((8, 16)).astype(np.float32)
    x = rng.standard_normal((5, 16)).astype(np.float32)
    router = SigmoidGroupedTopKRouter(Linear(SimpleNamespace(value=gate, info=SimpleNamespace(shape=gate.shape))), 3,
                                      routed_scaling_factor=2.0, norm_eps=norm_eps)
    ops = CpuBackend()
    indices, weights = router(x, Step(ops, np.arange(5), None))
    scores = 1 / (1 + np.exp(-(x.astype(np.float64) @ gate.T.astype(np.float64))))
    expected_ids = np.sort(np.argsort(-scores, axis=1)[:, :3], axis=1)
    assert np.array_equal(np.sort(indices, axis=1), expected_ids)
    chosen = np.take_along_axis(scores, indices, axis=1)
    np.testing.assert_allclose(weights, chosen / (chosen.sum(axis=1, keepdims=True) + norm_eps) * 2.0, rtol=1e-5)
