"""What the kit tests of the recurrent token mixers (Mamba-2, Mamba-1, lightning
attention: tests/test_mamba*.py, tests/test_lightning.py) share: the backends they run
on, feeding a mixer a sequence in pieces, seeded inputs, comparing outputs and states
with the host reference, and a batched step of two sequences."""

from __future__ import annotations

import numpy as np
import pytest

from colibri_core.nn import Cache, Step


def backend_fixture_params() -> list:
    """The ``ops`` fixture's params: the host reference backend, then every installed one."""
    from colibri_core.testing.backends import backend_params, matrix_beyond_cpu

    return [pytest.param("reference", id="reference"), *matrix_beyond_cpu(backend_params())]


def backend(name: str):
    """The backend an ``ops`` fixture param names."""
    from colibri_core.compute.reference import ReferenceBackend
    from colibri_core.plugins.discovery import create_backend, get_registry

    return ReferenceBackend() if name == "reference" else create_backend(get_registry(), name)


def feed(mixer, ops, x, cuts, cache=None, start=0):
    """``mixer`` fed the rows of ``x`` from ``start`` up to each cut in turn (from a fresh
    state unless ``cache`` is given): (the outputs, on the host, and the cache)."""
    cache = cache or Cache([mixer.new_state(ops, 1024)])
    outs = []
    for end in cuts:
        outs.append(ops.to_host(mixer(ops.asarray(x[start:end]), Step(ops, np.arange(start, end), cache))))
        cache.length = start = end
    return np.concatenate(outs), cache


def inputs(random_weights, shape, seed: int, positions: int):
    """Seeded weights (``random_weights(shape, seed)``) and ``positions`` rows of input."""
    rng = np.random.default_rng(seed + 100)
    return random_weights(shape, seed), rng.standard_normal((positions, shape.hidden)).astype(np.float32)


def check(got, state, out, states: dict, label: str, tolerance: float) -> None:
    """Outputs ``got`` and the mixer's ``state`` against the reference's output and named
    state arrays (``{"conv": ..., "ssm": ...}``)."""
    assert np.abs(got - out).max() < tolerance, f"{label}: outputs differ by {np.abs(got - out).max():.2e}"
    for name, want in states.items():
        assert np.abs(state.backend.to_host(state[name]) - want).max() < tolerance, f"{label}: {name} state"


def batched_two(mixer, ops, x, decoding: int, prompt: int, chunk_end: int):
    """A batched step of two sequences, each first fed a prompt of its own: one at
    ``decoding`` positions decodes its next token, the other at ``prompt`` positions
    takes a chunk up to ``chunk_end``. Returns (host outputs of the step's rows, each
    sequence's rows (begin, end), each one's cache)."""
    caches = [Cache([mixer.new_state(ops, 1024)]) for _ in range(2)]
    for cache, n in zip(caches, (decoding, prompt)):
        mixer(ops.asarray(x[:n]), Step(ops, np.arange(n), cache))
        cache.length = n
    rows = [(0, 1), (1, 1 + chunk_end - prompt)]
    segments = [Step(ops, np.arange(decoding, decoding + 1), caches[0]), Step(ops, np.arange(prompt, chunk_end), caches[1])]
    step = Step(ops, np.concatenate([s.positions for s in segments]), None, segments=segments, rows=rows)
    got = ops.to_host(mixer.batched(ops.asarray(np.concatenate([x[decoding : decoding + 1], x[prompt:chunk_end]])), step))
    return got, rows, caches
