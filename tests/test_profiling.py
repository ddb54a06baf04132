"""Where a turn's time goes (colibri_core.engine.profiling, colibri_core.nn.stages): the
scheduler's per-request accounts against the store's own counters, shares of batched
steps adding up to the step, the last 30 turns kept, and the clock changing no number.
The profiling page that draws them: plugins/colibri-serve/tests/test_serve_profile_page.py."""

import numpy as np
import pytest

import colibri_core
from colibri_core.engine.profiling import PHASES
from colibri_core.engine.scheduler import Request, Scheduler
from colibri_core.engine.sampling import SamplingParams
from colibri_core.nn.stages import STAGES, StageClock
from colibri_core.testing.tiny_models import DEMO, model_dir, prompts

GREEDY = SamplingParams(temperature=0)


@pytest.fixture(scope="module")
def streamed(tmp_path_factory):
    """The int4 demo model with one expert slot per layer: lookups miss and are read."""
    path = model_dir("demo_int4", tmp_path_factory)
    with colibri_core.load(path, ram=DEMO.default_budget(path), cap=1, history=False) as model:
        yield model


def counters(model) -> tuple[int, int, int, int]:
    s = model.store.stats
    lookups = s.hits_device + s.hits_pinned + s.hits_lru + s.hits_prefetched + s.misses
    return lookups, s.misses, sum(d.bytes_read for d in model.store.disk.drives), s.read_wait_ns


def test_a_turn_accounts_for_its_lookups_reads_and_waits_exactly(streamed):
    before = counters(streamed)
    with Scheduler(streamed, slots=1).start() as sched:
        handle = sched.submit(Request(prompts(1, seed=3)[0], max_tokens=9, sampling=GREEDY, tokenize_s=0.25))
        handle.wait()
        turns = sched.profiler.turns()
    lookups, misses, read, waited = (b - a for a, b in zip(before, counters(streamed)))
    (turn,) = turns
    assert list(turn["seconds"]) == list(PHASES) and list(turn["prefill_stages"]) == list(STAGES)
    assert turn["lookups"] == lookups > 0 and turn["misses"] == misses > 0 and turn["bytes_read"] == read > 0
    assert turn["hits"]["ram"] + turn["hits"]["prefetched"] + turn["hits"]["device"] + misses == lookups
    assert turn["hit_rate"] == pytest.approx(1 - misses / lookups)
    # the time blocked on reads is moved out of the routed experts' whole, nothing lost or doubled
    assert turn["seconds"]["expert_reads"] + turn["prefill_stages"]["expert_reads"] == pytest.approx(waited / 1e9, abs=1e-9)
    assert turn["seconds"]["tokenize"] == 0.25  # the caller's, as given
    assert turn["completion_tokens"] == len(handle.token_ids) and turn["steps"] == len(handle.token_ids) - 1
    for name in ("prefill", "attention", "routers", "routed_experts", "lm_head", "sampling", "detokenize"):
        assert turn["seconds"][name] > 0, name
    assert turn["seconds"]["prefill"] >= sum(turn["prefill_stages"].values())
    assert turn["seconds"]["dense_mlp"] == turn["seconds"]["drafting"] == 0  # every layer is MoE; no drafts
    engine = sum(v for k, v in turn["seconds"].items() if k != "tokenize")
    assert 0 < engine <= turn["wall_s"] and turn["queued_s"] >= 0 and 0 < turn["ttft_s"] <= turn["wall_s"]


def test_batched_steps_are_shared_by_the_tokens_each_request_brought(streamed):
    before = counters(streamed)
    with Scheduler(streamed, slots=3).start() as sched:
        handles = [sched.submit(Request(p, max_tokens=6 + 3 * i, sampling=GREEDY)) for i, p in
                   enumerate(prompts(3, seed=5))]
        for h in handles:
            h.wait()
        turns = sched.profiler.turns()
    lookups, misses, read, waited = (b - a for a, b in zip(before, counters(streamed)))
    assert len(turns) == 3
    assert abs(sum(t["lookups"] for t in turns) - lookups) <= 2  # each share rounded
    assert abs(sum(t["bytes_read"] for t in turns) - read) <= 2
    reads = sum(t["seconds"]["expert_reads"] + t["prefill_stages"]["expert_reads"] for t in turns)
    assert reads == pytest.approx(waited / 1e9, abs=1e-6)
    assert sorted(t["steps"] for t in turns) == [5, 8, 11]


def test_the_last_thirty_turns_are_kept(streamed):
    with Scheduler(streamed, slots=4).start() as sched:
        for h in [sched.submit(Request([5 + i], max_tokens=1, sampling=GREEDY)) for i in range(33)]:
            h.wait()
        turns = sched.profiler.turns()
    assert [t["id"] for t in turns] == list(range(4, 34))


def test_the_clock_changes_no_number(streamed):
    lm, ops = streamed.lm, streamed.backend
    ids = np.asarray(prompts(1, seed=8)[0])
    plain = lm.forward(ids, lm.new_cache(ops), ops, all_logits=True)
    clock = StageClock()
    timed = lm.forward(ids, lm.new_cache(ops), ops, all_logits=True, clock=clock)
    assert np.array_equal(plain, timed) and min(clock.ns) >= 0 and clock.ns[STAGES.index("routed_experts")] > 0
