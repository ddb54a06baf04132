"""The batched engine (colibri_core.engine.scheduler) on the CPU: the kernels compute rows
independently up to the rows they claim; a step's experts are fetched once; slots, queue
and KV budget are bounded; stopping, stop ids and errors free what they held.

That a request's tokens never depend on the batch and equal Model.generate's, prefix
reuse and cancellation are checked on every installed backend by the conformance kit's
engine checks (colibri_core.testing.backend_kit; tests/test_backend_conformance*.py)."""

import threading

import numpy as np
import pytest

import colibri_core
from colibri_core.engine.batching import RowInvariantOps
from colibri_core.engine.scheduler import QueueFull, Request, Scheduler
from colibri_core.errors import UsageError
from colibri_core.testing.tiny_models import DEMO, VOCAB, model_dir, prompts


@pytest.mark.parametrize("kind", ["q8", "q4", "mxfp4", "fp8", "bf16", "q4g32", "mxfp4pair"])
@pytest.mark.parametrize("k", [256, 1040])
def test_cpu_kernels_compute_rows_independently_up_to_the_rows_they_claim(kind, k):
    """What ``batch_invariant_rows`` promises, measured: every row of an M-row product
    equals that row alone, for every M up to the claim. K = 1040: kernels that split K
    into chunks by the number of rows split it more than once, and a partial last group."""
    from colibri_core.compute.cpu.backend import CpuBackend
    from colibri_core.testing.backend_kit import pack

    be = CpuBackend()
    if be.kernels is None:
        pytest.skip("the compiled CPU kernels are not built")
    rng = np.random.default_rng(0)
    w = pack(kind, rng.standard_normal((96, k)).astype(np.float32))
    claim = be.batch_invariant_rows("linear", [w])
    assert claim >= 8
    x = rng.standard_normal((claim, k)).astype(np.float32)
    alone = np.concatenate([be.linear(x[i : i + 1], w) for i in range(claim)])
    for m in sorted({2, 3, 4, 5, 8, 9, claim}):  # every size the kernels treat apart (1-4, 5-8, past 8)
        assert np.array_equal(be.linear(x[:m], w), alone[:m]), f"{m} rows"
    router = rng.standard_normal((16, k)).astype(np.float32)
    rows = be.batch_invariant_rows("router", [router])
    one = [be.softmax_top_k(x[i : i + 1], router, 4, True) for i in range(rows)]
    many = be.softmax_top_k(x[:rows], router, 4, True)
    assert np.array_equal(many[1], np.concatenate([o[1] for o in one]))
    assert be.batch_invariant_rows("linear", [rng.standard_normal((8, 8)).astype(np.float32)]) == 1  # BLAS: no promise


def test_a_multi_sequence_step_fetches_each_distinct_expert_once(tmp_path_factory):
    path = model_dir("demo_int4", tmp_path_factory)
    with colibri_core.load(path, ram=DEMO.default_budget(path), history=False) as model:
        lm, ops, store = model.lm, model.backend, model.store
        caches = []
        for p in prompts(8, seed=4):
            caches.append(lm.new_cache(ops))
            lm.forward(np.asarray(p), caches[-1], ops)
        s = store.stats
        lookups = lambda: s.hits_device + s.hits_pinned + s.hits_lru + s.hits_prefetched + s.misses  # noqa: E731
        before, routing = lookups(), []
        lm.forward_batch([(np.asarray([t]), c) for t, c in zip(range(20, 28), caches)], RowInvariantOps(ops), routing=routing)
        distinct = sum(len(np.unique(ids)) for _, ids in routing)
        routed = sum(ids.size for _, ids in routing)
        assert len(routing) == DEMO.num_hidden_layers and all(ids.shape == (8, 2) for _, ids in routing)
        assert lookups() - before == distinct < routed  # 16 choices among 8 experts: some shared


def test_queue_full_and_bad_requests_are_refused_at_submit(tmp_path_factory):
    path = model_dir("olmoe", tmp_path_factory)
    with colibri_core.load(path, history=False) as model:
        sched = Scheduler(model, slots=1, max_queue=2)  # not started: requests wait
        sched.submit(Request([1, 2], 4))  # takes the free slot at the next step
        sched.submit(Request([1, 2], 4))
        sched.submit(Request([1, 2], 4))
        with pytest.raises(QueueFull, match=r"every slot is taken and 2 requests wait for one \(max_queue 2\)"):
            sched.submit(Request([1, 2], 4))
        with pytest.raises(UsageError, match="context holds 128"):
            sched.submit(Request([1] * 128, 4))
        with pytest.raises(UsageError, match="empty"):
            sched.submit(Request([], 4))
        with pytest.raises(UsageError, match="outside the vocabulary"):
            sched.submit(Request([VOCAB + 3], 4))
        assert sched.stats()["queue_depth"] == 3
        queued = sched._waiting[-1]
        queued.cancel()  # a cancelled request leaves the queue at the next step
        sched.step()
        assert queued.done and queued.finish_reason == "cancelled"
        sched.submit(Request([1, 2], 4))  # its place is free again
        sched.stop()


def test_max_queue_0_runs_a_request_that_finds_a_free_slot_and_refuses_one_that_would_wait(tmp_path_factory):
    path = model_dir("olmoe", tmp_path_factory)
    with colibri_core.load(path, history=False) as model:
        sched = Scheduler(model, slots=2, max_queue=0)  # not started: the steps run below
        first = sched.submit(Request([1, 2], 4))  # idle: both slots are free
        second = sched.submit(Request([3, 4], 4))  # the second slot is still free
        with pytest.raises(QueueFull, match=r"every slot is taken and 0 requests wait for one \(max_queue 0\)"):
            sched.submit(Request([5, 6], 4))
        sched.step()
        assert sched.stats()["active"] == 2
        with pytest.raises(QueueFull):
            sched.submit(Request([5, 6], 4))
        while sched.step():
            pass
        assert first.finish_reason == second.finish_reason == "length"
        third = sched.submit(Request([5, 6], 4))  # the slots are free again
        while sched.step():
            pass
        assert third.finish_reason == "length" and len(third.token_ids) == 4
        sched.stop()


def test_kv_budget_queues_what_does_not_fit_and_refuses_what_never_will(tmp_path_factory):
    path = model_dir("olmoe", tmp_path_factory)
    with colibri_core.load(path, history=False) as model:
        probe = Scheduler(model)
        one = probe._reservation(30)  # one request of 10 + 20 tokens
        sched = Scheduler(model, slots=4, kv_budget=one + one // 2, prefix_reuse=False)
        handles = [sched.submit(Request(list(range(1 + i, 11 + i)), 20)) for i in range(3)]
        with pytest.raises(UsageError, match="KV budget"):
            sched.submit(Request(list(range(1, 41)), 20))
        most = 0
        while sched.step():
            most = max(most, sched.stats()["active"])
            assert sched.stats()["kv_reserved_bytes"] <= sched.kv.budget
        assert most == 1  # room for one at a time: the others queued, then ran
        assert all(h.done and len(h.token_ids) == 20 for h in handles)
        assert sched.stats()["kv_reserved_bytes"] == 0


def test_the_engine_survives_a_request_that_errors(tmp_path_factory):
    path = model_dir("olmoe", tmp_path_factory)
    with colibri_core.load(path, history=False) as model:
        expected = model.generate(token_ids=[4, 5, 6], max_tokens=6, ignore_eos=True).token_ids

        def explode(event):
            if event is not None:
                raise RuntimeError("client callback failed")

        with Scheduler(model, slots=4) as sched:
            bad = sched.submit(Request([1, 2, 3], 6), on_event=explode)
            good = sched.submit(Request([4, 5, 6], 6))
            assert bad.wait(60) and good.wait(60)
            assert bad.finish_reason == "error" and "client callback" in str(bad.error)
            assert good.finish_reason == "length" and good.token_ids == expected
            after = sched.submit(Request([4, 5, 6], 6))
            assert after.wait(60) and after.token_ids == expected


def test_stop_ids_end_a_request_and_events_stream_in_order(tmp_path_factory):
    path = model_dir("olmoe", tmp_path_factory)
    with colibri_core.load(path, history=False) as model:
        free = model.generate(token_ids=[7, 8, 9], max_tokens=8, ignore_eos=True).token_ids
        with Scheduler(model) as sched:
            h = sched.submit(Request([7, 8, 9], 8, stop_ids=frozenset({free[3]})))
            events = list(h)
        cut = free.index(free[3])
        assert [e.token_id for e in events] == free[:cut] == h.token_ids
        assert h.finish_reason == "stop" and h.done and h.usage["completion_tokens"] == cut


def test_stop_cancels_running_and_queued_requests(tmp_path_factory):
    path = model_dir("olmoe", tmp_path_factory)
    with colibri_core.load(path, history=False) as model:
        sched = Scheduler(model, slots=1).start()
        started = threading.Event()
        running = sched.submit(Request([1, 2], 120), on_event=lambda e: started.set())
        waiting = sched.submit(Request([3, 4], 5))
        assert started.wait(60)
        sched.stop()
        assert running.finish_reason == "cancelled" and waiting.finish_reason == "cancelled"
        with pytest.raises(UsageError, match="stopped"):
            sched.submit(Request([1], 1))
