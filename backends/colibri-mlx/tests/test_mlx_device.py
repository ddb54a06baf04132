"""What is MLX's own: memory members (unified memory, dtypes) and the backend's stream.
Every operation against the numpy reference is the conformance kit's job
(test_mlx_conformance.py)."""

import mlx.core as mx
import numpy as np
import pytest

from mlx_checks import assert_close, host, mlx_backend, reference, rng  # noqa: F401 (fixtures)


def f32(rng, *shape, scale=1.0):
    return (rng.standard_normal(shape) * scale).astype(np.float32)


def test_memory_members(mlx_backend):
    x = mlx_backend.asarray(np.arange(6, dtype=np.float32).reshape(2, 3))
    assert isinstance(x, mx.array) and x.dtype == mx.float32
    before = mlx_backend.host_syncs
    np.testing.assert_array_equal(mlx_backend.to_host(x), np.arange(6, dtype=np.float32).reshape(2, 3))
    assert mlx_backend.host_syncs == before + 1
    assert mlx_backend.nbytes(x) == 24
    for dtype, size in (("float32", 4), ("bfloat16", 2), ("float16", 2), ("int64", 8), ("int32", 4), ("uint8", 1)):
        z = mlx_backend.zeros((3, 5), dtype)
        assert mlx_backend.nbytes(z) == 15 * size
        assert not host(mlx_backend, z).any()
    np.testing.assert_array_equal(host(mlx_backend, mlx_backend.asarray([1.5, -2.0], "bfloat16")), [1.5, -2.0])
    with pytest.raises(ValueError, match="float64"):
        mlx_backend.zeros((2,), "float64")
    assert mlx_backend.unified_memory
    assert mlx_backend.device_memory() > 1 << 30  # the host's memory on the CPU build
    assert mlx_backend.float_dtypes == ("float32",)


def test_runs_on_its_own_stream_whatever_the_default(mlx_backend, reference, rng):
    x = f32(rng, 4, 8)
    with mx.stream(mx.new_stream(mx.cpu)):
        y = mlx_backend.silu(mlx_backend.asarray(x))
    assert_close(mlx_backend, y, reference.silu(x))
    assert mlx_backend.device in (mx.cpu, mx.gpu)
