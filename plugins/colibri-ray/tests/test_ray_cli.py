"""The options on the command line: ``colibri run --ray ADDRESS`` (joining the test
session's cluster), its statistics, ``colibri plan --ray``, and bad options."""

import json

from colibri_core.testing.cli import run_colibri
from colibri_core.testing.oracle import OracleCase, oracle_fixture

import colibri_core


def _fx(tmp_path_factory):
    from transformers import OlmoeConfig

    def config():
        return OlmoeConfig(vocab_size=128, eos_token_id=None, hidden_size=32, intermediate_size=16, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=4, num_experts=8, num_experts_per_tok=2,
                           max_position_embeddings=128, initializer_range=0.1)

    return oracle_fixture("RayCli", "olmoe", OracleCase(config, new_tokens=8), "OlmoeForCausalLM",
                          tmp_path_factory.mktemp("ray-cli"))


def test_run_with_ray_gives_the_local_tokens_and_per_worker_statistics(ray_cluster, tmp_path_factory):
    fx = _fx(tmp_path_factory)
    ids = ",".join(map(str, fx.prompt))
    with colibri_core.load(fx.path, history=False) as model:
        local = model.generate(token_ids=fx.prompt, max_tokens=8, ignore_eos=True).token_ids
    address = ray_cluster.get_runtime_context().gcs_address
    out = run_colibri("run", "--model", str(fx.path), "--token-ids", ids, "--max-tokens", "8", "--ignore-eos",
                      "--history", "off", "--ray", address, "--ray-workers", "3", "--json", timeout=180)
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert data["token_ids"] == local
    compute = data["stats"]["compute"]
    assert compute["tier"] == "ray" and len(compute["workers"]) == 3
    assert compute["fallback_experts"] == 0
    assert sum(w["experts"] for w in compute["workers"].values()) > 0
    assert all({"bytes_read", "requests", "network_bytes_sent", "network_bytes_received"} <= set(w)
               for w in compute["workers"].values())


def test_plan_shows_each_worker_and_the_network(tmp_path_factory):
    fx = _fx(tmp_path_factory)
    out = run_colibri("plan", "--model", str(fx.path), "--ray", "local", "--ray-workers", "3", "--ray-worker-ram", "1G",
                      "--disk-bw", "1G", "--json", timeout=120)
    assert out.returncode == 0, out.stderr
    ray = json.loads(out.stdout)["ray"]
    assert [w["name"] for w in ray["workers"]] == ["worker-0", "worker-1", "worker-2"]
    assert sum(w["experts"] for w in ray["workers"]) == 8 * 2
    assert all(w["holds_shard"] for w in ray["workers"])
    assert ray["network_bytes_per_token"] > 0 and ray["bottleneck"] in ("network", "disk", "compute")
    text = run_colibri("plan", "--model", str(fx.path), "--ray", "local", "--ray-worker-ram", "1G", "--disk-bw", "1G",
                       timeout=120)
    assert text.returncode == 0 and "ray bottleneck" in text.stdout and "worker-1" in text.stdout


def test_doctor_checks_every_worker_reads_the_checkpoint(ray_cluster, tmp_path_factory):
    fx = _fx(tmp_path_factory)
    address = ray_cluster.get_runtime_context().gcs_address
    out = run_colibri("doctor", "--model", str(fx.path), "--ray", address, "--ray-workers", "2", "--json", timeout=180)
    assert out.returncode == 0, out.stdout + out.stderr
    checks = {c["name"]: c for c in json.loads(out.stdout)["checks"]}
    assert checks["ray worker 0"]["status"] == checks["ray worker 1"]["status"] == "pass"


def test_bad_ray_options_are_one_line_errors(tmp_path_factory):
    fx = _fx(tmp_path_factory)
    out = run_colibri("run", "--model", str(fx.path), "--token-ids", "1,2", "--ray", "local", "--ray-workers", "0")
    assert out.returncode != 0 and out.returncode != 70
    assert out.stderr.strip().splitlines()[-1] == "error: --ray-workers must be at least 1, got 0"
