import numpy as np
import pytest

from colibri_core.engine.reference import ReferenceBackend
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

