import numpy as np
import pytest

from colibri_core.errors import UsageError
from colibri_core.engine.sampling import BLOCK, Sampler, SamplingParams, draw


def logits(seed=0, n=50):
    return np.random.default_rng(seed).standard_normal(n).astype(np.float32) * 3


def test_greedy_is_argmax():
    for seed in range(5):
        x = logits(seed)
        assert Sampler(SamplingParams())(x) == int(np.argmax(x))


def test_seeded_sampling_is_reproducible_and_seed_dependent():
    x = logits()

    def draws(seed):
        sampler = Sampler(SamplingParams(temperature=1.0, seed=seed))
        return [sampler(x) for _ in range(20)]

    assert draws(1) == draws(1)
    assert draws(1) != draws(2)


def test_top_k_one_and_tiny_top_p_are_greedy():
    x = logits(3)
    for params in (SamplingParams(temperature=1.5, top_k=1, seed=0), SamplingParams(temperature=1.5, top_p=1e-6, seed=0)):
        sampler = Sampler(params)
        assert {sampler(x) for _ in range(30)} == {int(np.argmax(x))}


def test_the_smallest_temperatures_are_greedy_not_an_error():
    # logits / 5e-324 overflow to inf; found by schemathesis through colibri serve
    x = logits(5)
    for params in (SamplingParams(temperature=5e-324, seed=0), SamplingParams(temperature=5e-324, top_p=5e-324, seed=0),
                   SamplingParams(temperature=1e-300, top_k=3, seed=0)):
        sampler = Sampler(params)
        assert {sampler(x) for _ in range(10)} == {int(np.argmax(x))}


def test_top_k_limits_the_support():
    x = logits(4)
    allowed = set(np.argsort(-x)[:3].tolist())
    sampler = Sampler(SamplingParams(temperature=5.0, top_k=3, seed=0))
    seen = {sampler(x) for _ in range(300)}
    assert seen == allowed


def test_top_p_keeps_the_smallest_prefix_reaching_p():
    x = np.log(np.array([0.5, 0.3, 0.15, 0.05], dtype=np.float32))
    sampler = Sampler(SamplingParams(temperature=1.0, top_p=0.8, seed=0))
    seen = {sampler(x) for _ in range(500)}
    assert seen == {0, 1}


def test_sampling_follows_the_distribution():
    x = np.log(np.array([0.7, 0.2, 0.1], dtype=np.float32))
    sampler = Sampler(SamplingParams(temperature=1.0, seed=0))
    counts = np.bincount([sampler(x) for _ in range(4000)], minlength=3) / 4000
    assert np.allclose(counts, [0.7, 0.2, 0.1], atol=0.03)


@pytest.mark.parametrize("kwargs", [{"temperature": -1}, {"top_p": 0}, {"top_p": 1.5}, {"top_k": -2}])
def test_bad_parameters_are_refused(kwargs):
    with pytest.raises(UsageError):
        SamplingParams(**kwargs)


def test_draw_is_the_inverse_cdf():
    """The block-wise draw picks what a full cumulative sum picks, never a zero weight,
    also at the edges of blocks and of [0, 1)."""
    rng = np.random.default_rng(0)
    for size in (5, BLOCK, 3 * BLOCK + 17):
        weights = rng.random(size) ** 4
        weights[rng.random(size) < 0.3] = 0.0  # masked tokens (top-k / top-p)
        weights[-min(5, size // 2):] = 0.0
        weights[0] = 0.5
        cdf = np.cumsum(weights) / weights.sum()
        for u in [0.0, 1.0 - 2**-53, *rng.random(300), *cdf[:: max(1, size // 50)]]:
            i = draw(weights, u)
            assert weights[i] > 0
            expected = int(np.searchsorted(cdf, u, side="right"))
            if expected < size and abs(cdf[expected] - u) > 1e-9 and (expected == 0 or abs(cdf[expected - 1] - u) > 1e-9):
                assert i == expected, (size, u)


def test_nan_logits_are_refused_with_a_clear_error():
    from colibri_core.errors import ColibriError

    x = logits()
    x[3] = np.nan
    with pytest.raises(ColibriError, match="NaN"):
        Sampler(SamplingParams(temperature=1.0, seed=0))(x)
