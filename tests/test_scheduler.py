"""The batched engine (colibri_core.engine.scheduler): a request's tokens never depend on
what else is in the batch, and equal Model.generate's; prefix reuse gives a cold
prefill's tokens while skipping the prefix; a step's experts are fetched once; slots,
queue and KV budget are bounded; cancellation and errors free what they held."""

import threading

import numpy as np
import pytest

import colibri_core
from colibri_core.cli.convert import convert
from colibri_core.cli.demo import DemoSpec, ensure_demo_model
from colibri_core.engine import generation
from colibri_core.engine.batching import RowInvariantOps
from colibri_core.engine.sampling import SamplingParams
from colibri_core.engine.scheduler import QueueFull, Request, Scheduler
from colibri_core.errors import UsageError

VOCAB = 128
DEMO = DemoSpec(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_experts=8, num_experts_per_tok=2,
                intermediate_size=32, tokenizer_vocab=300, shard_bytes=60_000, cached_experts_per_layer=2)


def _olmoe():
    from transformers import OlmoeConfig

    return "OlmoeForCausalLM", OlmoeConfig(vocab_size=VOCAB, eos_token_id=None, hidden_size=32, intermediate_size=16,
                                           num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, num_experts=8,
                                           num_experts_per_tok=2, max_position_embeddings=128, initializer_range=0.1)


DEEPSEEK = dict(vocab_size=VOCAB, eos_token_id=None, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
                num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, num_experts_per_tok=2,
                n_shared_experts=1, n_group=2, topk_group=1, first_k_dense_replace=1, routed_scaling_factor=2.5,
                kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=12,
                max_position_embeddings=128, initializer_range=0.1)


def _deepseek_v3():  # MLA
    from transformers import DeepseekV3Config

    return "DeepseekV3ForCausalLM", DeepseekV3Config(**DEEPSEEK)


def _deepseek_v32():  # MLA + the DSA indexer (4 keys chosen: sparse from the fifth position)
    from transformers import DeepseekV32Config

    return "DeepseekV32ForCausalLM", DeepseekV32Config(**DEEPSEEK, index_n_heads=16, index_head_dim=16, index_topk=4)


def _qwen3_next():  # Gated DeltaNet layers and gated full attention
    from transformers import Qwen3NextConfig

    return "Qwen3NextForCausalLM", Qwen3NextConfig(
        vocab_size=VOCAB, eos_token_id=None, hidden_size=32, num_attention_heads=4, num_key_value_heads=2, num_experts=8,
        num_experts_per_tok=2, moe_intermediate_size=16, max_position_embeddings=256, initializer_range=0.1, head_dim=16,
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=16,
        shared_expert_intermediate_size=24, num_hidden_layers=4, intermediate_size=48, mlp_only_layers=[0])


ORACLES = {"olmoe": _olmoe, "deepseek_v3": _deepseek_v3, "deepseek_v32": _deepseek_v32, "qwen3_next": _qwen3_next}
_built: dict = {}


def model_dir(name: str, tmp_path_factory):
    """A tiny float32 model saved by transformers (random weights, perturbed), or the demo
    model converted to int4 experts and int8 dense weights."""
    if name not in _built:
        root = tmp_path_factory.mktemp(name)
        if name == "demo_int4":
            src = ensure_demo_model(root / "bf16", DEMO)
            convert(src, root / "int4", experts="int4", dense="int8")
            _built[name] = root / "int4"
        else:
            import torch
            import transformers

            torch.manual_seed(0)
            cls, config = ORACLES[name]()
            config._attn_implementation = "eager"
            model = getattr(transformers, cls)(config).eval().to(torch.float32)
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(torch.randn_like(p) * 0.05)
            model.save_pretrained(root)
            _built[name] = root
    return _built[name]


def prompts(n=8, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(1, VOCAB, size=int(rng.integers(3, 40))).tolist() for _ in range(n)]


def run_all(sched, reqs, **kw):
    handles = [sched.submit(r, **kw) for r in reqs]
    for h in handles:
        assert h.wait(120)
    return handles


FAMILIES = ["olmoe", "deepseek_v3", "deepseek_v32", "qwen3_next", "demo_int4"]


@pytest.mark.parametrize("name", FAMILIES)
def test_tokens_alone_equal_tokens_among_seven_others_and_model_generate(name, tmp_path_factory):
    path = model_dir(name, tmp_path_factory)
    ram = DEMO.default_budget(path) if name == "demo_int4" else None  # the demo streams its experts
    with colibri_core.load(path, ram=ram, history=False) as model:
        ps = prompts()
        lengths = [12, 5, 20, 9, 16, 3, 14, 7]  # requests end at different steps: the batch changes
        expected = [model.generate(token_ids=p, max_tokens=n, ignore_eos=True).token_ids for p, n in zip(ps, lengths)]
        sampled = SamplingParams(temperature=0.9, top_p=0.9, seed=7)
        with Scheduler(model, slots=8) as alone:
            first = run_all(alone, [Request(ps[0], lengths[0])])[0]
            lone_sampled = run_all(alone, [Request(ps[1], 10, sampled)])[0]
        with Scheduler(model, slots=8) as busy:
            handles = run_all(busy, [Request(p, n) for p, n in zip(ps, lengths)] + [Request(ps[1], 10, sampled)])
            assert busy.stats()["steps"] < sum(lengths)  # decode steps really carried several sequences
    assert first.token_ids == expected[0] == handles[0].token_ids
    assert [h.token_ids for h in handles[:8]] == expected
    assert handles[8].token_ids == lone_sampled.token_ids and len(lone_sampled.token_ids) == 10
    assert all(h.finish_reason == "length" for h in handles)
    assert handles[0].usage == {"prompt_tokens": len(ps[0]), "completion_tokens": 12, "cached_tokens": 0}


@pytest.mark.parametrize("name", FAMILIES)
def test_a_batched_step_gives_each_row_the_bits_of_a_one_row_step(name, tmp_path_factory):
    path = model_dir(name, tmp_path_factory)
    with colibri_core.load(path, history=False) as model:
        lm, ops = model.lm, model.backend
        ps = prompts(8, seed=1)
        alone, batched = [], []
        for p in ps:
            for caches in (alone, batched):
                cache = lm.new_cache(ops)
                lm.forward(np.asarray(p), cache, ops)
                caches.append(cache)
        feed = [(np.asarray([t]), c) for t, c in zip(range(10, 18), batched)]
        for _ in range(3):  # three decode steps, each sequence at its own position
            rows = lm.forward_batch(feed, RowInvariantOps(ops))
            for (ids, _), cache, row in zip(feed, alone, rows):
                one = lm.forward(ids, cache, ops)
                assert np.array_equal(one, row)
            feed = [(np.asarray([int(np.argmax(r))]), c) for r, (_, c) in zip(rows, feed)]


@pytest.mark.parametrize("kind", ["q8", "q4", "mxfp4", "fp8", "bf16", "q4g32", "mxfp4pair"])
@pytest.mark.parametrize("k", [256, 1040])
def test_cpu_kernels_compute_rows_independently_up_to_the_rows_they_claim(kind, k):
    """What ``batch_invariant_rows`` promises, measured: every row of an M-row product
    equals that row alone, for every M up to the claim. K = 1040: kernels that split K
    into chunks by the number of rows split it more than once, and a partial last group."""
    from colibri_core.backends.cpu.backend import CpuBackend
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


@pytest.mark.parametrize("name", ["olmoe", "deepseek_v3", "qwen3_next", "demo_int4"])
def test_prefix_reuse_gives_cold_tokens_and_skips_the_prefix(name, tmp_path_factory, monkeypatch):
    path = model_dir(name, tmp_path_factory)
    with colibri_core.load(path, history=False) as model:
        first = [(3 + 7 * i) % VOCAB for i in range(13)]
        with Scheduler(model, prefill_chunk=4) as sched:
            turn1 = run_all(sched, [Request(first, 6)])[0]
            second = first + turn1.token_ids + [9, 8, 7]  # the next turn of a chat
            before = sched.stats()["prefill_tokens"]
            turn2 = run_all(sched, [Request(second, 8)])[0]
            # whole chunks of the first prompt (13 -> 12) are reused, the rest is prefilled
            assert turn2.usage["cached_tokens"] == 12
            assert sched.stats()["prefill_tokens"] - before == len(second) - 12
            assert sched.stats()["prefix_hits_tokens"] == 12
            branch = first[:10] + [3, 4, 5, 6]  # shares 10 tokens: reuse stops at the boundary 8
            turn3 = run_all(sched, [Request(branch, 5)])[0]
            assert turn3.usage["cached_tokens"] == 8
        with Scheduler(model, prefill_chunk=4, prefix_reuse=False) as cold:
            cold2, cold3 = run_all(cold, [Request(second, 8), Request(branch, 5)])
            assert cold.stats()["prefix_hits_tokens"] == 0 and cold2.usage["cached_tokens"] == 0
        monkeypatch.setattr(generation, "PREFILL_CHUNK", 4)
        expected = model.generate(token_ids=second, max_tokens=8, ignore_eos=True).token_ids
    assert turn2.token_ids == cold2.token_ids == expected
    assert turn3.token_ids == cold3.token_ids


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


def test_cancel_frees_the_slot_for_the_queued_request(tmp_path_factory):
    path = model_dir("olmoe", tmp_path_factory)
    with colibri_core.load(path, history=False) as model:
        with Scheduler(model, slots=1, prefix_reuse=False) as sched:
            seen = []

            def on_event(event):
                seen.append(event)
                if len(seen) == 3:
                    long.cancel()

            long = sched.submit(Request([5, 6, 7], 100), on_event=on_event)
            queued = sched.submit(Request([8, 9], 4))
            assert queued.wait(60) and long.wait(60)
            assert long.finish_reason == "cancelled" and len(long.token_ids) == 3 and seen[-1] is None
            assert queued.finish_reason == "length" and len(queued.token_ids) == 4
            long.cancel()  # idempotent
            stats = sched.stats()
            assert stats["active"] == 0 and stats["kv_reserved_bytes"] == 0 and stats["queue_depth"] == 0


def test_queue_full_and_bad_requests_are_refused_at_submit(tmp_path_factory):
    path = model_dir("olmoe", tmp_path_factory)
    with colibri_core.load(path, history=False) as model:
        sched = Scheduler(model, slots=1, max_queue=2)  # not started: requests wait
        sched.submit(Request([1, 2], 4))
        sched.submit(Request([1, 2], 4))
        with pytest.raises(QueueFull):
            sched.submit(Request([1, 2], 4))
        with pytest.raises(UsageError, match="context holds 128"):
            sched.submit(Request([1] * 128, 4))
        with pytest.raises(UsageError, match="empty"):
            sched.submit(Request([], 4))
        with pytest.raises(UsageError, match="outside the vocabulary"):
            sched.submit(Request([VOCAB + 3], 4))
        assert sched.stats()["queue_depth"] == 2
        queued = sched._waiting[-1]
        queued.cancel()  # a cancelled request leaves the queue at the next step
        sched.step()
        assert queued.done and queued.finish_reason == "cancelled"
        sched.submit(Request([1, 2], 4))  # its place is free again
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
