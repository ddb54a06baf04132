"""Inkling in the batched serving engine: the short convolutions' states and the KV
caches (bounded ones on sliding layers) are per sequence, so a request's tokens among
others equal its tokens alone and Model.generate's; the conv states and the sliding
windows are snapshotted at chunk boundaries, and prefix reuse gives cold tokens."""

import numpy as np
import pytest

import colibri_core
from colibri_core.engine import generation
from colibri_core.engine.batching import RowInvariantOps
from colibri_core.engine.scheduler import Request, Scheduler
from colibri_core.testing.oracle import OracleCase, oracle_fixture
from colibri_core.testing.oracle_cases import prompt

import test_inkling_oracle as suites
from test_inkling_oracle import inkling

FULL_ONLY = OracleCase(inkling(num_hidden_layers=2, layer_types=["hybrid", "hybrid"], log_scaling_n_floor=2), seed=5)


def run_all(sched, reqs):
    handles = [sched.submit(r) for r in reqs]
    for h in handles:
        assert h.wait(120)
    return handles


FIRST_TURN = list(prompt(13))  # three prefill chunks of 4 and a token


def second_turns(model, monkeypatch, *later: tuple[list[int], int]):
    """A chat's second turn (the first turn's prompt and reply, and 3 more tokens) in a
    scheduler of prefill chunks of 4 that reuses prefixes, and in one that does not; then
    the ``later`` (prompt, max_tokens) requests in each. The second turn resumes at 12 (the
    last chunk boundary in the first turn's prompt) and gives the cold tokens, which are
    Model.generate's; returns the handles of the later requests (reused, cold)."""
    with Scheduler(model, prefill_chunk=4) as sched:
        turn1 = run_all(sched, [Request(FIRST_TURN, 6)])[0]
        second = FIRST_TURN + turn1.token_ids + [9, 8, 7]
        reused = [run_all(sched, [Request(ids, n)])[0] for ids, n in [(second, 8), *later]]
    with Scheduler(model, prefill_chunk=4, prefix_reuse=False) as cold:
        fresh = run_all(cold, [Request(ids, n) for ids, n in [(second, 8), *later]])
    assert reused[0].usage["cached_tokens"] == 12 and fresh[0].usage["cached_tokens"] == 0
    monkeypatch.setattr(generation, "PREFILL_CHUNK", 4)
    expected = model.generate(token_ids=second, max_tokens=8, ignore_eos=True).token_ids
    assert reused[0].token_ids == fresh[0].token_ids == expected
    return reused[1:], fresh[1:]


def test_tokens_among_others_equal_tokens_alone_and_model_generate(tmp_path_factory):
    fx = suites.TestInklingOracle.oracle("hybrid", tmp_path_factory)
    with colibri_core.load(fx.path, history=False) as model:
        ps = [list(prompt(n, step=s)) for n, s in ((9, 5), (3, 7), (14, 3), (6, 11))]
        lengths = [10, 4, 7, 12]
        expected = [model.generate(token_ids=p, max_tokens=n, ignore_eos=True).token_ids for p, n in zip(ps, lengths)]
        with Scheduler(model, slots=4) as busy:
            handles = run_all(busy, [Request(p, n) for p, n in zip(ps, lengths)])
            assert busy.stats()["steps"] < sum(lengths)  # decode steps really carried several sequences
    assert [h.token_ids for h in handles] == expected


def test_a_batched_step_gives_each_row_the_bits_of_a_one_row_step(tmp_path_factory):
    fx = suites.TestInklingOracle.oracle("hybrid", tmp_path_factory)
    with colibri_core.load(fx.path, history=False) as model:
        lm, ops = model.lm, model.backend
        alone, batched = [], []
        for n in (4, 9, 13):
            for caches in (alone, batched):
                cache = lm.new_cache(ops)
                lm.forward(np.asarray(prompt(n)), cache, ops)
                caches.append(cache)
        feed = [(np.asarray([t]), c) for t, c in zip((10, 20, 30), batched)]
        for _ in range(3):
            rows = lm.forward_batch(feed, RowInvariantOps(ops))
            for (ids, _), cache, row in zip(feed, alone, rows):
                assert np.array_equal(lm.forward(ids, cache, ops), row)
            feed = [(np.asarray([int(np.argmax(r))]), c) for r, (_, c) in zip(rows, feed)]


def test_prefix_reuse_resumes_the_conv_states_from_snapshots(tmp_path_factory, monkeypatch):
    root = tmp_path_factory.getbasetemp() / "oracles"
    root.mkdir(exist_ok=True)
    fx = oracle_fixture("InklingServing", "full-only", FULL_ONLY, "InklingForCausalLM", root)
    with colibri_core.load(fx.path, history=False) as model:
        lm, ops = model.lm, model.backend
        assert lm.new_cache(ops).reusable()
        # a prefix copied from a snapshot resumes exactly where a cold prefill would be
        ids = np.asarray(prompt(20))
        source, cold, resumed = lm.new_cache(ops), lm.new_cache(ops), lm.new_cache(ops)
        lm.forward(ids[:12], source, ops)
        snapshot = source.snapshot()
        lm.forward(ids[12:16], source, ops)  # the source moves on: its conv states are replaced
        source.copy_prefix(resumed, 12, snapshot)
        lm.forward(ids[:12], cold, ops)
        assert np.array_equal(lm.forward(ids[12:], resumed, ops, all_logits=True),
                              lm.forward(ids[12:], cold, ops, all_logits=True))
        second_turns(model, monkeypatch)


def test_prefix_reuse_resumes_the_sliding_windows_from_snapshots(tmp_path_factory, monkeypatch):
    """Sliding layers (window 5) drop the positions before their window: a prefix resumes
    from the window kept at a chunk boundary, and gives a cold prefill's bits and tokens."""
    fx = suites.TestInklingOracle.oracle("hybrid", tmp_path_factory)
    with colibri_core.load(fx.path, history=False) as model:
        lm, ops = model.lm, model.backend
        assert lm.new_cache(ops).reusable()
        ids = np.asarray(prompt(24))
        source, cold, resumed = lm.new_cache(ops), lm.new_cache(ops), lm.new_cache(ops)
        for a in range(0, 12, 4):
            lm.forward(ids[a : a + 4], source, ops)
            lm.forward(ids[a : a + 4], cold, ops)
        snapshot = source.snapshot()
        lm.forward(ids[12:20], source, ops)  # the source moves on: its windows slide past position 12
        source.copy_prefix(resumed, 12, snapshot)
        assert np.array_equal(lm.forward(ids[12:], resumed, ops, all_logits=True),
                              lm.forward(ids[12:], cold, ops, all_logits=True))
        branch = FIRST_TURN[:10] + [3, 4, 5, 6]  # resumes at 8: the latest snapshot kept at or before 10
        [turn3], [cold3] = second_turns(model, monkeypatch, (branch, 5))
    assert turn3.usage["cached_tokens"] == 8
    assert turn3.token_ids == cold3.token_ids


def test_a_sliding_snapshot_refuses_another_length(tmp_path_factory):
    from colibri_core.nn.cache import SlidingKVCache

    fx = suites.TestInklingOracle.oracle("hybrid", tmp_path_factory)
    with colibri_core.load(fx.path, history=False) as model:
        ops = model.backend
        a, b = SlidingKVCache(ops, 1, 4, 4, 5), SlidingKVCache(ops, 1, 4, 4, 5)
        rows = np.ones((6, 1, 4), dtype=np.float32)
        a.append(rows, rows)
        snap = a.snapshot()
        assert snap["k"].shape[1] == 4  # the window's last 4 positions, not the 6 seen
        with pytest.raises(ValueError, match="taken at 6 positions, not 4"):
            a.copy_prefix(b, 4, snap)
        with pytest.raises(ValueError, match="holds 6 positions, not 4"):
            a.copy_prefix(b, 4)
