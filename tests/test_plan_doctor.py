"""colibri plan and colibri doctor."""

import json
import struct
from collections import OrderedDict

import numpy as np
import pytest

import colibri_core
from colibri_core.cli.demo import DemoSpec
from colibri_core.experts.history import FILENAME
from colibri_core.cli.plan import lru_hit_rate

from colibri_core.testing.cli import run_colibri

SPEC = DemoSpec(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_experts=16, num_experts_per_tok=2,
                intermediate_size=16, tokenizer_vocab=300, shard_bytes=40_000)


def simulated_lru(p, slots, n=40_000, seed=0):
    rng = np.random.default_rng(seed)
    cache, hits = OrderedDict(), 0
    for item in rng.choice(len(p), size=n, p=p):
        if item in cache:
            hits += 1
            cache.move_to_end(item)
        else:
            cache[item] = True
            if len(cache) > slots:
                cache.popitem(last=False)
    return hits / n


def test_che_approximation_tracks_a_simulated_lru():
    assert lru_hit_rate(np.full(64, 1 / 64), 16) == pytest.approx(0.25, abs=1e-6)
    assert lru_hit_rate(np.full(8, 1 / 8), 8) == 1.0 and lru_hit_rate(np.full(8, 1 / 8), 0) == 0.0
    zipf = 1 / np.arange(1, 65) ** 1.1
    zipf /= zipf.sum()
    for slots in (4, 16, 32):
        assert lru_hit_rate(zipf, slots) == pytest.approx(simulated_lru(zipf, slots), abs=0.03)


def plan_json(model_dir, *args):
    out = run_colibri("plan", "--model", model_dir, "--json", "--disk-bw", "1G", *args)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_plan_reports_the_placement_load_would_make(model_dir):
    data = plan_json(model_dir, "--cap", "4")
    for key in ("dense_bytes", "kv_bytes_per_token", "kv_bytes_at_context", "expert_bytes", "cache_slots_per_layer",
                "pinned_experts", "projected_hit_rate", "bottleneck", "recommended"):
        assert key in data
    assert data["bottleneck"] in ("disk", "memory", "compute")
    with colibri_core.load(model_dir, cap=4, history=False) as model:
        assert data["cache_slots_per_layer"] == model.placement.slots == 4
        assert data["dense_bytes"] == model.placement.dense_bytes
        assert data["kv_bytes_per_token"] == model.lm.new_cache(model.backend).bytes_per_token()
    assert data["steady_hit_rate"] == pytest.approx(4 / 16)  # no history: uniform routing, once warm
    assert data["projected_hit_rate"] < data["steady_hit_rate"]  # a run starts from empty caches
    assert data["kv_bytes_at_context"] == data["kv_bytes_per_token"] * SPEC.max_position_embeddings


def test_plan_learns_from_the_routing_history(model_dir):
    counts = np.zeros((2, 16))
    counts[:, :3] = 100  # three hot experts per layer
    counts[:, 3:] = 1
    (model_dir / FILENAME).write_text(json.dumps({"format": 1, "family": "olmoe", "tokens": 500, "counts": counts.tolist()}))
    skewed = plan_json(model_dir, "--cap", "4")
    assert skewed["pinned_experts"] == 4 and skewed["history_tokens"] == 500
    assert skewed["projected_hit_rate"] > 0.8
    unpinned = plan_json(model_dir, "--cap", "4", "--pin", "off")
    # the skew helps the LRU alone too; here (3 hot experts, 4 slots) even more than a pinned half
    assert unpinned["pinned_experts"] == 0 and unpinned["projected_hit_rate"] > 0.8


def test_plan_refuses_an_impossible_budget_in_one_line(model_dir):
    out = run_colibri("plan", "--model", model_dir, "--ram", "1K", "--disk-bw", "1G")
    assert out.returncode == 2 and out.stderr.startswith("error: RAM budget") and len(out.stderr.splitlines()) == 1


def doctor(model_dir, *args):
    out = run_colibri("doctor", "--model", model_dir, "--json", *args)
    data = json.loads(out.stdout)
    return out.returncode, {c["name"]: c for c in data["checks"]}, data


def test_doctor_passes_a_healthy_model(model_dir):
    code, checks, data = doctor(model_dir, "--deep")
    assert code == 0 and data["ok"]
    # colibri-cuda's CUDA check is about the machine (a warn without an NVIDIA driver), not the model
    assert all(c["status"] == "pass" for name, c in checks.items() if name != "CUDA"), checks
    assert {"config.json", "family plugin", "tokenizer", "chat template", "weight shards", "headers and tensors",
            "RAM budget", "routing history", "disk space", "tensor data (--deep)"} <= set(checks)


def test_doctor_warns_without_tokenizer_and_with_a_corrupt_history(model_dir):
    (model_dir / "tokenizer.json").unlink()
    (model_dir / FILENAME).write_text("{garbage")
    code, checks, _ = doctor(model_dir)
    assert code == 0
    assert checks["tokenizer"]["status"] == "warn" and checks["tokenizer"]["hint"]
    assert checks["routing history"]["status"] == "warn" and "unreadable" in checks["routing history"]["detail"]


def test_doctor_fails_a_damaged_shard_and_names_it(model_dir):
    shard = sorted(model_dir.glob("*.safetensors"))[1]
    raw = shard.read_bytes()
    shard.write_bytes(raw[: len(raw) // 2])
    code, checks, data = doctor(model_dir)
    assert code == 1 and not data["ok"]
    assert checks["headers and tensors"]["status"] == "fail" and shard.name in checks["headers and tensors"]["detail"]
    assert checks["headers and tensors"]["hint"]


def test_doctor_deep_finds_non_finite_weights(model_dir):
    shard = sorted(model_dir.glob("*.safetensors"))[0]
    raw = bytearray(shard.read_bytes())
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    name, entry = next((k, v) for k, v in header.items() if k != "__metadata__")
    start = 8 + n + entry["data_offsets"][0]
    raw[start : start + 2] = np.array([0x7FC0], dtype="<u2").tobytes()  # a bf16 NaN
    shard.write_bytes(bytes(raw))
    assert doctor(model_dir)[0] == 0  # only --deep reads the data
    code, checks, _ = doctor(model_dir, "--deep")
    assert code == 1 and name in checks["tensor data (--deep)"]["detail"]


def test_doctor_fails_unknown_family_and_impossible_budget(model_dir):
    code, checks, _ = doctor(model_dir, "--ram", "1K")
    assert code == 1 and checks["RAM budget"]["status"] == "fail"
    config = json.loads((model_dir / "config.json").read_text())
    config["model_type"] = "not_installed_moe"
    (model_dir / "config.json").write_text(json.dumps(config))
    code, checks, _ = doctor(model_dir)
    assert code == 1 and checks["family plugin"]["status"] == "fail" and "not_installed_moe" in checks["family plugin"]["detail"]


def test_doctor_table_output(model_dir):
    out = run_colibri("doctor", "--model", model_dir)
    assert out.returncode == 0 and "headers and tensors" in out.stdout and "pass" in out.stdout


# -- a RAM budget beyond the memory available ----------------------------------------------
def test_a_ram_budget_beyond_the_memory_available_is_flagged_by_run_plan_and_doctor(model_dir):
    from colibri_core.model.placement import available_memory

    huge = "100T"
    assert (100 << 40) > available_memory()  # no machine running these tests has 100 TiB free
    out = run_colibri("run", "--model", model_dir, "--token-ids", "1,2,3", "--max-tokens", "2", "--ram", huge,
                      "--history", "off", "-q")
    assert out.returncode == 0, out.stderr
    warned = [line for line in out.stderr.splitlines() if line.startswith("warning:")]
    assert len(warned) == 1 and "100.0 TiB" in warned[0] and "memory available" in warned[0], out.stderr
    assert plan_json(model_dir, "--ram", huge)["ram_budget_warning"].startswith("--ram 100.0 TiB is more than the memory available")
    table = run_colibri("plan", "--model", model_dir, "--disk-bw", "1G", "--ram", huge)
    assert table.returncode == 0 and "warning:" in table.stdout and "memory available" in table.stdout
    code, checks, _ = doctor(model_dir, "--ram", huge)
    assert code == 0 and checks["RAM budget"]["status"] == "warn" and "memory available" in checks["RAM budget"]["detail"]
    # a budget that fits is not flagged
    assert plan_json(model_dir, "--ram", "64M")["ram_budget_warning"] is None
    assert doctor(model_dir, "--ram", "64M")[1]["RAM budget"]["status"] == "pass"


@pytest.mark.parametrize("version", [1, 2])
def test_memory_available_is_bounded_by_the_memory_cgroup(tmp_path, monkeypatch, version):
    from colibri_core.model import placement

    gib = 1 << 30
    if version == 2:
        (tmp_path / "proc").write_text("0::/jobs/run\n")
        outer, inner = tmp_path / "cg" / "jobs", tmp_path / "cg" / "jobs" / "run"
        inner.mkdir(parents=True)
        (outer / "memory.max").write_text(f"{3 * gib}\n")  # the ancestor's limit binds
        (outer / "memory.current").write_text(f"{gib}\n")
        (outer / "memory.stat").write_text(f"anon {gib // 2}\nfile {gib // 2}\n")
        (inner / "memory.max").write_text("max\n")
        (inner / "memory.current").write_text(f"{gib}\n")
        expected = 3 * gib - gib + gib // 2
    else:
        (tmp_path / "proc").write_text("5:cpu:/\n4:memory:/jobs/run\n0::/\n")
        inner = tmp_path / "cg" / "memory" / "jobs" / "run"
        inner.mkdir(parents=True)
        (tmp_path / "cg" / "memory" / "memory.limit_in_bytes").write_text("9223372036854771712\n")  # v1: no limit
        (inner / "memory.limit_in_bytes").write_text(f"{2 * gib}\n")
        (inner / "memory.usage_in_bytes").write_text(f"{gib}\n")
        (inner / "memory.stat").write_text(f"cache 100\ntotal_cache {gib // 4}\n")
        expected = 2 * gib - gib + gib // 4
    monkeypatch.setattr(placement, "PROC_CGROUP", str(tmp_path / "proc"))
    monkeypatch.setattr(placement, "CGROUP_ROOT", str(tmp_path / "cg"))
    monkeypatch.setattr(placement, "_meminfo_available", lambda: 24 * gib)
    assert placement.memory_available() == (expected, "the memory cgroup's limit less its usage")
    assert "the memory cgroup" in placement.budget_beyond_memory(expected + 1)
    assert placement.budget_beyond_memory(expected) is None
    monkeypatch.setattr(placement, "_meminfo_available", lambda: gib // 8)  # MemAvailable lower: it binds
    assert placement.memory_available() == (gib // 8, "MemAvailable")
