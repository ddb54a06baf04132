"""Prefixes spilled to disk (colibri_core.engine.prefix_disk), on the CPU: spilled when
memory evicts them, read back longest first, least recently used out past the budget,
damaged files removed and never used. That a prefix read back gives a cold prefill's
tokens is the conformance kit's (every backend)."""

import os

import colibri_core
from colibri_core.engine.prefix_disk import SUFFIX, PrefixDisk
from colibri_core.engine.scheduler import Request, Scheduler
from colibri_core.testing.tiny_models import VOCAB, model_dir


def run(sched, *requests):
    handles = [sched.submit(r) for r in requests]
    for h in handles:
        assert h.wait(120) and h.finish_reason != "error", h.error
    return handles


def prompt(seed: int, n: int = 13) -> list[int]:
    return [(seed + 7 * i) % VOCAB for i in range(n)]


def files(where):
    return sorted(where.glob(f"*{SUFFIX}"), key=lambda p: p.stat().st_mtime)


def test_memory_evictions_spill_and_the_budget_keeps_the_recently_used(tmp_path_factory, tmp_path):
    path = model_dir("olmoe", tmp_path_factory)
    with colibri_core.load(path, history=False) as model:
        one = PrefixDisk(model, 1 << 30, 4, tmp_path / "probe")
        # a KV budget of one request: each new prompt evicts the last one's prefix, which spills
        budget = Scheduler(model, slots=1)._reservation(15 + 2)
        with Scheduler(model, slots=1, prefill_chunk=4, kv_budget=budget, prefix_disk=one) as sched:
            run(sched, Request(prompt(1), 2))
            run(sched, Request(prompt(2), 2))
            one.flush()
            assert len(files(one.dir)) == 1, "an evicted prefix was not spilled"
        one.close()
        size = files(one.dir)[0].stat().st_size
        disk = PrefixDisk(model, 2 * size + size // 2, 4, tmp_path / "kv")  # room for two files
        with Scheduler(model, slots=1, prefill_chunk=4, kv_budget=budget, prefix_disk=disk) as sched:
            for seed in (1, 2, 3):
                run(sched, Request(prompt(seed), 2))
            disk.flush()
            assert len(files(disk.dir)) == 2 and disk.evictions == 0  # 1 and 2 spilled; 3 is in memory
            first_spilled = files(disk.dir)[0]
            again = run(sched, Request(prompt(2) + [5, 6], 2))[0]  # from disk: memory holds 3 only
            assert again.usage["cached_tokens"] == 12 and disk.hits == 1
        disk.close()  # 3 spilled at the stop: over the budget, the least recently used (1) goes
        assert len(files(disk.dir)) == 2 and disk.evictions == 1 and not first_spilled.exists()
        assert disk.stats()["kv_disk_bytes"] <= disk.budget
        # a prefix larger than the whole budget is not written
        tiny = PrefixDisk(model, 100, 4, tmp_path / "tiny")
        with Scheduler(model, slots=1, prefill_chunk=4, prefix_disk=tiny) as sched:
            run(sched, Request(prompt(4), 2))
        tiny.close()
        assert not files(tiny.dir) and tiny.writes == 0


def test_a_damaged_file_is_removed_and_the_prompt_prefilled(tmp_path_factory, tmp_path):
    path = model_dir("olmoe", tmp_path_factory)
    with colibri_core.load(path, history=False) as model:
        disk = PrefixDisk(model, 1 << 30, 4, tmp_path)
        with Scheduler(model, prefill_chunk=4, prefix_disk=disk) as sched:
            cold = run(sched, Request(prompt(1), 5))[0]
        disk.close()
        (damaged,) = files(tmp_path)
        data = bytearray(damaged.read_bytes())
        data[-5] ^= 0x40
        damaged.write_bytes(bytes(data))
        disk = PrefixDisk(model, 1 << 30, 4, tmp_path)
        with Scheduler(model, prefill_chunk=4, prefix_disk=disk) as sched:
            again = run(sched, Request(prompt(1), 5))[0]
        disk.close()
        assert again.usage["cached_tokens"] == 0 and again.token_ids == cold.token_ids
        assert disk.errors == 1 and disk.hits == 0 and disk.writes == 1  # removed, then spilled again at the stop
        disk = PrefixDisk(model, 1 << 30, 4, tmp_path)
        with Scheduler(model, prefill_chunk=4, prefix_disk=disk) as sched:
            third = run(sched, Request(prompt(1), 5))[0]
        disk.close()
        assert third.usage["cached_tokens"] == 12 and third.token_ids == cold.token_ids and disk.errors == 0


def test_the_key_names_model_backend_cache_dtype_and_chunk(tmp_path_factory, tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    path = model_dir("olmoe", tmp_path_factory)
    with colibri_core.load(path, history=False) as model:
        dirs = {PrefixDisk(model, 1, 4).dir, PrefixDisk(model, 1, 8).dir}
    with colibri_core.load(path, history=False, kv_cache="float16") as half:
        dirs.add(PrefixDisk(half, 1, 4).dir)
    with colibri_core.load(path, history=False, backend="mlx") as mlx:
        dirs.add(PrefixDisk(mlx, 1, 4).dir)
    assert len(dirs) == 4 and all(str(d).startswith(str(tmp_path / "colibri" / "kv")) for d in dirs)
    assert all(os.path.isdir(d) for d in dirs)
