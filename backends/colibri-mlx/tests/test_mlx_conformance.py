"""The conformance kit on the MLX backend: every operation of the contract (the hand-written
op tests it replaced went), the composites on MLX's primitives, and the batched engine,
against the numpy reference."""

import pytest

from colibri_core.testing.backend_kit import BackendConformanceSuite

pytestmark = pytest.mark.matrix  # the kit on one more backend


class TestMlxBackend(BackendConformanceSuite):
    def make_backend(self):
        from colibri_mlx.backend import MlxBackend

        return MlxBackend()
