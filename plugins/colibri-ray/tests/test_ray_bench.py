"""benchmarks/ray_bench.py at a tiny scale: the local run and one worker in their own
memory cgroups, cold, give the same tokens, and the table says what each read; with
``--throttle`` (the simulated scale-out), the kernel's read limit holds and the tokens stay."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
BENCH = ROOT / "benchmarks"
sys.path.insert(0, str(BENCH))
TINY = ["--layers", "3", "--hidden", "64", "--intermediate", "32", "--experts", "16", "--top-k", "4", "--vocab", "256",
        "--heads", "4"]


def _cgroups_writable() -> bool:
    from colibri_core.cli.bench import Cgroup
    from colibri_core.errors import UsageError

    try:
        Cgroup.create(1 << 30).remove()
        return True
    except (UsageError, OSError):
        return False


def _tiny_model_or_skip(tmp_path: Path) -> Path:
    """A tiny synthetic OLMoE model to benchmark, or a skip where ray or cgroups are missing."""
    pytest.importorskip("ray")
    if not _cgroups_writable():
        pytest.skip("needs a writable memory cgroup (root): the benchmark puts every worker in its own")
    model = tmp_path / "olmoe"
    done = subprocess.run([sys.executable, str(BENCH / "synthetic_olmoe.py"), "--out", str(model), *TINY],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return model


def _ray_bench(model: Path, out: Path, *args: str) -> dict:
    """Run benchmarks/ray_bench.py, one round of 5 tokens from a 4-token prompt, writing
    ``out``.json and ``out``.md; returns the JSON."""
    done = subprocess.run([sys.executable, str(BENCH / "ray_bench.py"), "--model", str(model), "--rounds", "1",
                           "--tokens", "5", "--prompt-tokens", "4", "--overhead", "700M", "--out", str(out), *args],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return json.loads(out.with_suffix(".json").read_text())


def test_ray_bench_runs_workers_in_their_cgroups_with_the_local_tokens(tmp_path):
    model = _tiny_model_or_skip(tmp_path)
    out = tmp_path / "ray"
    data = _ray_bench(model, out, "--workers", "1")
    runs = {r["workers"]: r for r in data["runs"]}
    assert set(runs) == {0, 1}
    for r in runs.values():
        assert "error" not in r, r
        assert r["generated"] == 5 and r["decode_tok_s"] > 0
        assert r["cache"].startswith("dropped") or r["cache"].startswith("model files")
    assert runs[1]["token_ids"] == runs[0]["token_ids"]
    assert runs[1]["fallback_requests"] == 0 and runs[1]["network_bytes_per_token"] > 0
    # a third of the experts fit: the worker's reads of the rest came from its own disk path
    assert sum(runs[1]["worker_bytes_read"].values()) > 0
    assert len(runs[1]["cgroup_peaks"]) == 1 and runs[1]["cgroup_peaks"][0] > 0
    assert runs[0]["cgroup_peak_bytes"] > 0
    assert sorted(b["threads"] for b in data["disk_bounds"]) == [1, 2, 3]
    table = out.with_suffix(".md").read_text()
    assert "| 0 | 1 workers |" in table and "| yes |" in table and "| local |" in table
    assert runs[0]["prefill_device_bytes"] >= 0 and runs[1]["prefill_s"] > 0


def _throttle_or_skip(on: Path):
    import ray_bench

    why = ray_bench.ReadThrottle.unavailable()
    if why:
        pytest.skip(why)
    major, minor = (os.major(os.stat(on).st_dev), os.minor(os.stat(on).st_dev))
    if not Path(f"/sys/dev/block/{major}:{minor}").exists():
        pytest.skip(f"{on} is not on a block device (tmpfs?): nothing to throttle")
    return ray_bench


READER = """
import mmap, os, sys, time
fd = os.open(sys.argv[1], os.O_RDONLY | os.O_DIRECT)  # every byte from the disk, none from the page cache
buf, done, started = mmap.mmap(-1, 1 << 20), 0, time.perf_counter()
while (n := os.preadv(fd, [buf], done)) > 0:
    done += n
print(done, time.perf_counter() - started)
"""


def _read_in(group, path: Path) -> tuple[int, float]:
    done = subprocess.run([sys.executable, "-c", READER, str(path)], capture_output=True, text=True, timeout=60,
                          preexec_fn=lambda: group.add(os.getpid()))
    assert done.returncode == 0, done.stderr
    nbytes, seconds = done.stdout.split()
    return int(nbytes), float(seconds)


def test_read_throttle_holds_reads_to_its_rate(tmp_path):
    """N bytes at R bytes/s take at least N / R in a throttled group, and far less in an
    unlimited one (so the throttle, not the disk, is what took the time); the group counts them."""
    data = tmp_path / "data.bin"
    data.write_bytes(os.urandom(4 << 20))
    ray_bench = _throttle_or_skip(data)
    rate = 4_000_000
    limited, free = ray_bench.ReadThrottle.create(data, rate), ray_bench.ReadThrottle.create(data, None)
    try:
        nbytes, seconds = _read_in(limited, data)
        assert nbytes == 4 << 20
        assert seconds >= 0.9 * nbytes / rate, f"{nbytes} bytes in {seconds:.3f} s: faster than {rate} bytes/s"
        assert limited.bytes_read() >= nbytes
        nbytes, unlimited_seconds = _read_in(free, data)
        assert unlimited_seconds < 0.5 * nbytes / rate, f"unthrottled: {unlimited_seconds:.3f} s (a disk this slow cannot tell)"
        assert free.bytes_read() >= nbytes
    finally:
        limited.remove()
        free.remove()
    assert not limited.path.exists() and not free.path.exists()


@pytest.mark.slow
def test_ray_bench_throttle_keeps_the_tokens_and_reads_through_each_workers_group(tmp_path):
    model = _tiny_model_or_skip(tmp_path)
    _throttle_or_skip(model / "config.json")
    out = tmp_path / "ray"
    data = _ray_bench(model, out, "--workers", "1,2", "--share", "1/16", "--throttle", "2")
    assert data["throttle_bytes_per_s"] == 2_000_000 and "SIMULATION" in data["simulation"]
    runs = {r["workers"]: r for r in data["runs"]}
    assert set(runs) == {0, 1, 2} and not any("error" in r for r in runs.values()), runs
    # the local run is unthrottled: the throttled workers' tokens are its tokens
    assert runs[1]["token_ids"] == runs[0]["token_ids"] and runs[2]["token_ids"] == runs[0]["token_ids"]
    assert runs[0]["throttle_bps"] is None and runs[1]["throttle_bps"] == 2_000_000
    assert len(runs[1]["group_read_bytes"]) == 1 and len(runs[2]["group_read_bytes"]) == 2
    # each worker's expert reads went through its own throttled group (a sixteenth of the experts fit)
    assert sum(runs[1]["group_read_bytes"]) > 0 and all(b > 0 for b in runs[2]["group_read_bytes"])
    assert sorted(b["threads"] for b in data["disk_bounds"]) == [1, 2, 3]
    model_efficiency = data["busiest_worker_model"]  # JSON: worker counts as strings
    assert model_efficiency["1"] == 1.0 and 0.5 < model_efficiency["2"] < 1.0
    table = out.with_suffix(".md").read_text()
    assert "**SIMULATION" in table and "| 2 workers | 2 | 4 |" in table and "| local (whole disk) |" in table
