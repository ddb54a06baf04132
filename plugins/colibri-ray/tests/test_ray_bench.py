"""benchmarks/ray_bench.py at a tiny scale: the local run and one worker in their own
memory cgroups, cold, give the same tokens, and the table says what each read."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
BENCH = ROOT / "benchmarks"
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


def test_ray_bench_runs_workers_in_their_cgroups_with_the_local_tokens(tmp_path):
    pytest.importorskip("ray")
    if not _cgroups_writable():
        pytest.skip("needs a writable memory cgroup (root): the benchmark puts every worker in its own")
    model = tmp_path / "olmoe"
    done = subprocess.run([sys.executable, str(BENCH / "synthetic_olmoe.py"), "--out", str(model), *TINY],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    out = tmp_path / "ray"
    done = subprocess.run([sys.executable, str(BENCH / "ray_bench.py"), "--model", str(model), "--workers", "1",
                           "--rounds", "1", "--tokens", "5", "--prompt-tokens", "4", "--overhead", "700M",
                           "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    data = json.loads(out.with_suffix(".json").read_text())
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
