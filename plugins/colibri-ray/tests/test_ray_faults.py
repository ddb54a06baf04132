"""The ``ray`` tier under faults, in the batched engine, and its guards: a worker killed
mid-generation (its experts computed here from the local disk, one warning, the tokens
unchanged, the fallback reads counted), a worker that comes back (it rejoins), workers
that answer too late, requests from anyone but the coordinator, the placement."""

import time
import warnings

import numpy as np
import pytest

import colibri_core
from colibri_core.testing.oracle import OracleCase, oracle_fixture
from colibri_core.warn import ColibriWarning
from colibri_ray.worker import shard_fingerprints

TOKENS = 12


def _olmoe():
    from transformers import OlmoeConfig

    return OlmoeConfig(vocab_size=128, eos_token_id=None, hidden_size=32, intermediate_size=16, num_hidden_layers=3,
                       num_attention_heads=4, num_key_value_heads=2, num_experts=16, num_experts_per_tok=4,
                       max_position_embeddings=128, initializer_range=0.1)


@pytest.fixture(scope="module")
def fx(tmp_path_factory):
    root = tmp_path_factory.mktemp("ray-faults")
    return oracle_fixture("RayFaults", "olmoe", OracleCase(_olmoe, new_tokens=TOKENS), "OlmoeForCausalLM", root)


@pytest.fixture(scope="module")
def local(fx):
    with colibri_core.load(fx.path, history=False) as model:
        return model.generate(token_ids=fx.prompt, max_tokens=TOKENS, ignore_eos=True, return_logits=True)


def _same(result, local):
    assert result.token_ids == local.token_ids
    for a, b in zip(result.logits, local.logits):
        assert np.array_equal(a, b)


def _stream(model, fx, at=None, action=None):
    generation = model.stream(token_ids=fx.prompt, max_tokens=TOKENS, ignore_eos=True, return_logits=True)
    for n, _ in enumerate(generation):
        if n == at:
            action()
    return generation.result()


def _colibri_warnings(caught):
    return [str(w.message) for w in caught if issubclass(w.category, ColibriWarning)]


def test_a_worker_killed_mid_generation_changes_no_token(ray_cluster, fx, local):
    ray = ray_cluster
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with colibri_core.load(fx.path, history=False, cap=1, compute="ray",
                               compute_options={"workers": 2, "timeout": 20.0, "retry": 1e9}) as model:
            tier = model.store.compute
            result = _stream(model, fx, at=3, action=lambda: ray.kill(tier.workers[0].actor, no_restart=True))
    _same(result, local)
    messages = _colibri_warnings(caught)
    assert len(messages) == 1 and "worker 0" in messages[0], messages
    c = result.stats.compute
    assert c["fallback_experts"] > 0 and c["fallback_requests"] > 0
    assert c["fallback_reads"] > 0 and c["fallback_bytes_read"] > 0  # the coordinator's own disk served them
    w0, w1 = c["workers"]["worker-0"], c["workers"]["worker-1"]
    assert w0["alive"] is False and w0["failures"] == 1 and w0["experts"] > 0  # it served until it died
    assert w1["alive"] is True and w1["failures"] == 0 and w1["experts"] > 0


def test_a_restarted_worker_rejoins(ray_cluster, fx, local):
    ray = ray_cluster
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with colibri_core.load(fx.path, history=False, compute="ray",
                               compute_options={"workers": 2, "timeout": 20.0, "retry": 0.0}) as model:
            tier = model.store.compute
            actor = tier.workers[0].actor
            first = _stream(model, fx, at=2, action=lambda: ray.kill(actor, no_restart=False))
            later = []
            deadline = time.monotonic() + 60
            while not tier.workers[0].alive and time.monotonic() < deadline:  # pinged beside the generation
                later.append(_stream(model, fx))
                time.sleep(0.1)
            after = _stream(model, fx)
    for result in [first, *later, after]:
        _same(result, local)
    assert len(_colibri_warnings(caught)) == 1
    assert first.stats.compute["fallback_experts"] > 0
    assert sum(r.stats.compute["workers"]["worker-0"]["rejoins"] for r in [first, *later]) == 1
    w0 = after.stats.compute["workers"]["worker-0"]
    assert w0["alive"] is True and w0["experts"] > 0 and after.stats.compute["fallback_experts"] == 0


def test_workers_answering_too_late_are_covered_here(ray_cluster, fx, local):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with colibri_core.load(fx.path, history=False, compute="ray",
                               compute_options={"workers": 2, "timeout": 1e-9, "retry": 1e9}) as model:
            result = _stream(model, fx)
    _same(result, local)
    messages = _colibri_warnings(caught)
    assert len(messages) == 2 and all("no answer within" in m for m in messages), messages
    c = result.stats.compute
    assert sum(w["timeouts"] for w in c["workers"].values()) == 2
    assert c["fallback_experts"] > 0


def test_batched_engine_through_the_ray_tier(pools, fx):
    from colibri_core.engine.scheduler import Request, Scheduler

    prompts = [fx.prompt, fx.prompt[:3] + [9, 8], [70, 71, 72, 73, 74, 75]]
    with colibri_core.load(fx.path, history=False) as model:
        alone = [model.generate(token_ids=p, max_tokens=8, ignore_eos=True).token_ids for p in prompts]
    with colibri_core.load(fx.path, history=False, compute="ray", compute_options={"pool": pools[3]}) as model:
        with Scheduler(model, slots=4) as sched:
            handles = [sched.submit(Request(prompt_ids=list(p), max_tokens=8)) for p in prompts]
            for h in handles:
                assert h.wait(120)
            stats = sched.stats()
    assert [h.token_ids for h in handles] == alone
    assert stats["compute"]["fallback_experts"] == 0 and stats["compute"]["requests"] > 0


def test_workers_take_work_only_from_their_coordinator(ray_cluster, pools, fx):
    ray = ray_cluster
    actor = pools[2].actors[0]
    with pytest.raises(ray.exceptions.RayTaskError, match="only from its coordinator"):
        ray.get(actor.info.remote("a guessed token"))
    with colibri_core.load(fx.path, history=False, compute="ray", compute_options={"pool": pools[2]}) as model:
        model.generate(token_ids=fx.prompt, max_tokens=2, ignore_eos=True)
        token = model.store.compute._token
        x, ids = np.zeros((1, 32), np.float32), np.array([0], np.int64)
        offsets, rows = np.array([0, 1], np.int64), np.array([0], np.int64)
        with pytest.raises(ray.exceptions.RayTaskError, match="only from its coordinator"):
            ray.get(actor.compute.remote("x" * 64, 10**9, 0, x, ids, offsets, rows, False))
        with pytest.raises(ray.exceptions.RayTaskError, match="already answered"):  # no request answered twice
            ray.get(actor.compute.remote(token, 1, 0, x, ids, offsets, rows, False))
        with pytest.raises(ray.exceptions.RayTaskError, match="numpy arrays"):
            ray.get(actor.compute.remote(token, 10**9, 0, [[0.0] * 32], ids, offsets, rows, False))
        request, out, _ = ray.get(actor.compute.remote(token, 10**9 + 1, 0, x, ids, offsets, rows, False))
        assert request == 10**9 + 1 and out.shape == (1, 32) and out.dtype == np.float32
    # a machine holding another checkpoint at the path: refused when the worker opens it
    other = {name: (size + 1, digest) for name, (size, digest) in
             shard_fingerprints(sorted(fx.path.glob("*.safetensors"))).items()}
    with pytest.raises(ray.exceptions.RayTaskError, match="differs from the coordinator's"):
        ray.get(actor.open.remote(pools[2].token, str(fx.path), "cpu", None, other))


def test_rendezvous_placement_is_deterministic_weighted_and_stable():
    from colibri_ray.placement import assign

    workers = [("worker-0", 1.0), ("worker-1", 3.0)]
    owners = assign([1000, 1000], workers)
    assert owners == assign([1000, 1000], workers)
    share = sum(o == 1 for row in owners for o in row) / 2000
    assert 0.70 < share < 0.80  # 3/4 of the experts to the worker with 3x the RAM
    three = assign([1000, 1000], workers + [("worker-2", 2.0)])
    moved = [(a, b) for ra, rb in zip(owners, three) for a, b in zip(ra, rb) if a != b]
    assert moved and all(b == 2 for _, b in moved)  # a new worker takes experts only for itself
