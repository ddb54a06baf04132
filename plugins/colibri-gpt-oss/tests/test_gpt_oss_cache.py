"""The sliding layers' KV cache is bounded by the window, at run time and in ``colibri plan``."""

import json

import numpy as np

import colibri_core as colibri
from colibri_core.testing.cli import run_colibri

import test_gpt_oss_oracle as suites

CASE = "full_first_mha"  # layer 0 full, layers 1 and 2 sliding (window 6), 4 KV heads of 12


def test_sliding_layers_hold_at_most_the_window_while_decoding(tmp_path_factory):
    fx = suites.TestGptOssOracle.oracle(CASE, tmp_path_factory)
    window, per_token = 6, 4 * (12 + 12) * 4  # float32 keys and values
    with colibri.load(fx.path, history=False) as model:
        lm, ops = model.lm, model.backend
        cache = lm.new_cache(ops)
        ids = fx.prompt + fx.tokens
        lm.forward(np.asarray(ids[:4]), cache, ops)
        for token in ids[4:]:
            lm.forward(np.asarray([token]), cache, ops)
        assert cache.length == len(ids) > 3 * window
        full, *sliding = cache.layers
        assert full.nbytes >= len(ids) * per_token
        for layer in sliding:
            assert 0 < layer.nbytes <= window * per_token  # window - 1 kept + the new position
        assert cache.bytes_for(100) == 100 * per_token + 2 * window * per_token


def test_plan_counts_the_window_not_the_context(tmp_path_factory):
    fx = suites.TestGptOssOracle.oracle(CASE, tmp_path_factory)
    window, per_token = 6, 4 * (12 + 12) * 4
    out = run_colibri("plan", "--model", fx.path, "--context", "100", "--disk-bw", "1G", "--json")
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert data["kv_bytes_at_context"] == 100 * per_token + 2 * window * per_token


def test_batched_requests_give_the_tokens_of_generate(tmp_path_factory):
    """Several sequences in one batched step (sliding caches, the biased experts through
    the batch-invariant path) give each one's own greedy tokens."""
    from colibri_core.engine.scheduler import Request, Scheduler

    fx = suites.TestGptOssOracle.oracle("yarn_gqa_clamped", tmp_path_factory)
    prompts = [fx.prompt, fx.prompt[:5] + [1, 2, 3, 4, 5, 6], [9, 8, 7]]
    with colibri.load(fx.path, history=False) as model:
        alone = [model.generate(token_ids=p, max_tokens=12, ignore_eos=True).token_ids for p in prompts]
        assert alone[0] == fx.tokens[:12]
        with Scheduler(model, slots=3) as sched:
            handles = [sched.submit(Request(prompt_ids=p, max_tokens=12)) for p in prompts]
            for h in handles:
                h.wait(300)
            assert [h.token_ids for h in handles] == alone


def test_prefix_reuse_resumes_the_sliding_layers_and_gives_cold_tokens(tmp_path_factory, monkeypatch):
    """A next chat turn reuses the whole prefill chunks of the first (the sliding layers
    from the window kept at the chunk boundary), with a cold prefill's tokens."""
    from colibri_core.engine import generation
    from colibri_core.engine.scheduler import Request, Scheduler

    fx = suites.TestGptOssOracle.oracle(CASE, tmp_path_factory)
    first = [(3 + 7 * i) % 50 for i in range(17)]  # past the window (6) of the sliding layers
    with colibri.load(fx.path, history=False) as model:
        with Scheduler(model, prefill_chunk=4) as sched:
            turn1 = sched.submit(Request(prompt_ids=first, max_tokens=5))
            assert turn1.wait(300)
            second = first + turn1.token_ids + [9, 8, 7]
            turn2 = sched.submit(Request(prompt_ids=second, max_tokens=8))
            assert turn2.wait(300)
            assert turn2.usage["cached_tokens"] == 16
        monkeypatch.setattr(generation, "PREFILL_CHUNK", 4)
        expected = model.generate(token_ids=second, max_tokens=8, ignore_eos=True).token_ids
    assert turn2.token_ids == expected
