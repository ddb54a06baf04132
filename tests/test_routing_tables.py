"""benchmarks/routing_tables.py on colibri-trained's OLMoE-geometry model, a tiny workload:
the recorder's per-layer prefetch counts agree with the store's own, every lookup is a
hit or a miss, a plain LRU reads a miss's bytes and nothing else, and a learned history
pins exactly its hottest experts (an LRU run pins none)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"
TOKENS = 24  # test tokens: one window of one-row decode steps


@pytest.fixture(scope="module")
def rt():
    spec = importlib.util.spec_from_file_location("bench_routing_tables", BENCH / "routing_tables.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def halves(rt, trained_olmoe):
    import colibri_core

    with colibri_core.load(trained_olmoe, history=False) as model:
        return rt.split_heldout(model, trained_olmoe, ["python", "prose"])


def test_spread_windows_are_disjoint_and_sized(rt):
    ids = list(range(1000))
    wins = rt.spread_windows(ids, 300, 64)
    assert [len(w) for w in wins] == [64, 64, 64, 64, 44]
    starts = [w[0] for w in wins]
    assert starts == sorted(starts) and all(b - a >= 64 for a, b in zip(starts, starts[1:]))
    with pytest.raises(SystemExit):
        rt.spread_windows(ids[:100], 300, 64)


def test_prefetch_counts_per_layer_match_the_store(rt, trained_olmoe, halves):
    learn, test = halves["python"]
    assert learn and test and len(learn) + 1 >= len(test) >= len(learn)  # halves of one text
    r = rt.measure_prefetch(trained_olmoe, [test[:TOKENS]], free_prompts=[test[:8]], free_tokens=4)
    layers = r["layers"]
    assert len(layers) == 16 and r["steps"] == TOKENS
    assert layers[0]["predicted"] == 0  # the first MoE layer has no predictor
    for layer in layers[1:]:
        assert layer["steps"] == TOKENS
        assert layer["predicted"] == layer["used"] == 8 * TOKENS  # top-8 named, top-8 used, one row
        assert 0 <= layer["predicted_used"] <= layer["predicted"]
        assert 0.0 <= layer["precision"] <= 1.0 and layer["precision"] == layer["recall"]
    # the recorder scores as the store does: its sums are the store's own counters
    assert r["store_counters"] == {k: sum(x[k] for x in layers) for k in ("predicted", "predicted_used", "used")}
    assert 0.0 < r["precision"] <= 1.0
    assert r["layer_min"]["precision"] <= r["layer_mean_precision"] <= r["layer_max"]["precision"]
    slots = r["by_slots"]
    assert slots[-1]["precision"] == pytest.approx(r["precision"]) and slots[-1]["recall"] == pytest.approx(r["recall"])
    assert all(a["recall"] <= b["recall"] for a, b in zip(slots, slots[1:]))  # reading more covers more
    free = r["free_decode"]
    assert 0.0 <= free["precision"] <= 1.0 and free["tokens"] == 4


def test_history_pins_its_hottest_experts_and_lru_pins_none(rt, trained_olmoe, halves, tmp_path):
    learn, test = halves["python"]
    copy = rt.learn_history(trained_olmoe, learn[:128], tmp_path / "python", window=64)
    saved = json.loads((copy / "colibri-usage.json").read_text())
    assert saved["tokens"] == 128
    counts = np.asarray(saved["counts"])
    assert counts.sum() == 128 * 16 * 8  # every token routed to top-8 in each of 16 layers
    assert not (trained_olmoe / "colibri-usage.json").exists()  # the installed model was not written to

    windows = [test[:TOKENS]]
    lru = rt.store_run(trained_olmoe, windows, cap=16, history=False)
    pinned = rt.store_run(copy, windows, cap=16, history=True, repin=False)
    for r in (lru, pinned):
        assert r["lookups"] == TOKENS * 16 * 8
        assert r["hits"] + r["misses"] == r["lookups"] and r["hits_prefetched"] == 0  # prefetch off
        assert 0.0 <= r["hit_rate"] <= 1.0
    # plain LRU: no pins, the whole cap is LRU slots, and every miss reads one expert
    assert lru["pinned_at_load"] == [] and lru["pinned_load_bytes"] == 0 and lru["lru_slots"] == 16
    assert lru["bytes_read"] == lru["misses"] * lru["expert_bytes"]
    # the history: half the budget pinned at load, the hottest of the saved counts
    assert pinned["pinned_capacity"] == 16 * 16 // 2 and pinned["lru_slots"] == 8
    order = np.lexsort((np.arange(counts.size), -counts.ravel()))[: pinned["pinned_capacity"]]
    hottest = sorted([list(divmod(int(i), counts.shape[1])) for i in order])
    assert pinned["pinned_at_load"] == hottest
    assert pinned["pinned_load_bytes"] == len(hottest) * pinned["expert_bytes"]
    assert pinned["repins"] == 0 and pinned["bytes_read"] == pinned["misses"] * pinned["expert_bytes"]
    assert pinned["hits_pinned"] > 0 and lru["hits_pinned"] == 0
