"""A sequence's caches are sized for its reply before decode starts: growing by doubling
mid-decode copies every layer's whole cache in one step (512 -> 1024 positions stalled a
decode of the full OLMoE shape for ~0.5 s, a third of a 16-token reply's time)."""

import numpy as np
import pytest

import colibri_core
from colibri_core.engine.generation import RESERVE_AHEAD
from colibri_core.engine.scheduler import Request, Scheduler
from colibri_core.nn import cache as cache_module
from colibri_core.nn import mla as mla_module
from colibri_core.testing import tiny_models


@pytest.fixture
def grown(monkeypatch):
    """Every cache growth that copies positions already held (a reallocation mid-sequence)."""
    seen = []
    kv_grow, rows_grow = cache_module.KVCache._grow, mla_module._Rows._grow

    def kv(self, needed):
        if self._k is not None and needed > self._k.shape[1] and self.length:
            seen.append(("kv", self.length, needed))
        kv_grow(self, needed)

    def rows(self, end):
        if self._data is not None and end > self._data.shape[0] and self.length:
            seen.append(("rows", self.length, end))
        rows_grow(self, end)

    monkeypatch.setattr(cache_module.KVCache, "_grow", kv)
    monkeypatch.setattr(mla_module._Rows, "_grow", rows)
    return seen


@pytest.mark.parametrize("tiny_model", ["demo_int4", "deepseek_v3"])
def test_no_cache_grows_mid_decode(tiny_model, tmp_path_factory, grown):
    path = tiny_models.model_dir(tiny_model, tmp_path_factory)
    with colibri_core.load(path, history=False) as model:
        prompt = [(5 + 3 * i) % tiny_models.VOCAB for i in range(70)]  # past the first capacity (64)
        reply = model.generate(token_ids=prompt, max_tokens=40, ignore_eos=True)
        assert len(reply.token_ids) == 40
        assert grown == [], f"caches grew mid-sequence (kind, positions held, needed): {grown[:4]}"
        with Scheduler(model, slots=2) as sched:
            handle = sched.submit(Request(prompt, 40))
            assert handle.wait(120) and handle.finish_reason == "length", handle.error
        assert grown == [], f"caches grew mid-sequence in the batched engine: {grown[:4]}"


def test_the_reservation_is_bounded_by_the_context_and_the_reserve_ahead():
    from colibri_core.compute.reference import ReferenceBackend

    kv = cache_module.KVCache(ReferenceBackend(), 2, 4, 4, max_len=100)
    kv.reserve(10_000)
    assert kv._k.shape[1] == 100  # never past the context
    k = np.ones((3, 2, 4), np.float32)
    keys, _ = kv.append(k, k)
    assert keys.shape == (2, 3, 4) and kv._k.shape[1] == 100
    assert RESERVE_AHEAD >= 256  # a usual reply fits
