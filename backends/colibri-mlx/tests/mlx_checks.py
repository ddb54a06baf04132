"""Fixtures and comparisons for the MLX backend's tests, imported by each test module
(a conftest.py here would shadow the one of the core's tests, which they import by name)."""

import numpy as np
import pytest

from colibri_core.compute.reference import ReferenceBackend
from colibri_mlx.backend import MlxBackend


@pytest.fixture(scope="module")
def mlx_backend():
    return MlxBackend()


@pytest.fixture(scope="module")
def reference():
    return ReferenceBackend()


@pytest.fixture
def rng():
    return np.random.default_rng(0)


def host(backend, x) -> np.ndarray:
    """A backend array (or a host one) as numpy."""
    return x if isinstance(x, np.ndarray) else backend.to_host(x)


def assert_close(backend, ours, expected, tol=2e-6):
    """Within ``tol`` of the reference, relative to the reference's largest magnitude:
    float32 rounding of a different order of operations, nothing more."""
    ours = host(backend, ours)
    assert ours.shape == expected.shape
    assert ours.dtype == expected.dtype
    scale = max(1.0, float(np.abs(expected[np.isfinite(expected)]).max(initial=0.0)))
    np.testing.assert_array_equal(np.isfinite(ours), np.isfinite(expected))
    finite = np.isfinite(expected)
    np.testing.assert_array_equal(ours[~finite], expected[~finite])
    assert np.abs(ours[finite] - expected[finite]).max(initial=0.0) <= tol * scale
