"""DeepSeek-V4 beyond token agreement: the cache holds the window and the compressed
entries only (and ``plan`` counts them), the hash-routed first layer's experts are read
ahead from the token ids, legacy config spellings mean what transformers makes of them,
and bad configs and tables are refused naming the field or tensor."""

import json
import subprocess
import sys

import numpy as np
import pytest

import colibri_core
from colibri_core.errors import ModelFormatError, UnsupportedModelError
from colibri_core.io.safetensors import write_safetensors
from colibri_core.testing import copy_model

import test_deepseek_v4_oracle as v4_suite
from colibri_deepseek.v4 import DeepseekV4Args


def fixture(tmp_path_factory, name="mixed"):
    return v4_suite.TestDeepseekV4Oracle.oracle(name, tmp_path_factory)


def expected_bytes(config, tokens):
    """The V4 cache of ``tokens`` positions, layer by layer, in float32: the window's rows
    (one head), an entry per rate tokens (CSA: and an indexer key), the bounded rest."""
    d, di, window = config["head_dim"], config["index_head_dim"], config["sliding_window"]
    total = 0
    for kind in config["layer_types"]:
        total += min(tokens, window) * d * 4
        if kind == "sliding_attention":
            continue
        rate = config["compress_rates"][kind]
        dims = [d, di] if kind == "compressed_sparse_attention" else [d]
        for dim in dims:
            width = 2 * dim if kind == "compressed_sparse_attention" else dim
            pending = 2 * (rate - 1) * width + (2 * rate * dim if width != dim else 0)
            total += (tokens // rate) * dim * 4 + pending * 4
    return total


def test_the_cache_holds_the_window_and_the_entries(tmp_path_factory):
    fx = fixture(tmp_path_factory)
    ids = (fx.prompt + fx.tokens) * 3  # 159 positions: far past the window and the rates
    with colibri_core.load(fx.path, history=False) as model:
        c = model.config
        cache = model.lm.new_cache(model.backend)
        for start in range(0, len(ids), 7):
            model.lm.forward(np.asarray(ids[start : start + 7]), cache, model.backend)
        for kind, state in zip(c["layer_types"], cache.layers):
            assert state.rows.last().shape == (c["sliding_window"] - 1, c["head_dim"])
            if kind == "sliding_attention":
                assert state.compressed is None and state.index is None
                continue
            rate = c["compress_rates"][kind]
            assert state.compressed.count == len(ids) // rate
            assert state.compressed.pending_kv.shape[0] == len(ids) % rate
            assert (state.index is not None) == (kind == "compressed_sparse_attention")
            if state.index is not None:
                assert state.index.count == len(ids) // rate
                assert state.index.all_entries().shape == (len(ids) // rate, c["index_head_dim"])
        assert cache.bytes_for(len(ids)) == expected_bytes(c, len(ids))
        # far less than full attention's keys (one head) at every position
        assert cache.bytes_for(len(ids)) < len(c["layer_types"]) * len(ids) * c["head_dim"] * 4


def test_plan_counts_the_compressed_cache(tmp_path_factory):
    fx = fixture(tmp_path_factory)
    out = subprocess.run([sys.executable, "-m", "colibri_core", "plan", "--model", str(fx.path), "--json", "--context", "200"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    plan = json.loads(out.stdout)
    config = json.loads((fx.path / "config.json").read_text())
    found = {k: v for k, v in plan.items() if k.startswith("kv_bytes")} or plan.get("kv", {})
    assert found["kv_bytes_at_context"] == expected_bytes(config, 200)


def test_hash_routed_first_layer_is_read_ahead_from_the_token_ids(tmp_path_factory):
    fx = fixture(tmp_path_factory)
    with colibri_core.load(fx.path, cap=1, prefetch=True, history=False) as model:
        first = model.lm.layers[0].mlp.router
        assert model.config["mlp_layer_types"][0] == "hash_moe"
        predicted = []
        original = model.store.prefetch

        def spy(layer, experts, **options):
            predicted.append((layer, list(experts)))
            return original(layer, experts, **options)

        model.store.prefetch = spy
        submitted, submit = [], model.store._submit_prefetch
        model.store._submit_prefetch = lambda layer, reads: (submitted.append((layer, list(reads))), submit(layer, reads))
        routing = []
        model.lm.forward(np.asarray(fx.prompt), model.lm.new_cache(model.backend), model.backend, routing=routing)
        table = model.backend.to_host(first.tid2eid.value).astype(np.int64)
    # known, not predicted: read ahead before any prediction of the router's has been scored
    assert submitted[0][0] == 0 and submitted[0][1]
    want = sorted(set(table[fx.prompt].ravel().tolist()))
    assert predicted[0] == (0, want)  # before any layer ran
    used = {layer: set(np.unique(experts).tolist()) for layer, experts in routing}
    assert used[0] == set(want)
    # the second hash layer is predicted exactly too (by the router look-ahead)
    second = [experts for layer, experts in predicted if layer == 1]
    assert second and set(second[0]) <= used[1]


def test_legacy_config_spellings():
    base = dict(vocab_size=96, hidden_size=32, moe_intermediate_size=16, num_hidden_layers=4, num_attention_heads=4,
                head_dim=16, q_lora_rank=24, n_routed_experts=8, num_experts_per_tok=2, o_groups=2, index_head_dim=16)
    legacy = DeepseekV4Args.from_dict({**base, "compress_ratios": [0, 4, 128, 4], "num_hash_layers": 1,
                                       "qk_rope_head_dim": 8, "compress_rate_hca": 64})
    assert legacy.layer_types == ["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention",
                                  "compressed_sparse_attention"]
    assert legacy.mlp_layer_types == ["hash_moe", "moe", "moe", "moe"]
    assert legacy.rope_dim == 8 and legacy.compress_rates["heavily_compressed_attention"] == 64
    default = DeepseekV4Args.from_dict(base)  # transformers' defaults: 2 HCA, then CSA / HCA alternating
    assert default.layer_types == ["heavily_compressed_attention"] * 3 + ["compressed_sparse_attention"]
    assert default.mlp_layer_types == ["hash_moe"] * 3 + ["moe"] and default.rope_dim == 2
    from transformers import DeepseekV4Config

    for raw in ({**base, "compress_ratios": [0, 4, 128, 4], "num_hash_layers": 1, "qk_rope_head_dim": 8}, base):
        theirs = DeepseekV4Config(**raw)
        ours = DeepseekV4Args.from_dict(raw)
        assert ours.layer_types == theirs.layer_types and ours.mlp_layer_types == theirs.mlp_layer_types
        assert ours.rope_dim == theirs.qk_rope_head_dim


@pytest.mark.parametrize("changes,error,match", [
    ({"num_key_value_heads": 2}, UnsupportedModelError, "num_key_value_heads 2"),
    ({"scoring_func": "softmax"}, UnsupportedModelError, "scoring_func 'softmax'"),
    ({"hidden_act": "gelu"}, UnsupportedModelError, "hidden_act 'gelu'"),
    ({"layer_types": ["sliding_attention"] * 3}, ModelFormatError, "layer_types must list"),
    ({"layer_types": ["full_attention"] * 4}, ModelFormatError, "layer_types must list"),
    ({"mlp_layer_types": ["dense"] * 4}, ModelFormatError, "mlp_layer_types must list"),
    ({"compress_rates": {"compressed_sparse_attention": 0, "heavily_compressed_attention": 8}}, ModelFormatError,
     "compress_rates"),
    ({"o_groups": 3}, ModelFormatError, "not a multiple of o_groups 3"),
    ({"partial_rotary_factor": 0.0625}, ModelFormatError, "rotary dimension 1"),
    ({"num_experts_per_tok": 9}, ModelFormatError, "num_experts_per_tok 9 exceeds"),
    ({"o_lora_rank": 10}, ModelFormatError, "wo_a.weight' has shape"),
])
def test_bad_configs_are_refused_naming_the_field(tmp_path_factory, tmp_path, changes, error, match):
    fx = fixture(tmp_path_factory)
    bad = copy_model(fx.path, tmp_path / "bad", **changes)
    with pytest.raises(error, match=match) as err:
        colibri_core.load(bad)
    assert "config.json" in str(err.value) or "safetensors" in str(err.value)


@pytest.mark.parametrize("table,match", [
    ("duplicate", "routes a token to one expert twice"),
    ("out_of_range", "must hold expert ids 0..7"),
    ("huge", "integers beyond 2\\*\\*24"),
])
def test_bad_hash_tables_are_refused_naming_the_tensor(tmp_path_factory, tmp_path, table, match):
    from safetensors.numpy import load_file

    fx = fixture(tmp_path_factory)
    bad = copy_model(fx.path, tmp_path / "bad")
    shard = bad / "model.safetensors"
    tensors = load_file(shard)
    name = "model.layers.1.ffn.gate.tid2eid"
    t = tensors[name].copy()
    t[5] = {"duplicate": [3, 3], "out_of_range": [1, 8], "huge": [1, 1 << 25]}[table]
    tensors[name] = t
    write_safetensors(shard, tensors, {"format": "pt"})
    with pytest.raises(ModelFormatError, match=match) as err:
        with colibri_core.load(bad, history=False) as model:
            model.generate(token_ids=fx.prompt, max_tokens=1, ignore_eos=True)
    assert "tid2eid" in str(err.value)


def test_list_families_shows_deepseek_v4():
    out = subprocess.run([sys.executable, "-m", "colibri_core", "list-families", "--json"], capture_output=True,
                         text=True, timeout=120, check=True).stdout
    families = {f["family"]: f for f in json.loads(out)}
    assert families["deepseek-v4"]["model_types"] == ["deepseek_v4"]


def test_a_batched_step_computes_each_sequence_as_alone(tmp_path_factory):
    """Three sequences at different positions in one batched step (the scheduler's decode,
    through its batch-invariant ops): each row's logits are bit for bit its sequence's
    alone; the hash layers read each row's own id."""
    from colibri_core.engine.batching import RowInvariantOps

    fx = fixture(tmp_path_factory)
    ids = fx.prompt + fx.tokens
    with colibri_core.load(fx.path, history=False) as model:
        lm, ops = model.lm, model.backend
        lengths = (9, 21, 40)  # before, at and past several compression windows
        caches, alone = [], []
        for n in lengths:
            cache = lm.new_cache(ops)
            lm.forward(np.asarray(ids[:n]), cache, ops)
            caches.append(cache)
            solo = lm.new_cache(ops)
            lm.forward(np.asarray(ids[:n]), solo, ops)
            alone.append(lm.forward(np.asarray(ids[n : n + 1]), solo, ops))
        batched = lm.forward_batch([(np.asarray(ids[n : n + 1]), c) for n, c in zip(lengths, caches)],
                                   RowInvariantOps(ops))
    for row, want in zip(batched, alone):
        np.testing.assert_array_equal(row, want)


def test_the_scheduler_serves_v4_as_model_generate_does(tmp_path_factory):
    """Eight requests of different lengths batched by the scheduler (the window and the
    compressors per sequence, no prefix reuse: the window forgets) give each one's tokens."""
    from colibri_core.engine.scheduler import Request, Scheduler

    fx = fixture(tmp_path_factory)
    rng = np.random.default_rng(3)
    prompts = [rng.integers(0, 96, size=int(rng.integers(3, 30))).tolist() for _ in range(8)]
    lengths = [12, 5, 20, 9, 16, 3, 14, 7]
    with colibri_core.load(fx.path, history=False) as model:
        assert not model.lm.new_cache(model.backend).reusable()
        expected = [model.generate(token_ids=p, max_tokens=n, ignore_eos=True).token_ids for p, n in zip(prompts, lengths)]
        with Scheduler(model, slots=8) as sched:
            handles = [sched.submit(Request(p, n)) for p, n in zip(prompts, lengths)]
            for h in handles:
                assert h.wait(120)
            assert sched.stats()["steps"] < sum(lengths)  # decode steps carried several sequences
    assert [h.token_ids for h in handles] == expected
